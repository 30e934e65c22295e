"""Checks a fusedoff optimizer makes before anything changes: groups, parameters, gradients."""

from __future__ import annotations

import torch
from torch import Tensor

from fusedoff.sharding import is_dtensor, local_tensor
from fusedoff.tensor_layout import is_dense

LOW_PRECISION = (torch.float16, torch.bfloat16)
SUPPORTED_DTYPES = (torch.float32, *LOW_PRECISION)


def check_group(params: list[Tensor]) -> None:
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"the parameters of one param group must be on one device, got {sorted(map(str, devices))}")
    for p in params:
        if p.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"fusedoff supports float32, float16 and bfloat16 parameters, got {p.dtype}")


def check_param(param: Tensor) -> None:
    """Everything the fused ops would reject, checked before any state changes."""
    if not is_dense(local_tensor(param)):
        # The kernels walk a tensor's elements in memory order (see fusedoff/tensor_layout.py).
        raise ValueError(f"fusedoff needs dense parameters (any order of dimensions, no gaps or overlaps), got one of "
                         f"shape {tuple(param.shape)} with strides {param.stride()}; make it contiguous")
    check_grad(param)


def check_grad(param: Tensor) -> None:
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
