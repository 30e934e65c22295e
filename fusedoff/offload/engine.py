"""OffloadEngine: the step of every bucket, wherever its states live.

The engine orchestrates; its parts own their jobs. `Placement` (placement.py) forms the buckets
(bucket.py), decides the budgets and places each bucket's tensors: resident within the device
budget, streamed beyond it, a share of the streamed ones stepped by the host where their states
live (host_share.py). Each bucket keeps ``opt.state`` and its placed states one (adoption), its
master weights following their parameters, and cuts its fused calls' ranges. `DeviceRuntimes`
(runtimes.py) holds the device runtimes, which count the bytes they copy. `ForwardSchedule`
(schedule.py) orders the chunks when the step overlaps the next forward (fusedoff/optim/overlap.py).
What the engine does itself is the step, as a transaction (see [note: the step as a
transaction]), each bucket's part prepared as a `BucketRun` (run.py), and the re-placement after
``load_state_dict`` or a new budget.

Its interface is narrow: `step` (every bucket with gradients), `place_loaded` (after
``load_state_dict``), `set_device_budget`, `overlap`/`wait_for`/`join` (the overlapped step),
`wait_host` (before host state is read) and `memory_stats`. What it asks of the optimizer class
is `contract.OptimizerRules`, and only before the step changes anything.

A step runs an optimizer's `FusedUpdate` (contract.py), plain data, with one call into
``fusedoff.ops.run_update`` per phase and list of tensors: resident tensors whole, on the current
stream; streamed chunks through the pipeline. Chunks holding only whole, unsharded tensors run
every phase while resident in their buffers (one copy in, one out); the pieces of tensors spanning
chunks, and sharded tensors, take one pass per phase, so that each phase sees the previous one's
whole-tensor results (completed over shards by the phase's reductions).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from fusedoff import ops
from fusedoff.offload.bucket import Bucket
from fusedoff.offload.contract import LOADED_PARAM_VALUE, FusedUpdate, OptimizerRules, Phase
from fusedoff.offload.gradients import checked_flat_grads
from fusedoff.offload.auto_share import AUTO, AutoShares
from fusedoff.offload.host_share import auto_host_computable, default_host_threads, host_share_of
from fusedoff.offload.pipeline import StreamPipeline
from fusedoff.offload.placement import (DEFAULT_CHUNK_SIZE, OFFLOAD_MODES, BucketKey, Placement,
                                        check_device_budget)
from fusedoff.offload.plan import ALIGN_ELEMENTS, Chunk
from fusedoff.offload.run import BucketRun, reserve_buffers
from fusedoff.offload.runtimes import DeviceRuntimes
from fusedoff.offload.schedule import ForwardSchedule
from fusedoff.offload.transaction import StepIncompleteError, incomplete_message, interrupts_held
from fusedoff.sharding import all_reduce_over_shards_, local_tensor
from fusedoff.tensor_layout import check_dense


class OffloadEngine:
    def __init__(self, mode: str, chunk_size: int | None, num_buffers: int, device_budget: int | None,
                 decided: dict | None = None, host_threads: int | None = None) -> None:
        # What the engine keeps over its life, whatever its placement: the runtimes' link counts,
        # the most it held on the device, the forward's order, whether a step failed half done, and
        # the automatic host shares' measurements.
        self.host_threads = host_threads  # as given (None: default_host_threads())
        self.runtimes = DeviceRuntimes(default_host_threads() if host_threads is None else host_threads)
        self.auto_shares = AutoShares()
        self.placement = Placement(mode, chunk_size, num_buffers, device_budget, self.runtimes, decided,
                                   self.wait_host)
        self.schedule = ForwardSchedule()
        self._device_peak = 0
        self._host_pending = False
        # Why a step that failed among its changes left the optimizer inconsistent (None: it is not).
        self.incomplete: str | None = None
        self.steps_taken = 0  # whole steps, counted as each one's changes are done

    def config(self, **changes) -> dict:
        """The arguments that make an engine configured as this one (with `changes`); a copy of an
        optimizer also keeps the automatic budget decided at its first step, so that it places alike."""
        placement = self.placement
        config = dict(mode=placement.mode, chunk_size=placement.given_chunk_size, num_buffers=placement.num_buffers,
                      device_budget=placement.device_budget, decided={}, host_threads=self.host_threads)
        if placement.device_budget is None and placement.mode == "auto":
            config["decided"] = dict(placement.budget.limits)
        return {**config, **changes}

    @property
    def buckets(self) -> dict[BucketKey, Bucket]:
        return self.placement.buckets

    @property
    def pipelines(self) -> dict[torch.device, StreamPipeline]:
        return self.placement.pipelines

    def buffer_bytes_for(self, states) -> int:
        """The streaming buffers a bucket with `states` (names or specs) needs (Placement.buffer_bytes_for)."""
        return self.placement.buffer_bytes_for(states)

    def _place(self, key: BucketKey, params: list[Tensor], backend: str, group: dict, rules: OptimizerRules) -> Bucket:
        option, measurable = host_share_of(group), False
        if option == AUTO:
            update = rules._fused_update(group, backend, None, None, tuple(s.name for s in key.specs), params)
            measurable = auto_host_computable(key.device, backend, bool(update.stats_columns),
                                              self.runtimes.of(key.device))
        share = self.auto_shares.share(option, key.device, measurable and self.schedule.order is None)
        bucket = self.placement.place(key, params, backend, share, auto_share=measurable)
        self._device_peak = max(self._device_peak, self.placement.device_bytes)
        return bucket

    def _share_of(self, group: dict, bucket: Bucket) -> float:
        """The host share `bucket` would be placed with now (see [note: the automatic host share]).
        Under `overlap_with`, "auto" is 0: the next forward reads a module's host-computed parameters
        only once the host has stepped its whole bucket (see [note: the host share of a step]), which
        the step's timers do not see."""
        measurable = bucket.auto_share and self.schedule.order is None
        return self.auto_shares.share(host_share_of(group), bucket.device, measurable)

    # ---- re-placement ---------------------------------------------------------------------------------
    def drop_placement(self, **changes) -> None:
        """Forgets every bucket, store, pipeline, runtime and decided budget (states are placed afresh
        at their next step, from ``opt.state``), keeping what the engine keeps over its life; with
        `changes` to its configuration (``device_budget``). The caller has waited for the copies back
        (`wait_host`): no queued work is left on the old buckets."""
        config = {**self.config(decided={}), **changes}
        config.pop("host_threads")  # (the runtimes' setting, kept over the engine's life)
        self._device_peak = max(self._device_peak, self.placement.device_bytes)  # the most held, over its life
        self.placement.release()  # (recorded by the old buckets' runtimes, before they are retired)
        self.runtimes.retire()
        self.auto_shares.placed()
        self.placement = Placement(**config, runtimes=self.runtimes, wait_host=self.wait_host)
        self._host_pending = False

    def set_device_budget(self, device_budget: int | None) -> None:
        """A new budget: refused before anything changes if it cannot be; then every state is placed
        afresh at its next step, keeping its value (until then states stay where they are)."""
        check_device_budget(self.placement.mode, device_budget)
        self.wait_host()  # every chunk done (copied back after its computation): no join needed
        self.drop_placement(device_budget=device_budget)

    # ---- the step ------------------------------------------------------------------------------
    def step(self, groups: list[dict], state: dict, rules: OptimizerRules,
             scaling: Callable[[torch.device], tuple[Tensor | None, Tensor | None]]) -> None:
        """One step of every parameter of `groups` that has a gradient. `state` is ``opt.state``;
        `scaling(device)` the gradient divisor (GradScaler's scale, clipping) and found_inf there.
        Gradients, parameters, options and every bucket's update are checked and made before any
        state, step count or parameter changes."""
        if self.schedule.order is not None and self.incomplete is None:  # the previous step's chunks: done
            self.join()  # before this one counts steps
        if self.incomplete is not None:
            raise StepIncompleteError(self.incomplete)
        self.auto_shares.observe()  # (the last step's host work was waited for: by its join, or just above)
        self.runtimes.step_started()
        placement = self.placement
        placement.forget_groups_from(len(groups))
        for group in groups:  # (before a group's changed options place its states afresh)
            rules._check_group_options(group)
        if placement.storage_changed(groups, rules):
            self.place_loaded(groups, state, rules)  # states kept afresh in the groups' new form
            placement = self.placement
        elif placement.share_changed(groups, self._share_of):  # placed afresh below, values kept (as for a new budget)
            self.wait_host()
            self.drop_placement(decided=self.config()["decided"])
            placement = self.placement
        work = []
        for index, group in enumerate(groups):
            for key, (members, sharded) in placement.members(index, group, rules).items():
                raw = [p.grad for p in members]
                stepping = [t for t, g in enumerate(raw) if g is not None]
                if not stepping:
                    continue
                bucket = placement.buckets.get(key)
                for t in stepping:
                    rules._check_group_param(group, members[t])
                if bucket is not None:
                    bucket.check_layouts(stepping)
                else:
                    for t in stepping:
                        check_dense(local_tensor(members[t]))
                work.append(_Work(group, key, members, stepping, checked_flat_grads(members, raw, stepping, sharded)))
        placement.decide_budgets(groups, rules, {w.key.device for w in work})
        # Everything that can fail without changing a value, first (see [note: the step as a
        # transaction]): placement, adoption, the fused calls, the buffers, every allocation.
        created = []  # parameters whose opt.state this step made: taken back if it fails here
        try:
            runs, increments = self._prepare_step(work, state, rules, scaling, created)
        except BaseException:
            for param in created:
                dict.pop(state, param, None)
            raise
        timings = self.auto_shares.start(runs) if self.schedule.order is None else []  # (0 under overlap)
        with interrupts_held():
            try:
                for increment in increments:
                    increment()
                if self.schedule.order is None:
                    for run in runs:
                        self._run(run, overlapped=False)
                    self.auto_shares.stop(timings)
                    self._join_host_share()  # (last: the host computed while the device streamed)
                else:
                    self._run_in_forward_order(runs)
                    self.auto_shares.stop(timings)
            except BaseException as error:
                self.auto_shares.discard()
                self.incomplete = incomplete_message(error)
                self._settle_after()
                raise StepIncompleteError(self.incomplete) from error
            self.steps_taken += 1  # (before a held interrupt is raised: the step is whole)
            self.runtimes.step_done(sum(run.moved_numel for run in runs))

    def _settle_after(self) -> None:
        """After a failure among a step's changes: waits for whatever the pipelines had queued, so
        that the host may write its states (a checkpoint loaded) without racing a queued copy. A
        device that fails again now (a sticky error) is only warned about: the first failure is the
        one raised."""
        settle = [pipeline.settle for pipeline in self.pipelines.values()]
        settle += [functools.partial(b.host.settle, b) for b in self.buckets.values() if b.host is not None]
        for wait in settle:
            try:
                wait()
            except Exception as again:  # noqa: PERF203 (once, on a failure path)
                warnings.warn(f"fusedoff: waiting for the copies queued before the step failed failed too: {again!r}",
                              RuntimeWarning, stacklevel=3)

    def _prepare_step(self, work: list[_Work], state: dict, rules: OptimizerRules, scaling,
                      created: list) -> tuple[list[BucketRun], list[Callable[[], None]]]:
        """The runs of a step (`BucketRun`s) and its step counts' increments, made without changing any
        value: buckets placed, ``opt.state`` adopted (new tensors' fresh states, their parameters
        listed in `created`), statistics and buffers allocated."""
        placed = []
        for w in work:
            bucket = self.buckets.get(w.key)
            if bucket is None:
                bucket = self._place(w.key, w.members, rules._resolve_backend(w.group, w.key.device), w.group, rules)
                bucket.check_layouts(w.stepping)
            divisor, found_inf = scaling(bucket.device)
            update = rules._fused_update(w.group, bucket.backend, divisor, found_inf, bucket.names, bucket.params)
            placed.append(_Placed(bucket, update, w.stepping, w.grads, found_inf))
        steps_of = [p.bucket.adopt_states(p.stepping, state, created) for p in placed]
        for p in placed:
            _check_capturable(p.bucket, p.stepping)
        runs = [BucketRun.prepare(p.bucket, p.update, p.stepping, p.grads, steps) for p, steps in zip(placed, steps_of)]
        increments = [p.bucket.step_increment(p.stepping, p.found_inf) for p in placed]
        reserve_buffers(runs)
        return runs, increments

    def _run(self, run: BucketRun, *, overlapped: bool, whole_pass: bool = True) -> None:
        """Runs `run`: its single-pass chunks first (unless `whole_pass` is False: the caller
        schedules them), then phase by phase its spanning chunks and its resident tensors; the main
        stream joins the pipeline between phases, and at the end unless `overlapped`."""
        bucket, update = run.bucket, run.update
        if run.host is not None:  # first: the host computes while the device works through the chunks
            self._host_pending = True
            bucket.host.queue(bucket, run.host, overlapped=overlapped)
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
                rt = bucket.runtime
                rt.launch(rt.current_stream(), functools.partial(ops.run_update, update, phase, args))
            if k < last:  # the next phase reads what this one accumulated over whole tensors
                if run.chunks:
                    bucket.pipeline.join()
                if phase.reductions and run.stats is not None:
                    _reduce_over_shards(bucket, phase, run.stats)
            elif run.chunks and not overlapped:
                bucket.pipeline.join()

    def _stream(self, run: BucketRun, phases: tuple[Phase, ...], chunks: list[Chunk]) -> None:
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

    # ---- overlap with the next forward (schedule.py) ------------------------------------------------
    def overlap(self, forward_order: dict[int, int] | None) -> None:
        """Steps from now on end without the main stream waiting for the streamed chunks: the caller
        makes the main stream wait for the chunks of the parameters it is about to read
        (`wait_for`), parameters being updated in `forward_order` (id(param) -> position; None: as
        before, the whole step joined). See [note: overlap with the next forward]."""
        self.join()
        self.schedule.follow(forward_order)

    def join(self) -> None:
        """The main stream waits for every queued chunk of every bucket, and for the parameters the
        host stepped (the plain step's end)."""
        for pipeline in self.pipelines.values():
            pipeline.join()
        self._join_host_share()

    def _join_host_share(self) -> None:
        """The main stream waits for the copies back of the parameters the host stepped, queued
        once the host has waited for its worker (see [note: the host share of a step])."""
        for bucket in self.buckets.values():
            if bucket.host is not None:
                rt = bucket.runtime
                copied_up = self._finish_host_share(bucket)
                rt.wait_event(rt.current_stream(), copied_up)

    def _finish_host_share(self, bucket: Bucket):
        """`bucket`'s host share finished (HostShare.finish): the event of its copies back. A task
        of the worker that failed left its step half done: every later step refuses to run, as
        after a failure among a step's changes (an interrupt of the wait leaves the task to wait
        for again)."""
        try:
            return bucket.host.finish(bucket)
        except Exception as error:
            if self.incomplete is None:
                self.incomplete = incomplete_message(error)
            raise

    def wait_for(self, key: Hashable, params: Sequence[Tensor]) -> None:
        """The main stream waits for the chunks holding `params` (see ForwardSchedule.wait_for)."""
        self.schedule.wait_for(key, params, self.placement, self._finish_host_share)

    def _run_in_forward_order(self, runs: list[BucketRun]) -> None:
        """Every bucket's step with the chunks of single-pass updates interleaved across buckets in
        the order the next forward reads their parameters, and no join at the end."""
        for run in runs:
            self._run(run, overlapped=True, whole_pass=False)
        for k, chunks in self.schedule.passes([run.bucket for run in runs], [run.whole_pass for run in runs]):
            self._stream(runs[k], runs[k].update.phases, chunks)

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
        self.drop_placement()
        self.incomplete = None  # the loaded states are whole
        placement = self.placement
        for index, group in enumerate(groups):
            for key, (params, _) in placement.members(index, group, rules).items():
                loaded = [(t, p) for t, p in enumerate(params) if dict.get(state, p)]
                if not loaded:
                    continue
                if placement.needs_decision(key.device):
                    fp32 = {s.name for s in key.specs if s.dtype == torch.float32}
                    for _, p in loaded:
                        values = dict.get(state, p)
                        values.clear()
                        values.update(converted[p])
                        for name, value in values.items():
                            if name in fp32 and isinstance(value, Tensor) and value.dtype != torch.float32:
                                values[name] = value.to(torch.float32)
                    continue
                bucket = placement.buckets.get(key) or self._place(key, params,
                                                                   rules._resolve_backend(group, key.device), group,
                                                                   rules)
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
        for bucket in self.buckets.values():  # the host's share: its worker, and its copies back (the
            if bucket.host is not None:  # parameters: the host may write them next, as load_state_dict does)
                copied_up = self._finish_host_share(bucket)
                bucket.runtime.synchronize(copied_up)
        self._host_pending = False
        for bucket in self.buckets.values():  # what the host may now read (recorded by the simulator)
            stores = [s for s in (bucket.store, bucket.host and bucket.host.store) if s is not None]
            if stores:
                bucket.runtime.host_access([s for store in stores for s in store.all_slabs()],
                                           write=False, what="host state read after wait_host")

    # ---- memory ----------------------------------------------------------------------------------
    def memory_stats(self) -> dict:
        self._device_peak = max(self._device_peak, self.placement.device_bytes)
        return {**self.placement.memory_stats(self.runtimes, self._device_peak),
                "host_share_auto": self.auto_shares.report()}


class _Work(NamedTuple):
    """One bucket's part of a step, checked: `stepping` indexes the members with gradients, `grads`
    their gradients, flat."""

    group: dict
    key: BucketKey
    members: list[Tensor]
    stepping: list[int]
    grads: list[Tensor]


class _Placed(NamedTuple):
    """One bucket's part of a step, placed, with its update and found_inf for this step."""

    bucket: Bucket
    update: FusedUpdate
    stepping: list[int]
    grads: list[Tensor]
    found_inf: Tensor | None


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
    if bucket.pipeline is not None and not all(bucket.resident[t] for t in stepping) and bucket.runtime.capturing():
        raise RuntimeError("fusedoff: a step that streams states cannot be captured in a CUDA graph (its copies "
                           "and host synchronisation are outside the graph); capture with every state resident "
                           "(offload='none', or a device_budget that holds them all)")


__all__ = ["ALIGN_ELEMENTS", "DEFAULT_CHUNK_SIZE", "OFFLOAD_MODES", "OffloadEngine"]
