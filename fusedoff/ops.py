"""The fused-step ops, one entry per step, whatever the backend.

``cpu`` and ``cuda`` run ``torch.ops.fusedoff.adam_step_`` (C++/CUDA, registered through
torch.library in csrc/ops.cpp); ``triton`` runs fusedoff/kernels/triton_adam.py; ``torch`` runs
the pure-PyTorch reference. All take the same arguments and update their inputs in place. The native
ops return nothing, so the fake kernels torch derives from their schemas trace them (opcheck passes).

``cuda_emulated`` is for the tests: the CUDA kernels compiled as host C++ and run by the CUDA
emulation (csrc/emulation) on CPU tensors, ``torch.ops.fusedoff_emulated`` (``_ext.load_emulated_extension``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from fusedoff._ext import load_emulated_extension, load_extension

BACKENDS = ("cpu", "cuda", "triton", "torch")
TEST_BACKENDS = ("cuda_emulated",)  # accepted everywhere a backend is, never chosen by 'auto'


def increment_steps_(steps: Sequence[Tensor], found_inf: Tensor | None = None) -> None:
    """Adds one to each step count, or nothing where ``found_inf`` is non-zero, without a host sync.

    Any non-zero ``found_inf`` skips, as in the kernels: torch.amp.GradScaler sums the flags of every
    device the gradients live on, so a model on two GPUs that overflows on both passes 2.0 (and
    ``1 - found_inf`` would count the step backwards). NaN skips too.
    """
    if not steps:
        return
    if found_inf is None:
        torch._foreach_add_(list(steps), 1.0)
    else:
        stepped = (found_inf.reshape(()).to(steps[0].device) == 0).to(steps[0].dtype)
        torch._foreach_add_(list(steps), [stepped] * len(steps))


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
    backend: str,
) -> None:
    """One fused Adam (``decoupled_weight_decay=False``) or AdamW step over a list of tensors.

    The math is in ``csrc/include/fusedoff/adam.h``. ``steps`` hold each tensor's step count after
    this step's increment (see ``increment_steps_``); ``max_exp_avg_sqs`` is empty unless
    ``amsgrad``; ``master_params`` is empty or holds fp32 master weights, in which case the params
    receive the rounded master values. States are fp32; params and grads fp32, fp16 or bf16.
    """
    _check_backend(backend)
    if len(params) == 0:
        return  # nothing to update (and nothing for the dispatcher to pick a device from)
    tensors = (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, steps)
    hyper = dict(
        lr=float(lr),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(eps),
        weight_decay=float(weight_decay),
        decoupled_weight_decay=bool(decoupled_weight_decay),
        amsgrad=bool(amsgrad),
        maximize=bool(maximize),
        grad_scale=grad_scale,
        found_inf=found_inf,
    )
    if backend in _NATIVE:
        _native_ops(backend, params).adam_step_(*(list(t) for t in tensors), **hyper)
    elif backend == "triton":
        from fusedoff.kernels import triton_adam

        triton_adam.adam_step_(*tensors, **hyper)
    elif backend == "torch":
        from fusedoff.kernels import reference

        reference.adam_step_(*tensors, **hyper)
    else:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def adam_compressed_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    exp_avg_absmaxs: Sequence[Tensor],
    exp_avg_sq_absmaxs: Sequence[Tensor],
    master_params: Sequence[Tensor],
    steps: Sequence[Tensor],
    offsets: Sequence[int],
    tensor_keys: Sequence[int],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    backend: str,
) -> None:
    """One fused Adam/AdamW step whose moments are stored compressed (no amsgrad).

    The states' dtype says how (see [note: compressed states] in csrc/include/fusedoff/state_codec.h):
    bfloat16 (written with stochastic rounding; ``exp_avg_absmaxs``/``exp_avg_sq_absmaxs`` empty) or
    uint8 codes with one fp32 absmax per block of ``fusedoff.kernels.codec.QUANT_BLOCK`` elements.
    A tensor may be a range of a larger one: ``offsets`` gives its first element there (a multiple
    of the block for 8-bit states), the origin of its blocks and of its random indices;
    ``tensor_keys`` the random stream's keys (``codec.tensor_key``). The rest is ``adam_step_``'s.
    """
    _check_backend(backend)
    if len(params) == 0:
        return
    tensors = (params, grads, exp_avgs, exp_avg_sqs, exp_avg_absmaxs, exp_avg_sq_absmaxs, master_params, steps)
    hyper = dict(lr=float(lr), beta1=float(beta1), beta2=float(beta2), eps=float(eps),
                 weight_decay=float(weight_decay), decoupled_weight_decay=bool(decoupled_weight_decay),
                 maximize=bool(maximize), grad_scale=grad_scale, found_inf=found_inf)
    offsets, tensor_keys = [int(o) for o in offsets], [int(k) for k in tensor_keys]
    if backend in _NATIVE:
        _native_ops(backend, params).adam_compressed_step_(*(list(t) for t in tensors), offsets, tensor_keys, **hyper)
    elif backend == "triton":
        from fusedoff.kernels import triton_adam_compressed

        triton_adam_compressed.adam_compressed_step_(*tensors, offsets, tensor_keys, **hyper)
    else:
        from fusedoff.kernels import reference

        reference.adam_compressed_step_(*tensors, offsets, tensor_keys, **hyper)


APOLLO_PHASES = ("reduce", "full", "moments", "finish")
APOLLO_NUM_STATS = 5  # sum d^4, sum y*d, sum B*d^2, max |y|, sum D (see csrc/include/fusedoff/apollo.h)


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
    lr: float,
    base_lr: float,
    init_lr: float,
    warmup: float,
    beta: float,
    eps: float,
    weight_decay: float,
    rebound: str,
    weight_decay_type: str,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    backend: str,
) -> None:
    """One phase of a fused Apollo step over tensors, or contiguous ranges of tensors.

    The math and the phases are in ``csrc/include/fusedoff/apollo.h``: ``reduce`` adds each range's
    sums into its ``stats`` (float64, ``APOLLO_NUM_STATS`` each; ranges of one tensor share one),
    then ``full`` applies the step; with ``weight_decay_type='stable'`` the apply is ``moments`` then
    ``finish``. ``total_numels`` are the whole tensors' sizes. ``apollo_whole_step_`` runs them all.
    """
    _check_backend(backend)
    if phase not in APOLLO_PHASES:
        raise ValueError(f"phase must be one of {APOLLO_PHASES}, got {phase!r}")
    if len(params) == 0:
        return
    tensors = (params, grads, exp_avg_grads, approx_hessians, updates, master_params, steps, stats)
    hyper = dict(
        phase=phase,
        lr=float(lr),
        base_lr=float(base_lr),
        init_lr=float(init_lr),
        warmup=float(warmup),
        beta=float(beta),
        eps=float(eps),
        weight_decay=float(weight_decay),
        rebound=rebound,
        weight_decay_type=weight_decay_type,
        grad_scale=grad_scale,
        found_inf=found_inf,
    )
    numels = [int(n) for n in total_numels]
    if backend in _NATIVE:
        _native_ops(backend, params).apollo_step_(*(list(t) for t in tensors), numels, **hyper)
    elif backend == "triton":
        from fusedoff.kernels import triton_apollo

        triton_apollo.apollo_step_(*tensors, numels, **hyper)
    else:
        from fusedoff.kernels import reference

        reference.apollo_step_(*tensors, numels, **hyper)


def apollo_phases(weight_decay: float, weight_decay_type: str) -> tuple[str, ...]:
    """The phases of one whole Apollo step, in order."""
    stable = weight_decay != 0 and weight_decay_type == "stable"
    return ("reduce", "moments", "finish") if stable else ("reduce", "full")


def apollo_whole_step_(params, grads, exp_avg_grads, approx_hessians, updates, master_params, steps, *,
                       backend: str, total_numels: Sequence[int] | None = None,
                       after_phase: Callable[[Tensor, str], None] | None = None, **hyper) -> None:
    """A complete Apollo step over whole tensors: every phase, with fresh stats.

    For shards of larger tensors, `total_numels` gives the whole tensors' sizes (default: the
    tensors' own) and `after_phase(stats, phase)` completes the sums in `stats` (one row per tensor)
    over the other shards before the next phase reads them.
    """
    if len(params) == 0:
        return
    stats = torch.zeros(len(params), APOLLO_NUM_STATS, dtype=torch.float64, device=params[0].device)
    numels = [p.numel() for p in params] if total_numels is None else list(total_numels)
    for phase in apollo_phases(hyper["weight_decay"], hyper["weight_decay_type"]):
        apollo_step_(params, grads, exp_avg_grads, approx_hessians, updates, master_params, steps, stats.unbind(0),
                     numels, phase=phase, backend=backend, **hyper)
        if after_phase is not None:
            after_phase(stats, phase)


_NATIVE = ("cpu", "cuda", "cuda_emulated")


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS + TEST_BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def _native_ops(backend: str, params: Sequence[Tensor]):
    """The op namespace of a native backend, its module loaded, once the parameters' device is checked."""
    device_type = "cpu" if backend == "cuda_emulated" else backend
    for p in params:
        if p.device.type != device_type:
            raise ValueError(f"backend={backend!r} needs {device_type} tensors, got a parameter on {p.device}")
    if backend == "cuda_emulated":
        load_emulated_extension()
        return torch.ops.fusedoff_emulated
    load_extension()
    return torch.ops.fusedoff
