"""The wheel's tools: tools/check_wheel.py (what `make wheel`'s wheel holds) and
tools/without_compilers.py (the proof's PATH with no compiler), each shown able to fail."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from fusedoff import _build, _ext

ROOT = Path(__file__).resolve().parents[1]


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"fusedoff_tool_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_wheel = load_tool("check_wheel")


def test_the_arch_list_names_each_architecture_and_the_ptx():
    assert check_wheel.expected_device_code("8.0;9.0;12.0+PTX") == {("sm", 80), ("sm", 90), ("sm", 120), ("ptx", 120)}


def test_the_built_extension_carries_device_code_for_exactly_its_arch_list():
    """The fatbin reader against the extension built here (make test's, or the installed wheel's), whose
    architectures are TORCH_CUDA_ARCH_LIST's or the default."""
    code = check_wheel.device_code(built_extension())
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", _build.DEFAULT_CUDA_ARCH_LIST)
    assert set(code) == check_wheel.expected_device_code(arch_list), (
        f"device code {sorted(code)}; if the build used another TORCH_CUDA_ARCH_LIST, set the same one here")
    assert len(set(code.values())) == 1  # every translation unit carries every architecture


def wheel_with(tmp_path: Path, names: list[str], library: Path | None = None) -> Path:
    """A dist/ folder holding one wheel of `names` (empty files), and `library` as fusedoff/_C.abi3.so."""
    dist = tmp_path / "dist"
    dist.mkdir()
    with zipfile.ZipFile(dist / "fusedoff-0.1.0-cp310-abi3-manylinux_2_34_x86_64.whl", "w") as archive:
        for name in names:
            archive.writestr(name, b"")
        if library is not None:
            archive.write(library, "fusedoff/_C.abi3.so")
    return dist


def built_extension() -> Path:
    if shutil.which("objcopy") is None or shutil.which("readelf") is None:
        pytest.skip("no binutils here")
    if not _ext.native_available() or not _ext.load_extension().with_cuda:
        pytest.skip("the extension here was built without its CUDA kernels")
    from fusedoff import _C

    return Path(_C.__file__)


def test_check_wheel_passes_the_extension_built_here(tmp_path, capsys):
    """Every check at once on make test's extension (built as the wheel's): the refusals below fail alone."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST", _build.DEFAULT_CUDA_ARCH_LIST) != _build.DEFAULT_CUDA_ARCH_LIST:
        pytest.skip("built for another TORCH_CUDA_ARCH_LIST than the wheel's")
    assert check_wheel.main(wheel_with(tmp_path, ["fusedoff/__init__.py"], built_extension())) == 0
    assert "glibc >= 2.34" in capsys.readouterr().out


def test_check_wheel_refuses_a_library_torch_does_not_provide(tmp_path):
    library = Path(torch.__file__).parent / "lib" / "libtorch_python.so"  # needs libshm.so, libtorch.so, ...
    with pytest.raises(SystemExit, match="which neither torch nor a manylinux system provides"):
        check_wheel.main(wheel_with(tmp_path, [], library))


def test_check_wheel_refuses_cxx_symbols_of_torch(tmp_path, monkeypatch):
    if shutil.which("nm") is None:
        pytest.skip("no nm (binutils) here")
    library = Path(torch.__file__).parent / "lib" / "libtorch_python.so"  # torch's bindings call its C++ API
    monkeypatch.setattr(check_wheel, "TORCH_PROVIDES", check_wheel.TORCH_PROVIDES | check_wheel.needed(library))
    with pytest.raises(SystemExit, match="names C\\+\\+ symbols of torch's"):
        check_wheel.main(wheel_with(tmp_path, [], library))


def test_check_wheel_refuses_debug_information(tmp_path, monkeypatch):
    """The tests' emulated module keeps Python's -g (only the wheel's module is built with -g0)."""
    emulated = sorted((ROOT / "fusedoff").glob("_C_emulated*.so"))
    if not emulated:
        pytest.skip("needs the tests' emulated module beside the sources (make test builds it)")
    monkeypatch.setattr(check_wheel, "TORCH_PROVIDES", check_wheel.TORCH_PROVIDES | check_wheel.needed(emulated[0]))
    with pytest.raises(SystemExit, match="carries debug information"):
        check_wheel.main(wheel_with(tmp_path, [], emulated[0]))


def test_check_wheel_refuses_device_code_of_other_architectures(tmp_path, monkeypatch):
    library = built_extension()
    monkeypatch.setattr(_build, "DEFAULT_CUDA_ARCH_LIST", "8.0;9.0")
    with pytest.raises(SystemExit, match="device code"):
        check_wheel.main(wheel_with(tmp_path, [], library))


@pytest.mark.parametrize("names,refused", [
    (["fusedoff/_C.abi3.so", "fusedoff/_C_emulated.abi3.so"], "not only fusedoff/_C.abi3.so"),
    (["fusedoff/_C.abi3.so", "fusedoff/_C.cpython-311-x86_64-linux-gnu.so"], "not only fusedoff/_C.abi3.so"),
    (["fusedoff/__init__.py"], "not only fusedoff/_C.abi3.so"),
], ids=["emulated module", "stale module", "no module"])
def test_check_wheel_refuses_a_wheel_with_other_binaries(tmp_path, names, refused):
    with pytest.raises(SystemExit, match=refused):
        check_wheel.main(wheel_with(tmp_path, names))


def test_check_wheel_refuses_a_wheel_not_tagged_manylinux_abi3(tmp_path):
    dist = wheel_with(tmp_path, ["fusedoff/_C.abi3.so"])
    wheel = next(dist.glob("*.whl"))
    wheel.rename(dist / "fusedoff-0.1.0-cp310-abi3-linux_x86_64.whl")
    with pytest.raises(SystemExit, match="expected one cp310-abi3 manylinux wheel"):
        check_wheel.main(dist)


def test_without_compilers_hides_every_compiler_and_keeps_the_rest(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("gcc", "g++-12", "x86_64-linux-gnu-gcc-12", "cc", "c++", "nvcc", "ninja", "ld.gold", "clang++",
                 "python-tool", "ccache-stats", "lddtree"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    probe = ("import os, shutil; print(sorted(os.listdir(os.path.dirname(shutil.which('python-tool')))), "
             "os.environ.get('CUDA_HOME'))")
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "without_compilers.py"), "--", sys.executable, "-c", probe],
                            env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                                 "CUDA_HOME": "/usr/local/cuda"},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    listed = result.stdout.strip().splitlines()[-1]
    for kept in ("python-tool", "ccache-stats", "lddtree"):
        assert f"'{kept}'" in listed
    for hidden in ("'gcc'", "'g++-12'", "'x86_64-linux-gnu-gcc-12'", "'cc'", "'c++'", "'nvcc'", "'ninja'", "'ld.gold'",
                   "'clang++'"):
        assert hidden not in listed
    assert listed.endswith("None")  # CUDA_HOME unset
