#!/usr/bin/env bash
# Wheels of the optional peers for the GPU machine, which has no internet and none of them installed
# (its image: Python 3.12, x86_64): DeepSpeed (with hjson and pydantic), torchao, bitsandbytes. Run it
# here (pip reaches the registry), then carry the folder with the GPU run; gpu_suite.sh installs whatever
# *.whl it finds in $PEER_WHEELS (default .whl) into a temporary folder, and each peer stays optional.
#
#   bash benchmarks/gpu_suite/peer_wheels.sh [DIR]         # default .whl (added to .git/info/exclude)
#   bash benchmarks/gpu_suite/peer_wheels.sh .whl nobnb    # without bitsandbytes (its wheel is ~45 MB of the 64 MiB a
#                                                # GPU run may carry)
#
# DeepSpeed is published as source only: its pure-Python wheel is built here (its ops build at run time).
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${1:-.whl}
mkdir -p "$dir"
pip=${PIP:-.venv/bin/pip}
if [ "$dir" = .whl ] && [ -d .git ] && ! grep -qx '/.whl/' .git/info/exclude 2> /dev/null; then
  echo '/.whl/' >> .git/info/exclude
fi
binary=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64
        --platform manylinux1_x86_64 -d "$dir")
"$pip" download "${binary[@]}" hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 torchao==0.18.0
[ "${2:-}" = nobnb ] || "$pip" download "${binary[@]}" bitsandbytes==0.50.2
"$pip" wheel --no-deps --no-build-isolation -w "$dir" deepspeed==0.19.8
ls -la "$dir"
du -sh "$dir"
