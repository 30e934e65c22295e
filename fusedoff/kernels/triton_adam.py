"""Triton Adam/AdamW: the ``triton`` backend of ``fusedoff.ops.adam_step_``.

The math is that of ``csrc/include/fusedoff/adam.h`` (its header comment states the update), per
element in fp32 whatever the storage dtypes. This module mirrors it line for line: ``_adam_scalars`` is
``adam_scalars`` (the per-tensor scalars, with maximize, weight decay and the bias corrections folded
in so that no element pays a branch) and ``_adam_update`` is ``adam_update`` (one element). Change
one, change the other, and ``fusedoff/kernels/reference.py``.

How the mirror stays faithful to the C++ (the CPU and CUDA kernels built from adam.h):

- Hyperparameters arrive as fp64 run-time arguments (annotated ``tl.float64``), like
  ``AdamHyperparams`` (doubles): the constants derived from them (1 - beta, 1 - lr * wd, the step
  size) are computed in fp64 and rounded once to fp32, as adam.h does (1 - fp32(0.999) is 1.3e-5
  off 0.001, relatively: a bias in every update). Only mode flags are ``tl.constexpr``, so a
  scheduler changing lr never recompiles.
- The step count is loaded in the kernel from its float32 tensor (no ``.item()``, no host sync), and
  the bias corrections are computed from it in fp64, as the C++ does in double, then rounded once to
  fp32. Triton has no portable ``pow`` (libdevice's is CUDA/HIP-only and the interpreter has none),
  so ``pow(beta, t)`` is ``exp2(t * log2(beta))`` in fp64 (``triton_common.fp64_pow``, whose
  docstring bounds its error): after the rounding to fp32 it agrees with C++'s ``pow``.
  fp32 would not do: near t = 1 the cancellation in ``1 - beta2^t`` turns one fp32 ulp of
  ``beta2^t`` (6e-8) into a relative error of 6e-8 / (1 - beta2) in the bias correction, i.e. 6e-5
  for beta2 = 0.999 and 6e-4 for 0.9999.
- fp32 divisions and the square root use ``tl.div_rn`` / ``tl.sqrt_rn`` (IEEE round-to-nearest, like
  ``/`` and ``sqrtf`` in C++): Triton's plain ``/`` and ``tl.sqrt`` lower to approximate
  instructions on NVIDIA GPUs (``div.full.f32``, ``sqrt.approx.ftz.f32`` in triton 3.8's sm_90 PTX).
  A compiled kernel may contract a multiply and an add into an FMA (Triton's default,
  ``enable_fp_fusion``), where the C++ kernels never do (``-ffp-contract=off`` and nvcc's
  ``--fmad=false``: [note: one rounding everywhere] in ``fusedoff/_build.py``), so on a GPU this
  backend agrees with the others to about an ulp, not bit for bit. Triton's interpreter contracts
  nothing.
- Loads upcast to fp32 in registers; stores round to nearest even (Triton's default fp downcast;
  under the interpreter, bf16 is rounded in integer arithmetic, see ``triton_common.round_to_bf16``).
  With master weights (``MASTER``: fp32, or "split"/"split8" low bits beside a bf16 param), the
  master is the parameter the math updates and the param receives its rounding: the
  ``load_weights``/``store_weights`` of ``triton_common``, a mirror of master.h.
- ``found_inf`` is loaded in the kernel: where it is non-zero every load and store is masked off, so
  nothing changes and the host never waits for the device. ``grad_scale`` is loaded likewise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusedoff.hyperparameters import AdamHyperparameters
from fusedoff.kernels.triton_common import (
    BLOCK_SIZE,
    INTERPRETED,
    NUM_WARPS,
    check_call_device,
    check_param_and_grad,
    check_state,
    check_step,
    fp64_pow,
    load_grad_scale,
    load_weights,
    master_mode,
    master_storage_dtype,
    program_block,
    store_weights,
)


@triton.jit
def _adam_scalars(lr, beta1, beta2, eps, weight_decay, step, DECOUPLED_WEIGHT_DECAY: tl.constexpr,
                  MAXIMIZE: tl.constexpr):
    """``adam_scalars`` of adam.h: the scalars that depend on one tensor's step count."""
    # fp64 like AdamHyperparams. (`tl.full` is a no-op on the fp64 arguments of a compiled kernel;
    # the interpreter passes Python floats through, which would otherwise become fp32 constants.)
    lr = tl.full((), lr, tl.float64)
    beta1 = tl.full((), beta1, tl.float64)
    beta2 = tl.full((), beta2, tl.float64)
    eps = tl.full((), eps, tl.float64)
    weight_decay = tl.full((), weight_decay, tl.float64)
    t = step.to(tl.float64)
    if MAXIMIZE:
        grad_sign = -1.0
    else:
        grad_sign = 1.0
    if DECOUPLED_WEIGHT_DECAY:
        l2_decay = 0.0
        decay_factor = (1.0 - lr * weight_decay).to(tl.float32)
    else:
        l2_decay = weight_decay.to(tl.float32)
        decay_factor = 1.0
    beta1_f = beta1.to(tl.float32)
    one_minus_beta1 = (1.0 - beta1).to(tl.float32)
    beta2_f = beta2.to(tl.float32)
    one_minus_beta2 = (1.0 - beta2).to(tl.float32)
    step_size = (lr / (1.0 - fp64_pow(beta1, t))).to(tl.float32)
    bias_correction2_sqrt = tl.sqrt(1.0 - fp64_pow(beta2, t)).to(tl.float32)  # fp64 sqrt is IEEE
    eps = eps.to(tl.float32)
    return (grad_sign, l2_decay, decay_factor, beta1_f, one_minus_beta1, beta2_f, one_minus_beta2, step_size,
            bias_correction2_sqrt, eps)


