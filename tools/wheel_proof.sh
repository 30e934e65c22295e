#!/usr/bin/env bash
# The binary wheel's proof: dist/'s wheel (make wheel) installed as a user installs it, into VENV with
# CONSTRAINTS' torch (the venv is made when missing), then the CPU suite against that install, run from
# a copy of the tests (so `import fusedoff` is the wheel), with no compiler, linker or ninja on PATH
# (tools/without_compilers.py), FUSEDOFF_NO_JIT=1 and an empty torch extension cache: nothing can be
# built, and nothing built earlier stands in for the wheel's module.
#
#   bash tools/wheel_proof.sh VENV CONSTRAINTS     (make test-wheel runs it for the oldest and the pinned torch)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$1 constraints=$2
root=$PWD
wheels=(dist/fusedoff-*-cp310-abi3-manylinux_*_x86_64.whl)
if [ ${#wheels[@]} -ne 1 ] || [ ! -f "${wheels[0]}" ]; then
  echo "wheel_proof: expected one wheel in dist/ (make wheel), found: ${wheels[*]}" >&2; exit 2
fi
wheel=${wheels[0]}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet -c "$constraints" torch
fi
# The wheel with its run-time requirements (torch stays the venv's), then the test extra at make test's
# versions (read from the installed wheel's own metadata).
"$venv/bin/pip" install --quiet --force-reinstall --no-deps "$wheel"
"$venv/bin/pip" install --quiet -c "$constraints" "$wheel"
"$venv/bin/pip" install --quiet -c constraints.txt $("$venv/bin/python" -I -c 'from importlib.metadata import requires
print(*(r.split(";")[0] for r in requires("fusedoff") if "extra == \"test\"" in r))')
# The wheel is this checkout's: its Python files are the checkout's (a wheel an earlier `make wheel` left
# in dist/ fails here, not in a test of what changed since).
"$venv/bin/python" - "$root" <<'PY'
import filecmp, sys, sysconfig
from pathlib import Path
installed, source = Path(sysconfig.get_paths()["platlib"]) / "fusedoff", Path(sys.argv[1]) / "fusedoff"
ours = {p.relative_to(source) for p in source.rglob("*.py")}
theirs = {p.relative_to(installed) for p in installed.rglob("*.py")}
differ = sorted(str(f) for f in ours & theirs if not filecmp.cmp(source / f, installed / f, shallow=False))
if differ or ours != theirs:
    sys.exit(f"wheel_proof: the wheel in dist/ is not this checkout's (make wheel): differ {differ[:5]}, "
             f"only here {sorted(map(str, ours - theirs))[:5]}, only in the wheel {sorted(map(str, theirs - ours))[:5]}")
PY
suite=$root/build/wheel-suite-$(basename "$venv")
rm -rf "$suite" && mkdir -p "$suite/extensions" && cp -r tests benchmarks csrc tools pyproject.toml README.md "$suite"/
cd "$suite"
export FUSEDOFF_NO_JIT=1 TORCH_EXTENSIONS_DIR=$suite/extensions
py=$(cd "$root" && realpath "$venv")/bin/python
# The module is the wheel's, in site-packages, and every symbol of it (the CUDA runtime's included)
# resolves without a GPU.
"$py" "$root/tools/without_compilers.py" -- env LD_BIND_NOW=1 "$py" -c '
import sysconfig, torch, fusedoff
from fusedoff import _C, _ext
assert _C.__file__.startswith(sysconfig.get_paths()["platlib"]), _C.__file__
assert _ext.load_extension().with_cuda, "the wheel was built without its CUDA kernels"
print(f"wheel_proof: torch {torch.__version__}: {_C.__file__} loads (LD_BIND_NOW=1), CPU ISA {_ext.cpu_isa()}")'
# (as make test-oldest: the training-library integrations follow the pinned torch; the emulated CUDA
#  kernels and the exhaustive runs are make test's; the packaging and stable-ABI tests build)
"$py" "$root/tools/without_compilers.py" -- "$py" -m pytest -q -p no:cacheprovider \
  --ignore=tests/test_packaging.py --ignore=tests/test_stable_abi.py --ignore=tests/test_integrations.py \
  -m "not emulated and not exhaustive" ${PYTEST_ARGS:-}
