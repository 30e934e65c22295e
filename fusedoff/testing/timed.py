"""TimedRuntime: the engine's device side on CPU tensors, recorded and then timed by a deterministic scheduler.

A `Runtime` (fusedoff/offload/runtime.py) that runs every copy and kernel at once, on CPU tensors, with
the real kernels (so results are the host loopback's, bit for bit), and records each operation the engine
asks for: its timeline (the host, the main stream, a side stream), its kind, its bytes, and what it waits
for. `schedule(rates)` then places every recorded operation in time, and `predict` reads from that
schedule what a GPU run must measure: the step time, the link-bound time, the time the step adds to the
next forward, and the critical path.

What is recorded (the dependencies are those of a GPU):
  * every runtime call is a *host* operation on the host timeline, one after another, each taking
    `Rates.host_call` (the engine's Python per call; `benchmarks/predict_step.py` measures it);
  * the device operation a call queues (a copy, a kernel, an event record, a wait, main-stream work)
    starts after that host operation, after the previous operation on its stream, and after the events
    it waits for; `synchronize` is a host operation that ends no earlier than its event;
  * a copy is h2d or d2h by which side is a device buffer (`empty`); its bytes are its destination's;
  * a kernel's bytes are those of the ops it runs (see [note: timed kernel bytes]);
  * `main_work(seconds, what)` is work of a given duration on the current (main) stream: the caller's
    forward or backward layers. It waits for whatever the main stream waited for before it, so a layer
    queued after `wait_event(current_stream(), event)` starts when `event` completes.

[note: timed scale] `scale` multiplies the bytes of every copy and kernel: a model with the same number
of chunks as a large one, each chunk `scale` times smaller (chunk_size 256 standing for 4M elements:
scale 16384), records the large model's schedule in milliseconds of CPU time. Per-call host costs and
main-stream work do not scale: they are per operation, and the chunk count is kept.

[note: timed link sharing] The link has a rate per direction (`Rates.h2d`, `Rates.d2h`) and a cap on
both directions at once (`Rates.both`). While copies run in both directions, each direction gets the
smaller of its rate and half the cap, and what one direction leaves of its half goes to the other
(max-min fair sharing of the cap); several copies in one direction share its rate equally. Kernels run
at `Rates.kernel_rate` bytes per second and do not slow each other, the copies, or main-stream work
(HBM and SMs are not shared in this model).

[note: timed host resource] The host worker (`host_compute`: the host share's kernels, see
fusedoff/offload/host_share.py) is a timeline of its own: a task starts after the event it waits for
and after the task before it, and moves the bytes its ops read and write ([note: timed kernel bytes])
at `Rates.host_kernel` bytes per second (its threads' rate alone; None: host memory's) but never faster
than what host memory has left: `Rates.host_memory` less the copies' bytes per second at that moment.
The copies are DMA into and out of host memory, so they take from it first: where they would move more
than `host_memory` together, both directions slow down alike. The default host memory is unbounded
(the schedules of streamed steps are those of before); `fusedoff.costs` presets give one GPU's share of
a node's DRAM. The host waits for a task (`wait_host_compute`) as for an event.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from fusedoff.offload.runtime import Runtime

HOST = "host"
H2D, D2H, KERNEL, WORK, MARK = "h2d", "d2h", "kernel", "work", "mark"
HOST_KERNEL = "host kernel"  # a task of the host worker: see [note: timed host resource]


@dataclass(frozen=True)
class Rates:
    """The calibration of a timed schedule: link, device memory and host per call.

    Defaults: an H200 on PCIe Gen5 x16 (64 GB/s raw per direction; about 55 GB/s reached by large
    pinned copies each way), an assumed cap of 100 GB/s for both directions at once, HBM3e at its
    published 4.8 TB/s with an assumed 80% reached by a streaming kernel, and the engine's Python per
    runtime call as `benchmarks/predict_step.py` measured it (benchmarks/results/RESULTS.md).
    """

    h2d: float = 55e9  # bytes/s host -> device
    d2h: float = 55e9  # bytes/s device -> host
    both: float = 100e9  # bytes/s both directions together, when both are busy
    device_memory: float = 4.8e12  # bytes/s, published peak
    device_memory_fraction: float = 0.8  # of the peak a streaming kernel reaches (assumed)
    host_call: float = 6.4e-6  # seconds of host time per runtime call: predict_step.py, RESULTS.md
    host_memory: float = math.inf  # bytes/s of host memory: copies (DMA) and the host worker's kernels
    host_kernel: float | None = None  # bytes/s the host worker's kernels reach alone (None: host_memory)

    @property
    def kernel_rate(self) -> float:
        return self.device_memory * self.device_memory_fraction


@dataclass
class TimedOp:
    index: int
    kind: str  # HOST, H2D, D2H, KERNEL, WORK, MARK
    timeline: str
    what: str
    deps: tuple[int, ...]
    amount: float = 0.0  # bytes (h2d, d2h, kernel: before `scale`) or seconds (work)


@dataclass
class _Stream:
    name: str
    last: int | None = None  # the index of the stream's last operation


@dataclass(frozen=True)
class _TimedEvent:
    op: int


class _KernelBytes(TorchDispatchMode):
    """[note: timed kernel bytes] The bytes a kernel moves, from the ops it runs: each tensor argument
    read once, each argument its op's schema marks mutated written once, each new tensor it returns written
    once; views move nothing. The engine's `launch` also names the whole parameters and gradients of a
    bucket among its reads and writes (the compute waits for them), so those lists overstate a chunk's
    bytes; the ops' arguments are the chunk's own pieces. An argument that is only written (the bf16
    parameter rounded from its fp32 master) counts as read too: an upper bound by 2 bytes a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view:
            return out
        for k, argument in enumerate(func._schema.arguments):  # positional arguments come first
            value = args[k] if not argument.kwarg_only and k < len(args) else kwargs.get(argument.name)
            written = argument.alias_info is not None and argument.alias_info.is_write
            self.bytes += _nbytes(value) * (2 if written else 1)
        outs = out if isinstance(out, tuple) else (out,)
        for returned, value in zip(func._schema.returns, outs):
            if returned.alias_info is None:  # a new tensor (an in-place op returns its input)
                self.bytes += _nbytes(value)
        return out


