"""One build for every torch (see [note: one binary for every torch] in csrc/ops.cpp): the built
extension names no C++ symbol of torch's (only the stable C shims), says which torch it targets, and,
built here against the pinned torch, loads and steps unchanged in the oldest supported torch."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from fusedoff import _build, _ext
from tests.helpers import ADAMW_STEPS_AGAINST_TORCH

ROOT = Path(__file__).resolve().parents[1]
# The modules `python setup.py build_ext --inplace` (or an install) put beside the package: _C, and
# _C_emulated where the emulated CUDA kernels were built too.
BUILT = sorted((ROOT / "fusedoff").glob("_C*.so"))
# make test-oldest points this at a venv holding the oldest supported torch (as tests/test_packaging.py).
OLDEST_VENV = os.environ.get("FUSEDOFF_OLDEST_VENV")
torch_cxx_symbols = _build.torch_cxx_symbols


def test_the_symbol_check_sees_torch_cxx_symbols():
    """The check below can fail: torch's own Python bindings call libtorch's C++ API."""
    if shutil.which("nm") is None:
        pytest.skip("no nm (binutils) here")
    assert torch_cxx_symbols(Path(torch.__file__).parent / "lib" / "libtorch_python.so")


@pytest.mark.parametrize("library", BUILT, ids=lambda path: path.name)
def test_the_built_extension_names_no_cxx_symbol_of_torch(library):
    if shutil.which("nm") is None:
        pytest.skip("no nm (binutils) here")
    assert torch_cxx_symbols(library) == []


def test_the_extension_targets_the_oldest_supported_torch():
    """_build.OLDEST_TORCH is pyproject.toml's `torch>=` and constraints-oldest.txt's pin, and the
    built module says it was compiled for it."""
    major_minor = ".".join(map(str, _build.OLDEST_TORCH))
    assert f'"torch>={major_minor}"' in (ROOT / "pyproject.toml").read_text()
    assert re.search(rf"^torch=={re.escape(major_minor)}\.", (ROOT / "constraints-oldest.txt").read_text(), re.M)
    assert _build.stable_abi_defines() == [f"-DTORCH_TARGET_VERSION=0x{_build.OLDEST_TORCH[0]:02x}"
                                           f"{_build.OLDEST_TORCH[1]:02x}000000000000"]
    if not _ext.native_available():
        pytest.skip(f"no native extension: {_ext._load()[1]}")
    assert _ext.load_extension().oldest_torch == major_minor


STEP_UNDER_OLDEST_TORCH = textwrap.dedent(
    """
    import sys, torch, fusedoff
    from pathlib import Path
    from fusedoff import _ext
    root, emulated = Path(sys.argv[1]), sys.argv[2] == "1"
    assert Path(fusedoff.__file__).parent == root / "fusedoff", fusedoff.__file__
    module = _ext.load_extension()
    assert Path(module.__file__).parent == root / "fusedoff", module.__file__  # the prebuilt one, no JIT
    """
) + ADAMW_STEPS_AGAINST_TORCH + textwrap.dedent(
    """
    if emulated:
        from fusedoff.testing.emulation import load_emulated_extension
        load_emulated_extension()
        outputs, error = torch.ops.fusedoff_emulated.selftest("indices")
        assert error == "" and len(outputs) == 2 * 6 * 64, (len(outputs), error)
    print("stepped with torch", torch.__version__, "built with", module.torch_version, "isa", _ext.cpu_isa())
    """
)


@pytest.mark.skipif(not OLDEST_VENV, reason="needs FUSEDOFF_OLDEST_VENV, a venv with the oldest supported torch "
                                            "(make test-oldest makes one)")
def test_the_extension_built_here_steps_in_the_oldest_torch():
    """The modules built against this torch, imported as they are (FUSEDOFF_NO_JIT: no build) by the
    oldest supported torch, every symbol bound at load: an AdamW step on the cpu backend matches
    torch.optim.AdamW's there, and the emulated CUDA kernels run where they were built."""
    if not [path for path in BUILT if path.name.startswith("_C.")]:
        pytest.skip("no prebuilt fusedoff._C here (python setup.py build_ext --inplace)")
    python = Path(OLDEST_VENV).resolve() / "bin" / "python"
    version = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True,
                             text=True, check=True).stdout.strip()
    assert version.split(".")[:2] == [str(v) for v in _build.OLDEST_TORCH], version
    emulated = any(path.name.startswith("_C_emulated.") for path in BUILT)
    # LD_BIND_NOW: every symbol the modules name resolves when they load, not at its first call (the
    # CUDA launchers' too, which no step here calls).
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FUSEDOFF_NO_JIT": "1", "LD_BIND_NOW": "1"}
    env.pop("FUSEDOFF_NO_PREBUILT", None)
    result = subprocess.run([str(python), "-c", STEP_UNDER_OLDEST_TORCH, str(ROOT), "1" if emulated else "0"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"stepped with torch {version}" in result.stdout
