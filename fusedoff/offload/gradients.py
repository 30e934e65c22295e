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


def checked_flat_grads(params: list[Tensor], grads: list[Tensor], stepping: list[int], sharded: bool) -> list[Tensor]:
    """The flat gradients `grads[t]` of `params[t]` for `t` in `stepping`, each checked (`sharded`:
    some of `params` may be DTensors). Views only: nothing changes if one of them raises."""
    flat = []
    for t in stepping:
        p, g = params[t], grads[t]
        if g.is_sparse or g.dtype not in SUPPORTED_DTYPES or g.shape != p.shape or g.device != p.device or sharded:
            check_grad(p)  # raises where something is wrong (and checks a sharded gradient's placements)
            g, p = local_tensor(g), local_tensor(p)
        dim, contiguous = g.dim(), g.is_contiguous()
        if dim == 1 and contiguous:  # biases and norm weights, most of a model's tensors: flat already
            flat.append(g)
        elif contiguous and (dim == 0 or p.is_contiguous()):
            flat.append(g.view(-1))
        else:
            flat.append(flat_view(in_layout_of(g, p)))
    return flat
