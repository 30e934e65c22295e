"""SimulatedRuntime: the engine's device side on CPU tensors, with a happens-before race checker.

A `Runtime` (fusedoff/offload/runtime.py) whose side streams are queues. Queued operations run only when
their waits are met, in a seeded random interleaving across streams, and an asynchronous copy's effect
lands at a random later point before the next operation of its stream (so before its completion event).
Kernels are the real CPU kernels, so results are real: a missing wait shows as a wrong value when the
interleaving is unlucky, and always as a race.

The race checker records every access to memory (device buffers, host slabs, parameters,
gradients, steps, stats; a region is a byte range of a storage) with a vector clock, and checks
that each pair of conflicting accesses (overlapping, one a write) is ordered by the recorded
program order and event edges: a violation raises `RaceError` naming both accesses, their
timelines and the region. Happens-before is fixed when an operation is queued, so a missing edge
is reported whatever the interleaving.

A buffer's lifetime is checked the same way: host memory the engine drops (a bucket placed afresh
or forgotten, `Bucket.release`: its streamed states, its host share's states and page-locked
buffers) is recorded as a host write of every slab, since from then on the host may write it (a
new placement's buffers, any allocation). A device copy still queued on a released buffer, which
the host did not wait for, is reported as a race, as a write into it would be.

Timelines: 0 is the host (the Python thread; its host-memory accesses), 1 the main stream (the
user's kernels: backward writes gradients there, the next forward reads parameters there; its work
runs at once, in program order), then one per side stream. Work queued after a host action is
ordered after it; main-stream work is ordered after the host actions before it; side streams see
main-stream work only through events, as on a GPU.

The host worker (`host_compute`: the host's share of a step, fusedoff/offload/host_share.py) is
one more ordered agent, a timeline of its own made at its first task: its tasks run in order, each
once the event it was given is complete, in the same random interleaving as the streams; a task
is ordered after what the host did before giving it (a thread's submission), and after its event.
Only the host waits for a task (`wait_host_compute`, which joins the worker's clock into the
host's): a stream that waited for one would be a GPU waiting for a host thread, which it cannot,
so `wait_event` refuses a task.
"""

from __future__ import annotations

import contextlib
import random
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fusedoff.offload.runtime import Runtime

Clock = dict[int, int]


class RaceError(AssertionError):
    """Two conflicting accesses that no stream order or event orders."""


def _join(a: Clock, b: Clock) -> Clock:
    out = dict(a)
    for k, v in b.items():
        if v > out.get(k, 0):
            out[k] = v
    return out


@dataclass
class _Access:
    start: int
    end: int
    write: bool
    clock: Clock
    timeline: int
    what: str

    def before(self, clock: Clock) -> bool:
        return self.clock.get(self.timeline, 0) <= clock.get(self.timeline, 0)


@dataclass
class _Event:
    clock: Clock
    done: bool = False


@dataclass
class _HostTask:
    """A task given to the host worker: complete with its event; what it raised, raised by the first
    wait for it (as a thread's error is, by the host that joins it)."""

    event: _Event | None = None
    error: Exception | None = None


@dataclass
class _Op:
    what: str
    run: Callable[[], None] = lambda: None
    ready: Callable[[], bool] = lambda: True


@dataclass
class _Timeline:
    index: int
    name: str
    clock: Clock
    side: bool = False  # a side stream (queued, asynchronous); else host or a main-like stream (immediate)
    queue: deque = field(default_factory=deque)  # side streams: queued ops
    landings: deque = field(default_factory=deque)  # side streams: copies read but not yet visible

    def tick(self) -> Clock:
        self.clock[self.index] = self.clock.get(self.index, 0) + 1
        return dict(self.clock)


