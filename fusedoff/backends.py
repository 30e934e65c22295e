"""The backends: one table of what each needs, the one check of a backend's name, and the choice
of one for a device (the fastest available, or the one the user named)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import warnings
from collections.abc import Callable

import torch

from fusedoff import _ext


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _require_cuda_kernels() -> None:
    _ext.load_extension()  # raises the clear error naming what is missing
    if not _ext.cuda_kernels_available():
        raise _ext.NativeExtensionUnavailable(
            "fusedoff: the native extension was built without CUDA kernels (no CUDA toolkit at build time); "
            "rebuild with CUDA_HOME set, or use backend='triton' or 'torch'"
        )


def _require_triton() -> None:
    if not triton_available():
        raise ValueError("backend='triton' needs the triton package")


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    # The device its tensors must be on; None: whichever the tensors are on.
    device_type: str | None
    # Raises, naming what is missing, if the backend cannot run here (loads a native module).
    require: Callable[[], None]
    # The torch.ops namespace of csrc/ops.cpp's ops it runs; None for the Python backends.
    native_namespace: str | None = None
    # The backend whose implementation of each op (fusedoff.ops) it runs, from its own namespace;
    # None: its own.
    runs: str | None = None

    @property
    def implementation(self) -> str:
        return self.runs or self.name


_TABLE = {b.name: b for b in (
    Backend("cpu", "cpu", _ext.load_extension, native_namespace="fusedoff"),
    Backend("cuda", "cuda", _require_cuda_kernels, native_namespace="fusedoff"),
    Backend("triton", None, _require_triton),
    Backend("torch", None, lambda: None),
)}
BACKENDS = tuple(_TABLE)


def register_test_backend(backend: Backend) -> None:
    """Adds a backend that only the tests use (fusedoff.testing adds ``cuda_emulated``): accepted by
    name wherever a backend is, never chosen by 'auto', not one of BACKENDS. Adding the same one
    again does nothing; another under a name taken is refused."""
    if _TABLE.setdefault(backend.name, backend) is not backend:
        raise ValueError(f"fusedoff: a backend named {backend.name!r} is registered already")


def backend_named(name: str) -> Backend:
    """The backend called ``name``: the one place a backend's name is checked."""
    try:
        return _TABLE[name]
    except KeyError:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}") from None


def check_device(backend: Backend, device: torch.device) -> None:
    if backend.device_type is not None and device.type != backend.device_type:
        raise ValueError(f"backend={backend.name!r} needs {backend.device_type} tensors, not tensors on {device}")


def resolve_backend(requested: str, device: torch.device) -> str:
    """The backend to run on ``device``; raises ValueError/NativeExtensionUnavailable if it cannot."""
    if requested == "auto":
        if device.type == "cuda":
            if _ext.cuda_kernels_available():
                return "cuda"
            return "triton" if triton_available() else "torch"
        if device.type == "cpu" and _ext.native_available():
            return "cpu"
        if device.type == "cpu":
            _warn_native_missing()
        return "torch"
    backend = backend_named(requested)
    check_device(backend, device)
    backend.require()
    if backend.name == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # Compiled Triton kernels cannot read host memory; only its interpreter runs on CPU tensors.
        raise ValueError("backend='triton' runs on CPU tensors only under Triton's interpreter (TRITON_INTERPRET=1)")
    return requested


@functools.cache
def _warn_native_missing() -> None:
    warnings.warn(
        f"fusedoff: the native cpu backend is unavailable ({_ext._load()[1]}); using the pure-PyTorch backend",
        stacklevel=4,
    )
