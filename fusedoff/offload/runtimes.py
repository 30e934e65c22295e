"""Which runtime (runtime.py) a device gets: CUDA, the host loopback, or the simulator in tests.

Kept apart from the `Runtime` interface, which names none of its implementations.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from fusedoff.offload.runtime import HostRuntime, Runtime

# The runtime for CPU devices inside `simulate` (None: the host loopback).
_simulated: Callable[[torch.device], Runtime] | None = None


def runtime_for(device: torch.device) -> Runtime:
    """The runtime of `device`: CUDA, the host loopback, or (inside `simulate`) the simulator for CPU."""
    if device.type == "cuda":
        from fusedoff.offload.cuda_runtime import CudaRuntime

        return CudaRuntime(device)
    if _simulated is not None and device.type == "cpu":
        return _simulated(device)
    return HostRuntime(device)


@contextlib.contextmanager
def simulate(factory: Callable[[torch.device], Runtime]):
    """Within this block, optimizers created for CPU parameters get the runtime `factory(device)`."""
    global _simulated
    previous, _simulated = _simulated, factory
    try:
        yield
    finally:
        _simulated = previous
