"""Pure-PyTorch Adam/AdamW: the ``torch`` backend and the float64 oracle for the other backends.

It mirrors ``csrc/include/fusedoff/adam.h`` line for line. Math runs in float64 when any of the
parameter (or master) and state tensors is float64, otherwise in float32; low-precision tensors are
upcast on the fly and written back with round-to-nearest-even. With ``found_inf`` it computes the
update and keeps the old values where ``found_inf`` is 1, so it never synchronises with the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def _math_dtype(*tensors: Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def adam_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    max_exp_avg_sqs: Sequence[Tensor],
    master_params: Sequence[Tensor],
    steps: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    amsgrad: bool,
    maximize: bool,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """In-place Adam/AdamW step; ``steps`` hold each tensor's count after this step's increment."""
    for i, param in enumerate(params):
        master = master_params[i] if master_params else None
        weights = master if master is not None else param
        exp_avg, exp_avg_sq = exp_avgs[i], exp_avg_sqs[i]
        math = _math_dtype(weights, exp_avg)
        step = steps[i].to(torch.float64)
        step_size = (lr / (1 - beta1**step)).to(math)
        bias_correction2_sqrt = torch.sqrt(1 - beta2**step).to(math)

        p = weights.to(math)
        g = grads[i].to(math)
        if grad_scale is not None:
            g = g / grad_scale.to(math)
        if maximize:
            g = -g
        if weight_decay != 0 and not decoupled_weight_decay:
            g = g + weight_decay * p
        if weight_decay != 0 and decoupled_weight_decay:
            p = p * (1 - lr * weight_decay)
        m = beta1 * exp_avg.to(math) + (1 - beta1) * g
        v = beta2 * exp_avg_sq.to(math) + (1 - beta2) * g * g
        vhat = v
        if amsgrad:
            vmax = torch.maximum(max_exp_avg_sqs[i].to(math), v)
            vhat = vmax
        denom = torch.sqrt(vhat) / bias_correction2_sqrt + eps
        p = p - step_size * (m / denom)

        updates = [(exp_avg, m), (exp_avg_sq, v), (param, p)]
        if amsgrad:
            updates.append((max_exp_avg_sqs[i], vmax))
        if master is not None:
            updates.append((master, p))
        for target, value in updates:
            if found_inf is not None:
                value = torch.where(found_inf.reshape(()).to(torch.bool), target.to(math), value)
            target.copy_(value)
