"""Which runtime (runtime.py) a device gets: CUDA, the host loopback, or the simulator in tests;
and `DeviceRuntimes`, the runtimes of one engine with the bytes they copied over the link.

Kept apart from the `Runtime` interface, which names none of its implementations.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from fusedoff.offload.runtime import HostRuntime, LinkBytes, Runtime

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


class DeviceRuntimes:
    """The runtime of each device an engine's placement uses (made at its first use), and the bytes
    they copied between host memory and the devices (each runtime counts its own in ``link``):
    over the engine's life, the runtimes of its earlier placements included, and in its last step."""

    def __init__(self, host_threads: int | None = None) -> None:
        self.host_threads = host_threads  # the host worker's threads, given to each runtime made
        self._by_device: dict[torch.device, Runtime] = {}
        self._retired = LinkBytes()  # copied by the runtimes of earlier placements
        self._at_step_start = LinkBytes()
        self.last_step = LinkBytes()  # copied by the last step (none until one is whole)
        self.streamed_last_step = 0  # the parameter elements whose states streamed in the last step

    def of(self, device: torch.device) -> Runtime:
        rt = self._by_device.get(device)
        if rt is None:
            rt = self._by_device[device] = runtime_for(device)
            rt.host_threads = self.host_threads
        return rt

    def __getitem__(self, device: torch.device) -> Runtime:
        return self._by_device[device]

    def values(self):
        return self._by_device.values()

    def retire(self) -> None:
        """Forgets the runtimes (a placement made afresh makes its own), keeping what they copied."""
        self._retired = self.total
        self._by_device = {}

    @property
    def total(self) -> LinkBytes:
        """Every byte copied between host memory and the devices, each way, over the engine's life."""
        total = self._retired
        for rt in self._by_device.values():
            total = total + rt.link
        return total

    def step_started(self) -> None:
        self._at_step_start = self.total
        self.last_step, self.streamed_last_step = LinkBytes(), 0

    def step_done(self, streamed: int) -> None:
        """A whole step, which streamed the states of `streamed` parameter elements."""
        self.last_step, self.streamed_last_step = self.total - self._at_step_start, streamed
