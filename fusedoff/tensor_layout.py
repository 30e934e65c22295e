"""Parameters of any dense layout (a transposed or channels_last weight) seen as flat runs of memory.

The kernels update elements in memory order through 1-D views. A dense tensor (non-overlapping,
no gaps: every permutation of a contiguous layout) is one run of memory whatever its strides, so
its states are laid out with the same strides and every tensor of an update is walked in the same
order. A tensor with gaps or overlaps (a strided slice) is not: it is refused.
"""

from __future__ import annotations

import torch
from torch import Tensor


def is_dense(t: Tensor) -> bool:
    """True when `t` covers one run of memory with no gaps or overlaps (any order of dimensions)."""
    if t.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def check_dense(t: Tensor) -> None:
    """Raises unless `t` is dense: the kernels walk a tensor's elements in memory order."""
    if not is_dense(t):
        raise ValueError(f"fusedoff needs dense parameters (any order of dimensions, no gaps or overlaps), got one of "
                         f"shape {tuple(t.shape)} with strides {t.stride()}; make it contiguous")


def flat_view(t: Tensor) -> Tensor:
    """The elements of a dense tensor `t` in memory order, as a 1-D view (writes go to `t`)."""
    return t.view(-1) if t.is_contiguous() else t.as_strided((t.numel(),), (1,))


def in_layout_of(t: Tensor, like: Tensor) -> Tensor:
    """`t` with `like`'s strides (itself when they already match, as autograd makes gradients)."""
    if t.stride() == like.stride() or t.numel() <= 1:
        return t
    return torch.empty_like(like, dtype=t.dtype).copy_(t)
