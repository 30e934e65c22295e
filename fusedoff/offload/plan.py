"""ChunkPlan: how the tensors of one bucket are laid out in flat host state and cut into chunks.

Tensors are placed one after another in a flat index space, each starting on a multiple of
`ALIGN_ELEMENTS` (so every view the kernels get is 64-byte aligned and their vector paths apply),
and the space is cut into chunks of `chunk_size` elements (a multiple of `ALIGN_ELEMENTS`). A chunk
holds pieces of one or more tensors; a tensor may span several chunks. Each state of the bucket is
stored with this same layout, so one chunk of one state is one contiguous copy.
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
    flat_begin: int
    flat_end: int  # exclusive; the chunk's extent in the flat space, padding included
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return self.flat_end - self.flat_begin


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class ChunkPlan:
    def __init__(self, numels: list[int], chunk_size: int) -> None:
        if chunk_size <= 0 or chunk_size % ALIGN_ELEMENTS:
            raise ValueError(f"chunk_size must be a positive multiple of {ALIGN_ELEMENTS}, got {chunk_size}")
        self.numels = list(numels)
        self.chunk_size = chunk_size
        self.offsets: list[int] = []
        flat = 0
        for n in self.numels:
            self.offsets.append(flat)
            flat = round_up(flat + n, ALIGN_ELEMENTS)
        self.total = flat
        self.chunks: list[Chunk] = []
        first = 0  # the first tensor that may still reach into the current chunk (one sweep overall)
        for index, begin in enumerate(range(0, self.total, chunk_size)):
            end = min(begin + chunk_size, self.total)
            while first < len(self.numels) and self.offsets[first] + self.numels[first] <= begin:
                first += 1
            pieces = []
            t = first
            while t < len(self.numels) and self.offsets[t] < end:
                lo, hi = max(begin, self.offsets[t]), min(end, self.offsets[t] + self.numels[t])
                if lo < hi:
                    pieces.append(Piece(t, lo - self.offsets[t], lo - begin, hi - lo))
                t += 1
            self.chunks.append(Chunk(index, begin, end, tuple(pieces)))

    def whole_tensors_only(self, chunk: Chunk) -> bool:
        """True when every tensor with a piece in `chunk` lies entirely inside it."""
        return all(p.length == self.numels[p.tensor] for p in chunk.pieces)
