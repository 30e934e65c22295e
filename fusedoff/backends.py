"""Choosing a backend for a device: the fastest one available, or the one the user named."""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings

import torch

from fusedoff import _ext
from fusedoff.ops import BACKENDS, TEST_BACKENDS


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


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
    if requested not in BACKENDS + TEST_BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {requested!r}")
    if requested == "cuda_emulated":  # the tests' CUDA kernels on the host (csrc/emulation)
        if device.type != "cpu":
            raise ValueError(f"backend='cuda_emulated' runs the CUDA kernels on CPU tensors, not on {device}")
        _ext.load_emulated_extension()
        return requested
    if requested in ("cpu", "cuda"):
        if device.type != requested:
            raise ValueError(f"backend={requested!r} cannot update parameters on {device}")
        _ext.load_extension()  # raises the clear error naming what is missing
        if requested == "cuda" and not _ext.cuda_kernels_available():
            raise _ext.NativeExtensionUnavailable(
                "fusedoff: the native extension was built without CUDA kernels (no CUDA toolkit at build time); "
                "rebuild with CUDA_HOME set, or use backend='triton' or 'torch'"
            )
    if requested == "triton" and not triton_available():
        raise ValueError("backend='triton' needs the triton package")
    if requested == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # Compiled Triton kernels cannot read host memory; only its interpreter runs on CPU tensors.
        raise ValueError("backend='triton' runs on CPU tensors only under Triton's interpreter (TRITON_INTERPRET=1)")
    return requested


@functools.cache
def _warn_native_missing() -> None:
    warnings.warn(
        f"fusedoff: the native cpu backend is unavailable ({_ext._load()[1]}); using the pure-PyTorch backend",
        stacklevel=4,
    )
