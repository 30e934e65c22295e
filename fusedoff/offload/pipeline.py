"""StreamPipeline: moves chunks of host state through a few device buffers around a compute step.

For each chunk of a ChunkPlan: copy the states it reads into a free buffer set (copy-in stream),
run the caller's compute on the buffers (compute stream), copy the states it writes back to host
memory (copy-out stream). Streams are ordered by events only, so chunk i+1's copy-in overlaps
chunk i's compute and chunk i-1's copy-out, and a buffer set is refilled only after its copy-out
has finished. `run` returns with the work enqueued; `join` makes the current stream wait for the
computed chunks (before anything reads the parameters); `wait_host` blocks until host state is
final.

With CPU parameters the same bookkeeping runs with host buffers and plain copies, no streams: the
chunking, buffer rotation and piece views are exercised exactly as on a GPU.

The pipeline knows chunks, buffers, streams and events; what the compute does is the caller's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from fusedoff.offload.plan import Chunk, ChunkPlan
from fusedoff.offload.store import HostStateStore


class StreamPipeline:
    def __init__(self, device: torch.device, chunk_size: int, num_buffers: int) -> None:
        if num_buffers < 2:
            raise ValueError(f"num_buffers must be >= 2, got {num_buffers}")
        self.device = device
        self.cuda = device.type == "cuda"
        self.chunk_size = chunk_size
        # buffers[set][slot]: one fp32 chunk per state a pass moves; grown to the most states any
        # bucket has (all buckets of a device share them: GPU memory is bounded by the buffers).
        self.buffers: list[list[Tensor]] = [[] for _ in range(num_buffers)]
        self._free: list[torch.cuda.Event | None] = [None] * num_buffers
        # The last copy back into each store (by id): a pass waits for its own store's writes only,
        # so buckets sharing this pipeline overlap one another.
        self._last_copy_out: dict[int, torch.cuda.Event] = {}
        if self.cuda:
            self.copy_in = torch.cuda.Stream(device)
            self.compute = torch.cuda.Stream(device)
            self.copy_out = torch.cuda.Stream(device)

    def run(self, plan: ChunkPlan, store: HostStateStore, *, read: Iterable[str], write: Iterable[str],
            compute: Callable[[Chunk, dict[str, Tensor]], None], device_inputs: Iterable[Tensor] = (),
            chunks: Iterable[Chunk] | None = None) -> None:
        """One pass over every chunk (or over `chunks`). `device_inputs` are tensors the compute reads or writes on the
        device (grads, params, stats): the compute waits for the current stream's work on them, and
        they are kept alive until it is done with them."""
        # Every written state is also read: a chunk buffer goes back to host memory whole, and the
        # pieces of tensors that sit out this step must go back as they came.
        read, write = tuple(dict.fromkeys(tuple(read) + tuple(write))), tuple(write)
        names = read
        chunks = plan.chunks if chunks is None else list(chunks)
        grown = self._ensure_slots(len(names))
        if not self.cuda:
            for k, chunk in enumerate(chunks):
                buffers = self._views(k, chunk, names)
                for name in read:
                    buffers[name].copy_(store.chunk(name, chunk))
                compute(chunk, buffers)
                for name in write:
                    store.chunk(name, chunk).copy_(buffers[name])
            return

        main = torch.cuda.current_stream(self.device)
        self.compute.wait_stream(main)  # grads, params, steps and stats are produced on it
        if grown:  # new buffers come from main's pool: blocks main's queued kernels may still use
            self.copy_in.wait_stream(main)
        for t in device_inputs:
            t.record_stream(self.compute)  # not reused by the allocator before the compute is done
        if id(store) in self._last_copy_out:  # host state written by this store's previous pass
            self.copy_in.wait_event(self._last_copy_out[id(store)])
        for k, chunk in enumerate(chunks):
            slot = k % len(self.buffers)
            buffers = self._views(k, chunk, names)
            with torch.cuda.stream(self.copy_in):
                if self._free[slot] is not None:
                    self.copy_in.wait_event(self._free[slot])
                for name in read:
                    buffers[name].copy_(store.chunk(name, chunk), non_blocking=True)
                loaded = self.copy_in.record_event()
            with torch.cuda.stream(self.compute):
                self.compute.wait_event(loaded)
                compute(chunk, buffers)
                computed = self.compute.record_event()
            with torch.cuda.stream(self.copy_out):
                self.copy_out.wait_event(computed)
                for name in write:
                    store.chunk(name, chunk).copy_(buffers[name], non_blocking=True)
                self._free[slot] = self.copy_out.record_event()
        self._last_copy_out[id(store)] = self.copy_out.record_event()

    def join(self) -> None:
        """The current stream waits for every computed chunk: the parameters (and the stats the
        compute accumulated) are final before anything queued after this reads them."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.compute)

    def wait_host(self) -> None:
        """Blocks until every copy back to host memory has finished (before reading host state)."""
        for event in self._last_copy_out.values():
            event.synchronize()

    @property
    def buffer_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for buffers in self.buffers for b in buffers)

    def _ensure_slots(self, count: int) -> bool:
        """Grows every buffer set to `count` state buffers; True if anything was allocated."""
        grown = False
        for buffers in self.buffers:
            while len(buffers) < count:
                buffer = torch.empty(self.chunk_size, dtype=torch.float32, device=self.device)
                if self.cuda:  # used on the side streams: not reused before their work is done
                    for stream in (self.copy_in, self.compute, self.copy_out):
                        buffer.record_stream(stream)
                buffers.append(buffer)
                grown = True
        return grown

    def _views(self, k: int, chunk: Chunk, names: tuple[str, ...]) -> dict[str, Tensor]:
        buffers = self.buffers[k % len(self.buffers)]
        return {name: buffers[slot][: chunk.numel] for slot, name in enumerate(names)}
