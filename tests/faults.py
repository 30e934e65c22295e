"""Fault injection through the runtime seam: a `Runtime` that wraps another and fails at the k-th
operation of a step, as the real runtime fails there (see [note: the step as a transaction] in
fusedoff/offload/transaction.py).

Every operation the engine asks of a device counts: allocation (`empty`), pinning, copies, kernel
launches, streams, events, waits and host synchronisations, the host worker's tasks and the waits
for them, memory figures. A fault is either the error the real runtime raises there
(``torch.OutOfMemoryError`` for an allocation, ``RuntimeError`` for anything else) or a SIGINT
delivered at that moment (Ctrl-C: Python raises KeyboardInterrupt there unless a handler holds it).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

import torch

from fusedoff.offload.runtime import Runtime


class InjectedError(RuntimeError):
    """Marks an injected RuntimeError (a real one would be a plain RuntimeError)."""


class InjectedOutOfMemory(torch.OutOfMemoryError):
    """Marks an injected torch.OutOfMemoryError."""


@dataclass
class Faults:
    """Shared by every `FaultyRuntime` of a test: the operations counted while armed, and the one
    (by index) that fails, with `kind` "error" or "interrupt"."""

    fault_at: int | None = None
    kind: str = "error"
    armed: bool = False
    count: int = 0
    operations: list[str] = field(default_factory=list)
    injected: BaseException | None = None

    def arm(self, fault_at: int | None, kind: str = "error") -> None:
        self.fault_at, self.kind, self.armed, self.count, self.injected = fault_at, kind, True, 0, None
        self.operations = []

    def disarm(self) -> None:
        self.armed = False

    def operation(self, what: str) -> None:
        if not self.armed:
            return
        index = self.count
        self.count += 1
        self.operations.append(what)
        if index != self.fault_at:
            return
        if self.kind == "interrupt":
            signal.raise_signal(signal.SIGINT)  # KeyboardInterrupt here, unless a handler holds it
            return
        error = (InjectedOutOfMemory if what == "empty" else InjectedError)(f"injected fault at operation {index} ({what})")
        self.injected = error
        raise error


class FaultyRuntime(Runtime):
    """`inner` (a HostRuntime or a SimulatedRuntime) with `faults` asked before every operation."""

    def __init__(self, inner: Runtime, faults: Faults) -> None:
        super().__init__(inner.device)
        self.inner, self.faults = inner, faults
        self.decides_budget = inner.decides_budget
        self.asynchronous = inner.asynchronous
        self.records_accesses = inner.records_accesses

    def new_stream(self):
        self.faults.operation("new_stream")
        return self.inner.new_stream()

    def current_stream(self):
        return self.inner.current_stream()

    def record(self, stream):
        self.faults.operation("record")
        return self.inner.record(stream)

    def wait_event(self, stream, event) -> None:
        self.faults.operation("wait_event")
        self.inner.wait_event(stream, event)

    def wait_stream(self, waiter, waited) -> None:
        self.faults.operation("wait_stream")
        self.inner.wait_stream(waiter, waited)

    def synchronize(self, event) -> None:
        self.faults.operation("synchronize")
        self.inner.synchronize(event)

    def copy(self, stream, dst, src) -> None:
        self.faults.operation("copy")
        self.inner.copy(stream, dst, src)

    def launch(self, stream, fn, *, reads=(), writes=()) -> None:
        self.faults.operation("launch")
        self.inner.launch(stream, fn, reads=reads, writes=writes)

    def host_compute(self, fn, *, after, reads=(), writes=()):
        self.faults.operation("host_compute")
        return self.inner.host_compute(fn, after=after, reads=reads, writes=writes)

    def wait_host_compute(self, task) -> None:
        self.faults.operation("wait_host_compute")
        self.inner.wait_host_compute(task)

    def empty(self, numel: int):
        self.faults.operation("empty")
        return self.inner.empty(numel)

    def keep_alive(self, tensor, stream) -> None:
        self.inner.keep_alive(tensor, stream)

    def pin(self, tensor) -> bool:
        self.faults.operation("pin")
        return self.inner.pin(tensor)

    def unpin(self, tensors) -> None:
        self.inner.unpin(tensors)

    def memory_info(self):
        self.faults.operation("memory_info")
        return self.inner.memory_info()

    def capturing(self) -> bool:
        return self.inner.capturing()

    def host_access(self, tensors, *, write: bool, what: str = "") -> None:
        self.inner.host_access(tensors, write=write, what=what)

    def main_access(self, tensors, *, write: bool, what: str = "") -> None:
        self.inner.main_access(tensors, write=write, what=what)

    def drain(self) -> None:
        """Runs whatever the inner runtime still has queued (the simulator's side streams)."""
        if hasattr(self.inner, "drain"):
            self.inner.drain()
