"""The host's share of a step: tensors whose states the host kernels step where they live.

A streamed tensor's states cross the link both ways every step. A *host-computed* tensor's states
(and master weight) stay in host memory, in a `HostStateStore` of their own, and the host kernels
step them there: the link carries its gradient (in its own dtype) and its parameter down, and its
parameter back up. Which tensors are host-computed is the placement's choice (see [note: the host
share] in placement.py); `HostShare` is one bucket's host-computed part.

[note: the host share of a step] The step of a bucket's host-computed tensors is queued first,
before its streamed chunks, so that the host computes while the device works through them:

1. copy-out stream (waits for the main stream, which made the gradients and counted the steps):
   the step counts, GradScaler's scale (with the clip factor folded in: the kernels' divisor) and
   found_inf, each gradient and each parameter, into page-locked host buffers; an event.
2. the host worker (`Runtime.host_compute`, a thread off the Python one; the host kernels release
   the GIL): waits for that event, then runs every phase of the update over whole tensors.
3. the copy back of the parameters, on the copy-in stream, queued by the Python thread once it
   has waited for the worker (`finish`): no GPU stream can wait for a host thread. That wait is
   the only synchronisation of the host share; it comes where something needs the parameters or
   states: the end of a plain step (its join), a forward's wait for its module's parameters under
   `overlap_with`, `wait_host` (``opt.state``, ``state_dict``, a write through ``opt.state``), the
   next step. The scale, found_inf and clip factor reach the worker through the copies of step 1,
   ordered by its event: the Python thread never waits for the device to read them.

The parameter goes down every step because anything may have written it since the last step (see
[note: master weights follow the parameters] in bucket.py): the kernels see the written value as
a resident step would, bit for bit. Sharded tensors are never host-computed (their phases' sums
are completed over ranks on the main stream between phases).
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from fusedoff import ops
from fusedoff.backends import backend_named
from fusedoff.offload.auto_share import AUTO
from fusedoff.offload.contract import FusedUpdate, StateSpec, UpdateArgs
from fusedoff.offload.plan import ALIGN_ELEMENTS, ChunkPlan, round_up
from fusedoff.offload.runtime import Runtime
from fusedoff.offload.store import HostStateStore

HOST_SHARE_KEY = "host_share"  # the param-group option


def check_host_share(value, mode: str) -> None:
    """Raises if `value` cannot be a ``host_share`` with offload `mode`."""
    if value == AUTO:
        return  # (0 wherever nothing streams)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"host_share must be 'auto' or a number in [0, 1] (the fraction of each bucket's streamed "
                         f"elements the host steps), got {value!r}")
    if value and mode == "none":
        raise ValueError("host_share applies to offload='stream' or 'auto'; offload='none' keeps every state on "
                         "the device, and the host computes the share of streamed states only")


def host_share_of(group: dict) -> float | str:
    """`group`'s ``host_share`` as given: a fraction of its buckets' streamed elements, or "auto"
    (see [note: the automatic host share] in auto_share.py)."""
    value = group.get(HOST_SHARE_KEY, AUTO)
    return value if value == AUTO else float(value)


def default_host_threads() -> int:
    """The host worker's threads where ``host_threads`` is not given: the CPUs this process may run
    on, split among the node's ranks where the launcher did not already split them
    (``LOCAL_WORLD_SIZE``: torchrun's; an affinity that the ranks' count of would fit in the machine
    is taken as split already, one a container narrows is not), less one each for the Python thread that queues the next forward and the data loader's
    main loop. Data loader workers are processes of their own: pass fewer where they need cores."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # (not on every platform)
        cpus = os.cpu_count() or 1
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    if cpus * ranks <= (os.cpu_count() or cpus):  # each rank pinned to its own part of the machine
        ranks = 1
    return max(1, cpus // ranks - 1)


def check_host_threads(value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1):
        raise ValueError(f"host_threads must be None (the default: see default_host_threads) or an integer >= 1, "
                         f"got {value!r}")


def host_computed(numels: Sequence[int], eligible: Sequence[bool], share: float) -> list[bool]:
    """Which of a bucket's tensors are host-computed: see [note: the host share] in placement.py."""
    left = share * sum(n for n, e in zip(numels, eligible) if e)
    flags = []
    for n, e in zip(numels, eligible):
        take = e and share > 0.0 and n <= left
        left -= n if take else 0
        flags.append(take)
    return flags


def host_backend(backend: str) -> str:
    """The backend the host kernels of a bucket running `backend` are: its own where it runs on
    host tensors (the same kernels as a resident step on CPU), else the host kernels ("cpu")."""
    if backend == "torch" or backend_named(backend).device_type == "cpu":
        return backend
    return "cpu"


def _inexact_on_host(device: torch.device, backend: str, sums_whole_tensors: bool) -> str | None:
    """Why a tensor stepped by the host kernels would not get, bit for bit, the result the device's
    kernels give it (None: it would; on host tensors both are the same kernels)."""
    if device.type == "cpu":
        return None
    if backend != "cuda":
        return (f"fusedoff: host_share > 0 on {device} needs backend='cuda' (this bucket runs {backend!r}): the host "
                f"kernels give the CUDA kernels' results bit for bit, not {backend!r}'s, so a tensor's result would "
                "depend on where it was stepped; use backend='cuda' or host_share=0")
    if sums_whole_tensors:
        return (f"fusedoff: host_share > 0 on {device} is refused for an update that sums over whole tensors "
                "(Apollo): the host kernels sum in another order than the CUDA kernels, so a host-computed tensor's "
                "result would differ from a device-computed one in the last bits; use host_share=0")
    return None


def check_host_computable(device: torch.device, backend: str, sums_whole_tensors: bool) -> None:
    """Raises where a host-computed tensor's result would depend on where it was stepped (see [note:
    the host share of a step]); then, if the host kernels cannot run here, says what is missing."""
    reason = _inexact_on_host(device, backend, sums_whole_tensors)
    if reason is not None:
        raise ValueError(reason)
    backend_named(host_backend(backend)).require()


def auto_host_computable(device: torch.device, backend: str, sums_whole_tensors: bool, runtime: Runtime) -> bool:
    """Whether host_share="auto" may host a bucket's tensors: its runtime measures the step, its
    results do not depend on where a tensor is stepped, and the host kernels run here (else "auto"
    is 0, where a fraction would raise)."""
    if not runtime.measures_time or _inexact_on_host(device, backend, sums_whole_tensors) is not None:
        return False
    host = backend_named(host_backend(backend))
    try:
        host.require()
    except Exception:  # noqa: BLE001 (whatever says the host kernels are missing: "auto" does without them)
        return False
    return True


@dataclass
class HostRun:
    """One step of a bucket's host-computed tensors, prepared (every allocation made)."""

    tensors: list[int]
    grads: list[Tensor]  # on the device, flat
    update: FusedUpdate  # the host's: host backend, scale and found_inf read from host buffers
    divisor: Tensor | None  # the device's scale and found_inf, copied down with the gradients
    found_inf: Tensor | None
    calls: list[UpdateArgs]
    touched: list[Tensor]  # what the worker reads and writes (the race checker's record)


class HostShare:
    """The host-computed tensors of one bucket: their states, their parameters' and gradients'
    page-locked buffers, the step's pending worker task and the last copy back of parameters."""

    def __init__(self, plan: ChunkPlan, specs: tuple[StateSpec, ...], param_dtype: torch.dtype, count: int,
                 runtime: Runtime) -> None:
        rt = runtime
        self.plan = plan  # the host-computed tensors' elements (others: 0)
        self._pinning = dict(pin=rt.pin if rt.asynchronous else None, unpin=rt.unpin)
        self.store = HostStateStore(plan, specs, **self._pinning)
        self.params = HostStateStore(plan, (StateSpec("param", param_dtype),), **self._pinning)
        self._grads: dict[torch.dtype, HostStateStore] = {}  # one buffer per gradient dtype seen
        # The step counts of the bucket's tensors, then the kernels' divisor and found_inf.
        self._scalars = HostStateStore(ChunkPlan([count + 2], round_up(count + 2, ALIGN_ELEMENTS)), ("scalars",),
                                       **self._pinning)
        scalars = self._scalars.view("scalars", 0)
        self.steps, self._divisor, self._found_inf = scalars[:count], scalars[count], scalars[count + 1]
        self.task = None  # the worker's task of the last step, until the host has waited for it
        self.last_task = None  # the same, kept (the timed runtime's record of it)
        self._to_copy_up: list[int] = []  # tensors whose parameter goes back once the task is done
        self.copied_up = None  # the event of the last copy back of parameters
        self.copied_down = None  # the (timer) event of the last step's copies down
        self.compute_s = 0.0  # the host kernels' seconds in the last step's task (set by the worker)
        self._skip_flag: Tensor | None = None  # the last step's found_inf, copied down (None: none)

    @property
    def numel(self) -> int:
        return sum(self.plan.numels)

    @property
    def skipped(self) -> bool:
        """Whether GradScaler skipped the last step (its found_inf, as copied down; read once the host
        has waited for the worker, which waited for that copy)."""
        return self._skip_flag is not None and bool(self._skip_flag.item())

    @property
    def pinned(self) -> bool:
        """Whether its states and every page-locked buffer (parameters, gradients, scalars) are pinned."""
        return all(s.pinned for s in self.stores().values())

    @property
    def buffer_bytes(self) -> int:
        """The page-locked buffers of parameters, gradients, step counts and scalars."""
        return sum(s.nbytes for name, s in self.stores().items() if name != "states")

    def stores(self) -> dict[str, HostStateStore]:
        """Its host memory by what it holds: the states, and the page-locked buffers of the
        parameters, the step counts and scalars, and the gradients of each dtype."""
        grads = {f"{dtype} gradient buffer": store for dtype, store in self._grads.items()}
        return {"states": self.store, "parameter buffer": self.params, "step and scalar buffer": self._scalars,
                **grads}

    # ---- before the step changes anything ----------------------------------------------------------
    def prepare(self, bucket, update: FusedUpdate, tensors: list[int], grads: list[Tensor]) -> HostRun:
        """The host's step of `tensors` of `bucket` (their flat gradients `grads`): buffers and
        statistics allocated, the host kernels' calls made."""
        check_host_computable(bucket.device, update.backend, bool(update.stats_columns))
        stats = None
        if update.stats_columns:
            stats = torch.zeros(len(bucket.params), update.stats_columns, dtype=torch.float64)
        for g in grads:
            if g.dtype not in self._grads:
                self._grads[g.dtype] = HostStateStore(self.plan, (StateSpec("grad", g.dtype),), **self._pinning)
        divisor, found_inf = update.grad_scale, update.found_inf
        host_update = replace(update, backend=host_backend(update.backend),
                              grad_scale=None if divisor is None else _host_like(self._divisor, divisor),
                              found_inf=None if found_inf is None else _host_like(self._found_inf, found_inf))
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, g in enumerate(grads):
            by_dtype.setdefault(g.dtype, []).append(i)
        calls, touched = [], [self.steps]
        for dtype, rows in by_dtype.items():
            ts = [tensors[i] for i in rows]
            args = UpdateArgs(
                tensors=ts, params=[self.params.view("param", t) for t in ts],
                grads=[self._grads[dtype].view("grad", t) for t in ts],
                states={name: [self.store.view(name, t) for t in ts] for name in self.store.names},
                steps=[self.steps[t] for t in ts], stats=[stats[t] for t in ts] if stats is not None else [],
                total_numels=[bucket.params[t].numel() for t in ts], offsets=[bucket.origins[t] for t in ts])
            calls.append(args)
            touched += [*args.params, *args.grads, *(v for views in args.states.values() for v in views)]
        touched += [t for t in (host_update.grad_scale, host_update.found_inf) if t is not None]
        return HostRun(tensors, grads, host_update, divisor, found_inf, calls, touched)

    # ---- the step ----------------------------------------------------------------------------------
    def queue(self, bucket, run: HostRun, *, overlapped: bool) -> None:
        """Steps 1 and 2 of [note: the host share of a step]: the copies down, and the worker's task."""
        rt, down = bucket.runtime, bucket.pipeline.copy_out
        rt.wait_stream(down, rt.current_stream())  # gradients, steps, scale and found_inf: made on main
        for begin, end in _runs(run.tensors):  # (only theirs: streamed chunks read the others meanwhile)
            rt.copy_to_host(down, self.steps[begin:end], bucket.step_counts[begin:end])
        sources = [t for t in (run.divisor, run.found_inf) if t is not None]
        for host, device in zip([t for t in (run.update.grad_scale, run.update.found_inf) if t is not None], sources):
            rt.copy_to_host(down, host, device)
        for t, g in zip(run.tensors, run.grads):
            rt.copy_to_host(down, self._grads[g.dtype].view("grad", t), g)
            rt.copy_to_host(down, self.params.view("param", t), bucket.flat_param(t))
        if overlapped:  # memory the main stream may free or reuse before the copies ran
            for t in (*run.grads, *sources):
                rt.keep_alive(t, down)
        update, calls = run.update, run.calls

        def compute() -> None:
            began = rt.now()
            with torch.no_grad():  # (grad mode is per thread: the worker's is not the step's)
                for phase in update.phases:  # whole tensors: each phase sees the previous one's sums
                    for args in calls:
                        ops.run_update(update, phase, args)
            self.compute_s = rt.now() - began  # (read once the host waited for the task)

        writes = run.touched
        self.copied_down = self._copied_down(rt, down)
        self._skip_flag = run.update.found_inf
        self.task = self.last_task = rt.host_compute(compute, after=self.copied_down, reads=writes, writes=writes)
        self._to_copy_up = list(run.tensors)

    def _copied_down(self, rt: Runtime, down):
        """The event the worker waits for: the copies down are done (a timer: host_share="auto"
        reads when they were)."""
        loaded = rt.timer(down)
        return loaded

    def _wait_for_worker(self, rt: Runtime) -> None:
        """The host waits for the worker's task (before the copy back reads what it wrote)."""
        rt.wait_host_compute(self.task)

    def finish(self, bucket):
        """Step 3: waits for the worker, then queues the copy back of the parameters it stepped (once
        per step); returns the event of the last copy back (None: none yet)."""
        if self.task is None and not self._to_copy_up:
            return self.copied_up
        rt = bucket.runtime
        try:
            self._wait_for_worker(rt)
        except Exception:
            # The task, or the wait for it, failed: the step is incomplete and the parameters in the
            # pinned buffer may be half stepped, so they are never copied up (a checkpoint loaded
            # next restores the device's). The task stays to be waited for: it may still be running.
            self._to_copy_up = []
            raise
        # (an interrupt of the wait leaves the task and its copies back to wait for again)
        self.task = None
        up = bucket.pipeline.copy_in
        for t in self._to_copy_up:
            rt.copy_to_device(up, bucket.flat_param(t), self.params.view("param", t))
        self._to_copy_up = []
        self.copied_up = rt.timer(up)  # (a timer: host_share="auto" reads when the host's path ended)
        return self.copied_up

    def settle(self, bucket) -> None:
        """After a failure among a step's changes: the worker's task done, no copy back queued (the
        copies back queued before are the pipeline's to settle); raises what the task raised (the
        engine warns, the first failure being the one it raises)."""
        self._to_copy_up = []
        bucket.runtime.wait_host_compute(self.task)
        self.task = None


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """The runs of consecutive values of the increasing `indices`, as [begin, end) ranges."""
    runs = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return [(begin, end) for begin, end in runs]


def _host_like(buffer: Tensor, value: Tensor) -> Tensor:
    """`buffer` (one fp32 element in host memory) as the host copy of the one-element `value`."""
    if value.numel() != 1 or value.dtype != torch.float32:
        raise ValueError(f"a host-computed step takes a one-element fp32 scale and found_inf, got {value.dtype} "
                         f"of {value.numel()} elements")
    return buffer.reshape(value.shape)


__all__ = ["HostShare", "auto_host_computable", "check_host_computable", "check_host_share", "check_host_threads",
           "default_host_threads", "host_computed", "host_share_of"]