class SimulatedRuntime(Runtime):
    decides_budget = True
    asynchronous = True
    records_accesses = True

    def __init__(self, device: torch.device, *, seed: int = 0, total_memory: int = 2**34, peak_memory: int = 0,
                 pin_fails: bool = False, capturing: bool = False) -> None:
        super().__init__(device)
        self.rng = random.Random(seed)
        self.host = _Timeline(0, "host", {})
        self.main = _Timeline(1, "main stream", {})
        self.timelines = [self.host, self.main]
        self._current = self.main
        self.memory = (total_memory, peak_memory)
        self.pin_fails = pin_fails
        self.capturing_graph = capturing
        self._history: dict[int, list[_Access]] = {}
        self._host_worker: _Timeline | None = None
        self.host_tasks = 0  # tasks the host worker ran
        self.ops_run = 0
        self.checked = 0

    # ---- streams and events ------------------------------------------------------------------------
    def new_stream(self) -> _Timeline:
        timeline = _Timeline(len(self.timelines), f"side stream {len(self.timelines) - 1}", {}, side=True)
        self.timelines.append(timeline)
        return timeline

    def current_stream(self) -> _Timeline:
        return self._current

    @contextlib.contextmanager
    def user_stream(self):
        """Makes a new stream the current one (a user's non-default stream) within the block; like
        a user, it waits for the previous stream on entry, and that stream waits for it on exit."""
        previous = self._current
        self._current = _Timeline(len(self.timelines), "user stream", dict(previous.clock))
        self.timelines.append(self._current)
        try:
            yield self._current
        finally:
            previous.clock = _join(previous.clock, self._current.clock)
            self._current = previous

    def record(self, stream: _Timeline) -> _Event:
        if not stream.side:
            return _Event(dict(stream.clock), done=True)
        event = _Event(dict(stream.clock))
        self._enqueue(stream, _Op(f"record an event on {stream.name}", run=lambda: setattr(event, "done", True)))
        return event

    def wait_event(self, stream: _Timeline, event: _Event | None) -> None:
        if event is None:
            return
        if isinstance(event, _HostTask):
            raise TypeError("a stream cannot wait for the host worker: the host waits for the task "
                            "(wait_host_compute), then queues what reads its results")
        if not stream.side:
            self._run_until(event)
            stream.clock = _join(stream.clock, event.clock)
            return
        stream.clock = _join(stream.clock, event.clock)
        self._enqueue(stream, _Op(f"wait on {stream.name}", ready=lambda: event.done))

    def wait_stream(self, waiter: _Timeline, waited: _Timeline) -> None:
        self.wait_event(waiter, self.record(waited))

    def synchronize(self, event: _Event | None) -> None:
        if event is not None:
            self._run_until(event)
            self.host.clock = _join(self.host.clock, event.clock)

    # ---- work ------------------------------------------------------------------------------------------
    def copy(self, stream: _Timeline, dst: Tensor, src: Tensor) -> None:
        def start() -> None:
            stream.landings.append((dst, src.clone()))  # read now, visible later

        what = f"copy of {tuple(src.shape)} on {stream.name}"
        self._enqueue(stream, _Op(what, run=start), reads=[src], writes=[dst])

    def launch(self, stream: _Timeline, fn, *, reads=(), writes=()) -> None:
        if not stream.side:  # the main stream's (or a user stream's) work runs at once, in program order
            writes = list(writes)
            write_ids = {id(t) for t in writes}
            self.main_access([t for t in reads if id(t) not in write_ids], write=False, what=f"kernel on {stream.name}")
            self.main_access(writes, write=True, what=f"kernel on {stream.name}")
            fn()
            return
        self._enqueue(stream, _Op(f"kernel on {stream.name}", run=fn), reads=reads, writes=writes)

    # ---- the host worker ---------------------------------------------------------------------------------
    def host_compute(self, fn, *, after, reads=(), writes=()) -> _HostTask:
        worker = self._host_worker
        if worker is None:
            worker = self._host_worker = _Timeline(len(self.timelines), "host worker", {}, side=True)
            self.timelines.append(worker)
        self.wait_event(worker, after)
        task = _HostTask()

        def run() -> None:
            try:
                fn()
            except Exception as error:  # noqa: BLE001 (raised by the host's wait, not by the scheduler)
                task.error = error
            self.host_tasks += 1

        self._enqueue(worker, _Op("host compute on the host worker", run=run), reads=reads, writes=writes)
        task.event = self.record(worker)
        return task

    def wait_host_compute(self, task: _HostTask | None) -> None:
        if task is not None:
            self.synchronize(task.event)
            error, task.error = task.error, None  # (raised at the first wait only)
            if error is not None:
                raise error

    def empty(self, numel: int) -> Tensor:
        buffer = torch.full((numel,), float("nan"), dtype=torch.float32, device=self.device)  # poison
        self.main_access([buffer], write=True, what="a new buffer from the main stream's pool")
        return buffer

    def keep_alive(self, tensor: Tensor, stream) -> None:
        pass  # simulated buffers are CPU tensors the pipeline holds: nothing reuses their memory early

    def unpin(self, tensors: list[Tensor]) -> None:
        pass

    def pin(self, tensor: Tensor) -> bool:
        return not self.pin_fails

    def memory_info(self) -> tuple[int, int]:
        return self.memory

    def capturing(self) -> bool:
        return self.capturing_graph

    # ---- accesses by the host and the main stream ------------------------------------------------------
    def host_access(self, tensors: Iterable[Tensor], *, write: bool, what: str = "") -> None:
        self._check(tensors, write, self.host.tick(), self.host.index, what or "host access")

    def main_access(self, tensors: Iterable[Tensor], *, write: bool, what: str = "") -> None:
        main = self._current
        main.clock = _join(main.clock, self.host.clock)
        self._check(tensors, write, main.tick(), main.index, what or f"access on {main.name}")

    def drain(self) -> None:
        """Runs every queued operation (what a device synchronisation would wait for)."""
        while self._step_once():
            pass

    # ---- the scheduler -----------------------------------------------------------------------------------
    def _enqueue(self, stream: _Timeline, op: _Op, reads: Iterable[Tensor] = (), writes: Iterable[Tensor] = ()) -> None:
        stream.clock = _join(stream.clock, self.host.clock)  # queued after everything the host did so far
        clock = stream.tick()
        writes = list(writes)
        write_ids = {id(t) for t in writes}
        self._check([t for t in reads if id(t) not in write_ids], False, clock, stream.index, op.what)
        self._check(writes, True, clock, stream.index, op.what)
        stream.queue.append(op)
        for _ in range(self.rng.randint(0, 3)):
            if not self._step_once():
                break

    def _step_once(self) -> bool:
        """Runs one queued operation or lands one copy, on a random stream; False if nothing can."""
        choices = []
        for timeline in self.timelines:
            if not timeline.side:
                continue
            if timeline.landings:
                choices.append((timeline, "land"))
            if timeline.queue and timeline.queue[0].ready():
                choices.append((timeline, "run"))
        if not choices:
            return False
        timeline, action = self.rng.choice(choices)
        if action == "land":
            dst, data = timeline.landings.popleft()
            dst.copy_(data)
            return True
        while timeline.landings:  # stream order: earlier copies complete before the next operation
            dst, data = timeline.landings.popleft()
            dst.copy_(data)
        op = timeline.queue.popleft()
        op.run()
        self.ops_run += 1
        return True

    def _run_until(self, event: _Event) -> None:
        while not event.done:
            if not self._step_once():
                raise RuntimeError("simulated deadlock: an event that no queued operation can complete")

    # ---- the race checker ----------------------------------------------------------------------------------
    def _check(self, tensors: Iterable[Tensor], write: bool, clock: Clock, timeline: int, what: str) -> None:
        for t in tensors:
            if t.numel() == 0:
                continue
            size = t.element_size()
            key = t.untyped_storage().data_ptr()
            start = t.storage_offset() * size
            end = start + t.numel() * size
            accesses = self._history.setdefault(key, [])
            for a in accesses:
                self.checked += 1
                if a.end <= start or end <= a.start or not (write or a.write) or a.before(clock):
                    continue
                raise RaceError(
                    f"race on bytes [{max(a.start, start)}, {min(a.end, end)}) of a storage: "
                    f"{'write' if a.write else 'read'} by {a.what!r} on {self.timelines[a.timeline].name} and "
                    f"{'write' if write else 'read'} by {what!r} on {self.timelines[timeline].name}, "
                    "ordered by no stream or event")
            if write:  # a later access ordered after this write is ordered after what it covers
                accesses[:] = [a for a in accesses if not (start <= a.start and a.end <= end and a.before(clock))]
            accesses.append(_Access(start, end, write, clock, timeline, what))
