"""The fused-step ops: a table of ops, each with its implementation on every backend.

Each op is one entry of ``_OPS``: its name and its implementations keyed by backend. The native
backends (``cpu``, ``cuda``, the test backend ``fusedoff.testing`` adds; see ``fusedoff.backends``) run the op of
that name that csrc/ops.cpp registers through torch.library; ``triton`` runs the function of that
name in its fusedoff/kernels/triton_*.py module, ``torch`` the pure-PyTorch reference
(fusedoff/kernels/reference.py). Every implementation updates its inputs in place. The native ops
return nothing, so the fake kernels torch derives from their schemas trace them (opcheck passes);
the Python functions here are plain functions over those ops and need no fake kernel of their own.

The scalar hyperparameters travel as one frozen object (``fusedoff.hyperparameters``), built once
by the optimizer class, handed to the Python backends as it is and unpacked once, here, into the
native schema's typed arguments. Each public op takes ``hyper=`` or the hyperparameters as
keywords (one object is built from them); ``grad_scale``/``found_inf`` travel beside it.
Dispatch is a lookup: the backend's name is checked in one place, ``backends.backend_named``.

An optimizer's step reaches its op through `run_update`: the optimizer class describes the update
as data (``fusedoff.offload.contract.FusedUpdate``: the op's name, which state feeds which argument,
the hyperparameters) and the engine calls ``run_update(update, phase, args)`` once per phase and
list of tensors; this is where that description becomes the op's arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from fusedoff import _ext
from fusedoff.backends import BACKENDS, Backend, backend_named, check_device
from fusedoff.hyperparameters import AdamHyperparameters, ApolloHyperparameters
from fusedoff.kernels import codec

__all__ = ["BACKENDS", "APOLLO_PHASES", "APOLLO_NUM_STATS", "increment_steps_", "adam_step_",
           "adam_compressed_step_", "apollo_step_", "apollo_phases", "run_update", "apollo_whole_step_", "encode_8bit",
           "decode_8bit"]

APOLLO_PHASES = ("reduce", "full", "moments", "finish")
APOLLO_NUM_STATS = 5  # sum d^4, sum y*d, sum B*d^2, max |y|, sum D (see csrc/include/fusedoff/apollo.h)


# ---- the table ------------------------------------------------------------------------------------


@functools.cache
def _native_op(namespace: str, name: str, hyper_kind: type):
    """The native op and the names of its schema's typed hyperparameters, in the object's fields."""
    op = getattr(getattr(torch.ops, namespace), name).default
    fields = {f.name for f in dataclasses.fields(hyper_kind)}
    return op, tuple(a.name for a in op._schema.arguments if a.kwarg_only and a.name in fields)


def _native(name: str) -> Callable:
    """A native backend's implementation of op ``name``: the parameters' device checked, the
    backend's module loaded, the hyperparameter object unpacked into the schema's typed arguments
    (the ones it has: the compressed op's schema has no amsgrad)."""

    def run(backend: Backend, params: Sequence[Tensor], *lists, hyper, **keywords) -> None:
        # The first parameter's device only: the op itself refuses a call whose tensors are on several devices.
        check_device(backend, params[0].device)
        backend.require()
        op, hyper_names = _native_op(backend.native_namespace, name, type(hyper))
        op(list(params), *(list(x) for x in lists), **{n: getattr(hyper, n) for n in hyper_names}, **keywords)

    return run


def _python(module: str, name: str) -> Callable:
    """A Python backend's implementation: function ``name`` of ``module``, imported at the first call
    (triton is optional, and slow to import)."""

    def run(backend: Backend, *args, **keywords) -> None:
        getattr(importlib.import_module(module), name)(*args, **keywords)

    return run


def _implementations(name: str, triton_module: str) -> dict[str, Callable]:
    native = _native(name)
    return {"cpu": native, "cuda": native,
            "triton": _python(f"fusedoff.kernels.{triton_module}", name),
            "torch": _python("fusedoff.kernels.reference", name)}


_OPS: dict[str, dict[str, Callable]] = {
    "adam_step_": _implementations("adam_step_", "triton_adam"),
    "adam_compressed_step_": _implementations("adam_compressed_step_", "triton_adam_compressed"),
    "apollo_step_": _implementations("apollo_step_", "triton_apollo"),
}
assert all(set(impls) == set(BACKENDS) for impls in _OPS.values())


def _run(name: str, backend: str, params: Sequence[Tensor], *args, **keywords) -> None:
    """Runs op ``name`` on ``backend``; an empty call returns at once (nothing to update, and no
    device for the dispatcher to pick)."""
    b = backend_named(backend)
    if len(params) == 0:
        return
    _OPS[name][b.implementation](b, params, *args, **keywords)


def _hyperparameters(kind: type, hyper, keywords: dict):
    """``hyper`` as given, or one object built from the keywords."""
    if hyper is None:
        return kind(**keywords)
    if keywords:
        raise TypeError(f"pass hyper= or the hyperparameters as keywords, not both (got {sorted(keywords)})")
    if not isinstance(hyper, kind):
        raise TypeError(f"hyper must be {kind.__name__}, got {type(hyper).__name__}")
    return hyper


# ---- the ops --------------------------------------------------------------------------------------


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
    backend: str,
    hyper: AdamHyperparameters | None = None,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    **hyperparameters,
) -> None:
    """One fused Adam (``decoupled_weight_decay=False``) or AdamW step over a list of tensors.

    The math is in ``csrc/include/fusedoff/adam.h``; ``hyper`` (or its fields as keywords) says which.
    ``steps`` hold each tensor's step count after this step's increment (see ``increment_steps_``);
    ``max_exp_avg_sqs`` is empty unless ``amsgrad``; ``master_params`` is empty or holds master
    weights, in which case the params receive the rounded master values: fp32, or beside bf16 params
    the int16 ("split") or uint8 ("split8") low bits of a split master, on every backend (see
    [note: split master weights] in csrc/include/fusedoff/master.h). States are fp32; params and
    grads fp32, fp16 or bf16.
    """
    _run("adam_step_", backend, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, steps,
         hyper=_hyperparameters(AdamHyperparameters, hyper, hyperparameters), grad_scale=grad_scale,
         found_inf=found_inf)


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
    backend: str,
    hyper: AdamHyperparameters | None = None,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    **hyperparameters,
) -> None:
    """One fused Adam/AdamW step whose moments are stored compressed (no amsgrad).

    The states' dtype says how (see [note: compressed states] in csrc/include/fusedoff/state_codec.h):
    bfloat16 (written with stochastic rounding; ``exp_avg_absmaxs``/``exp_avg_sq_absmaxs`` empty) or
    uint8 codes with one fp32 absmax per block of ``fusedoff.kernels.codec.QUANT_BLOCK`` elements.
    A tensor may be a range of a larger one: ``offsets`` gives its first element there (a multiple
    of the block for 8-bit states), the origin of its blocks and of its random indices;
    ``tensor_keys`` the random stream's keys (``codec.tensor_key``). The rest is ``adam_step_``'s.
    """
    hyper = _hyperparameters(AdamHyperparameters, hyper, hyperparameters)
    if hyper.amsgrad:
        raise ValueError("fusedoff: compressed states do not support amsgrad")
    _run("adam_compressed_step_", backend, params, grads, exp_avgs, exp_avg_sqs, exp_avg_absmaxs, exp_avg_sq_absmaxs,
         master_params, steps, [int(o) for o in offsets], [int(k) for k in tensor_keys], hyper=hyper,
         grad_scale=grad_scale, found_inf=found_inf)


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
    backend: str,
    hyper: ApolloHyperparameters | None = None,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    **hyperparameters,
) -> None:
    """One phase of a fused Apollo step over tensors, or contiguous ranges of tensors.

    The math and the phases are in ``csrc/include/fusedoff/apollo.h``: ``reduce`` adds each range's
    sums into its ``stats`` (float64, ``APOLLO_NUM_STATS`` each; ranges of one tensor share one),
    then ``full`` applies the step; with ``weight_decay_type='stable'`` the apply is ``moments`` then
    ``finish``. ``total_numels`` are the whole tensors' sizes. ``apollo_whole_step_`` runs them all.
    """
    hyper = _hyperparameters(ApolloHyperparameters, hyper, hyperparameters)
    if phase not in APOLLO_PHASES:
        raise ValueError(f"phase must be one of {APOLLO_PHASES}, got {phase!r}")
    _run("apollo_step_", backend, params, grads, exp_avg_grads, approx_hessians, updates, master_params, steps, stats,
         [int(n) for n in total_numels], phase=phase, hyper=hyper, grad_scale=grad_scale, found_inf=found_inf)


