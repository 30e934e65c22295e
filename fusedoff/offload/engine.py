"""OffloadEngine: host-resident states for the parameters of an optimizer, streamed by chunks.

A bucket is the parameters of one param group that share a device, dtype and master-weight
setting, fixed when the bucket is first used; its fp32 states live in a HostStateStore laid out by
a ChunkPlan. Every bucket of a device shares that device's StreamPipeline, so device memory for
the optimizer is the pipeline's buffers however many buckets and parameters there are.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fusedoff.offload.pipeline import StreamPipeline
from fusedoff.offload.plan import ALIGN_ELEMENTS, Chunk, ChunkPlan, Piece
from fusedoff.offload.store import HostStateStore
from fusedoff.sharding import local_tensor

# NOTE: 4M elements: with AdamW + master weights (3 fp32 states) one buffer set is 48 MiB and the
# default two sets 96 MiB, whatever the model size; large enough that each copy runs at full PCIe
# speed (copies of a few MiB already do).
DEFAULT_CHUNK_SIZE = 4 * 2**20


@dataclass
class OffloadedBucket:
    params: list[Tensor]
    names: tuple[str, ...]
    plan: ChunkPlan
    store: HostStateStore
    pipeline: StreamPipeline
    index: dict[int, int] = field(default_factory=dict)  # id(param) -> position in `params`
    # Flat views of the parameters for the pass under way, made once per pass: a DTensor's local
    # view costs ~30 us, and a pass asks for it once per piece (and per phase).
    _flat_params: dict[int, Tensor] = field(default_factory=dict)

    def flat_param(self, t: int) -> Tensor:
        # A sharded (DTensor) parameter's states are its local shard's: the plan counts local elements.
        flat = self._flat_params.get(t)
        if flat is None:
            flat = self._flat_params[t] = local_tensor(self.params[t].detach()).view(-1)
        return flat

    def calls(self, chunk: Chunk, buffers: dict[str, Tensor], grads: dict[int, Tensor]) -> Iterator["ChunkCall"]:
        """The fused calls for `chunk`: one per gradient dtype among the pieces whose tensor has a
        gradient in `grads` (tensor position -> gradient), with each piece's views."""
        by_dtype: dict[torch.dtype, list[Piece]] = defaultdict(list)
        for piece in chunk.pieces:
            if piece.tensor in grads:
                by_dtype[grads[piece.tensor].dtype].append(piece)
        for pieces in by_dtype.values():
            yield ChunkCall(
                pieces=pieces,
                params=[_slice(self.flat_param(p.tensor), p.tensor_offset, p.length) for p in pieces],
                grads=[_slice(grads[p.tensor].view(-1), p.tensor_offset, p.length) for p in pieces],
                states={name: [_slice(buf, p.chunk_offset, p.length) for p in pieces] for name, buf in buffers.items()},
            )

    def run(self, *, read: Iterable[str], write: Iterable[str], compute: Callable[[Chunk, dict[str, Tensor]], None],
            device_inputs: Iterable[Tensor] = (), chunks: Iterable[Chunk] | None = None) -> None:
        self._flat_params.clear()  # the parameters may have been replaced since the last pass
        self.pipeline.run(self.plan, self.store, read=read, write=write, compute=compute, device_inputs=device_inputs,
                          chunks=chunks)


class OffloadEngine:
    def __init__(self, chunk_size: int | None, num_buffers: int) -> None:
        chunk_size = DEFAULT_CHUNK_SIZE if chunk_size is None else int(chunk_size)
        if chunk_size < ALIGN_ELEMENTS or chunk_size % ALIGN_ELEMENTS:
            raise ValueError(f"chunk_size must be a positive multiple of {ALIGN_ELEMENTS}, got {chunk_size}")
        if int(num_buffers) != num_buffers or num_buffers < 2:
            raise ValueError(f"num_buffers must be an integer >= 2, got {num_buffers}")
        self.chunk_size = chunk_size
        self.num_buffers = int(num_buffers)
        self.buckets: dict[tuple, OffloadedBucket] = {}
        self.pipelines: dict[torch.device, StreamPipeline] = {}
        self._device_peak = 0

    def bucket(self, key: tuple, params: list[Tensor], names: tuple[str, ...],
               initial: Callable[[str, Tensor], Tensor | None]) -> OffloadedBucket:
        """The bucket for `key`, created on first use with states `names`; `initial(name, param)`
        gives a state's starting value (None: zeros)."""
        bucket = self.buckets.get(key)
        if bucket is not None:
            return bucket
        for p in params:
            if not local_tensor(p).is_contiguous():
                raise ValueError("offload='stream' needs contiguous parameters")
        device = params[0].device
        pipeline = self.pipelines.get(device)
        if pipeline is None:
            pipeline = self.pipelines[device] = StreamPipeline(device, self.chunk_size, self.num_buffers)
        plan = ChunkPlan([local_tensor(p).numel() for p in params], self.chunk_size)
        store = HostStateStore(plan, names, pin=device.type == "cuda", device=device)
        bucket = OffloadedBucket(params, names, plan, store, pipeline, {id(p): i for i, p in enumerate(params)})
        for name in names:
            for t, p in enumerate(params):
                value = initial(name, p)
                if value is not None:
                    store.write(name, t, value.detach().to("cpu", torch.float32))
        self.buckets[key] = bucket
        self._device_peak = max(self._device_peak, self.device_bytes)
        return bucket

    def find(self, param: Tensor) -> tuple[OffloadedBucket, int] | None:
        for bucket in self.buckets.values():
            t = bucket.index.get(id(param))
            if t is not None:
                return bucket, t
        return None

    def wait_host(self) -> None:
        for pipeline in self.pipelines.values():
            pipeline.wait_host()

    @property
    def device_bytes(self) -> int:
        return sum(p.buffer_bytes for p in self.pipelines.values() if p.cuda)

    def memory_stats(self) -> dict:
        self._device_peak = max(self._device_peak, self.device_bytes)
        stores = [b.store for b in self.buckets.values()]
        return {
            "host_bytes": sum(s.nbytes for s in stores),
            "host_pinned": bool(stores) and all(s.pinned for s in stores),
            "device_bytes": self.device_bytes,
            "device_peak_bytes": self._device_peak,
            "chunk_size": self.chunk_size,
            "num_buffers": self.num_buffers,
        }


@dataclass
class ChunkCall:
    """The arguments of one fused call over pieces of a chunk: device views of the parameters and
    gradients, and views of the chunk buffers for each state."""

    pieces: list[Piece]
    params: list[Tensor]
    grads: list[Tensor]
    states: dict[str, list[Tensor]]


def _slice(flat: Tensor, offset: int, length: int) -> Tensor:
    return flat[offset : offset + length]
