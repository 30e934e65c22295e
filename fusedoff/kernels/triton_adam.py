"""Triton Adam/AdamW: the ``triton`` backend of ``fusedoff.ops.adam_step_``.

Per element, in fp32 whatever the storage dtypes, with t the tensor's step count after increment:

    g = grad / grad_scale;  if maximize: g = -g
    Adam (L2):         g = g + wd * p
    AdamW (decoupled): p = p * (1 - lr * wd)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    vhat = amsgrad ? (vmax = max(vmax, v)) : v
    p = p - (lr / (1 - beta1^t)) * m / (sqrt(vhat) / sqrt(1 - beta2^t) + eps)

This is a line-for-line mirror of ``csrc/include/fusedoff/adam.h``: ``_adam_scalars`` is
``adam_scalars`` (the per-tensor scalars, with maximize, weight decay and the bias corrections folded
in so that no element pays a branch) and ``_adam_update`` is ``adam_update`` (one element). Change
one, change the other, and ``fusedoff/kernels/reference.py``.

How the mirror stays faithful to the C++ (the CPU and CUDA kernels built from adam.h):

- Hyperparameters arrive as fp64 run-time arguments (annotated ``tl.float64``), like
  ``AdamHyperparams`` (doubles): the constants derived from them (1 - beta, 1 - lr * wd, the step
  size) are computed in fp64 and rounded once to fp32, as adam.h does (1 - fp32(0.999) would be
  1.3e-5 off, a bias in every update). Only mode flags are ``tl.constexpr``, so a scheduler changing
  lr never recompiles.
- The step count is loaded in the kernel from its float32 tensor (no ``.item()``, no host sync), and
  the bias corrections are computed from it in fp64, as the C++ does in double, then rounded once to
  fp32. Triton has no portable ``pow`` (libdevice's is CUDA/HIP-only and the interpreter has none),
  so ``pow(beta, t)`` is ``exp2(t * log2(beta))`` in fp64 (``_pow``). With x = t * |log2 beta| its
  relative error is about x * 2^-52, so the absolute error of ``1 - beta^t`` is at most
  ~ x * 2^-x * 2^-52 < 2^-52 for every t, and where ``1 - beta^t`` is small (t * (1 - beta) << 1)
  its relative error stays ~2^-52: after the rounding to fp32 it agrees with C++'s ``pow``.
  fp32 would not do: near t = 1 the cancellation in ``1 - beta2^t`` turns one fp32 ulp of
  ``beta2^t`` (6e-8) into a relative error of 6e-8 / (1 - beta2) in the bias correction, i.e. 6e-5
  for beta2 = 0.999 and 6e-4 for 0.9999. On NVIDIA the fp64 exp2/log2 inline libdevice's code (no
  call; checked in the sm_90 PTX); it is a few dozen scalar operations per program, free next to
  the memory traffic.
- fp32 divisions and the square root use ``tl.div_rn`` / ``tl.sqrt_rn`` (IEEE round-to-nearest, like
  ``/`` and ``sqrtf`` in C++): Triton's plain ``/`` and ``tl.sqrt`` lower to approximate
  instructions on NVIDIA GPUs (``div.full.f32``, ``sqrt.approx.ftz.f32`` in triton 3.8's sm_90 PTX).
  As in nvcc's default build, multiply-adds may be contracted to FMAs, so the backends agree to
  about an ulp, not bit for bit.
- Loads upcast to fp32 in registers; stores round to nearest even (Triton's default fp downcast;
  under the interpreter, bf16 is rounded in integer arithmetic, see ``_round_to_bf16``).
  With master weights, the fp32 master is the parameter the math updates and the param receives its
  rounded copy.
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

# NOTE: 1024 elements x 4 warps is the usual shape for a memory-bound elementwise kernel (8 elements
# per thread: two 16-byte loads per fp32 stream). Not measured yet: no GPU was at hand.
BLOCK_SIZE = 1024
NUM_WARPS = 4

_STORAGE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _pow(base, exponent):
    """``pow`` for fp64 ``base`` in [0, 1] and ``exponent`` >= 0; see the module docstring."""
    return tl.exp2(exponent * tl.log2(base))


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
    step_size = (lr / (1.0 - _pow(beta1, t))).to(tl.float32)
    bias_correction2_sqrt = tl.sqrt(1.0 - _pow(beta2, t)).to(tl.float32)  # fp64 sqrt is IEEE
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
def _round_to_bf16(x):
    """fp32 -> bf16, round to nearest even, in integer arithmetic (NaN stays NaN).

    NOTE: only for the interpreter. Triton 3.8's interpreter truncates fp32 -> bf16 casts: 99,987 of
    200,000 random fp32 bit patterns came out one ulp low, which over 20 Adam steps puts bf16 params
    ~10 ulps off. Compiled kernels cast with ``cvt.rn.bf16.f32`` and do not use this.
    """
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _adam_kernel(
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    max_exp_avg_sq_ptr,  # None unless AMSGRAD
    master_ptr,  # None unless HAS_MASTER
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
    HAS_MASTER: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    DECOUPLED_WEIGHT_DECAY: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    INDEX_64: tl.constexpr,
    ROUND_BF16_IN_SOFTWARE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One tensor's Adam step over BLOCK_SIZE elements per program (the loop of csrc/cpu/adam_cpu.cpp)."""
    pid = tl.program_id(0)
    if INDEX_64:
        pid = pid.to(tl.int64)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    if HAS_FOUND_INF:
        # AMP overflow: the tensor counts as empty, so every access below is masked off and nothing
        # is written. (Not `mask & (found_inf == 0)`: triton 3.8's interpreter types a scalar
        # comparison like its fp32 operands, and broadcasting it for the `&` then fails.)
        numel = tl.where(tl.load(found_inf_ptr) == 0.0, numel, 0)
    mask = offsets < numel
    if HAS_GRAD_SCALE:
        grad_scale = tl.load(grad_scale_ptr)
    else:
        grad_scale = 1.0
    s = _adam_scalars(lr, beta1, beta2, eps, weight_decay, tl.load(step_ptr), DECOUPLED_WEIGHT_DECAY, MAXIMIZE)

    if HAS_MASTER:
        p = tl.load(master_ptr + offsets, mask=mask)
    else:
        p = tl.load(param_ptr + offsets, mask=mask).to(tl.float32)
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
    if HAS_MASTER:
        tl.store(master_ptr + offsets, p, mask=mask)
    if ROUND_BF16_IN_SOFTWARE:
        tl.store(param_ptr + offsets, _round_to_bf16(p), mask=mask)
    else:
        tl.store(param_ptr + offsets, p.to(param_ptr.dtype.element_ty), mask=mask)


