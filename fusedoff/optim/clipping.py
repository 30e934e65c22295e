"""Gradient clipping folded into the next step's kernels: a total norm, and a divisor for the gradients."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor

from fusedoff.sharding import all_reduce_over_shards_, is_dtensor, local_tensor


def total_grad_norm(params: list[Tensor], norm_type: float) -> Tensor:
    """The norm of all of `params`' gradients together, from the gradients as they are stored
    (fp16/bf16/fp32, accumulated in fp32; torch's CPU norm makes an fp32 copy of one low-precision
    gradient at a time, never of all at once), on the first gradient's device; sharded
    gradients combine their shards' norms over the ranks holding them."""
    by_device: dict[torch.device, list[int]] = defaultdict(list)
    for t, p in enumerate(params):
        by_device[p.grad.device].append(t)
    first = params[0].grad.device
    # An empty gradient (a rank's empty shard of a small FSDP2 parameter) has norm 0, the identity
    # of both ways of combining norms; torch's inf-norm of nothing raises instead.
    norms: list[Tensor] = [torch.zeros((), device=first)] * len(params)
    for rows in by_device.values():
        rows = [t for t in rows if local_tensor(params[t].grad).numel()]
        local_grads = [local_tensor(params[t].grad) for t in rows]
        for t, n in zip(rows, torch._foreach_norm(local_grads, norm_type, dtype=torch.float32)):
            norms[t] = n.to(first, non_blocking=True)
    stacked = torch.stack(norms)
    inf = norm_type == float("inf")
    if any(is_dtensor(p) for p in params):
        # A sharded gradient's norm combines the shards' norms: max, or the p-th root of the
        # sum of p-th powers, over the ranks holding its shards.
        partial = stacked if inf else stacked.pow(norm_type)
        all_reduce_over_shards_(partial, params, "max" if inf else "sum")
        return partial.max() if inf else partial.sum().pow(1.0 / norm_type)
    return stacked.max() if inf else torch.linalg.vector_norm(stacked, norm_type)


def clip_coefficient(max_norm: float, total: Tensor) -> Tensor:
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def grad_divisor(grad_scale: Tensor | None, clip: Tensor | None, device: torch.device) -> Tensor | None:
    """What the kernels divide gradients by: the AMP scale and, after clipping, 1 / clip factor."""
    scale = grad_scale.to(device, non_blocking=True) if grad_scale is not None else None
    if clip is None:
        return scale
    clip = clip.to(device, non_blocking=True)
    return (scale / clip if scale is not None else 1.0 / clip).reshape(()).to(torch.float32)