@triton.jit
def _adam_update(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, grad_scale, s, AMSGRAD: tl.constexpr):
    """``adam_update`` of adam.h: one element (here a block of them), all fp32; ``s`` is ``_adam_scalars``."""
    grad_sign, l2_decay, decay_factor, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, \
        bias_correction2_sqrt, eps = s
    g = grad_sign * tl.div_rn(grad, grad_scale)
    g = g + l2_decay * param
    param = param * decay_factor
    exp_avg = beta1 * exp_avg + one_minus_beta1 * g
    exp_avg_sq = beta2 * exp_avg_sq + one_minus_beta2 * g * g
    vhat = exp_avg_sq
    if AMSGRAD:
        max_exp_avg_sq = tl.maximum(max_exp_avg_sq, exp_avg_sq)  # NaN-ignoring, like fmaxf
        vhat = max_exp_avg_sq
    denom = tl.div_rn(tl.sqrt_rn(vhat), bias_correction2_sqrt) + eps
    param = param - step_size * tl.div_rn(exp_avg, denom)
    return param, exp_avg, exp_avg_sq, max_exp_avg_sq


@triton.jit
def _adam_kernel(
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    max_exp_avg_sq_ptr,  # None unless AMSGRAD
    master_ptr,  # None unless MASTER
    step_ptr,
    grad_scale_ptr,  # None unless HAS_GRAD_SCALE
    found_inf_ptr,  # None unless HAS_FOUND_INF
    numel,
    lr: tl.float64,
    beta1: tl.float64,
    beta2: tl.float64,
    eps: tl.float64,
    weight_decay: tl.float64,
    AMSGRAD: tl.constexpr,
    MASTER: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    DECOUPLED_WEIGHT_DECAY: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    INDEX_64: tl.constexpr,
    ROUND_BF16_IN_SOFTWARE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One tensor's Adam step over BLOCK_SIZE elements per program (the loop of csrc/cpu/adam_cpu.cpp)."""
    pid, offsets, mask = program_block(numel, found_inf_ptr, HAS_FOUND_INF, INDEX_64, BLOCK_SIZE)
    grad_scale = load_grad_scale(grad_scale_ptr, HAS_GRAD_SCALE)
    step = tl.load(step_ptr)
    s = _adam_scalars(lr, beta1, beta2, eps, weight_decay, step, DECOUPLED_WEIGHT_DECAY, MAXIMIZE)

    p = load_weights(param_ptr, master_ptr, offsets, mask, MASTER)
    grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
    m = tl.load(exp_avg_ptr + offsets, mask=mask)
    v = tl.load(exp_avg_sq_ptr + offsets, mask=mask)
    if AMSGRAD:
        vmax = tl.load(max_exp_avg_sq_ptr + offsets, mask=mask)
    else:
        vmax = 0.0

    p, m, v, vmax = _adam_update(p, grad, m, v, vmax, grad_scale, s, AMSGRAD)

    tl.store(exp_avg_ptr + offsets, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, v, mask=mask)
    if AMSGRAD:
        tl.store(max_exp_avg_sq_ptr + offsets, vmax, mask=mask)
    store_weights(param_ptr, master_ptr, offsets, p, mask, step, MASTER, ROUND_BF16_IN_SOFTWARE)


def _check_call(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, steps, amsgrad,
                grad_scale, found_inf) -> int:
    """The checks of ``describe_adam_call`` in csrc/ops.cpp, all made before anything is written;
    returns the call's MASTER."""
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(steps) == n):
        raise ValueError("fusedoff: params, grads, exp_avgs, exp_avg_sqs and steps must have the same length")
    if len(max_exp_avg_sqs) != (n if amsgrad else 0):
        raise ValueError("fusedoff: max_exp_avg_sqs must have one tensor per parameter with amsgrad, none without")
    if master_params and len(master_params) != n:
        raise ValueError("fusedoff: master_params must be empty or have one tensor per parameter")
    master = master_mode(master_params, params)
    if n == 0:
        return master
    device = check_call_device(params, grads, grad_scale, found_inf, __name__)
    for i, (p, g) in enumerate(zip(params, grads)):
        check_param_and_grad(i, p, g, params, grads, device)
        check_state(exp_avgs[i], p, "exp_avgs", i)
        check_state(exp_avg_sqs[i], p, "exp_avg_sqs", i)
        if amsgrad:
            check_state(max_exp_avg_sqs[i], p, "max_exp_avg_sqs", i)
        if master_params:
            check_state(master_params[i], p, "master_params", i, master_storage_dtype(master))
        check_step(steps[i], i, device)
    return master


