"""The engine's side of [note: overlap with the next forward] (fusedoff/optim/overlap.py).

`ForwardSchedule` holds the order the next forward reads the parameters in (None: steps join
as a plain step does). With an order, a step's single-pass chunks run interleaved across buckets
in that order (`passes`), and the main stream waits only for the chunks holding the parameters a
module is about to read (`wait_for`), and for a host-computed parameter's copy back (after the
host waited for its worker: see [note: the host share of a step] in host_share.py).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from torch import Tensor

from fusedoff.offload.bucket import Bucket
from fusedoff.offload.plan import Chunk

if TYPE_CHECKING:
    from fusedoff.offload.placement import Placement


class ForwardSchedule:
    def __init__(self) -> None:
        self.order: dict[int, int] | None = None  # id(param) -> its first use in the forward
        self._waits: dict[Hashable, list[_Waits]] = {}  # wait_for's chunks per parameter set
        self._generation = None  # the placement's generation the waits were found in

    def follow(self, order: dict[int, int] | None) -> None:
        """Steps from now on run in `order` and end without a join (None: as a plain step)."""
        self.order = order
        self._waits.clear()

    def wait_for(self, key: Hashable, params: Sequence[Tensor], placement: Placement,
                 finish_host_share: Callable[[Bucket], object]) -> None:
        """The main stream waits for the chunks holding `params` (their last step's update); resident
        parameters were updated on the main stream already; host-computed ones wait for the event
        `finish_host_share(bucket)` gives (the engine's). `key` names the set for the cache."""
        if self._generation != placement.generation:  # buckets placed or dropped since
            self._waits.clear()
            self._generation = placement.generation
        waits = self._waits.get(key)
        if waits is None:
            waits = self._waits[key] = _chunks_of(params, placement.buckets.values())
        for bucket, chunks, hosted in waits:
            rt = bucket.runtime
            main = rt.current_stream()
            done = bucket.chunk_done
            for c in chunks:
                rt.wait_event(main, done.get(c))
            if hosted:  # the host waits for its worker, then main for the copies back
                copied_up = finish_host_share(bucket)
                rt.wait_event(main, copied_up)

    def passes(self, buckets: Sequence[Bucket], chunks: Sequence[list[Chunk]]) -> list[tuple[int, list[Chunk]]]:
        """The single-pass chunks of a step's buckets (`chunks[k]` of `buckets[k]`) in the order the
        next forward reads their parameters, as passes: (k, a run of consecutive chunks of bucket k)."""
        order = self.order
        schedule = []
        for k, (bucket, own) in enumerate(zip(buckets, chunks)):
            for chunk in own:
                first = min((order.get(id(bucket.params[p.tensor]), len(order)) for p in chunk.pieces),
                            default=len(order))
                schedule.append(_Scheduled(first, k, chunk.index, chunk))
        schedule.sort(key=lambda entry: (entry.first_read, entry.bucket, entry.index))
        passes: list[tuple[int, list[Chunk]]] = []
        for entry in schedule:  # runs of consecutive chunks of one bucket: one pass each
            if passes and passes[-1][0] == entry.bucket:
                passes[-1][1].append(entry.chunk)
            else:
                passes.append((entry.bucket, [entry.chunk]))
        return passes


class _Scheduled(NamedTuple):
    """A chunk in the forward's order: the first position the forward reads of its parameters."""

    first_read: int
    bucket: int  # its bucket's index among the step's
    index: int  # its index in the bucket's plan
    chunk: Chunk


class _Waits(NamedTuple):
    """What a set of parameters waits for in one bucket: its streamed chunks, and whether some of
    them are host-computed (the copies back of the host's share)."""

    bucket: Bucket
    chunks: list[int]
    hosted: bool


def _chunks_of(params: Sequence[Tensor], buckets) -> list[_Waits]:
    """The streamed chunks holding `params`, and whether the host steps some of them, bucket by bucket."""
    wanted = {id(p) for p in params}
    found = []
    for bucket in buckets:
        chunks = sorted({c for t, p in enumerate(bucket.params) if id(p) in wanted and not bucket.resident[t]
                         for c in bucket.chunks_of_tensor(t)})
        hosted = any(bucket.hosted[t] for t, p in enumerate(bucket.params) if id(p) in wanted)
        if chunks or hosted:
            found.append(_Waits(bucket, chunks, hosted))
    return found