def apollo_phases(weight_decay: float, weight_decay_type: str) -> tuple[str, ...]:
    """The phases of one whole Apollo step, in order."""
    stable = weight_decay != 0 and weight_decay_type == "stable"
    return ("reduce", "moments", "finish") if stable else ("reduce", "full")


def apollo_whole_step_(params, grads, exp_avg_grads, approx_hessians, updates, master_params, steps, *,
                       backend: str, total_numels: Sequence[int] | None = None,
                       after_phase: Callable[[Tensor, str], None] | None = None,
                       hyper: ApolloHyperparameters | None = None, grad_scale: Tensor | None = None,
                       found_inf: Tensor | None = None, **hyperparameters) -> None:
    """A complete Apollo step over whole tensors: every phase, with fresh stats.

    For shards of larger tensors, `total_numels` gives the whole tensors' sizes (default: the
    tensors' own) and `after_phase(stats, phase)` completes the sums in `stats` (one row per tensor)
    over the other shards before the next phase reads them.
    """
    hyper = _hyperparameters(ApolloHyperparameters, hyper, hyperparameters)
    if len(params) == 0:
        return
    stats = torch.zeros(len(params), APOLLO_NUM_STATS, dtype=torch.float64, device=params[0].device)
    numels = [p.numel() for p in params] if total_numels is None else list(total_numels)
    for phase in apollo_phases(hyper.weight_decay, hyper.weight_decay_type):
        apollo_step_(params, grads, exp_avg_grads, approx_hessians, updates, master_params, steps, stats.unbind(0),
                     numels, phase=phase, backend=backend, hyper=hyper, grad_scale=grad_scale, found_inf=found_inf)
        if after_phase is not None:
            after_phase(stats, phase)


