"""ChunkPlan: how the streamed tensors of one bucket are laid out in host memory and cut into chunks.

Tensors are placed one after another, each starting on a multiple of `align` elements (at least
`ALIGN_ELEMENTS`, so every view the kernels get is 64-byte aligned and their vector paths apply;
a multiple of a state's block, so that blocks of block-wise states never straddle two chunks). The placed tensors are
grouped into segments of at most `segment_elements` (a tensor larger than that has a segment of its
own): a segment becomes one host allocation (a slab) per state, so no tensor spans two slabs and
every tensor's state is a view of one slab. Each segment is cut into chunks of `chunk_size`
elements (a multiple of `align`); a chunk holds pieces of one or more tensors of its
segment, a tensor may span several chunks, and no chunk spans two segments, so one chunk of one
state is one contiguous copy.

A tensor with no elements in the plan (numel 0: empty, or kept resident by the placement) takes no
space and has no pieces.

A tensor may have a `lead` (fewer than `align` elements): its first element is placed that far
after an aligned position, as if the elements before it were there. A shard of a larger tensor
whose blocks are counted from the whole tensor's first element (see fusedoff/sharding.py) has as
lead its offset there modulo the block, so that chunks are cut on the whole tensor's block
boundaries and its first block's other part is simply absent.
"""

from __future__ import annotations

from dataclasses import dataclass

ALIGN_ELEMENTS = 16  # 64 bytes of fp32: a cache line, and 16-byte vector alignment for any dtype


@dataclass(frozen=True)
class Piece:
    """Elements [tensor_offset, tensor_offset + length) of tensor `tensor`, at `chunk_offset` in its chunk."""

    tensor: int
    tensor_offset: int
    chunk_offset: int
    length: int


@dataclass(frozen=True)
class Chunk:
    index: int
    segment: int
    begin: int  # offset of the chunk in its segment
    numel: int  # padding included
    pieces: tuple[Piece, ...]


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def aligned_chunk_size(chunk_size: int) -> int:
    """`chunk_size` rounded up to the alignment every chunk keeps."""
    chunk_size = int(chunk_size)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive number of elements, got {chunk_size}")
    return round_up(chunk_size, ALIGN_ELEMENTS)


class ChunkPlan:
    def __init__(self, numels: list[int], chunk_size: int, segment_elements: int | None = None,
                 align: int = ALIGN_ELEMENTS, leads: list[int] | None = None) -> None:
        if align <= 0 or align % ALIGN_ELEMENTS:
            raise ValueError(f"align must be a positive multiple of {ALIGN_ELEMENTS}, got {align}")
        if chunk_size <= 0 or chunk_size % align:
            raise ValueError(f"chunk_size must be a positive multiple of {align}, got {chunk_size}")
        self.numels = [int(n) for n in numels]
        leads = [0] * len(self.numels) if leads is None else [int(lead) if n else 0
                                                              for lead, n in zip(leads, self.numels)]
        if len(leads) != len(self.numels) or not all(0 <= lead < align for lead in leads):
            raise ValueError(f"leads must be one per tensor, each in [0, {align}), got {leads}")
        self.chunk_size = chunk_size
        self.align = align
        limit = segment_elements if segment_elements is not None else float("inf")
        self.segment_of: list[int] = []  # per tensor: its segment
        self.offsets: list[int] = []  # per tensor: its offset in its segment
        self.segment_sizes: list[int] = []  # elements per segment, padding included
        used = 0
        for n, lead in zip(self.numels, leads):
            if n and used and used + lead + n > limit:  # start a new segment; a large tensor gets one of its own
                self.segment_sizes.append(used)
                used = 0
            self.segment_of.append(len(self.segment_sizes))
            self.offsets.append(used + lead)
            used = round_up(used + lead + n, align)
        if used or not self.segment_sizes:
            self.segment_sizes.append(used)
        self.total = sum(self.segment_sizes)
        self.chunks: list[Chunk] = []
        for segment, size in enumerate(self.segment_sizes):
            members = [t for t, s in enumerate(self.segment_of) if s == segment and self.numels[t]]
            first = 0  # the first member that may still reach into the current chunk (one sweep overall)
            for begin in range(0, size, chunk_size):
                end = min(begin + chunk_size, size)
                while first < len(members) and self.offsets[members[first]] + self.numels[members[first]] <= begin:
                    first += 1
                pieces = []
                for t in members[first:]:
                    if self.offsets[t] >= end:
                        break
                    lo, hi = max(begin, self.offsets[t]), min(end, self.offsets[t] + self.numels[t])
                    if lo < hi:
                        pieces.append(Piece(t, lo - self.offsets[t], lo - begin, hi - lo))
                self.chunks.append(Chunk(len(self.chunks), segment, begin, end - begin, tuple(pieces)))

    def whole_tensors_only(self, chunk: Chunk) -> bool:
        """True when every tensor with a piece in `chunk` lies entirely inside it."""
        return all(p.length == self.numels[p.tensor] for p in chunk.pieces)