# Triton picks the interpreter when a kernel is decorated, i.e. when this module is imported, so
# the kernel's type (not the environment now) says whether it is interpreted (and runs CPU tensors).
INTERPRETED = not isinstance(_adam_kernel, triton.runtime.jit.JITFunction)


def _check_state(state: Tensor, param: Tensor, what: str, index: int) -> None:
    if state.dtype != torch.float32:
        raise ValueError(f"fusedoff: {what}[{index}] must be float32, got {state.dtype}")
    if state.device != param.device:
        raise ValueError(f"fusedoff: {what}[{index}] is on {state.device} but its parameter is on {param.device}")
    if not state.is_contiguous():
        raise ValueError(f"fusedoff: {what}[{index}] must be contiguous")
    if state.numel() != param.numel():
        raise ValueError(
            f"fusedoff: {what}[{index}] has {state.numel()} elements but its parameter has {param.numel()}"
        )


def _check_scalar(t: Tensor | None, device: torch.device, what: str) -> None:
    if t is None:
        return
    if t.numel() != 1 or t.dtype != torch.float32:
        raise ValueError(f"fusedoff: {what} must be a one-element float32 tensor")
    if t.device != device:
        raise ValueError(f"fusedoff: {what} is on {t.device} but the parameters are on {device}")


