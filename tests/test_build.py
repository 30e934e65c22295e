"""The build machinery: toolkit discovery, the CUDA build in CI, and the deferred error."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fusedoff import _build, _ext


def make_fake_toolkit(root: Path) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (root / "bin" / "nvcc").chmod(0o755)
    (root / "include" / "cuda_runtime.h").write_text("")
    return root


def test_finds_toolkit_behind_a_wrapper_script(tmp_path, monkeypatch):
    toolkit = make_fake_toolkit(tmp_path / "cuda-99.0")
    wrappers = tmp_path / "wrappers"
    wrappers.mkdir()
    (wrappers / "nvcc").write_text(f'#!/bin/sh\nexec {toolkit}/bin/nvcc "$@"\n')
    (wrappers / "nvcc").chmod(0o755)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(wrappers))
    assert _build.find_cuda_home() == toolkit.resolve()


def test_cuda_home_is_honoured_and_checked(tmp_path, monkeypatch):
    toolkit = make_fake_toolkit(tmp_path / "mycuda")
    monkeypatch.setenv("CUDA_HOME", str(toolkit))
    assert _build.find_cuda_home() == toolkit
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "nothing-here"))
    with pytest.raises(RuntimeError, match="not a CUDA toolkit"):
        _build.find_cuda_home()


@pytest.mark.parametrize("value,expected", [("0", False), ("auto", True), ("1", True)])
def test_cuda_switch(monkeypatch, value, expected, tmp_path):
    monkeypatch.setenv("FUSEDOFF_CUDA", value)
    assert _build.cuda_build_requested(tmp_path) is expected
    if value == "1":
        with pytest.raises(RuntimeError, match="no CUDA toolkit"):
            _build.cuda_build_requested(None)


def test_cuda_kernels_built_where_a_toolkit_is():
    """CI has a toolkit but no GPU: the extension must still contain the compiled CUDA kernels."""
    if os.environ.get("FUSEDOFF_CUDA", "auto") in ("0", "off") or _build.find_cuda_home() is None:
        pytest.skip("no CUDA toolkit here, or the CUDA build was switched off")
    module = _ext.load_extension()
    assert module.with_cuda, "a CUDA toolkit is present but fusedoff._C was built without CUDA kernels"


def test_cpu_isa_dispatch_names_an_instruction_set():
    isa = _ext.cpu_isa()
    assert isa in ("avx512", "avx2", "baseline")
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " avx2 " in flags and " fma " in flags and " avx512f " not in flags:
        assert isa == "avx2"


def test_without_a_native_build_import_works_and_native_backends_say_why(tmp_path):
    """No prebuilt module and no ninja: import fusedoff works, backend='torch' runs, 'cpu' names ninja."""
    script = textwrap.dedent(
        """
        import builtins, shutil, torch
        real_import = builtins.__import__
        def no_prebuilt(name, globals=None, locals=None, fromlist=(), level=0):
            if name == "fusedoff" and fromlist and "_C" in fromlist:
                raise ImportError("simulated: no prebuilt extension")
            return real_import(name, globals, locals, fromlist, level)
        builtins.__import__ = no_prebuilt
        real_which = shutil.which
        shutil.which = lambda cmd, *a, **k: None if cmd == "ninja" else real_which(cmd, *a, **k)
        import fusedoff
        p = torch.nn.Parameter(torch.ones(3)); p.grad = torch.ones(3)
        fusedoff.AdamW([p], backend="torch").step()
        assert p.data.lt(1).all()
        try:
            fusedoff.AdamW([p], backend="cpu").step()
        except fusedoff.NativeExtensionUnavailable as exc:
            print("ERROR:", exc)
        """
    )
    # (the JIT's own error: not FUSEDOFF_NO_JIT's, which the wheel's proof sets for the suite)
    env = {k: v for k, v in os.environ.items() if k != "FUSEDOFF_NO_JIT"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert "ERROR:" in result.stdout and "ninja" in result.stdout, result.stdout
