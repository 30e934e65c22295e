"""OffloadEngine: the step of every bucket, wherever its states live.

The engine owns what an optimizer class does not need to know: it forms buckets (the parameters of
one param group that share a device, dtype and states; bucket.py), places each bucket's tensors
(placement.py: resident within the device budget, streamed beyond it), keeps ``opt.state`` and the
placed states one (adoption), keeps master weights following their parameters, and runs the
step. Its interface is narrow: `step` (every bucket with gradients), `place_loaded` (after
``load_state_dict``), `wait_host` (before host state is read), `memory_stats`, and
`predict_placement` (what `fusedoff.memory.predict` asks). What it asks of the optimizer class is
`contract.OptimizerRules`.

A step runs an optimizer's `FusedUpdate` (contract.py): resident tensors whole, in one call per
phase on the current stream; streamed chunks through the pipeline. Chunks holding only whole,
unsharded tensors run every phase while resident in their buffers (one copy in, one out); the
pieces of tensors spanning chunks, and sharded tensors, take one pass per phase, so that each
phase sees the previous one's whole-tensor results.

Where things plug in: a per-bucket step (to overlap the step with the next forward) is `_run` on
one bucket, which `step` already calls bucket by bucket; a placement computed elsewhere is a
`Budget` (placement.py) whose `place` answers the resident flags; a new storage tier is a store
with HostStateStore's `view`/`chunk` and a `Runtime` that copies to and from it.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from fusedoff import ops
from fusedoff.offload import placement
from fusedoff.offload.bucket import Bucket
from fusedoff.offload.gradients import checked_flat_grads
from fusedoff.offload.contract import (LOADED_PARAM_VALUE, FusedUpdate, OptimizerRules, Phase, StateSpec, moved,
                                       state_specs)
from fusedoff.offload.pipeline import StreamPipeline, buffer_regions, pass_link_bytes
from fusedoff.offload.placement import Budget
from fusedoff.offload.plan import ALIGN_ELEMENTS, Chunk, ChunkPlan, aligned_chunk_size, round_up
from fusedoff.offload.runtime import LinkBytes, Runtime
from fusedoff.offload.runtimes import runtime_for
from fusedoff.offload.store import HostStateStore
from fusedoff.offload.transaction import StepIncompleteError, incomplete_message, interrupts_held
from fusedoff.sharding import all_reduce_over_shards_, block_lead, is_dtensor, local_tensor
from fusedoff.tensor_layout import check_dense

OFFLOAD_MODES = ("auto", "none", "stream")

# NOTE: 4M elements: with AdamW + master weights (3 fp32 states) one buffer set is 48 MiB and the
# default two sets 96 MiB, whatever the model size; large enough that each copy runs at full PCIe
# speed (copies of a few MiB already do).
DEFAULT_CHUNK_SIZE = 4 * 2**20
# Host slabs hold at most this many bytes (a larger tensor gets a slab of its own): pinning one
# huge region fails on many systems.
DEFAULT_SEGMENT_BYTES = 256 * 2**20

class OffloadEngine:
    def __init__(self, mode: str, chunk_size: int | None, num_buffers: int, device_budget: int | None,
                 decided: dict | None = None) -> None:
        if mode not in OFFLOAD_MODES:
            raise ValueError(f"offload must be one of {OFFLOAD_MODES}, got {mode!r}")
        if device_budget is not None:
            if mode == "none":
                raise ValueError("device_budget applies to offload='stream' or 'auto'; offload='none' keeps every "
                                 "state on the device")
            if isinstance(device_budget, bool) or not isinstance(device_budget, int) or device_budget < 0:
                raise ValueError(f"device_budget must be None or a number of bytes >= 0, got {device_budget!r}")
        self.mode = mode
        self.chunk_size = DEFAULT_CHUNK_SIZE if chunk_size is None else aligned_chunk_size(chunk_size)
        if isinstance(num_buffers, bool) or int(num_buffers) != num_buffers or num_buffers < 2:
            raise ValueError(f"num_buffers must be an integer >= 2, got {num_buffers}")
        self.num_buffers = int(num_buffers)
        self.device_budget = device_budget  # as given: None, or bytes per device
        self._given_chunk_size = chunk_size
        self.budget = Budget()
        for device, limit in (decided or {}).items():  # a copy keeps the original's decision
            self.budget.set(device, limit)
        self.buckets: dict[tuple, Bucket] = {}
        # Per param group: (the parameters' identities and dtypes, their bucket keys and members).
        self._groups: dict[int, tuple[tuple, dict[tuple, tuple[list[Tensor], bool]]]] = {}
        self.runtimes: dict[torch.device, Runtime] = {}
        self.pipelines: dict[torch.device, StreamPipeline] = {}
        self._device_peak = 0
        # Bytes copied each way: by runtimes this engine no longer holds (an engine placed afresh keeps
        # its predecessor's count), and by the last step; parameter elements streamed in that step.
        self._link_before = LinkBytes()
        self._link_last_step = LinkBytes()
        self._streamed_last_step = 0
        self._host_pending = False
        self.forward_order: dict[int, int] | None = None  # see overlap()
        self._waits: dict = {}  # wait_for's chunks per parameter set
        # Why a step that failed among its changes left the optimizer inconsistent (None: it is not).
        self.incomplete: str | None = None
        self.steps_taken = 0  # whole steps, counted as each one's changes are done

    def config(self, **changes) -> dict:
        """The arguments that make an engine configured as this one (with `changes`); a copy of an
        optimizer also keeps the automatic budget decided at its first step, so that it places alike."""
        config = dict(mode=self.mode, chunk_size=self._given_chunk_size, num_buffers=self.num_buffers,
                      device_budget=self.device_budget, decided={})
        if self.device_budget is None and self.mode == "auto":
            config["decided"] = dict(self.budget.limits)
        return {**config, **changes}

    def runtime(self, device: torch.device) -> Runtime:
        rt = self.runtimes.get(device)
        if rt is None:
            rt = self.runtimes[device] = runtime_for(device)
        return rt

    # ---- placement ---------------------------------------------------------------------------
    def needs_decision(self, device: torch.device) -> bool:
        """True when the budget for `device` is decided from its memory at this first step."""
        return (self.mode == "auto" and self.device_budget is None and self.runtime(device).decides_budget
                and not self.budget.decided(device))

    def plan_chunk_size(self, specs: tuple[StateSpec, ...]) -> tuple[int, int]:
        """The chunk size and alignment of a plan for `specs`: a block-wise state's blocks stay whole
        in every chunk (the chunk size rounded up to a multiple of the largest block)."""
        align = max([ALIGN_ELEMENTS, *(s.block for s in specs)])
        return round_up(self.chunk_size, align), align

    def buffer_bytes_for(self, states) -> int:
        """The streaming buffers a bucket with `states` (names or specs) needs."""
        specs = state_specs(states)
        return self.num_buffers * buffer_regions(specs, self.plan_chunk_size(specs)[0])[1]

    def default_budget(self, decides_budget: bool) -> int | None:
        """The budget where none was decided from the device's memory at the first step (auto on a
        device that `decides_budget`, without a budget given, is): None is no limit."""
        if self.mode == "none" or (self.mode == "auto" and not decides_budget):
            return None  # auto never streams CPU parameters' states: they are in host memory already
        return self.device_budget if self.device_budget is not None else 0

    def predict_placement(self, buckets: Sequence[tuple[tuple[StateSpec, ...], Sequence[int]]],
                          budget: int | None) -> tuple[list[list[bool]], int]:
        """Where the states of `buckets` ((specs, element counts), in the order they step) would
        live under `budget` bytes (None: no limit): each bucket's resident flags, and the bytes of
        the streaming buffers. The placement rule and the buffers' rule are the ones `step` uses."""
        plan = Budget()
        plan.set(None, budget)
        flags, buffers = [], 0
        for specs, numels in buckets:
            resident = plan.place(None, [sum(s.nbytes(n) for s in specs) for n in numels])
            flags.append(resident)
            if any(n and not r for n, r in zip(numels, resident)):  # the device's buffer sets are shared
                buffers = max(buffers, self.buffer_bytes_for(specs))
        return flags, buffers

    def chunk_plan(self, numels: Sequence[int], specs: tuple[StateSpec, ...],
                   leads: Sequence[int] | None = None) -> ChunkPlan:
        """The host layout and chunks of a bucket with `specs` whose streamed tensors have `numels`
        elements (0: resident), shards with `leads` (see plan.py)."""
        chunk_size, align = self.plan_chunk_size(specs)
        return ChunkPlan(numels, chunk_size, round_up(max(chunk_size, DEFAULT_SEGMENT_BYTES // 4), align), align,
                         leads)

    def predict_link(self, specs: tuple[StateSpec, ...], phases: tuple[Phase, ...], numels: Sequence[int]) -> LinkBytes:
        """The bytes one step copies each way for a bucket with `specs` whose every tensor steps, the
        streamed ones having `numels` elements (0: resident), by the rules `_prepare` and `_stream`
        follow: chunks of whole tensors run every phase in one pass, the others one pass per phase
        (unsharded tensors). A prediction, for `fusedoff.memory.predict`; a step counts its copies."""
        plan = self.chunk_plan(numels, specs)
        chunks = [c for c in plan.chunks if c.pieces]
        whole, spanning = chunks, []
        if len(phases) > 1:
            whole = [c for c in chunks if plan.whole_tensors_only(c)]
            spanning = [c for c in chunks if not plan.whole_tensors_only(c)]
        by_name = {s.name: s for s in specs}
        link = pass_link_bytes(by_name, whole, *moved(phases))
        for phase in phases if spanning else ():
            link = link + pass_link_bytes(by_name, spanning, phase.reads, phase.writes)
        return link

    def _place(self, key: tuple, params: list[Tensor], specs: tuple[StateSpec, ...], backend: str) -> Bucket:
        device = params[0].device
        if not self.budget.decided(device):
            self.budget.set(device, self.default_budget(self.runtime(device).decides_budget))
        sizes = [sum(s.nbytes(local_tensor(p).numel()) for s in specs) for p in params]
        resident = self.budget.place(device, sizes)
        # A shard's block-wise states count blocks from its parameter's first element: its chunks are
        # cut on those blocks' boundaries (see `lead` in plan.py).
        block = max((s.block for s in specs), default=1)
        plan = self.chunk_plan([0 if r else local_tensor(p).numel() for p, r in zip(params, resident)], specs,
                               [block_lead(p, block) for p in params])
        store = pipeline = None
        rt = self.runtime(device)
        if not all(resident):
            pipeline = self.pipelines.get(device)
            if pipeline is None:
                pipeline = self.pipelines[device] = StreamPipeline(rt, self.chunk_size, self.num_buffers)
            store = HostStateStore(plan, specs, pin=rt.pin if rt.asynchronous else None, unpin=rt.unpin)
        self._waits.clear()  # a parameter set's chunks may lie in this bucket
        bucket = self.buckets[key] = Bucket(params, {s.name: s for s in specs}, backend, resident, plan, store,
                                            pipeline, rt, self.wait_host)
        self._device_peak = max(self._device_peak, self.device_bytes)
        return bucket

    def _members(self, index: int, group: dict, rules: OptimizerRules) -> dict[tuple, tuple[list[Tensor], bool]]:
        """The buckets of param group `index`: key -> (members: every parameter of the group with the
        key's device, dtype and states, in the group's order; whether any is sharded), kept while the
        group's tensors and the states it keeps for each dtype are the same. When they change, the
        group's placed buckets are dropped: its tensors are placed afresh at their next step, their
        states taken by value from ``opt.state``."""
        params = group["params"]
        dtypes = tuple(p.dtype for p in params)
        specs_of = {dtype: rules._bucket_specs(group, dtype) for dtype in set(dtypes)}
        signature = tuple(map(id, params)), dtypes, specs_of
        known = self._groups.get(index)
        if known is not None and known[0] == signature:
            return known[1]
        if known is not None:
            self.wait_host()
            for key in [key for key in self.buckets if key[0] == index]:
                del self.buckets[key]
            self._waits.clear()
        members: dict[tuple, list[Tensor]] = {}
        for p in params:
            members.setdefault((index, p.device, p.dtype, specs_of[p.dtype]), []).append(p)
        members = {key: (params, any(map(is_dtensor, params))) for key, params in members.items()}
        self._groups[index] = (signature, members)
        return members

    def _forget_groups_from(self, count: int) -> None:
        """Buckets and memberships of param groups that no longer exist (indices >= `count`)."""
        for index in [index for index in self._groups if index >= count]:
            del self._groups[index]
        for key in [key for key in self.buckets if key[0] >= count]:
            del self.buckets[key]
            self._waits.clear()

    def storage_changed(self, groups: list[dict], rules: OptimizerRules) -> bool:
        """True when a group's options now store its states otherwise than its placed buckets do
        (``group["state_precision"]`` changed since the last step)."""
        for index, _, dtype, specs in self.buckets:
            if index < len(groups) and rules._bucket_specs(groups[index], dtype) != specs:
                return True
        return False

    def _decide_budgets(self, groups: list[dict], rules: OptimizerRules, devices) -> None:
        """The automatic budget of each device that has none yet (see fusedoff/offload/placement.py)."""
        for device in devices:
            if not self.needs_decision(device):
                continue
            needed, buffers = 0, 0
            for index, group in enumerate(groups):
                for (_, bucket_device, _, specs), (members, _) in self._members(index, group, rules).items():
                    if bucket_device == device:
                        needed += sum(s.nbytes(local_tensor(p).numel()) for p in members for s in specs)
                        buffers = max(buffers, self.buffer_bytes_for(specs))
            total, peak = self.runtime(device).memory_info()
            self.budget.set(device, placement.auto_budget(total, peak, needed, buffers))

    # ---- the step ------------------------------------------------------------------------------
    def step(self, groups: list[dict], state: dict, rules: OptimizerRules,
             scaling: Callable[[torch.device], tuple[Tensor | None, Tensor | None]]) -> None:
        """One step of every parameter of `groups` that has a gradient. `state` is ``opt.state``;
        `scaling(device)` the gradient divisor (GradScaler's scale, clipping) and found_inf there.
        Gradients, parameters, options and every bucket's update are checked and made before any
        state, step count or parameter changes."""
        if self.forward_order is not None:  # the previous step's chunks: done before this one counts steps
            self.join()
        if self.incomplete is not None:
            raise StepIncompleteError(self.incomplete)
        link_before = self.link_total
        self._link_last_step, self._streamed_last_step = LinkBytes(), 0
        self._forget_groups_from(len(groups))
        if self.storage_changed(groups, rules):
            self.place_loaded(groups, state, rules)  # states kept afresh in the groups' new form
        work = []
        for index, group in enumerate(groups):
            rules._check_group_options(group)
            for key, (members, sharded) in self._members(index, group, rules).items():
                raw = [p.grad for p in members]
                stepping = [t for t, g in enumerate(raw) if g is not None]
                if not stepping:
                    continue
                bucket = self.buckets.get(key)
                for t in stepping:
                    rules._check_group_param(group, members[t])
                if bucket is not None:
                    bucket.check_layouts(stepping)
                else:
                    for t in stepping:
                        check_dense(local_tensor(members[t]))
                grads = checked_flat_grads(members, raw, stepping, sharded)
                work.append((group, key, members, stepping, grads))
        self._decide_budgets(groups, rules, {key[1] for _, key, _, _, _ in work})
        # Everything that can fail without changing a value, first (see [note: the step as a
        # transaction]): placement, adoption, the fused calls, the buffers, every allocation.
        created = []  # parameters whose opt.state this step made: taken back if it fails here
        try:
            runs, increments = self._prepare_step(work, state, rules, scaling, created)
        except BaseException:
            for param in created:
                dict.pop(state, param, None)
            raise
        with interrupts_held():
            try:
                for increment in increments:
                    increment()
                if self.forward_order is None:
                    for run in runs:
                        self._run(run, overlapped=False)
                else:
                    self._run_in_forward_order(runs)
            except BaseException as error:
                self.incomplete = incomplete_message(error)
                self._settle_after()
                raise StepIncompleteError(self.incomplete) from error
            self.steps_taken += 1  # (before a held interrupt is raised: the step is whole)
            self._link_last_step = self.link_total - link_before
            self._streamed_last_step = sum(run.bucket.plan.numels[t] for run in runs for t in run.grads_of)

    def _settle_after(self) -> None:
        """After a failure among a step's changes: waits for whatever the pipelines had queued, so
        that the host may write its states (a checkpoint loaded) without racing a queued copy. A
        device that fails again now (a sticky error) is only warned about: the first failure is the
        one raised."""
        for pipeline in self.pipelines.values():
            try:
                pipeline.settle()
            except Exception as again:  # noqa: PERF203 (once, on a failure path)
                warnings.warn(f"fusedoff: waiting for the copies queued before the step failed failed too: {again!r}",
                              RuntimeWarning, stacklevel=3)

    def _prepare_step(self, work: list, state: dict, rules: OptimizerRules, scaling, created: list) -> tuple[list, list]:
        """The runs of a step (`_Run`s) and its step counts' increments, made without changing any
        value: buckets placed, ``opt.state`` adopted (new tensors' fresh states, their parameters
        listed in `created`), statistics and buffers allocated."""
        placed = []
        for group, key, members, stepping, grads in work:
            bucket = self.buckets.get(key)
            if bucket is None:
                bucket = self._place(key, members, key[3], rules._resolve_backend(group, key[1]))
                bucket.check_layouts(stepping)
            divisor, found_inf = scaling(bucket.device)
            update = rules._fused_update(group, bucket.backend, divisor, found_inf, bucket.names, bucket.params)
            placed.append((bucket, update, stepping, grads, found_inf))
        steps_of = [bucket.adopt_states(stepping, state, created) for bucket, _, stepping, _, _ in placed]
        for bucket, _, stepping, _, _ in placed:
            _check_capturable(bucket, stepping)
        runs = [self._prepare(bucket, update, stepping, grads, steps)
                for (bucket, update, stepping, grads, _), steps in zip(placed, steps_of)]
        increments = [bucket.step_increment(stepping, found_inf) for bucket, _, stepping, _, found_inf in placed]
        self._reserve_buffers(runs)
        return runs, increments

    def _reserve_buffers(self, runs: list["_Run"]) -> None:
        """Grows each device's streaming buffers to what this step's passes need, before it changes anything."""
        needed: dict[StreamPipeline, int] = {}
        for run in runs:
            if not run.chunks:
                continue
            bucket = run.bucket
            passes = [run.update.reads] if run.whole_pass else []  # (a pass moves what it reads or writes)
            if run.spanning:
                passes += [phase.reads + phase.writes for phase in run.update.phases]
            for names in passes:
                specs = [bucket.store.specs[name] for name in dict.fromkeys(names)]
                set_bytes = buffer_regions(specs, bucket.plan.chunk_size)[1]
                needed[bucket.pipeline] = max(set_bytes, needed.get(bucket.pipeline, 0))
        for pipeline, set_bytes in needed.items():
            pipeline.reserve(set_bytes)

    # ---- overlap with the next forward -------------------------------------------------------------
    def overlap(self, forward_order: dict[int, int] | None) -> None:
        """Steps from now on end without the main stream waiting for the streamed chunks: the caller
        makes the main stream wait for the chunks of the parameters it is about to read
        (`wait_for`), parameters being updated in `forward_order` (id(param) -> position; None: as
        before, the whole step joined). See [note: overlap with the next forward]."""
        self.join()
        self.forward_order = forward_order
        self._waits.clear()

    def join(self) -> None:
        """The main stream waits for every queued chunk of every bucket (the plain step's end)."""
        for pipeline in self.pipelines.values():
            pipeline.join()

    def wait_for(self, key, params: Sequence[Tensor]) -> None:
        """The main stream waits for the chunks holding `params` (their last step's update); resident
        parameters were updated on the main stream already. `key` names the set for the cache."""
        waits = self._waits.get(key)
        if waits is None:
            waits = self._waits[key] = self._chunks_of(params)
        for bucket, chunks in waits:
            rt = bucket.runtime
            main = rt.current_stream()
            done = bucket.chunk_done
            for c in chunks:
                rt.wait_event(main, done.get(c))

    def _chunks_of(self, params: Sequence[Tensor]) -> list[tuple[Bucket, list[int]]]:
        wanted = {id(p) for p in params}
        found = []
        for bucket in self.buckets.values():
            chunks = sorted({c for t, p in enumerate(bucket.params) if id(p) in wanted and not bucket.resident[t]
                             for c in bucket.chunks_of_tensor(t)})
            if chunks:
                found.append((bucket, chunks))
        return found

    def _run_in_forward_order(self, runs: list["_Run"]) -> None:
        """Every bucket's step with the chunks of single-pass updates interleaved across buckets in
        the order the next forward reads their parameters, and no join at the end."""
        order = self.forward_order
        schedule = []
        for k, run in enumerate(runs):
            self._run(run, overlapped=True, whole_pass=False)
            for chunk in run.whole_pass:
                first = min((order.get(id(run.bucket.params[p.tensor]), len(order)) for p in chunk.pieces),
                            default=len(order))
                schedule.append((first, k, chunk.index, chunk))
        schedule.sort(key=lambda entry: entry[:3])
        start = 0
        while start < len(schedule):  # runs of consecutive chunks of one bucket: one pass each
            end = start
            while end < len(schedule) and schedule[end][1] == schedule[start][1]:
                end += 1
            run = runs[schedule[start][1]]
            self._stream(run, run.update.phases, [entry[3] for entry in schedule[start:end]])
            start = end

    def _prepare(self, bucket: Bucket, update: FusedUpdate, stepping: list[int], grads: list[Tensor],
                 steps: list[Tensor]) -> "_Run":
        """What one step of `update` over the tensors `stepping` of `bucket` (their flat gradients
        and step counts in `grads` and `steps`) runs: resident calls and streamed chunks."""
        rt = bucket.runtime
        stats = None
        if update.stats_columns:
            stats = torch.zeros(len(bucket.params), update.stats_columns, dtype=torch.float64, device=bucket.device)
        resident_rows = [i for i, t in enumerate(stepping) if bucket.resident[t]]
        if len(resident_rows) == len(stepping):
            resident, resident_grads, resident_steps = stepping, grads, steps
        else:
            resident = [stepping[i] for i in resident_rows]
            resident_grads, resident_steps = [grads[i] for i in resident_rows], [steps[i] for i in resident_rows]
        chunks, grads_of, steps_of = [], {}, {}
        if len(resident) < len(stepping):
            grads_of = {t: g for t, g in zip(stepping, grads) if not bucket.resident[t]}
            steps_of = {t: s for t, s in zip(stepping, steps) if not bucket.resident[t]}
            chunks = [c for c in bucket.plan.chunks if any(p.tensor in grads_of for p in c.pieces)]
        if rt.records_accesses:  # produced on the main stream before this step: gradients (backward), steps
            rt.main_access([*grads, *steps, *(() if stats is None else (stats,))], write=True,
                           what="gradients, steps and stats made on the main stream")
        whole_pass, spanning = chunks, []
        if len(update.phases) > 1:
            whole_pass = [c for c in chunks if bucket.plan.whole_tensors_only(c)
                          and not any(bucket.sharded[p.tensor] for p in c.pieces)]
            spanning = [c for c in chunks if c not in whole_pass]
        resident_calls = bucket.resident_calls(resident, resident_grads, resident_steps, stats) if resident else []
        return _Run(bucket, update, stepping, stats, resident_calls, chunks, whole_pass, spanning, grads_of, steps_of)

    def _run(self, run: "_Run", *, overlapped: bool, whole_pass: bool = True) -> None:
        """Runs `run`: its single-pass chunks first (unless `whole_pass` is False: the caller
        schedules them), then phase by phase its spanning chunks and its resident tensors; the main
        stream joins the pipeline between phases, and at the end unless `overlapped`."""
        bucket, update = run.bucket, run.update
        if run.chunks:
            self._host_pending = True
            if overlapped:  # memory the chunks read that the main stream may free or reuse before they ran
                for t in (*run.grads_of.values(), *(() if run.stats is None else (run.stats,))):
                    bucket.runtime.keep_alive(t, bucket.pipeline.compute)
        if whole_pass and run.whole_pass:
            self._stream(run, update.phases, run.whole_pass)
        last = len(update.phases) - 1
        for k, phase in enumerate(update.phases):
            if run.spanning:
                self._stream(run, (phase,), run.spanning)
            for args in run.resident_calls:  # on the current stream, beside the pipeline's work
                bucket.runtime.launch(bucket.runtime.current_stream(), functools.partial(ops.run_update, update, phase, args))
            if k < last:  # the next phase reads what this one accumulated over whole tensors
                if run.chunks:
                    bucket.pipeline.join()
                if phase.reductions and run.stats is not None:
                    _reduce_over_shards(bucket, phase, run.stats)
            elif run.chunks and not overlapped:
                bucket.pipeline.join()

    def _stream(self, run: "_Run", phases: tuple[Phase, ...], chunks: list[Chunk]) -> None:
        bucket, update = run.bucket, run.update
        if len(phases) == len(update.phases):
            read, write = update.reads, update.writes
        else:
            (phase,) = phases
            read, write = phase.reads, phase.writes
        grads, steps, stats = run.grads_of, run.steps_of, run.stats

        def compute(chunk: Chunk, buffers: dict[str, Tensor]) -> None:
            for phase in phases:
                for args in bucket.chunk_calls(chunk, buffers, grads, steps, stats):
                    ops.run_update(update, phase, args)

        done = bucket.pipeline.run(bucket.plan, bucket.store, read=read, write=write, compute=compute,
                                   touches=lambda chunk: bucket.chunk_touches(chunk, grads, steps, stats), chunks=chunks)
        bucket.chunk_done.update(done)

    # ---- loading -------------------------------------------------------------------------------
    def place_loaded(self, groups: list[dict], state: dict, rules: OptimizerRules) -> None:
        """After load_state_dict (or a change of how a group stores its states): every state placed
        afresh (budgets of 'auto' decided again at the next step), values taken from ``opt.state``
        in the form each group keeps (`rules.loaded_states`); those that cannot be placed before
        that step stay where they are, in fp32. Everything is converted before anything changes."""
        self.wait_host()
        converted = {}
        for group in groups:
            for p in group["params"]:
                values = dict.get(state, p)
                if values:
                    converted[p] = dict(rules._loaded_states(group, p, values))
        for p, values in converted.items():  # every state converted: the parameters a form needs changed
            value = values.pop(LOADED_PARAM_VALUE, None)
            if value is not None:
                local_tensor(p).detach().copy_(value)
        # (wait_host above waited for every chunk's copies back, after their computation: nothing the
        # main stream runs from now on can see the old buckets' chunks unfinished)
        forward_order = self.forward_order
        peak = max(self._device_peak, self.device_bytes)
        link_counts = self.link_counts()
        self.__init__(**self.config(decided={}))
        self._device_peak = peak  # the most the optimizer has held, over its whole life
        self.carry_link_counts(link_counts)
        self.forward_order = forward_order
        for index, group in enumerate(groups):
            for key, (params, _) in self._members(index, group, rules).items():
                loaded = [(t, p) for t, p in enumerate(params) if dict.get(state, p)]
                if not loaded:
                    continue
                device, specs = key[1], key[3]
                if self.needs_decision(device):
                    fp32 = {s.name for s in specs if s.dtype == torch.float32}
                    for _, p in loaded:
                        values = dict.get(state, p)
                        values.clear()
                        values.update(converted[p])
                        for name, value in values.items():
                            if name in fp32 and isinstance(value, Tensor) and value.dtype != torch.float32:
                                values[name] = value.to(torch.float32)
                    continue
                bucket = self.buckets.get(key) or self._place(key, params, specs, rules._resolve_backend(group, device))
                for t, p in loaded:
                    values = dict.get(state, p)
                    values.clear()
                    values.update(converted[p])
                    bucket.adopt(t, values)

    def wait_host(self) -> None:
        """Blocks until every copy back to host memory has finished (before host state is read)."""
        if not self._host_pending:
            return
        for pipeline in self.pipelines.values():
            pipeline.wait_host()
        self._host_pending = False
        for bucket in self.buckets.values():  # what the host may now read (recorded by the simulator)
            if bucket.store is not None:
                bucket.runtime.host_access([s for slabs in bucket.store.slabs.values() for s in slabs], write=False,
                                           what="host state read after wait_host")

    # ---- bytes over the link -----------------------------------------------------------------------
    @property
    def link_total(self) -> LinkBytes:
        """Every byte copied between host memory and the devices, each way, over the optimizer's life."""
        total = self._link_before
        for rt in self.runtimes.values():
            total = total + rt.link
        return total

    def link_counts(self) -> tuple[LinkBytes, LinkBytes, int]:
        """(bytes over the optimizer's life, bytes of the last step, elements streamed in it)."""
        return self.link_total, self._link_last_step, self._streamed_last_step

    def carry_link_counts(self, counts: tuple[LinkBytes, LinkBytes, int]) -> None:
        """A fresh engine (no runtime yet: states placed afresh) keeps the `link_counts()` of the one
        it replaces."""
        self._link_before, self._link_last_step, self._streamed_last_step = counts

    # ---- memory ----------------------------------------------------------------------------------
    @property
    def buffer_bytes(self) -> int:
        return sum(p.buffer_bytes for p in self.pipelines.values())

    @property
    def device_bytes(self) -> int:
        return self.buffer_bytes + self.resident_bytes

    @property
    def resident_bytes(self) -> int:
        total = 0
        for bucket in self.buckets.values():
            for name in bucket.names:
                for t, obj in enumerate(bucket.placed[name]):
                    if obj is not None and bucket.resident[t]:
                        local = local_tensor(obj)
                        total += local.numel() * local.element_size()
        return total

    def memory_stats(self) -> dict:
        self._device_peak = max(self._device_peak, self.device_bytes)
        stores = [bucket.store for bucket in self.buckets.values() if bucket.store is not None]
        limits = list(self.budget.limits.values())
        host_bytes = sum(s.nbytes for s in stores)
        streamed = sum(sum(s.plan.numels) for s in stores)
        last = self._link_last_step
        return {
            "host_bytes": host_bytes,
            "host_pinned": bool(stores) and all(s.pinned for s in stores),
            "resident_bytes": self.resident_bytes,
            "streamed_bytes": host_bytes,
            # The parameter elements whose states stream, and the host bytes (the store's alignment
            # padding included) per such element.
            "streamed_params": streamed,
            "host_bytes_per_param": host_bytes / streamed if streamed else None,
            # What the copies of the last step() moved, each way, counted as they were issued (none
            # where every state is resident); per element of the parameters streamed in that step.
            "link_bytes_last_step": last.as_dict(),
            "streamed_params_last_step": self._streamed_last_step,
            "link_bytes_per_param_last_step": {way: nbytes / self._streamed_last_step for way, nbytes in
                                               last.as_dict().items()} if self._streamed_last_step else None,
            "link_bytes_total": self.link_total.as_dict(),
            "device_bytes": self.device_bytes,
            "device_peak_bytes": self._device_peak,
            "chunk_size": self.chunk_size,
            "num_buffers": self.num_buffers,
            # The budget in force: None before it is decided, and where there is no limit
            # (offload="none", CPU parameters under "auto"); a dict by device for several devices.
            "device_budget": limits[0] if len(limits) == 1 else {str(d): b for d, b in self.budget.limits.items()} or None,
        }


@dataclass
class _Run:
    """One bucket's step, prepared: what `_run` and `_stream` need."""

    bucket: Bucket
    update: FusedUpdate
    stepping: list[int]
    stats: Tensor | None
    resident_calls: list
    chunks: list[Chunk]
    whole_pass: list[Chunk]
    spanning: list[Chunk]
    grads_of: dict[int, Tensor]
    steps_of: dict[int, Tensor]


def _reduce_over_shards(bucket: Bucket, phase: Phase, stats: Tensor) -> None:
    """`phase`'s reductions of the statistics: sharded tensors' partial sums completed over the ranks
    holding their other shards (nothing for unsharded ones), on the main stream. Collectives depend
    only on the bucket's members: every rank makes the same ones, even one whose shards are empty."""
    rt = bucket.runtime
    if rt.records_accesses:
        rt.main_access([stats], write=any(bucket.sharded), what="the shard reductions read the statistics")
    for reduction in phase.reductions:
        all_reduce_over_shards_(stats[:, reduction.first : reduction.end], bucket.params, reduction.op)


def _check_capturable(bucket: Bucket, stepping: list[int]) -> None:
    """Raises if this step would stream states while a CUDA graph is being captured."""
    if bucket.store is not None and not all(bucket.resident[t] for t in stepping) and bucket.runtime.capturing():
        raise RuntimeError("fusedoff: a step that streams states cannot be captured in a CUDA graph (its copies "
                           "and host synchronisation are outside the graph); capture with every state resident "
                           "(offload='none', or a device_budget that holds them all)")


__all__ = ["ALIGN_ELEMENTS", "DEFAULT_CHUNK_SIZE", "OFFLOAD_MODES", "OffloadEngine"]