def _nbytes(value) -> int:
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class TimedRuntime(Runtime):
    """Runs the engine's copies and kernels at once on CPU tensors and records them for `schedule`.

    With `rates`, it also answers the engine's timers (`seconds`) from the schedule of what it recorded
    since it was last drained, so that host_share="auto" measures the schedule's steps."""

    asynchronous = True  # host memory is "pinned" (pin answers True), as on a GPU

    def __init__(self, device: torch.device, *, scale: float = 1.0, total_memory: int = 2**40,
                 rates: Rates | None = None) -> None:
        super().__init__(device)
        self.rates = rates
        self.measures_time = rates is not None
        self.worker = _Stream("host worker")
        self._drains = [0]  # where each drain ended: the operations before one were complete after it
        self._schedules: dict[tuple[int, int], Schedule] = {}
        self.scale = scale
        self.ops: list[TimedOp] = []
        self.host = _Stream(HOST)
        self.main = _Stream("main stream")
        self.streams = [self.main]
        self.total_memory = total_memory
        self.device_seconds = 0.0  # wall time spent running the copies and kernels themselves
        self._device_storages: set[int] = set()

    # ---- recording ------------------------------------------------------------------------------------
    def _add(self, kind: str, stream: _Stream, what: str, amount: float = 0.0, waits: Iterable[int] = ()) -> int:
        deps = [] if stream.last is None else [stream.last]
        if stream is not self.host:  # queued by the host
            deps.append(self._add(HOST, self.host, f"issue {what}"))
        deps.extend(waits)
        index = len(self.ops)
        self.ops.append(TimedOp(index, kind, stream.name, what, tuple(dict.fromkeys(deps)), amount))
        stream.last = index
        return index

    @property
    def host_calls(self) -> int:
        return sum(op.kind == HOST for op in self.ops)

    def mark(self) -> int:
        """The index the next recorded operation gets: the boundary of a phase (a step, a forward)."""
        return len(self.ops)

    def main_work(self, seconds: float, what: str = "main-stream work") -> None:
        """Work of `seconds` on the current stream (a forward or backward layer)."""
        self._add(WORK, self.main, what, seconds)

    def drain(self) -> None:
        """The host waits for every stream and the host worker (a device synchronisation)."""
        for stream in self.streams:
            self.synchronize(self.record(stream))
        if self.worker.last is not None:
            self._add(HOST, self.host, "wait for the host worker", waits=(self.worker.last,))
        self._drains.append(len(self.ops))

    # ---- timers (host_share="auto"): from the schedule between two drains ----------------------------
    def timer(self, stream: _Stream) -> _TimedEvent:
        return self.record(stream)

    def _between_drains(self, *ops: int) -> Schedule | None:
        """The schedule of the operations between the drains around `ops` (None: a drain between them)."""
        first = max(d for d in self._drains if d <= min(ops))
        later = [d for d in self._drains if d > first]
        last = later[0] if later else len(self.ops)
        if max(ops) >= last:
            return None
        key = (first, last)
        if key not in self._schedules:  # (a window still growing is keyed by its length now: the
            # schedules of its shorter lengths are dropped)
            for stale in [k for k in self._schedules if k[0] == first]:
                del self._schedules[stale]
            self._schedules[key] = schedule(self.ops, self.rates, self.scale, window=range(first, last))
        return self._schedules[key]

    def seconds(self, start: _TimedEvent, end: _TimedEvent) -> float | None:
        timed = None if self.rates is None else self._between_drains(start.op, end.op)
        return None if timed is None else timed.end[end.op] - timed.end[start.op]

    def task_seconds(self, task, measured: float) -> float:
        timed = None if self.rates is None or task is None else self._between_drains(task.op)
        return measured if timed is None else timed.end[task.op] - timed.start[task.op]

    # ---- streams and events ---------------------------------------------------------------------------
    def new_stream(self) -> _Stream:
        stream = _Stream(f"side stream {len(self.streams)}")
        self.streams.append(stream)
        return stream

    def current_stream(self) -> _Stream:
        return self.main

    def record(self, stream: _Stream) -> _TimedEvent:
        return _TimedEvent(self._add(MARK, stream, f"record an event on {stream.name}"))

    def wait_event(self, stream: _Stream, event: _TimedEvent | None) -> None:
        if event is not None:
            self._add(MARK, stream, f"wait on {stream.name}", waits=(event.op,))

    def wait_stream(self, waiter: _Stream, waited: _Stream) -> None:
        self.wait_event(waiter, self.record(waited))

    def synchronize(self, event: _TimedEvent | None) -> None:
        if event is not None:
            self._add(HOST, self.host, "synchronize", waits=(event.op,))

    # ---- work -----------------------------------------------------------------------------------------
    def copy_to_device(self, stream, dst: Tensor, src: Tensor) -> None:
        self._direction = H2D  # (the host share's copies: a parameter is a "device" tensor not made by empty)
        super().copy_to_device(stream, dst, src)

    def copy_to_host(self, stream, dst: Tensor, src: Tensor) -> None:
        self._direction = D2H
        super().copy_to_host(stream, dst, src)

    def copy(self, stream: _Stream, dst: Tensor, src: Tensor) -> None:
        kind = H2D if self._on_device(dst) else D2H if self._on_device(src) else None
        kind, self._direction = kind or getattr(self, "_direction", None), None
        if kind is None:
            raise ValueError("a timed copy moves between a device tensor and host memory (copy_to_device, "
                             "copy_to_host, or a buffer made by empty)")
        began = time.perf_counter()
        dst.copy_(src)
        self.device_seconds += time.perf_counter() - began
        nbytes = dst.numel() * dst.element_size()
        self._add(kind, stream, f"{kind} copy", nbytes)

    def launch(self, stream: _Stream, fn: Callable[[], None], *, reads: Iterable[Tensor] = (),
               writes: Iterable[Tensor] = ()) -> None:
        began = time.perf_counter()
        with _KernelBytes() as counted:
            fn()
        self.device_seconds += time.perf_counter() - began
        self._add(KERNEL, stream, "kernel", counted.bytes)

    def host_compute(self, fn: Callable[[], None], *, after, reads: Iterable[Tensor] = (),
                     writes: Iterable[Tensor] = ()) -> _TimedEvent:
        """Runs `fn` at once and records it as a task of the host worker (see [note: timed host resource])."""
        with _KernelBytes() as counted:
            fn()
        waits = () if after is None else (after.op,)
        return _TimedEvent(self._add(HOST_KERNEL, self.worker, "host kernels", counted.bytes, waits=waits))

    def wait_host_compute(self, task: _TimedEvent | None) -> None:
        if task is not None:
            self._add(HOST, self.host, "wait for the host worker", waits=(task.op,))

    # ---- memory ---------------------------------------------------------------------------------------
    def empty(self, numel: int) -> Tensor:
        buffer = torch.empty(numel, dtype=torch.float32, device=self.device)
        self._device_storages.add(buffer.untyped_storage().data_ptr())
        return buffer

    def _on_device(self, tensor: Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._device_storages

    def keep_alive(self, tensor: Tensor, stream) -> None:
        pass  # the pipeline holds the buffers

    def pin(self, tensor: Tensor) -> bool:
        return True

    def unpin(self, tensors: list[Tensor]) -> None:
        pass

    def memory_info(self) -> tuple[int, int]:
        return self.total_memory, 0

    def capturing(self) -> bool:
        return False

    def schedule(self, rates: Rates, *, instant: range = range(0)) -> Schedule:
        return schedule(self.ops, rates, self.scale, instant=instant)


# ---- the scheduler ------------------------------------------------------------------------------------


@dataclass
class Schedule:
    ops: list[TimedOp]
    start: list[float]
    end: list[float]
    scale: float = 1.0

    def critical_path(self, last: int) -> list[int]:
        """The chain of operations ending at `last`, each released by the one before it (the dependency
        that ended last)."""
        path = [last]
        while self.ops[path[-1]].deps:
            path.append(max(self.ops[path[-1]].deps, key=lambda d: (self.end[d], d)))
        return path[::-1]


def link_rates(h2d_active: int, d2h_active: int, rates: Rates) -> tuple[float, float]:
    """Bytes/s of each active h2d copy and each active d2h copy (see [note: timed link sharing])."""
    h = rates.h2d if h2d_active else 0.0
    d = rates.d2h if d2h_active else 0.0
    if h2d_active and d2h_active and h + d > rates.both:
        half = rates.both / 2
        if h < half:
            d = min(d, rates.both - h)
        elif d < half:
            h = min(h, rates.both - d)
        else:
            h = d = half
    return h / max(h2d_active, 1), d / max(d2h_active, 1)


def host_rates(h2d: float, d2h: float, host_kernels_active: int, rates: Rates) -> tuple[float, float, float]:
    """The bytes/s of all h2d copies, of all d2h copies and of each active host kernel, where host memory
    carries them (see [note: timed host resource])."""
    copies = h2d + d2h
    if copies > rates.host_memory:
        h2d, d2h = h2d * rates.host_memory / copies, d2h * rates.host_memory / copies
        copies = rates.host_memory
    kernel = rates.host_memory if rates.host_kernel is None else rates.host_kernel
    left = max(0.0, rates.host_memory - copies)
    return h2d, d2h, min(kernel, left) / max(host_kernels_active, 1)


def schedule(ops: Sequence[TimedOp], rates: Rates, scale: float = 1.0, *, instant: range = range(0),
             window: range | None = None) -> Schedule:
    """Start and end of every operation: each starts when its last dependency ends and runs for its
    duration; copies share the link (a fluid simulation: rates change when a copy starts or ends), and
    with the host worker's kernels, host memory. Operations whose index is in `instant` take no time
    (the counterfactual of an instant step). With `window`, only its operations are scheduled, from 0,
    their dependencies before it taken as done (the others' times are NaN)."""
    n = len(ops)
    window = range(n) if window is None else window
    dependents: list[list[int]] = [[] for _ in range(n)]
    unmet = [0] * n
    for i in window:
        op = ops[i]
        for d in op.deps:
            if d in window:
                dependents[d].append(op.index)
                unmet[op.index] += 1
    start, end = [math.nan] * n, [math.nan] * n
    left = [0.0] * n  # bytes left (copies) or seconds left (everything else)
    t = 0.0
    ready = [i for i in window if unmet[i] == 0]
    active: list[int] = []
    while ready or active:
        for i in ready:
            op = ops[i]
            start[i] = t
            if i in instant:
                left[i] = 0.0
            elif op.kind in (H2D, D2H):
                left[i] = op.amount * scale
            elif op.kind == KERNEL:
                left[i] = op.amount * scale / rates.kernel_rate
            elif op.kind == HOST:
                left[i] = rates.host_call
            elif op.kind == WORK:
                left[i] = op.amount
            elif op.kind == HOST_KERNEL:
                left[i] = op.amount * scale
            active.append(i)
        ready = []
        h2d_active = sum(ops[i].kind == H2D for i in active)
        d2h_active = sum(ops[i].kind == D2H for i in active)
        per_h2d, per_d2h = link_rates(h2d_active, d2h_active, rates)
        h2d, d2h, per_host = host_rates(per_h2d * h2d_active, per_d2h * d2h_active,
                                        sum(ops[i].kind == HOST_KERNEL for i in active), rates)
        per_h2d, per_d2h = h2d / max(h2d_active, 1), d2h / max(d2h_active, 1)
        by_kind = {H2D: per_h2d, D2H: per_d2h, HOST_KERNEL: per_host}
        speed = [by_kind.get(ops[i].kind, 1.0) for i in active]
        finish = [(left[i] / s if s > 0 else math.inf) if left[i] > 0 else 0.0 for i, s in zip(active, speed)]
        if finish and min(finish) == math.inf:
            raise RuntimeError("host kernels wait for host memory that the copies never leave")
        dt = min(finish)
        t += dt
        still = []
        for i, s, f in zip(active, speed, finish):
            if f <= dt * (1 + 1e-12):
                end[i] = t
                for j in dependents[i]:
                    unmet[j] -= 1
                    if unmet[j] == 0:
                        ready.append(j)
            else:
                left[i] -= s * dt
                still.append(i)
        active = still
    if any(math.isnan(end[i]) for i in window):
        raise RuntimeError("an operation waits on one recorded after it")
    return Schedule(list(ops), start, end, scale)


# ---- what a GPU run must measure ----------------------------------------------------------------------


@dataclass
class Prediction:
    step_s: float  # the step's first operation's start to its last one's end
    link_bound_s: float  # the step's bytes at the link's rates (see `link_bound`)
    exposed_s: float  # how much later the forward ends than after an instant step (0 without one)
    forward_s: float  # the forward's main-stream work
    h2d_bytes: float
    d2h_bytes: float
    kernel_bytes: float
    host_calls: int
    host_kernel_bytes: float = 0.0  # what the host worker's kernels read and wrote
    critical_path: list[str] = field(default_factory=list)  # of the step, or of the forward if given
    path_seconds: dict[str, float] = field(default_factory=dict)  # time on the critical path, by kind


def link_bound(h2d_bytes: float, d2h_bytes: float, rates: Rates) -> float:
    """The least time the link moves these bytes in: each direction at its rate, both under the cap."""
    return max(h2d_bytes / rates.h2d, d2h_bytes / rates.d2h, (h2d_bytes + d2h_bytes) / rates.both)


def predict(rt: TimedRuntime, rates: Rates, step: range, forward: range = range(0)) -> Prediction:
    """The prediction for the operations `step` records (indices from `TimedRuntime.mark`), and for a
    forward recorded after it as main-stream work (`forward`): see `Prediction`."""
    timed = rt.schedule(rates)
    t0 = min(timed.start[i] for i in step)
    step_end = max(timed.end[i] for i in step)
    moved = {kind: sum(rt.ops[i].amount for i in step if rt.ops[i].kind == kind) * rt.scale
             for kind in (H2D, D2H, KERNEL, HOST_KERNEL)}
    forward_s = sum(rt.ops[i].amount for i in forward if rt.ops[i].kind == WORK)
    exposed = 0.0
    last = max(step, key=lambda i: timed.end[i])
    if forward:
        last = max(forward, key=lambda i: timed.end[i])
        alone = rt.schedule(rates, instant=step)  # the same forward after a step that takes no time
        exposed = timed.end[last] - max(alone.end[i] for i in forward)
    path = timed.critical_path(last)
    path = [i for i in path if timed.end[i] > t0]  # from the step on
    return Prediction(
        step_s=step_end - t0, link_bound_s=link_bound(moved[H2D], moved[D2H], rates), exposed_s=exposed,
        forward_s=forward_s, h2d_bytes=moved[H2D], d2h_bytes=moved[D2H], kernel_bytes=moved[KERNEL],
        host_calls=sum(rt.ops[i].kind == HOST for i in step), host_kernel_bytes=moved[HOST_KERNEL],
        critical_path=describe_path(timed, path, t0),
        path_seconds=_path_seconds(timed, path, t0))


def _path_seconds(timed: Schedule, path: list[int], t0: float) -> dict[str, float]:
    seconds: dict[str, float] = {}
    for i in path:
        kind = timed.ops[i].kind
        seconds[kind] = seconds.get(kind, 0.0) + timed.end[i] - max(timed.start[i], t0)
    return seconds


def describe_path(timed: Schedule, path: list[int], t0: float = 0.0) -> list[str]:
    """Readable lines (start, duration, timeline, what), with runs of operations of one kind on one
    timeline merged into one line."""
    lines, run = [], []

    def flush() -> None:
        if not run:
            return
        first, last = timed.ops[run[0]], timed.ops[run[-1]]
        begin = timed.start[run[0]] - t0
        what = first.what if len(run) == 1 else f"{len(run)} x {first.kind} ({first.what} ... {last.what})"
        if first.kind in (H2D, D2H, KERNEL, HOST_KERNEL):
            what += f", {sum(timed.ops[i].amount for i in run) * timed.scale / 2**20:.1f} MiB"
        lines.append(f"{begin * 1e3:10.3f} ms {(timed.end[run[-1]] - timed.start[run[0]]) * 1e3:9.3f} ms  "
                     f"{first.timeline:<14} {what}")
        run.clear()

    for i in path:
        if timed.end[i] - timed.start[i] == 0 and timed.ops[i].kind == MARK:
            continue  # event records and waits take no time
        if run and (timed.ops[run[-1]].kind, timed.ops[run[-1]].timeline) != (timed.ops[i].kind, timed.ops[i].timeline):
            flush()
        run.append(i)
    flush()
    return lines


__all__ = ["Prediction", "Rates", "Schedule", "TimedOp", "TimedRuntime", "link_bound", "link_rates", "predict",
           "schedule"]