# ---- an optimizer's update, described as data ---------------------------------------------------------
def _list_arguments(function: Callable) -> tuple[tuple[str, ...], bool]:
    """The names of an op function's list arguments, in order, and whether it takes a ``phase``."""
    parameters = inspect.signature(function).parameters.values()
    return (tuple(p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD),
            any(p.name == "phase" and p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters))


def run_update(update, phase, args) -> None:
    """Phase `phase` of `update` over the tensors (or ranges of tensors) of `args` (the contract's
    `Phase`, `FusedUpdate` and `UpdateArgs`, fusedoff/offload/contract.py: ops import nothing of the
    engine, which calls them): the op `update` names, each of its list arguments taken from `args`
    by name (params, grads, steps, stats, total_numels, offsets), from the states `update.states`
    maps to it, or from `update.per_tensor`."""
    if update.op not in _UPDATE_ARGUMENTS:
        raise ValueError(f"no fused op named {update.op!r}; the ops are {sorted(_UPDATE_ARGUMENTS)}")
    positional, phased = _UPDATE_ARGUMENTS[update.op]
    lists = {"params": args.params, "grads": args.grads, "steps": args.steps, "stats": args.stats,
             "total_numels": args.total_numels, "offsets": args.offsets}
    states = args.states
    for argument, fed_by in update.states:
        if isinstance(fed_by, str):
            lists[argument] = states[fed_by]
        else:  # the first the call holds, or none
            lists[argument] = next((states[name] for name in fed_by if states.get(name)), [])
    for argument, values in update.per_tensor:
        lists[argument] = [values[t] for t in args.tensors]
    op = globals()[update.op]  # (looked up at the call, as a call by name would)
    op(*(lists[name] for name in positional), **({"phase": phase.name} if phased else {}), backend=update.backend,
       hyper=update.hyper, grad_scale=update.grad_scale, found_inf=update.found_inf)


# The list arguments of each op's function (above), by the op's name in the table.
_UPDATE_ARGUMENTS = {name: _list_arguments(globals()[name]) for name in _OPS}


# ---- the 8-bit codec on whole tensors (checkpoints) ------------------------------------------------
def encode_8bit(values: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    """(uint8 codes, fp32 absmax per block of ``codec.QUANT_BLOCK``) of flat fp32 `values`: the host
    kernel for CPU tensors (the extension's, where it is built), else the PyTorch codec; the same
    bits either way (csrc/include/fusedoff/state_codec.h)."""
    if values.device.type == "cpu" and values.numel() and _ext.native_available():
        return torch.ops.fusedoff.encode_8bit(values.contiguous(), signed)
    return codec.quantize(values, signed=signed)


def decode_8bit(codes: Tensor, absmax: Tensor, signed: bool) -> Tensor:
    """Flat fp32 values of flat uint8 `codes` under their block scales `absmax` (see `encode_8bit`)."""
    if codes.device.type == "cpu" and codes.numel() and _ext.native_available():
        return torch.ops.fusedoff.decode_8bit(codes.contiguous(), absmax.to(torch.float32).contiguous(), signed)
    return codec.dequantize(codes, absmax, signed=signed)
