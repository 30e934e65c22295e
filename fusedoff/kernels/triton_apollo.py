"""Triton Apollo: the ``triton`` backend of ``fusedoff.ops.apollo_step_``.

The math is that of ``csrc/include/fusedoff/apollo.h`` (its header comment states one step of one
tensor), per element in fp32 whatever the storage dtypes. Its sums, max|y| and mean D run over the
whole tensor, so a step is split into phases, each a call over tensors or contiguous ranges of
tensors (ranges of one tensor share its ``stats``, five float64: sum d^4, sum y*d, sum B*d^2, max|y|,
sum D):

    'reduce'   adds the range's sum d^4, sum y*d, sum B*d^2 into stats[0:3], max|y| into stats[3]
    'full'     updates m, B, d and p (every decay but 'stable')
    'moments'  'stable' only: updates m and B, adds the range's sum D into stats[4]
    'finish'   'stable' only: writes d and p with the decay coefficient wd / (stats[4] / total_numel)

This module mirrors apollo.h line for line, phase by phase as ``csrc/cpu/apollo_cpu.cpp`` runs it:
``_apollo_step_scalars`` is ``apollo_step_scalars``, ``_apollo_grad`` ``apollo_grad``, ``_nan_max``
``nan_max``, ``_apollo_reduce_element`` ``apollo_reduce_element``, ``_apollo_step_constants``
``apollo_step_constants``, ``_apollo_decay_coefficient`` ``apollo_decay_coefficient``,
``_apollo_rebound`` ``apollo_rebound``, ``_apollo_update_moments`` ``apollo_update_moments`` and
``_apollo_finish_element`` ``apollo_finish_element``. Change one, change the other, and
``fusedoff/kernels/reference.py``.

How it stays faithful to the C++ (the conventions of ``triton_adam.py``):

- Hyperparameters are fp64 run-time arguments, as in ``ApolloHyperparams``; curr_lr, alpha and the
  step constants (den, delta, R, eps / alpha, the decay coefficient) are computed in fp64 from the
  float64 stats and the step count, both loaded in the kernel (no ``.item()``, no host sync), and
  rounded once to fp32; the step constants take the unrounded alpha, as apollo.h's take
  ``alpha_exact``. ``beta^t`` is ``triton_common.fp64_pow``. Only mode flags are
  ``tl.constexpr``: a scheduler changing lr never recompiles.
- fp32 divisions use ``tl.div_rn`` (IEEE, like ``/`` in C++; Triton's plain ``/`` is approximate on
  NVIDIA); fp64 ``/`` and ``tl.sqrt`` are IEEE. A compiled kernel may contract multiply-adds to FMAs
  (Triton's default), where the C++ kernels never do ([note: one rounding everywhere] in
  ``fusedoff/_build.py``), so on a GPU this backend agrees with the others to about an ulp, not bit
  for bit.
- max|y| and D propagate NaN like ``nan_max`` (``tl.maximum`` drops it by default, ``tl.max``
  promises nothing): a block counts its NaNs and reports NaN if there is one, as ``ReduceRange``
  does, and so does the combine.
- Reductions are deterministic, without atomics: each program sums its block in fp32 into a scratch
  row, and ``_apollo_combine_kernel`` (one program per tensor) adds the rows in float64 in a fixed
  order into ``stats``, as apollo_cpu.cpp adds its block partials in double.
- Loads upcast to fp32 in registers; stores round to nearest even (``triton_common.round_to_bf16``
  under the interpreter). With master weights (``MASTER``: fp32, or "split"/"split8" low bits beside
  a bf16 param) the master is the parameter the math updates and the param its rounding:
  ``triton_common``'s ``load_weights``/``store_weights``, a mirror of master.h.
- ``found_inf`` is loaded in the kernels: where it is non-zero every access is masked off and
  ``stats`` is not written, so nothing changes (to the bit) and the host never waits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusedoff.hyperparameters import ApolloHyperparameters
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

# The enums of apollo.h (ApolloDecay, ApolloPhase) and the stats layout (ApolloStat).
DECAY_NONE, DECAY_L2, DECAY_DECOUPLED, DECAY_STABLE = 0, 1, 2, 3
PHASE_REDUCE, PHASE_FULL, PHASE_MOMENTS, PHASE_FINISH = 0, 1, 2, 3
_PHASES = {"reduce": PHASE_REDUCE, "full": PHASE_FULL, "moments": PHASE_MOMENTS, "finish": PHASE_FINISH}
_DECAYS = {"L2": DECAY_L2, "decoupled": DECAY_DECOUPLED, "stable": DECAY_STABLE}
NUM_STATS = 5

_SIGMA = tl.constexpr(0.01)  # kApolloSigma
_NAN = tl.constexpr(float("nan"))
_L2: tl.constexpr = tl.constexpr(DECAY_L2)
_DECOUPLED: tl.constexpr = tl.constexpr(DECAY_DECOUPLED)
_STABLE: tl.constexpr = tl.constexpr(DECAY_STABLE)
_MOMENTS: tl.constexpr = tl.constexpr(PHASE_MOMENTS)
_FINISH: tl.constexpr = tl.constexpr(PHASE_FINISH)

# Rows of block partials that _apollo_combine_kernel adds per iteration (a 256 x 4 fp64 accumulator:
# 16 registers per thread with 4 warps).
COMBINE_ROWS = 256


# ---- the math of apollo.h ------------------------------------------------------------------------


@triton.jit
def _apollo_step_scalars(lr, base_lr, init_lr, warmup, beta, weight_decay, step, DECAY: tl.constexpr):
    """``apollo_step_scalars``: (alpha, curr_lr, l2_decay) from the tensor's step count, in fp64.

    alpha stays fp64 here (apollo.h's ``alpha_exact``): the step constants take it as it is, the m
    update its rounding to fp32 (apollo.h's ``alpha``).
    """
    # fp64 like ApolloHyperparams (`tl.full` is a no-op on the fp64 arguments of a compiled kernel;
    # the interpreter passes Python floats through, which would otherwise become fp32 constants).
    lr = tl.full((), lr, tl.float64)
    base_lr = tl.full((), base_lr, tl.float64)
    init_lr = tl.full((), init_lr, tl.float64)
    warmup = tl.full((), warmup, tl.float64)
    beta = tl.full((), beta, tl.float64)
    t = step.to(tl.float64)
    k = t - 1.0
    warming_up = k < warmup
    # A select, not a branch, computes both sides: divide by 1 where the quotient is not used, so
    # that warmup = 0 does not make 0 / 0 (the interpreter warns about it).
    warmup = tl.where(warming_up, warmup, 1.0)
    curr_lr = tl.where(warming_up, (base_lr - init_lr) * k / warmup + init_lr, lr)
    alpha = (1.0 - beta) / (1.0 - fp64_pow(beta, t))
    if DECAY == _L2:
        l2_decay = tl.full((), weight_decay, tl.float64).to(tl.float32)
    else:
        l2_decay = 0.0
    return alpha, curr_lr.to(tl.float32), l2_decay


@triton.jit
def _apollo_grad(grad, param, grad_scale, l2_decay):
    """``apollo_grad``: the gradient the step sees, unscaled, with L2 decay added."""
    return tl.div_rn(grad, grad_scale) + l2_decay * param


@triton.jit
def _nan_max(acc, x):
    """``nan_max``: max that propagates NaN like torch.maximum (``tl.maximum`` drops it)."""
    return tl.where((x > acc) | (x != x), x, acc)


@triton.jit
def _apollo_reduce_element(g, exp_avg_grad, hessian, update):
    """``apollo_reduce_element``: one element's terms of the four partials (summed by the caller)."""
    y = g - exp_avg_grad
    d2 = update * update
    return d2 * d2, y * update, hessian * d2, tl.abs(y)


@triton.jit
def _apollo_step_constants(eps, alpha, stats_ptr, BELIEF: tl.constexpr):
    """``apollo_step_constants``: (den, delta, R, rebound shift) from the whole tensor's stats and the
    fp64 alpha, in fp64."""
    eps = tl.full((), eps, tl.float64)
    if BELIEF:
        e = eps
    else:
        e = eps / _SIGMA
    den = tl.sqrt(tl.sqrt(tl.load(stats_ptr + 0))) + e  # fp64 sqrt is IEEE
    delta = ((-alpha * tl.load(stats_ptr + 1) - tl.load(stats_ptr + 2)) / (den * den)).to(tl.float32)
    if BELIEF:
        rebound_floor = tl.load(stats_ptr + 3).to(tl.float32)
        rebound_shift = (eps / alpha).to(tl.float32)
    else:
        rebound_floor = tl.full((), _SIGMA, tl.float64).to(tl.float32)
        rebound_shift = 0.0
    return den.to(tl.float32), delta, rebound_floor, rebound_shift


@triton.jit
def _apollo_decay_coefficient(weight_decay, stats_ptr, total_numel, DECAY: tl.constexpr):
    """``apollo_decay_coefficient``: wd ('decoupled'), wd / mean D ('stable'), else 0."""
    weight_decay = tl.full((), weight_decay, tl.float64)
    if DECAY == _DECOUPLED:
        decay = weight_decay.to(tl.float32)
    elif DECAY == _STABLE:
        total_numel = tl.full((), total_numel, tl.float64)
        decay = (weight_decay / (tl.load(stats_ptr + 4) / total_numel)).to(tl.float32)
    else:
        decay = 0.0
    return decay


@triton.jit
def _apollo_rebound(hessian, rebound_floor, rebound_shift):
    """``apollo_rebound``: D, the rebounded curvature, from the new B."""
    return _nan_max(rebound_floor, tl.abs(hessian)) + rebound_shift


@triton.jit
def _apollo_update_moments(g, exp_avg_grad, hessian, update, alpha, den, delta):
    """``apollo_update_moments``: the new m and B."""
    y = g - exp_avg_grad
    exp_avg_grad = exp_avg_grad + alpha * y
    dh = tl.div_rn(update, den)
    v = dh * dh
    hessian = hessian + delta * v
    return exp_avg_grad, hessian


@triton.jit
def _apollo_finish_element(param, exp_avg_grad, hessian, decay, curr_lr, rebound_floor, rebound_shift):
    """``apollo_finish_element``: the new p and d from the new m and B."""
    u = tl.div_rn(exp_avg_grad, _apollo_rebound(hessian, rebound_floor, rebound_shift))
    u = u + decay * param
    update = u
    param = param - curr_lr * u
    return param, update


# ---- kernels: the phases of csrc/cpu/apollo_cpu.cpp ----------------------------------------------


@triton.jit
def _apollo_reduce_kernel(
    param_ptr,  # read with L2 decay only
    grad_ptr,
    exp_avg_grad_ptr,
    hessian_ptr,
    update_ptr,
    master_ptr,  # None unless MASTER
    step_ptr,
    grad_scale_ptr,  # None unless HAS_GRAD_SCALE
    found_inf_ptr,  # None unless HAS_FOUND_INF
    partials_ptr,  # fp32, 4 per program: sum d^4, sum y*d, sum B*d^2, max|y|
    numel,
    lr: tl.float64,
    base_lr: tl.float64,
    init_lr: tl.float64,
    warmup_steps: tl.float64,  # not `warmup`: that name is a keyword of Triton's launcher
    beta: tl.float64,
    weight_decay: tl.float64,
    DECAY: tl.constexpr,
    MASTER: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    INDEX_64: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """'reduce', pass 1 (``ReduceRange``): this block's partials of the four sums, in fp32."""
    pid, offsets, mask = program_block(numel, found_inf_ptr, HAS_FOUND_INF, INDEX_64, BLOCK_SIZE)
    grad_scale = load_grad_scale(grad_scale_ptr, HAS_GRAD_SCALE)
    alpha, curr_lr, l2_decay = _apollo_step_scalars(lr, base_lr, init_lr, warmup_steps, beta, weight_decay,
                                                    tl.load(step_ptr), DECAY)
    if DECAY == _L2:
        p = load_weights(param_ptr, master_ptr, offsets, mask, MASTER)
    else:
        p = 0.0
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    g = _apollo_grad(grad, p, grad_scale, l2_decay)
    m = tl.load(exp_avg_grad_ptr + offsets, mask=mask, other=0.0)
    b = tl.load(hessian_ptr + offsets, mask=mask, other=0.0)
    d = tl.load(update_ptr + offsets, mask=mask, other=0.0)

    d4, yd, bdd, abs_y = _apollo_reduce_element(g, m, b, d)
    abs_y = tl.where(mask, abs_y, 0.0)
    has_nan = tl.sum((abs_y != abs_y).to(tl.int32)) > 0
    max_abs_y = tl.where(has_nan, _NAN, tl.max(tl.where(abs_y != abs_y, 0.0, abs_y)))
    row = partials_ptr + pid * 4
    tl.store(row + 0, tl.sum(tl.where(mask, d4, 0.0)))
    tl.store(row + 1, tl.sum(tl.where(mask, yd, 0.0)))
    tl.store(row + 2, tl.sum(tl.where(mask, bdd, 0.0)))
    tl.store(row + 3, max_abs_y)


@triton.jit
def _apollo_apply_kernel(
    param_ptr,
    grad_ptr,  # unused by 'finish'
    exp_avg_grad_ptr,
    hessian_ptr,
    update_ptr,
    master_ptr,  # None unless MASTER
    step_ptr,
    stats_ptr,  # fp64, the whole tensor's NUM_STATS
    grad_scale_ptr,  # None unless HAS_GRAD_SCALE
    found_inf_ptr,  # None unless HAS_FOUND_INF
    partials_ptr,  # 'moments': fp32, one sum D per program; else None
    numel,
    total_numel: tl.float64,
    lr: tl.float64,
    base_lr: tl.float64,
    init_lr: tl.float64,
    warmup_steps: tl.float64,  # not `warmup`: that name is a keyword of Triton's launcher
    beta: tl.float64,
    eps: tl.float64,
    weight_decay: tl.float64,
    PHASE: tl.constexpr,
    BELIEF: tl.constexpr,
    DECAY: tl.constexpr,
    MASTER: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    INDEX_64: tl.constexpr,
    ROUND_BF16_IN_SOFTWARE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """'full' and 'moments' (``ApplyRange``), 'finish' (``FinishRange``), from the reduced stats."""
    pid, offsets, mask = program_block(numel, found_inf_ptr, HAS_FOUND_INF, INDEX_64, BLOCK_SIZE)
    grad_scale = load_grad_scale(grad_scale_ptr, HAS_GRAD_SCALE)
    step = tl.load(step_ptr)
    alpha, curr_lr, l2_decay = _apollo_step_scalars(lr, base_lr, init_lr, warmup_steps, beta, weight_decay,
                                                    step, DECAY)
    den, delta, rebound_floor, rebound_shift = _apollo_step_constants(eps, alpha, stats_ptr, BELIEF)

    # 'moments' reads p only for L2 decay (which never runs it; the C++ loads it and adds 0 * p).
    if PHASE != _MOMENTS or DECAY == _L2:
        p = load_weights(param_ptr, master_ptr, offsets, mask, MASTER)
    else:
        p = 0.0
    m = tl.load(exp_avg_grad_ptr + offsets, mask=mask, other=0.0)
    b = tl.load(hessian_ptr + offsets, mask=mask, other=0.0)
    if PHASE != _FINISH:
        grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        g = _apollo_grad(grad, p, grad_scale, l2_decay)
        d = tl.load(update_ptr + offsets, mask=mask, other=0.0)
        m, b = _apollo_update_moments(g, m, b, d, alpha.to(tl.float32), den, delta)
        tl.store(exp_avg_grad_ptr + offsets, m, mask=mask)
        tl.store(hessian_ptr + offsets, b, mask=mask)

    if PHASE == _MOMENTS:
        rebounded = tl.where(mask, _apollo_rebound(b, rebound_floor, rebound_shift), 0.0)
        tl.store(partials_ptr + pid, tl.sum(rebounded))
    else:
        decay = _apollo_decay_coefficient(weight_decay, stats_ptr, total_numel, DECAY)
        p, d = _apollo_finish_element(p, m, b, decay, curr_lr, rebound_floor, rebound_shift)
        tl.store(update_ptr + offsets, d, mask=mask)
        store_weights(param_ptr, master_ptr, offsets, p, mask, step, MASTER, ROUND_BF16_IN_SOFTWARE)


@triton.jit
def _apollo_combine_kernel(
    partials_ptr,  # fp32, num_partials rows of 4 ('reduce') or 1 ('moments')
    stats_ptr,  # fp64, NUM_STATS
    found_inf_ptr,  # None unless HAS_FOUND_INF
    num_partials,
    REDUCE: tl.constexpr,  # 'reduce': rows of 4 into stats[0:4]; else 'moments': rows of 1 into stats[4]
    HAS_FOUND_INF: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Adds one tensor's block partials into its stats in float64, max|y| by ``nan_max``; one program.

    Deterministic: row r of the accumulator adds partials r, r + ROWS, r + 2 ROWS, ... in turn, then
    the rows are summed in a fixed tree. The sums accumulate (+=) and the max takes the max, so the
    ranges of one tensor may come in several calls.
    """
    width = 4 if REDUCE else 1  # compile-time
    first_stat = 0 if REDUCE else 4
    cols = tl.arange(0, 4)
    rows = tl.arange(0, ROWS)
    sums = tl.zeros((ROWS, 4), tl.float64)
    maxs = tl.zeros((ROWS, 4), tl.float32)
    nans = tl.zeros((ROWS, 4), tl.int32)
    # A while loop, not range(0, num_partials, ROWS): triton 3.6's interpreter turns a run-time
    # bound into a Python int with int() of a 1-element array, which numpy 2.4 refuses.
    start = 0
    while start < num_partials:
        r = start + rows
        mask = (r[:, None] < num_partials) & (cols[None, :] < width)
        x = tl.load(partials_ptr + r[:, None] * width + cols[None, :], mask=mask, other=0.0)
        sums += x.to(tl.float64)
        nans += (x != x).to(tl.int32)
        maxs = tl.maximum(maxs, tl.where(x != x, 0.0, x))
        start += ROWS
    total = tl.sum(sums, axis=0)
    max_abs_y = tl.where(tl.sum(nans, axis=0) > 0, _NAN, tl.max(maxs, axis=0)).to(tl.float64)

    num_writes = width
    if HAS_FOUND_INF:  # AMP overflow: stats stay as they are
        num_writes = tl.where(tl.load(found_inf_ptr) == 0.0, width, 0)
    old = tl.load(stats_ptr + first_stat + cols, mask=cols < width, other=0.0)
    if REDUCE:
        new = tl.where(cols == 3, _nan_max(old, max_abs_y), old + total)
    else:
        new = old + total
    tl.store(stats_ptr + first_stat + cols, new, mask=cols < num_writes)


# ---- the launcher ------------------------------------------------------------------------------


def _parse_modes(phase: str, rebound: str, weight_decay: float, weight_decay_type: str) -> tuple[int, bool, int]:
    """``parse_phase``, ``parse_rebound`` and ``parse_decay`` of csrc/ops.cpp, in that order."""
    if phase not in _PHASES:
        raise ValueError(f"fusedoff: phase must be 'reduce', 'full', 'moments' or 'finish', got {phase!r}")
    if rebound not in ("constant", "belief"):
        raise ValueError(f"fusedoff: rebound must be 'constant' or 'belief', got {rebound!r}")
    if weight_decay_type not in _DECAYS:
        raise ValueError(
            f"fusedoff: weight_decay_type must be 'L2', 'decoupled' or 'stable', got {weight_decay_type!r}"
        )
    decay = DECAY_NONE if weight_decay == 0.0 else _DECAYS[weight_decay_type]
    return _PHASES[phase], rebound == "belief", decay


def _check_call(params, grads, exp_avg_grads, approx_hessians, updates, master_params, steps, stats, total_numels,
                phase, rebound, weight_decay, weight_decay_type, grad_scale, found_inf) -> tuple[int, bool, int, int]:
    """The checks of ``describe_apollo_call`` in csrc/ops.cpp, all made before anything is written;
    returns the modes (phase, belief, decay, MASTER)."""
    n = len(params)
    if not (len(grads) == len(exp_avg_grads) == len(approx_hessians) == len(updates) == len(steps) == len(stats)
            == len(total_numels) == n):
        raise ValueError(
            "fusedoff: params, grads, exp_avg_grads, approx_hessians, updates, steps, stats and total_numels must "
            "have the same length"
        )
    if master_params and len(master_params) != n:
        raise ValueError("fusedoff: master_params must be empty or have one tensor per parameter")
    modes = (*_parse_modes(phase, rebound, weight_decay, weight_decay_type), master_mode(master_params, params))
    if n == 0:
        return modes
    device = check_call_device(params, grads, grad_scale, found_inf, __name__)
    for i, (p, g) in enumerate(zip(params, grads)):
        check_param_and_grad(i, p, g, params, grads, device)
        check_state(exp_avg_grads[i], p, "exp_avg_grads", i)
        check_state(approx_hessians[i], p, "approx_hessians", i)
        check_state(updates[i], p, "updates", i)
        if master_params:
            check_state(master_params[i], p, "master_params", i, master_storage_dtype(modes[-1]))
        check_step(steps[i], i, device)
        s = stats[i]
        if s.numel() != NUM_STATS or s.dtype != torch.float64 or s.device != device or not s.is_contiguous():
            raise ValueError(
                f"fusedoff: stats[{i}] must be a contiguous float64 tensor of {NUM_STATS} elements on {device}"
            )
        if total_numels[i] < p.numel():
            raise ValueError(
                f"fusedoff: total_numels[{i}] = {total_numels[i]} is smaller than the range's {p.numel()} elements"
            )
    return modes


def apollo_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avg_grads: Sequence[Tensor],
    approx_hessians: Sequence[Tensor],
    updates: Sequence[Tensor],
    master_params: Sequence[Tensor],
    steps: Sequence[Tensor],
    stats: Sequence[Tensor],
    total_numels: Sequence[int],
    *,
    phase: str,
    hyper: ApolloHyperparameters,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """One phase of an Apollo step, in place; the arguments are those of ``fusedoff.ops.apollo_step_``
    (``steps`` hold each tensor's count after this step's increment, ``stats`` its float64 sums).

    One launch per non-empty tensor, plus for 'reduce' and 'moments' a single-program launch that adds
    the tensor's block partials into its stats: the price of a deterministic reduction without
    atomics and without a host sync.
    """
    phase_id, belief, decay, stored_as = _check_call(params, grads, exp_avg_grads, approx_hessians, updates,
                                                     master_params, steps, stats, total_numels, phase, hyper.rebound,
                                                     hyper.weight_decay, hyper.weight_decay_type, grad_scale, found_inf)
    if not params:
        return
    device = params[0].device
    num_blocks = [triton.cdiv(p.numel(), BLOCK_SIZE) for p in params]
    partials = None
    if phase_id in (PHASE_REDUCE, PHASE_MOMENTS):
        width = 4 if phase_id == PHASE_REDUCE else 1
        partials = torch.empty(sum(num_blocks) * width, dtype=torch.float32, device=device)
    schedule = (hyper.lr, hyper.base_lr, hyper.init_lr, hyper.warmup, hyper.beta)
    flags = dict(DECAY=decay, MASTER=stored_as, HAS_GRAD_SCALE=grad_scale is not None,
                 HAS_FOUND_INF=found_inf is not None, BLOCK_SIZE=BLOCK_SIZE, num_warps=NUM_WARPS)
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    first_row = 0
    with guard:
        for i, param in enumerate(params):
            numel = param.numel()
            if numel == 0:  # adds nothing to any sum, and max|y| >= 0 already
                continue
            blocks = num_blocks[i]
            master = master_params[i] if master_params else None
            # 32-bit offsets unless the last block's would overflow.
            index_64 = blocks * BLOCK_SIZE > 2**31 - 1
            if phase_id == PHASE_REDUCE:
                partial_rows = partials[first_row * 4:(first_row + blocks) * 4]
                _apollo_reduce_kernel[(blocks,)](
                    param, grads[i], exp_avg_grads[i], approx_hessians[i], updates[i], master, steps[i], grad_scale,
                    found_inf, partial_rows, numel, *schedule, hyper.weight_decay, INDEX_64=index_64, **flags,
                )
            else:
                partial_rows = partials[first_row:first_row + blocks] if phase_id == PHASE_MOMENTS else None
                _apollo_apply_kernel[(blocks,)](
                    param, grads[i], exp_avg_grads[i], approx_hessians[i], updates[i], master, steps[i], stats[i],
                    grad_scale, found_inf, partial_rows, numel, float(total_numels[i]), *schedule, hyper.eps,
                    hyper.weight_decay,
                    PHASE=phase_id, BELIEF=belief, INDEX_64=index_64,
                    ROUND_BF16_IN_SOFTWARE=INTERPRETED and param.dtype == torch.bfloat16, **flags,
                )
            if partial_rows is not None:
                _apollo_combine_kernel[(1,)](
                    partial_rows, stats[i], found_inf, blocks, REDUCE=phase_id == PHASE_REDUCE,
                    HAS_FOUND_INF=found_inf is not None, ROWS=COMBINE_ROWS, num_warps=NUM_WARPS,
                )
            first_row += blocks
