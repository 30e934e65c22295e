"""What `import fusedoff` brings in: the library, and none of its test tools (fusedoff/testing: the stream
simulator, the timed model, the emulated CUDA backend), which only the tests and benchmarks import."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fusedoff import _ext, backends, ops

ROOT = Path(__file__).resolve().parents[1]


def test_importing_fusedoff_loads_no_test_tool_and_knows_no_test_backend():
    """In a fresh interpreter: the library's modules, the simulate seam included, load no module of
    fusedoff.testing (nor the emulated extension), and the backend table names only the library's
    backends until fusedoff.testing adds its own."""
    script = textwrap.dedent(
        """
        import sys
        import fusedoff, fusedoff.backends, fusedoff.ops, fusedoff.offload, fusedoff.offload.runtimes
        loaded = sorted(name for name in sys.modules if name.startswith("fusedoff"))
        tools = [name for name in loaded if name.startswith("fusedoff.testing") or name == "fusedoff._C_emulated"
                 or name.rsplit(".", 1)[-1] in ("simulator", "timed")]
        assert not tools, tools
        assert fusedoff.backends.BACKENDS == ("cpu", "cuda", "triton", "torch"), fusedoff.backends.BACKENDS
        try:
            fusedoff.backends.backend_named("cuda_emulated")
        except ValueError as exc:
            print("before:", exc)
        import fusedoff.testing
        emulated = fusedoff.backends.backend_named("cuda_emulated")
        assert (emulated.native_namespace, emulated.implementation) == ("fusedoff_emulated", "cuda")
        assert fusedoff.backends.BACKENDS == ("cpu", "cuda", "triton", "torch")  # never one of the library's
        print("after: ok")
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "before: backend must be one of ('cpu', 'cuda', 'triton', 'torch'), got 'cuda_emulated'", "after: ok"]


def test_a_test_backend_cannot_take_a_backends_name():
    with pytest.raises(ValueError, match="registered already"):
        backends.register_test_backend(backends.Backend("cpu", "cpu", lambda: None))
    assert backends.backend_named("cpu").native_namespace == "fusedoff"


def test_the_native_self_tests_live_apart():
    """The host kernels' self-tests (csrc/cpu/selftests.h) are ops of their own namespace,
    torch.ops.fusedoff_testing, for the tests: neither names of fusedoff.ops nor ops of torch.ops.fusedoff."""
    assert not [name for name in ops.__all__ if "selftest" in name]
    if not _ext.native_available():
        pytest.skip(f"no native extension: {_ext._load()[1]}")
    module = _ext.load_extension()
    assert not [name for name in dir(module) if "selftest" in name]
    for name in ("split_master_selftest", "written_param_selftest", "split_master_lanes_selftest",
                 "state_codec_selftest"):
        assert hasattr(torch.ops.fusedoff_testing, name), name
    assert not [name for name in dir(torch.ops.fusedoff) if "selftest" in name]
