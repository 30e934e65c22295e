"""The device seam: everything the offload engine asks of a device, in one small interface.

The engine (pipeline, store, placement) talks to a device only through a `Runtime`: side streams
and events (record, wait, synchronize), the current ("main") stream, asynchronous copies, kernels
launched on a stream, host computations run off the Python thread (the host worker), device
buffers, page-locked host memory, keeping a tensor alive for a stream, memory figures, and graph
capture. `Runtime` is that interface; four implementations:

- `HostRuntime`: the host loopback for CPU parameters. Everything runs at once, in program
  order; streams and events are None.
- `CudaRuntime` (cuda_runtime.py): torch's CUDA streams and events, and page-locking host memory.
  Nothing else in the engine touches torch.cuda.
- `fusedoff.testing.simulator.SimulatedRuntime` (a test tool): CPU tensors behind queued streams
  with a seeded random interleaving and a happens-before race checker, so CI runs the device side.
- `fusedoff.testing.timed.TimedRuntime` (a test and benchmark tool): CPU tensors run at once, every
  operation recorded and then timed by a deterministic scheduler (a prediction of a GPU's step).

Data-flow terms used by the simulator: the *host* is the Python thread (it reads and writes host
memory directly); the *host worker* runs the host's share of a step (`host_compute`: the host
kernels on host-computed tensors, see fusedoff/offload/host_share.py) in the order it was given,
each task after an event, and the host waits for a task with `wait_host_compute`: no stream waits
for a task (a GPU stream cannot wait for a host thread), so what reads a task's results is queued
by the host after that wait; *main* is the stream the user's kernels run on (the current stream: backward
writes gradients there, the next forward reads parameters there). `host_access` and `main_access`
tell the runtime about such accesses; only the simulator records them.

Every byte the engine moves between host memory and a device goes through the base class's counted
copies (`copy_to_device`, `copy_to_host`), so each runtime counts alike what it
copies each way in `link`; `memory_stats()` reports it (per step, in total, per parameter).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class LinkBytes:
    """Bytes copied between host memory and the device, each way."""

    to_device: int = 0
    to_host: int = 0

    def __add__(self, other: "LinkBytes") -> "LinkBytes":
        return LinkBytes(self.to_device + other.to_device, self.to_host + other.to_host)

    def __sub__(self, other: "LinkBytes") -> "LinkBytes":
        return LinkBytes(self.to_device - other.to_device, self.to_host - other.to_host)

    def as_dict(self) -> dict[str, int]:
        return {"to_device": self.to_device, "to_host": self.to_host}


class Runtime:
    """What the engine asks of a device. Every method but the access records, the counted copies
    (`copy_to_device`, `copy_to_host`: written once here, for every runtime) and the host worker
    (at once, for runtimes whose work completes as it is issued) must be implemented."""

    decides_budget = False  # offload='auto' decides a budget from the device's memory at the first step
    asynchronous = False  # copies overlap the host: host memory is page-locked for them
    records_accesses = False  # host_access/main_access are recorded (the simulator's race checker)
    measures_time = False  # `seconds` gives the device's times (host_share="auto" measures its steps)
    host_threads: int | None = None  # threads of the host worker's kernels (None: the process's default)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.link = LinkBytes()  # every byte the engine copied through this runtime, each way

    # the engine's copies, counted (the bytes of the host memory each one reads or writes)
    def copy_to_device(self, stream, dst: Tensor, src: Tensor) -> None:
        """`copy` from host memory `src` into the device buffer `dst`, counted in `link`."""
        self.link.to_device += src.numel() * src.element_size()
        self.copy(stream, dst, src)

    def copy_to_host(self, stream, dst: Tensor, src: Tensor) -> None:
        """`copy` from the device buffer `src` into host memory `dst`, counted in `link`."""
        self.link.to_host += dst.numel() * dst.element_size()
        self.copy(stream, dst, src)

    # streams and events
    def new_stream(self):
        """A new side stream."""
        raise NotImplementedError

    def current_stream(self):
        """The stream the user's kernels run on now ("main")."""
        raise NotImplementedError

    def record(self, stream):
        """An event completed when `stream`'s work queued so far is done."""
        raise NotImplementedError

    def timer(self, stream):
        """An event as `record`'s whose time `seconds` can read once it is complete."""
        return self.record(stream)

    def task_seconds(self, task, measured: float) -> float:
        """The seconds the host worker's `task` ran, which its kernels `measured` with `now`."""
        return measured

    def now(self) -> float:
        """The host's clock, in seconds (the host worker times its kernels with it)."""
        return time.perf_counter()

    def seconds(self, start, end) -> float | None:
        """Seconds from `start` to `end` (two `timer` events) where both are complete and this
        runtime `measures_time`; None otherwise (never waits)."""
        return None

    def wait_event(self, stream, event) -> None:
        """`stream`'s later work waits for `event` (None: nothing to wait for)."""
        raise NotImplementedError

    def wait_stream(self, waiter, waited) -> None:
        """`waiter`'s later work waits for `waited`'s work queued so far."""
        raise NotImplementedError

    def synchronize(self, event) -> None:
        """The host waits for `event`."""
        raise NotImplementedError

    # work
    def copy(self, stream, dst: Tensor, src: Tensor) -> None:
        """An asynchronous copy on `stream` (host <-> device, with page-locked host memory)."""
        raise NotImplementedError

    def launch(self, stream, fn: Callable[[], None], *, reads: Iterable[Tensor] = (),
               writes: Iterable[Tensor] = ()) -> None:
        """Runs `fn` (kernels reading `reads`, writing `writes`) on `stream`."""
        raise NotImplementedError

    # the host worker
    def host_compute(self, fn: Callable[[], None], *, after, reads: Iterable[Tensor] = (),
                     writes: Iterable[Tensor] = ()):
        """Runs `fn` (host kernels reading `reads`, writing `writes`, all host memory) on the host
        worker once `after` (an event, or None) is complete, after the tasks given before it;
        returns the task, for `wait_host_compute`. Here, for runtimes whose work completes as it is
        issued: at once, on the calling thread."""
        self.synchronize(after)
        fn()
        return None

    def wait_host_compute(self, task) -> None:
        """The host waits for `task` (a `host_compute`'s) and every task given before it; raises
        what the task raised, at the first wait for it only (a later wait finds it done)."""

    # memory
    def empty(self, numel: int) -> Tensor:
        """A new fp32 device buffer (allocated on the main stream)."""
        raise NotImplementedError

    def keep_alive(self, tensor: Tensor, stream) -> None:
        """The allocator must not reuse `tensor`'s memory before `stream`'s queued work is done."""
        raise NotImplementedError

    def pin(self, tensor: Tensor) -> bool:
        """Page-locks `tensor`'s memory in place for copies to this device; False if not possible."""
        raise NotImplementedError

    def unpin(self, tensors: list[Tensor]) -> None:
        """Unlocks tensors `pin` locked, once the copies queued on the device are done."""
        raise NotImplementedError

    def memory_info(self) -> tuple[int, int]:
        """(total bytes, peak bytes this process allocated so far) of the device."""
        raise NotImplementedError

    def capturing(self) -> bool:
        """True while the current stream is being captured into a graph."""
        raise NotImplementedError

    # accesses by the host and the main stream (recorded where `records_accesses`)
    def host_access(self, tensors: Iterable[Tensor], *, write: bool, what: str = "") -> None:
        pass

    def main_access(self, tensors: Iterable[Tensor], *, write: bool, what: str = "") -> None:
        pass


class HostRuntime(Runtime):
    """The host loopback: a device whose every operation completes when it is issued."""

    def new_stream(self):
        return None

    def current_stream(self):
        return None

    def record(self, stream):
        return None

    def wait_event(self, stream, event) -> None:
        pass

    def wait_stream(self, waiter, waited) -> None:
        pass

    def synchronize(self, event) -> None:
        pass

    def copy(self, stream, dst: Tensor, src: Tensor) -> None:
        dst.copy_(src)

    def launch(self, stream, fn: Callable[[], None], *, reads: Iterable[Tensor] = (),
               writes: Iterable[Tensor] = ()) -> None:
        fn()

    def empty(self, numel: int) -> Tensor:
        return torch.empty(numel, dtype=torch.float32, device=self.device)

    def keep_alive(self, tensor: Tensor, stream) -> None:
        pass

    def pin(self, tensor: Tensor) -> bool:
        return False  # nothing to pin for: the "device" is host memory

    def unpin(self, tensors: list[Tensor]) -> None:
        pass

    def memory_info(self) -> tuple[int, int]:
        raise NotImplementedError(f"no memory figures for {self.device}")

    def capturing(self) -> bool:
        return False
