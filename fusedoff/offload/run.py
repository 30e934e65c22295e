"""BucketRun: what one bucket's step runs, prepared before the step changes anything.

A bucket's stepping tensors split into resident ones, updated whole by fused calls on the current
stream, and streamed ones, whose chunks go through the device's pipeline: chunks holding only
whole, unsharded tensors in one pass running every phase (`whole_pass`), the others in one pass
per phase (`spanning`); host-computed ones are stepped by the host kernels in host memory
(`host`, see host_share.py). The engine runs them (engine.py); everything a run allocates (statistics,
the streaming buffers) is allocated here, see [note: the step as a transaction].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fusedoff.offload.bucket import Bucket
from fusedoff.offload.contract import FusedUpdate
from fusedoff.offload.host_share import HostRun
from fusedoff.offload.pipeline import StreamPipeline, buffer_regions
from fusedoff.offload.plan import Chunk


@dataclass
class BucketRun:
    """One bucket's step, prepared: what the engine's `_run` and `_stream` need."""

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
    host: HostRun | None  # the host-computed tensors' step (None: none steps)

    @property
    def streamed_numel(self) -> int:
        """The elements whose states this run streams."""
        return sum(self.bucket.plan.numels[t] for t in self.grads_of)

    @property
    def hosted_numel(self) -> int:
        """The elements the host steps in this run."""
        return sum(self.bucket.host.plan.numels[t] for t in self.host.tensors) if self.host is not None else 0

    @property
    def moved_numel(self) -> int:
        """The elements whose states or parameters this run moves over the link."""
        return self.streamed_numel + self.hosted_numel

    @classmethod
    def prepare(cls, bucket: Bucket, update: FusedUpdate, stepping: list[int], grads: list[Tensor],
                steps: list[Tensor]) -> BucketRun:
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
        chunks, grads_of, steps_of, host = [], {}, {}, None
        if len(resident) < len(stepping):
            hosted = bucket.hosted
            grads_of = {t: g for t, g in zip(stepping, grads) if not bucket.resident[t] and not hosted[t]}
            steps_of = {t: s for t, s in zip(stepping, steps) if not bucket.resident[t] and not hosted[t]}
            chunks = [c for c in bucket.plan.chunks if any(p.tensor in grads_of for p in c.pieces)]
            host_rows = [i for i, t in enumerate(stepping) if hosted[t]]
            if host_rows:
                host = bucket.host.prepare(bucket, update, [stepping[i] for i in host_rows],
                                           [grads[i] for i in host_rows])
        if rt.records_accesses:  # produced on the main stream before this step: gradients (backward), steps
            rt.main_access([*grads, *steps, *(() if stats is None else (stats,))], write=True,
                           what="gradients, steps and stats made on the main stream")
        whole_pass, spanning = chunks, []
        if len(update.phases) > 1:
            whole_pass = [c for c in chunks if bucket.plan.whole_tensors_only(c)
                          and not any(bucket.sharded[p.tensor] for p in c.pieces)]
            spanning = [c for c in chunks if c not in whole_pass]
        resident_calls = bucket.resident_calls(resident, resident_grads, resident_steps, stats) if resident else []
        return cls(bucket, update, stepping, stats, resident_calls, chunks, whole_pass, spanning, grads_of, steps_of,
                   host)


def reserve_buffers(runs: list[BucketRun]) -> None:
    """Grows each device's streaming buffers to what the passes of `runs` need, before the step changes anything."""
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
