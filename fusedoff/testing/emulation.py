"""The test backend ``cuda_emulated``: the CUDA kernels compiled as host C++ (csrc/emulation), run on
CPU tensors under the ops' own checks, from the test module ``fusedoff._C_emulated`` (its ops are
``torch.ops.fusedoff_emulated``). Importing this module adds the backend to ``fusedoff.backends``'
table, where the ops and the optimizer classes accept it by name; ``auto`` never chooses it."""

from __future__ import annotations

import functools
import os
import types
from pathlib import Path

from fusedoff import _ext, backends


@functools.cache
def load_emulated_extension() -> types.ModuleType:
    """``fusedoff._C_emulated``, built beside ``_C`` with FUSEDOFF_CUDA_EMULATION=1 (``make install``
    does), or the module file that FUSEDOFF_EMULATED_EXTENSION names (a sanitizer build:
    tools/sanitize_emulation.py); raises NativeExtensionUnavailable without one. Loading it registers
    torch.ops.fusedoff_emulated: the kernels' ops, and the emulator's controls (set_schedule_seed,
    launches) and self-test kernels (selftest_names, selftest)."""
    path = os.environ.get("FUSEDOFF_EMULATED_EXTENSION")
    if path:
        if not Path(path).is_file():
            raise _ext.NativeExtensionUnavailable(f"fusedoff: FUSEDOFF_EMULATED_EXTENSION={path} is not a module file")
        return _ext._import_module_file("fusedoff._C_emulated", Path(path))
    try:
        from fusedoff import _C_emulated  # type: ignore[attr-defined]
    except ImportError as exc:
        raise _ext.NativeExtensionUnavailable(
            f"fusedoff: the emulated CUDA kernels (backend 'cuda_emulated', for the tests) are not built ({exc}): "
            "build with FUSEDOFF_CUDA_EMULATION=1 pip install --no-build-isolation -e . (make install does)"
        ) from exc
    return _C_emulated


# It runs the cuda backend's implementation of each op, from its own namespace.
CUDA_EMULATED = backends.Backend("cuda_emulated", "cpu", load_emulated_extension, native_namespace="fusedoff_emulated",
                                 runs="cuda")
backends.register_test_backend(CUDA_EMULATED)
