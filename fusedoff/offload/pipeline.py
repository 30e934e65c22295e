"""StreamPipeline: moves chunks of host state through a few device buffers around a compute step.

For each chunk of a ChunkPlan: copy the states it reads into a free buffer set (copy-in stream),
run the caller's compute on the buffers (compute stream), copy the states it writes back to host
memory (copy-out stream). Streams are ordered by events only, so chunk i+1's copy-in overlaps
chunk i's compute and chunk i-1's copy-out, and a buffer set is refilled only after its copy-out
has finished. `run` returns with the work enqueued; `join` makes the main stream wait for the
computed chunks (before anything reads the parameters); `wait_host` blocks until host state is
final.

The pipeline talks to the device through its `Runtime` (runtime.py): on CUDA real streams, for
CPU parameters the host loopback (the same chunking, buffer rotation and piece views, run at
once), in CI also the simulator. It knows chunks, buffers, streams and events; what the compute
does is the caller's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from fusedoff.offload.plan import Chunk, ChunkPlan, round_up
from fusedoff.offload.runtime import LinkBytes, Runtime
from fusedoff.offload.store import HostStateStore
from fusedoff.offload.contract import StateSpec

REGION_ALIGN_BYTES = 64  # each state's region of a buffer set starts on a cache line


def buffer_regions(specs: Iterable[StateSpec], chunk_size: int) -> tuple[dict[str, int], int]:
    """Where each state's chunk of `chunk_size` elements lies in a buffer set (byte offsets), and
    the set's size in bytes: regions one after another, so compressed states take only their bytes."""
    offsets, used = {}, 0
    for spec in specs:
        offsets[spec.name] = used
        used += round_up(spec.nbytes(chunk_size), REGION_ALIGN_BYTES)
    return offsets, used


def pass_link_bytes(specs: dict[str, StateSpec], chunks: Iterable[Chunk], read: Iterable[str],
                    write: Iterable[str]) -> LinkBytes:
    """The bytes one `StreamPipeline.run` over `chunks` copies each way (a prediction: `run` counts
    what it copies): every state it reads or writes in, the written ones out, each chunk whole."""
    read, write = set(read) | set(write), set(write)
    link = LinkBytes()
    for chunk in chunks:
        link.to_device += sum(specs[name].nbytes(chunk.numel) for name in read)
        link.to_host += sum(specs[name].nbytes(chunk.numel) for name in write)
    return link