def _check_call(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, steps, amsgrad,
                grad_scale, found_inf) -> None:
    """The checks of ``describe_adam_call`` in csrc/ops.cpp, all made before anything is written."""
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(steps) == n):
        raise ValueError("fusedoff: params, grads, exp_avgs, exp_avg_sqs and steps must have the same length")
    if len(max_exp_avg_sqs) != (n if amsgrad else 0):
        raise ValueError("fusedoff: max_exp_avg_sqs must have one tensor per parameter with amsgrad, none without")
    if master_params and len(master_params) != n:
        raise ValueError("fusedoff: master_params must be empty or have one tensor per parameter")
    if n == 0:
        return
    device = params[0].device
    for what, first in (("params", params[0]), ("grads", grads[0])):
        if first.dtype not in _STORAGE_DTYPES:
            raise ValueError(f"fusedoff: {what} must be float32, float16 or bfloat16, got {first.dtype}")
    if device.type == "cpu" and not INTERPRETED:
        raise ValueError(
            "fusedoff: the triton backend needs GPU tensors (CPU tensors only with TRITON_INTERPRET=1 set "
            "before fusedoff.kernels.triton_adam is imported)"
        )
    _check_scalar(grad_scale, device, "grad_scale")
    _check_scalar(found_inf, device, "found_inf")
    for i, (p, g) in enumerate(zip(params, grads)):
        if p.device != device:
            raise ValueError(
                f"fusedoff: all params of one call must be on one device; params[{i}] is on {p.device}, "
                f"params[0] on {device}"
            )
        if p.dtype != params[0].dtype:
            raise ValueError("fusedoff: all params of one call must share a dtype")
        if g.dtype != grads[0].dtype:
            raise ValueError("fusedoff: all grads of one call must share a dtype")
        if g.layout != torch.strided:
            raise ValueError(f"fusedoff: sparse gradients are not supported (grads[{i}] is {g.layout})")
        if not (p.is_contiguous() and g.is_contiguous()):
            raise ValueError(f"fusedoff: params[{i}] and grads[{i}] must be contiguous")
        if g.device != device:
            raise ValueError(f"fusedoff: grads[{i}] is on {g.device} but its parameter is on {device}")
        if g.numel() != p.numel():
            raise ValueError(f"fusedoff: grads[{i}] has {g.numel()} elements but its parameter has {p.numel()}")
        _check_state(exp_avgs[i], p, "exp_avgs", i)
        _check_state(exp_avg_sqs[i], p, "exp_avg_sqs", i)
        if amsgrad:
            _check_state(max_exp_avg_sqs[i], p, "max_exp_avg_sqs", i)
        if master_params:
            _check_state(master_params[i], p, "master_params", i)
        step = steps[i]
        if step.numel() != 1 or step.dtype != torch.float32 or step.device != device:
            raise ValueError(f"fusedoff: steps[{i}] must be a one-element float32 tensor on {device}")


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
    """In-place Adam/AdamW step, one kernel launch per non-empty tensor; the arguments are those of
    ``fusedoff.ops.adam_step_`` (``steps`` hold each tensor's count after this step's increment)."""
    _check_call(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, steps, amsgrad,
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
                float(lr),
                float(beta1),
                float(beta2),
                float(eps),
                float(weight_decay),
                AMSGRAD=bool(amsgrad),
                HAS_MASTER=bool(master_params),
                HAS_GRAD_SCALE=grad_scale is not None,
                HAS_FOUND_INF=found_inf is not None,
                DECOUPLED_WEIGHT_DECAY=bool(decoupled_weight_decay),
                MAXIMIZE=bool(maximize),
                # 32-bit offsets unless the last block's would overflow.
                INDEX_64=num_blocks * BLOCK_SIZE > 2**31 - 1,
                ROUND_BF16_IN_SOFTWARE=INTERPRETED and param.dtype == torch.bfloat16,
                BLOCK_SIZE=BLOCK_SIZE,
                num_warps=NUM_WARPS,
            )
