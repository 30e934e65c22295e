"""Checks a fusedoff optimizer makes before anything changes: groups, parameters, gradients."""

from __future__ import annotations

import torch
from torch import Tensor

from fusedoff.offload.gradients import LOW_PRECISION, SUPPORTED_DTYPES



# torch.optim's implementation flags, accepted for code written for torch (see check_torch_flags).
TORCH_FLAGS = ("foreach", "fused", "capturable", "differentiable")


def check_torch_flags(*, foreach: bool | None = None, fused: bool | None = None, capturable: bool = False,
                      differentiable: bool = False) -> None:
    """torch.optim's flags at the values fusedoff can honour; torch's own errors for its own refusals.

    fusedoff's step is always one fused kernel call per bucket: `fused` and `foreach` choose
    nothing (torch's refusal of both True together is kept); `differentiable` and `capturable`
    ask for what the step cannot do, and are refused when True.
    """
    if differentiable:
        raise RuntimeError("`fused` does not support `differentiable`: fusedoff's step always runs its fused kernels, "
                           "outside autograd; leave differentiable=False")
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    if capturable:
        raise RuntimeError("fusedoff does not support capturable=True: its step passes lr and betas to the kernels "
                           "as host numbers (a tensor lr is read on the host at every step) and streamed states move "
                           "through host memory, which a CUDA graph cannot capture; leave capturable=False")


def check_group(params: list[Tensor]) -> None:
    """fusedoff's conditions on one param group's tensors (torch refuses anything else in `params`)."""
    params = [p for p in params if isinstance(p, Tensor)]
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"the parameters of one param group must be on one device, got {sorted(map(str, devices))}")
    for p in params:
        if p.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"fusedoff supports float32, float16 and bfloat16 parameters, got {p.dtype}")