class StreamPipeline:
    def __init__(self, runtime: Runtime, chunk_size: int, num_buffers: int) -> None:
        self.runtime = runtime
        self.chunk_size = chunk_size
        # buffers[set]: the bytes of one chunk of every state a pass moves (see buffer_regions); grown
        # to the largest set any bucket needs (all buckets of a device share them: device memory is
        # bounded by the buffers).
        self.buffers: list[Tensor | None] = [None] * num_buffers
        # Sets replaced by larger ones, held until the host has waited for every queued copy (their
        # memory is not reused under a side stream's queued work, whatever the runtime).
        self._retired: list[Tensor] = []
        self.generation = 0  # counts the times the buffer sets were replaced (views of them go stale)
        self._unwaited = False  # buffers allocated that the copy-in stream has not yet waited for
        self._free: list[object | None] = [None] * num_buffers  # copy-out done with each buffer set
        # The last copy back into each store (by id): a pass waits for its own store's writes only,
        # so buckets sharing this pipeline overlap one another.
        self._last_copy_out: dict[int, object] = {}
        self.copy_in = runtime.new_stream()
        self.compute = runtime.new_stream()
        self.copy_out = runtime.new_stream()

    def run(self, plan: ChunkPlan, store: HostStateStore, *, read: Iterable[str], write: Iterable[str],
            compute: Callable[[Chunk, dict[str, Tensor]], None],
            touches: Callable[[Chunk], Iterable[Tensor]] = lambda chunk: (),
            chunks: Iterable[Chunk] | None = None) -> dict[int, object]:
        """One pass over every chunk (or over `chunks`). `touches(chunk)` are the device tensors a
        chunk's compute reads or writes besides the buffers (its parameters, gradients, steps, stats),
        asked only by a runtime that records accesses: produced on the main stream, which the compute
        waits for, and final for main after `join`, or chunk by chunk after the main stream waits for
        a chunk's event in the returned {chunk index: event} (the chunk computed)."""
        rt = self.runtime
        # Every written state is also read: a chunk buffer goes back to host memory whole, and the
        # pieces of tensors that sit out this step must go back as they came.
        read, write = tuple(dict.fromkeys(tuple(read) + tuple(write))), tuple(write)
        chunks = plan.chunks if chunks is None else list(chunks)
        main = rt.current_stream()
        rt.wait_stream(self.compute, main)  # grads, params, steps and stats are produced on main
        regions, set_bytes = buffer_regions([store.specs[name] for name in read], plan.chunk_size)
        self.reserve(set_bytes)
        rt.wait_event(self.copy_in, self._last_copy_out.get(id(store)))  # this store's previous pass
        done = {}
        for k, chunk in enumerate(chunks):
            slot = k % len(self.buffers)
            buffers = self._views(slot, chunk, store, regions)
            rt.wait_event(self.copy_in, self._free[slot])
            for name in read:
                rt.copy_to_device(self.copy_in, buffers[name], store.chunk(name, chunk))
            loaded = rt.record(self.copy_in)
            rt.wait_event(self.compute, loaded)
            touched = list(touches(chunk)) if rt.records_accesses else []
            rt.launch(self.compute, lambda chunk=chunk, buffers=buffers: compute(chunk, buffers),
                      reads=[*buffers.values(), *touched], writes=[*(buffers[n] for n in write), *touched])
            computed = done[chunk.index] = rt.record(self.compute)
            rt.wait_event(self.copy_out, computed)
            for name in write:
                rt.copy_to_host(self.copy_out, store.chunk(name, chunk), buffers[name])
            self._free[slot] = rt.record(self.copy_out)
        self._last_copy_out[id(store)] = rt.record(self.copy_out)
        return done

    def reserve(self, set_bytes: int) -> None:
        """Grows every buffer set to `set_bytes` now, before a step changes anything (an allocation
        is what fails, see [note: the step as a transaction]): its passes then allocate nothing."""
        self._unwaited |= self._ensure_bytes(set_bytes)
        if self._unwaited:  # new buffers come from main's pool: blocks main may still use
            self.runtime.wait_stream(self.copy_in, self.runtime.current_stream())
            self._unwaited = False  # (only once the wait is queued: a step that failed before it waits at its retry)

    def settle(self) -> None:
        """Blocks until every operation queued on the pipeline's streams has finished (after a
        failure in the middle of a pass, whose last copy back `wait_host` does not know)."""
        for stream in (self.copy_in, self.compute, self.copy_out):
            self.runtime.synchronize(self.runtime.record(stream))

    def join(self) -> None:
        """The main stream waits for every computed chunk: the parameters (and the stats the
        compute accumulated) are final for anything queued on it after this."""
        self.runtime.wait_stream(self.runtime.current_stream(), self.compute)

    def wait_host(self) -> None:
        """Blocks until every copy back to host memory has finished (before reading host state)."""
        for event in self._last_copy_out.values():
            self.runtime.synchronize(event)
        self._retired.clear()

    @property
    def buffer_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers if b is not None)

    def _ensure_bytes(self, set_bytes: int) -> bool:
        """Grows every buffer set to `set_bytes`; True if anything was allocated."""
        grown = False
        for k, buffer in enumerate(self.buffers):
            if buffer is None or buffer.numel() < set_bytes:
                if buffer is not None:
                    self._retired.append(buffer)
                buffer = self.runtime.empty(-(-set_bytes // 4)).view(torch.uint8)
                for stream in (self.copy_in, self.compute, self.copy_out):  # used on the side streams
                    self.runtime.keep_alive(buffer, stream)
                self.buffers[k] = buffer
                grown = True
        self.generation += grown
        return grown

    def _views(self, slot: int, chunk: Chunk, store: HostStateStore, regions: dict[str, int]) -> dict[str, Tensor]:
        buffer = self.buffers[slot]
        views = {}
        for name, offset in regions.items():
            spec = store.specs[name]
            views[name] = buffer[offset : offset + spec.nbytes(chunk.numel)].view(spec.dtype)
        return views
