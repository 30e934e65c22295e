"""HostStateStore: one bucket's states (and master weights) in host memory, chunk-contiguous.

Each state is a sequence of slabs, one per segment of the ChunkPlan: a slab holds whole tensors
and whole chunks, so every tensor's state is a view of one slab and one chunk of one state moves
with one copy. Slabs are bounded in size (see `DEFAULT_SEGMENT_BYTES` in the engine) because
pinning one huge region fails on many systems. The runtime pins each slab in place (on CUDA:
cudaHostRegister of ordinary host allocations rather than torch's caching pinned allocator, which
rounds each request up to a power of two): the store holds the bytes it needs and no more.
"""

from __future__ import annotations

import mmap
import warnings
import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from fusedoff.offload.plan import Chunk, ChunkPlan
from fusedoff.offload.contract import StateSpec, state_specs


class HostStateStore:
    """The states of one bucket's streamed tensors: one slab per state and plan segment, in the
    state's dtype, one value per element or per block of elements (`StateSpec`).

    `view(name, t)` is tensor `t`'s state `name`: a flat view of its slab (never a copy), which the
    optimizer hands out as ``opt.state[p][name]``; `chunk(name, chunk)` the contiguous region one
    copy moves.
    """

    def __init__(self, plan: ChunkPlan, states: tuple[str | StateSpec, ...], *,
                 pin: Callable[[Tensor], bool] | None = None,
                 unpin: Callable[[list[Tensor]], None] | None = None) -> None:
        """`states`: names (fp32, one value per element) or specs, whose blocks divide the plan's
        alignment. `pin(slab)` page-locks a slab for the device's copies (None: nothing to pin
        for); `unpin(slabs)` unlocks them when the store is freed (it holds them until then)."""
        self.plan = plan
        self.specs = {spec.name: spec for spec in state_specs(states)}
        self.names = tuple(self.specs)
        for spec in self.specs.values():
            if plan.align % spec.block:
                raise ValueError(f"state {spec.name!r} has blocks of {spec.block} elements, which the plan's "
                                 f"alignment of {plan.align} does not keep whole")
        self.pinned = pin is not None
        self.slabs: dict[str, list[Tensor]] = {}
        pinned = []
        try:
            for name, spec in self.specs.items():
                slabs = []
                for size in plan.segment_sizes:
                    slab = torch.zeros(size // spec.block, dtype=spec.dtype) if pin is None else \
                        _page_aligned_zeros(size // spec.block, spec.dtype)
                    if self.pinned and size:
                        if pin(slab):
                            pinned.append(slab)
                        else:
                            warnings.warn("fusedoff: could not pin host memory for optimizer states; streaming from "
                                          "pageable memory (slower)", stacklevel=3)
                            self.pinned = False
                    slabs.append(slab)
                self.slabs[name] = slabs
        except BaseException:  # (an allocation or a pin that failed: the slabs locked so far are given back)
            if pinned and unpin is not None:
                unpin(pinned)
            raise
        if pinned and unpin is not None:
            finalizer = weakref.finalize(self, unpin, pinned)
            finalizer.atexit = False  # the process is ending: nothing to give back, and CUDA may be gone

    @property
    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.all_slabs())

    def all_slabs(self) -> list[Tensor]:
        """Every slab of every state (the host memory the store holds)."""
        return [s for slabs in self.slabs.values() for s in slabs]

    def chunk(self, name: str, chunk: Chunk) -> Tensor:
        """The host storage of `chunk` for state `name` (a contiguous 1-D view)."""
        block = self.specs[name].block
        return self.slabs[name][chunk.segment][chunk.begin // block : (chunk.begin + chunk.numel) // block]

    def view(self, name: str, tensor: int) -> Tensor:
        """Tensor `tensor` of state `name`, flat: a view of its slab."""
        spec = self.specs[name]
        offset = self.plan.offsets[tensor]  # a block-wise state: the blocks its elements touch (see `lead`s)
        begin, end = offset // spec.block, -(-(offset + self.plan.numels[tensor]) // spec.block)
        return self.slabs[name][self.plan.segment_of[tensor]][begin:end]


def _page_aligned_zeros(numel: int, dtype: torch.dtype) -> Tensor:
    """Zeros on pages of their own. Page-locking works on whole pages, and a second lock of a page
    another lock holds fails: small slabs (8-bit block scales: 1/64 of the codes' bytes) that the
    allocator put side by side would make the store fall back to pageable memory."""
    nbytes = numel * dtype.itemsize
    raw = torch.zeros(nbytes + 2 * mmap.PAGESIZE, dtype=torch.uint8)
    start = -raw.data_ptr() % mmap.PAGESIZE
    return raw[start : start + nbytes].view(dtype)  # the view keeps `raw` alive