def adam_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    max_exp_avg_sqs: Sequence[Tensor],
    master_params: Sequence[Tensor],
    steps: Sequence[Tensor],
    *,
    hyper: AdamHyperparameters,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """In-place Adam/AdamW step, one kernel launch per non-empty tensor; the arguments are those of
    ``fusedoff.ops.adam_step_`` (``steps`` hold each tensor's count after this step's increment)."""
    amsgrad = hyper.amsgrad
    master = _check_call(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, steps, amsgrad,
                         grad_scale, found_inf)
    if not params:
        return
    device = params[0].device
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with guard:
        for i, param in enumerate(params):
            numel = param.numel()
            if numel == 0:
                continue
            num_blocks = triton.cdiv(numel, BLOCK_SIZE)
            _adam_kernel[(num_blocks,)](
                param,
                grads[i],
                exp_avgs[i],
                exp_avg_sqs[i],
                max_exp_avg_sqs[i] if amsgrad else None,
                master_params[i] if master_params else None,
                steps[i],
                grad_scale,
                found_inf,
                numel,
                hyper.lr,
                hyper.beta1,
                hyper.beta2,
                hyper.eps,
                hyper.weight_decay,
                AMSGRAD=amsgrad,
                MASTER=master,
                HAS_GRAD_SCALE=grad_scale is not None,
                HAS_FOUND_INF=found_inf is not None,
                DECOUPLED_WEIGHT_DECAY=hyper.decoupled_weight_decay,
                MAXIMIZE=hyper.maximize,
                # 32-bit offsets unless the last block's would overflow.
                INDEX_64=num_blocks * BLOCK_SIZE > 2**31 - 1,
                ROUND_BF16_IN_SOFTWARE=INTERPRETED and param.dtype == torch.bfloat16,
                BLOCK_SIZE=BLOCK_SIZE,
                num_warps=NUM_WARPS,
            )
