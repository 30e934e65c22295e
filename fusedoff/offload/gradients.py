"""The gradients a step takes: checked in one pass, seen flat in their parameters' memory order.

The engine checks every gradient of a step before anything changes (a bad gradient leaves the
optimizer untouched) and hands the kernels flat views: in the parameter's memory order, which is
the order its states are kept in (see fusedoff/tensor_layout.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusedoff.sharding import is_dtensor, local_tensor
from fusedoff.tensor_layout import flat_view, in_layout_of

LOW_PRECISION = (torch.float16, torch.bfloat16)
SUPPORTED_DTYPES = (torch.float32, *LOW_PRECISION)


def check_grad(param: Tensor) -> None:
    """Raises the error that names what is wrong with `param.grad`."""
    grad = param.grad
    if grad.is_sparse:
        raise RuntimeError("fusedoff does not support sparse gradients")
    if grad.shape != param.shape:
        raise RuntimeError(f"gradient shape {tuple(grad.shape)} does not match parameter shape {tuple(param.shape)}")
    if grad.device != param.device:
        raise RuntimeError(f"gradient on {grad.device} but parameter on {param.device}")
    if grad.dtype not in SUPPORTED_DTYPES:
        raise RuntimeError(f"fusedoff supports float32, float16 and bfloat16 gradients, got {grad.dtype}")
    if is_dtensor(grad) != is_dtensor(param) or (is_dtensor(param) and grad.placements != param.placements):
        raise RuntimeError(f"gradient sharded as {getattr(grad, 'placements', 'a plain tensor')} "
                           f"but parameter as {getattr(param, 'placements', 'a plain tensor')}")


def checked_flat_grads(params: list[Tensor], stepping: list[int]) -> list[Tensor]:
    """The flat gradients of `params[t]` for `t` in `stepping`, every one checked first."""
    for t in stepping:
        p = params[t]
        g = p.grad
        if (g.is_sparse or g.dtype not in SUPPORTED_DTYPES or g.device != p.device or g.shape != p.shape
                or is_dtensor(g) or is_dtensor(p)):
            check_grad(p)  # raises where something is wrong (and checks a sharded gradient's placements)
    grads = []
    for t in stepping:
        p = params[t]
        g = local_tensor(p.grad)
        if g.is_contiguous() and (g.dim() <= 1 or local_tensor(p).is_contiguous()):
            grads.append(g.view(-1))
        else:
            grads.append(flat_view(in_layout_of(g, local_tensor(p))))
    return grads
