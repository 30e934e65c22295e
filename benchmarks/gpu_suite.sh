#!/usr/bin/env bash
# The one-shot GPU check, for a fresh copy of the repository on a machine with one GPU and no
# internet (it uses that machine's own python3, torch, nvcc and ninja): JIT-builds the extension
# (TORCH_CUDA_ARCH_LIST=9.0 by default), runs the `cuda`-marked tests, and a quick timing.
# Everything lands in the output folder ($1, or $OUT, or ./gpu_suite_out); a verdict table last.
#
#   bash benchmarks/gpu_suite.sh "$OUT"
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu_suite_out}}
mkdir -p "$out"
py=${PYTHON:-python3}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}

{ nvidia-smi; "$py" -c "import torch, sys; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"; } > "$out/env.txt" 2>&1

"$py" -c "
import time; t = time.time()
from fusedoff._ext import load_extension
m = load_extension()
print(f'built: cuda kernels {m.with_cuda}, cpu isa {m.cpu_isa()}, {time.time() - t:.0f} s')
" > "$out/build.log" 2>&1
build=$?

"$py" -m pytest -m cuda -q -p no:cacheprovider --junitxml "$out/cuda-tests.xml" > "$out/cuda-tests.log" 2>&1
tests=$?

timeout 240 "$py" benchmarks/gpu_quick_timing.py --out-dir "$out" > "$out/gpu_quick_timing.log" 2>&1
timing=$?

echo "== GPU suite verdict ($(date -u +%FT%TZ)) =="
printf '%-22s %s\n' "build (JIT)" "$([ $build -eq 0 ] && tail -1 "$out/build.log" || echo "FAILED: see build.log")"
printf '%-22s %s\n' "cuda-marked tests" "$([ $tests -eq 0 ] && echo pass || echo FAIL) ($(tail -1 "$out/cuda-tests.log"))"
printf '%-22s %s\n' "quick timing" "$([ $timing -eq 0 ] && echo done || echo FAILED)"
[ $timing -eq 0 ] && cat "$out/gpu_quick_timing.log"
exit $(( build || tests || timing ))
