"""fusedoff.Adam and fusedoff.AdamW: torch.optim-compatible classes over the fused step."""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch import Tensor

from fusedoff import ops
from fusedoff.hyperparameters import AdamHyperparameters
from fusedoff.kernels import codec
from fusedoff.offload.contract import FusedUpdate, Phase, StateSpec
from fusedoff.optim.base import MASTER_NAMES, FusedOptimizer
from fusedoff.optim.validation import check_torch_flags
from fusedoff.sharding import (block_lead, blocks_touched, is_dtensor, like_param, local_tensor, shard_key,
                               zero_redundancy_owner)
from fusedoff.tensor_layout import flat_view, in_layout_of, is_dense

MOMENTS = ("exp_avg", "exp_avg_sq")  # exp_avg takes the signed 8-bit map, exp_avg_sq the unsigned one
# An empty tensor beside the decoded 8-bit moments of a shard in a state dict for torch.save (see
# [note: checkpoints of compressed shards]).
DECODED_MARK = "8bit_moments_decoded"
# In each group of a state dict: the precision its moments are in there (see [note: distributed
# checkpoints across forms] in fusedoff/optim/checkpoint.py); loading drops it.
SAVED_PRECISION_KEY = "saved_state_precision"


class Adam(FusedOptimizer):
    """Adam with a fused step, a drop-in for ``torch.optim.Adam``.

    Same arguments as :class:`AdamW`, with ``weight_decay`` defaulting to 0 and, as in torch,
    ``decoupled_weight_decay``: False (default) adds ``weight_decay * p`` to the gradient (L2);
    True decays the parameter itself, which is AdamW.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        lr: float | Tensor = 1e-3,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        backend: str = "auto",
        master_weights: bool | None = None,
        offload: str = "auto",
        chunk_size: int | None = None,
        num_buffers: int = 2,
        device_budget: int | None = None,
        state_precision: str = "fp32",
        seed: int = 0,
        master_precision: str = "fp32",
    ) -> None:
        # torch's refusals first, in its order; then what fusedoff cannot do (capturable, differentiable).
        betas = _check_hyperparameters(lr, betas, eps, weight_decay, foreach, capturable)
        check_torch_flags(foreach=foreach, fused=fused, capturable=capturable, differentiable=differentiable)
        _check_precision(state_precision, seed, amsgrad)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        decoupled_weight_decay=decoupled_weight_decay, state_precision=state_precision, seed=seed,
                        # which 8-bit map the group's codes are in: in every group, so that whatever copies
                        # the groups (a state dict, DCP, ZeRO-1's consolidation) carries it with the codes
                        **{codec.CODEC_VERSION_KEY: codec.CODEC_VERSION})
        super().__init__(params, defaults, backend=backend, master_weights=master_weights, offload=offload,
                         chunk_size=chunk_size, num_buffers=num_buffers, device_budget=device_budget,
                         master_precision=master_precision)
        owner = zero_redundancy_owner()  # ZeRO-1's local optimizer: keys by ZeRO's (global) state dict
        self._zero_owner = weakref.ref(owner) if owner is not None else None

    def _key_positions(self) -> dict[int, int]:
        """Each parameter's index in the state dict, which keys its random stream: this optimizer's,
        or for ZeRO-1's local optimizer the consolidated (global) one (see sharding.zero_redundancy_owner)."""
        owner = self._zero_owner() if getattr(self, "_zero_owner", None) is not None else None
        groups = owner.param_groups if owner is not None else self.param_groups
        return {id(p): i for i, p in enumerate(p for g in groups for p in g["params"])}

    def _register_hooks(self) -> None:  # at construction and in every copy (deepcopy, pickle)
        super()._register_hooks()
        self.register_load_state_dict_pre_hook(Adam._checked_against_saved_forms)

    def _states_as_kept(self, state_dict: dict) -> dict:
        """For torch.save: the moments as kept, each group saying their form; but fp32 in groups
        whose 8-bit moments belong to sharded parameters (DTensors: see [note: checkpoints of
        compressed shards]) or are in several forms (so that the group says one)."""
        params = [p for g in self.param_groups for p in g["params"]]
        groups = []
        for group in state_dict["param_groups"]:
            pids = [pid for pid in group["params"] if pid in state_dict["state"]]
            forms = {_form_of(state_dict["state"][pid]) for pid in pids} - {None}
            mixed = len(forms) > 1
            saved = "fp32" if mixed else next(iter(forms), group["state_precision"])
            if mixed or saved == "8bit" and any(is_dtensor(params[pid]) for pid in pids):
                saved = "fp32"
                for pid in pids:
                    state_dict["state"][pid] = {**_decoded(state_dict["state"][pid], params[pid]),
                                                DECODED_MARK: torch.zeros(0)}
            groups.append({**group, SAVED_PRECISION_KEY: saved})
        state_dict["param_groups"] = groups
        return state_dict

    def _states_in_fp32(self, state_dict: dict) -> dict:
        state_dict = super()._states_in_fp32(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, state in list(state_dict["state"].items()):
            state = state_dict["state"][pid] = _decoded(state, params[pid])
            state.pop(DECODED_MARK, None)
        state_dict["param_groups"] = [{**g, SAVED_PRECISION_KEY: "fp32"} for g in state_dict["param_groups"]]
        return state_dict

    @staticmethod
    def _checked_against_saved_forms(optimizer: "Adam", state_dict: dict) -> dict | None:
        """Load pre-hook: refuses moments that are not what their group says it saved (see [note:
        distributed checkpoints across forms]), before anything changes; returns the state dict
        without the keys the post-hooks add (the user's dict unchanged)."""
        saved_as = {pid: (group.get(SAVED_PRECISION_KEY), group.get("state_precision")) for group in
                    state_dict["param_groups"] for pid in group["params"]}
        for pid, state in state_dict["state"].items():
            saved, kept = saved_as.get(pid, (None, None))
            for name in MOMENTS if saved is not None else ():
                value = state.get(name)
                if isinstance(value, Tensor) and not _holds_saved_values(value, state, name, saved, kept):
                    raise ValueError(_converted_on_the_way(pid, name, value, saved))
        if not any(SAVED_PRECISION_KEY in g for g in state_dict["param_groups"]) and not any(
                DECODED_MARK in state for state in state_dict["state"].values()):
            return None
        states = {pid: {k: v for k, v in state.items() if k != DECODED_MARK}
                  for pid, state in state_dict["state"].items()}
        groups = [{k: v for k, v in g.items() if k != SAVED_PRECISION_KEY} for g in state_dict["param_groups"]]
        return {**state_dict, "state": states, "param_groups": groups}

    def add_param_group(self, param_group: dict) -> None:
        if isinstance(param_group, dict):  # a group's own precision, checked before torch adds it
            self._check_group_options({**self.defaults, **param_group})
        super().add_param_group(param_group)

    def _check_group_options(self, group: dict) -> None:
        super()._check_group_options(group)
        _check_precision(group.get("state_precision", "fp32"), group.get("seed", 0), group.get("amsgrad", False))

    def _check_group_param(self, group: dict, param: Tensor) -> None:
        super()._check_group_param(group, param)

    def _state_names(self, group: dict) -> tuple[str, ...]:
        return tuple(spec.name for spec in self._state_specs(group))

    def _state_specs(self, group: dict) -> tuple[StateSpec, ...]:
        return adam_state_specs(group["state_precision"], group["amsgrad"])

    def _fused_update(self, group, backend, grad_scale, found_inf, names, params) -> FusedUpdate:
        beta1, beta2 = group["betas"]
        hyper = AdamHyperparameters(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                                    weight_decay=group["weight_decay"],
                                    decoupled_weight_decay=group["decoupled_weight_decay"], amsgrad=group["amsgrad"],
                                    maximize=group["maximize"])
        beside = dict(phases=(Phase("adam", reads=names, writes=names),), hyper=hyper, backend=backend,
                      grad_scale=grad_scale, found_inf=found_inf)
        moments = (("exp_avgs", "exp_avg"), ("exp_avg_sqs", "exp_avg_sq"))
        master = ("master_params", MASTER_NAMES)  # whichever form the bucket keeps, if any
        if group["state_precision"] == "fp32":
            return FusedUpdate("adam_step_", states=(*moments, ("max_exp_avg_sqs", ("max_exp_avg_sq",)), master),
                               **beside)
        # The random stream's key of each tensor: the optimizer's seed and the parameter's index in
        # the state dict, so it is the same however the tensor is placed or cut into chunks. A shard
        # that is no run of its parameter's elements draws from a stream of its own (see [note:
        # compressed states of shards]). The 8-bit scales are block-wise states (bf16 has none).
        positions = self._key_positions()
        keys = tuple(codec.tensor_key(group["seed"], positions[id(p)]) ^ shard_key(p) for p in params)
        scales = (("exp_avg_absmaxs", ("exp_avg_absmax",)), ("exp_avg_sq_absmaxs", ("exp_avg_sq_absmax",)))
        return FusedUpdate("adam_compressed_step_", states=(*moments, *scales, master),
                           per_tensor=(("tensor_keys", keys),), **beside)

    # ---- compressed states in checkpoints ------------------------------------------------------------
    def _upgraded_states(self, state_dict: dict, states: dict) -> dict:
        """8-bit codes of an older map are decoded with it, to fp32 moments (laid out as the codes),
        which `_loaded_states` then encodes with this version's."""
        versions = {pid: group.get(codec.CODEC_VERSION_KEY, 1) for group in state_dict["param_groups"]
                    for pid in group["params"]}
        if all(v == codec.CODEC_VERSION for v in versions.values()):
            return states
        upgraded = {}
        for pid, state in states.items():
            state, version = dict(state), versions.get(pid, 1)
            for name in MOMENTS if version != codec.CODEC_VERSION else ():
                value, absmax = state.get(name), state.get(f"{name}_absmax")
                if isinstance(value, Tensor) and value.dtype == torch.uint8 and isinstance(absmax, Tensor):
                    codes = local_tensor(value)
                    codes = codes if is_dense(codes) else codes.contiguous()
                    decoded = torch.empty_like(codes, dtype=torch.float32)
                    flat_view(decoded).copy_(codec.dequantize(flat_view(codes), local_tensor(absmax),
                                                              signed=name == "exp_avg", version=version))
                    state[name] = decoded
                    del state[f"{name}_absmax"]
            upgraded[pid] = state
        return upgraded

    def _loaded_states(self, group: dict, param: Tensor, state: dict) -> dict:
        """A loaded state in `group`'s precision: fp32 moments (a torch.optim checkpoint) are
        compressed (bf16 rounded to nearest; 8-bit quantized), compressed ones are kept, or decoded
        for an fp32 group."""
        state = super()._loaded_states(group, param, state)
        precision = group["state_precision"]
        out = {k: v for k, v in state.items() if not k.endswith("_absmax")}
        for name in MOMENTS:
            value = state.get(name)
            if not isinstance(value, Tensor):
                continue
            target = codec.state_dtype(precision)
            if value.dtype == target and precision != "8bit":
                continue
            local = local_tensor(param)
            if value.dtype == target:  # 8-bit codes: with their scales
                absmax = state.get(f"{name}_absmax")
                blocks = blocks_touched(param, codec.QUANT_BLOCK)
                if not isinstance(absmax, Tensor) or local_tensor(absmax).numel() != blocks:
                    raise ValueError(f"8-bit state {name!r} needs {name}_absmax with {blocks} block scales")
                if value.numel() <= 1 or local_tensor(value).stride() == local.stride():
                    out[name], out[f"{name}_absmax"] = value, absmax
                    continue
                # Blocks run in memory order: codes laid out unlike the parameter are quantized afresh.
            fp32 = _moment_fp32(state, name, param)
            if precision == "8bit":
                codes, out[f"{name}_absmax"] = _quantize_shard(flat_view(fp32), param, signed=name == "exp_avg")
                out[name] = torch.empty_like(fp32, dtype=torch.uint8)
                flat_view(out[name]).copy_(codes)
            else:
                out[name] = fp32.to(target)
            out[name] = like_param(out[name], param)  # a shard's: a DTensor like its parameter
        return out

    def fp32_state_dict(self) -> dict:
        """``state_dict()`` with every moment as fp32 (compressed ones decoded, their block scales
        left out): what ``torch.optim.Adam``/``AdamW.load_state_dict`` takes. The groups keep
        fusedoff's options (torch ignores them), with ``state_precision`` "fp32" as their states are,
        and master weights whole (``master_param``)."""
        state_dict = super().fp32_state_dict()
        state_dict["param_groups"] = [{**g, "state_precision": "fp32"} for g in state_dict["param_groups"]]
        return state_dict


class AdamW(Adam):
    """AdamW (decoupled weight decay) with a fused step, a drop-in for ``torch.optim.AdamW``.

    Args:
        params: parameters, ``named_parameters()`` (the names are kept in the state dict's
            ``param_names``) or param groups, as for any torch optimizer.
        lr: learning rate (float, or a one-element tensor; the kernels take it as a scalar, so a
            CUDA tensor is read on the host at each step, which waits for the GPU: keep it on the CPU).
        betas: coefficients of the running averages of the gradient and its square (both floats,
            or both one-element tensors, read on the host like a tensor lr).
        eps: added to the denominator for numerical stability.
        weight_decay: decoupled weight decay (``p *= 1 - lr * weight_decay``).
        amsgrad: use the maximum of past squared-gradient averages.
        maximize: maximise the objective instead of minimising it.
        foreach, fused: accepted at torch's values for code written for torch; they choose nothing
            here, the step always runs fusedoff's fused kernels (``fused=False`` and
            ``foreach=True`` included). As in torch, both True together is an error, and so is a
            tensor lr or betas with ``foreach=True``.
        capturable: False only. fusedoff's step reads lr and betas on the host and streams states
            through host memory, so it is not captured in CUDA graphs; True is an error.
        differentiable: False only: the fused step runs outside autograd; True is an error.
        backend: "auto" (the fastest available for the parameters' device), "cpu" (C++), "cuda",
            "triton" or "torch" (pure PyTorch).
        master_weights: keep fp32 master weights for fp16/bf16 parameters (the kernel updates the
            master and writes the rounded value to the parameter). None means True for fp16/bf16
            parameters. The master follows the parameter: an element written between steps
            (``copy_``, ``load_state_dict``, ``torch.nn.init``, ``p.data = ...``,
            ``p.data.copy_(w)``) is where the next step starts (see the README). fp16/bf16
            gradients are upcast inside the kernel.
        master_precision: how master weights are stored: "fp32" (default) whole; "split" their low 16
            bits only, the bf16 parameter being their upper half (2 bytes per parameter instead of 4,
            every result bit for bit those of "fp32"); "split8" 8 bits (1 byte; the master rounded
            stochastically to 24 bits each step, relative error < 2^-15). bf16 parameters only: an
            fp16 parameter cannot carry the upper half of its master (see the README). With master
            weights, a bf16 parameter is the master rounded to nearest with ties away from zero.
        offload: where states (and master weights) live. "none": on the parameters' device.
            "stream": in host memory, streamed to the parameters' device chunk by chunk through
            `num_buffers` buffers of `chunk_size` elements per state, except what fits in
            `device_budget` (default 0). "auto" (default): for CUDA parameters, resident what fits
            in `device_budget` and streamed the rest, the budget decided at the first step from
            the device's memory when not given (see ``memory_stats()["device_budget"]``); for CPU
            parameters, states in place (they are in host memory already).
        chunk_size: elements per chunk (rounded up to a multiple of 16; default 4M: 96 MiB of
            buffers for AdamW with master weights and two buffers).
        num_buffers: chunk buffer sets, >= 2 (double buffering).
        device_budget: bytes of state the optimizer may keep on the parameters' device besides
            its buffers (per device), filled in param-group order; the rest streams. Not with
            offload="none". ``set_device_budget()`` changes it later.

    ``state_dict()`` uses torch's keys (``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``),
    plus ``master_param`` when master weights are kept. Honours ``torch.amp.GradScaler`` like
    torch's fused AdamW: gradients are unscaled inside the kernel and an overflowing step changes
    nothing, without a host synchronisation; unlike torch's fused AdamW, training loops may still
    unscale and clip the gradients before the step (see [note: who asks whether the step unscales]
    in fusedoff/optim/base.py).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        lr: float | Tensor = 1e-3,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        backend: str = "auto",
        master_weights: bool | None = None,
        offload: str = "auto",
        chunk_size: int | None = None,
        num_buffers: int = 2,
        device_budget: int | None = None,
        state_precision: str = "fp32",
        seed: int = 0,
        master_precision: str = "fp32",
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, backend=backend, master_weights=master_weights,
                         offload=offload, chunk_size=chunk_size, num_buffers=num_buffers, device_budget=device_budget,
                         state_precision=state_precision, seed=seed, master_precision=master_precision)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # as torch's AdamW: whatever a loaded group said
            group["decoupled_weight_decay"] = True


def adam_state_specs(state_precision: str = "fp32", amsgrad: bool = False) -> tuple[StateSpec, ...]:
    """How Adam's states are stored per parameter (besides ``step`` and ``master_param``): fp32
    moments; bf16 ones; or 8-bit codes with one fp32 absmax per block of ``codec.QUANT_BLOCK``."""
    if state_precision == "fp32":
        return tuple(StateSpec(n) for n in MOMENTS + (("max_exp_avg_sq",) if amsgrad else ()))
    dtype = codec.state_dtype(state_precision)
    specs = tuple(StateSpec(name, dtype) for name in MOMENTS)
    if state_precision == "8bit":
        specs += tuple(StateSpec(f"{name}_absmax", torch.float32, codec.QUANT_BLOCK) for name in MOMENTS)
    return specs


def _check_precision(state_precision, seed, amsgrad) -> None:
    if state_precision not in codec.PRECISIONS:
        raise ValueError(f"state_precision must be one of {codec.PRECISIONS}, got {state_precision!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
    if amsgrad and state_precision != "fp32":
        raise ValueError(f"amsgrad keeps fp32 states only: state_precision={state_precision!r} compresses exp_avg and "
                         "exp_avg_sq, and a compressed running maximum is not implemented")


def _decoded(state: dict, param: Tensor) -> dict:
    """A copy of `state` (torch's state dict holds the optimizer's own) with its compressed moments
    as fp32, their block scales left out: exactly their values."""
    state = dict(state)
    for name in MOMENTS:
        if isinstance(state.get(name), Tensor) and state[name].dtype != torch.float32:
            state[name] = like_param(_moment_fp32(state, name, param), param)  # a DTensor where sharded
    for name in MOMENTS:
        state.pop(f"{name}_absmax", None)
    return state


def _form_of(state: dict) -> str | None:
    """The precision a parameter's moments are stored in (None: it has none yet)."""
    value = state.get(MOMENTS[0])
    return _precision_stored_as(value.dtype) if isinstance(value, Tensor) else None


def _precision_stored_as(dtype: torch.dtype) -> str | None:
    """The state precision whose moments are stored as `dtype` (None: none is)."""
    return next((precision for precision in codec.PRECISIONS if codec.state_dtype(precision) == dtype), None)


_SAVED_FORMS = {"fp32": "fp32 moments", "bf16": "bf16 moments", "8bit": "8-bit codes with their block scales"}


def _holds_saved_values(value: Tensor, state: dict, name: str, saved: str, kept: str | None) -> bool:
    """Whether moment `name` of a loaded `state`, whose group says it was saved in precision `saved`
    and is kept in `kept`, holds the saved values: in the saved form, or bf16 widened to fp32
    (exact); or in the kept form where that differs (a dict whose states were converted after it
    was made, as ZeRO-1's consolidated groups can be)."""
    def in_form(precision: str) -> bool:
        if precision == "8bit":
            return value.dtype == torch.uint8 and isinstance(state.get(f"{name}_absmax"), Tensor)
        return value.dtype == codec.state_dtype(precision)

    widened = saved == "bf16" and value.dtype == torch.float32
    return in_form(saved) or widened or (kept in codec.PRECISIONS and kept != saved and in_form(kept))


def _converted_on_the_way(pid, name: str, value: Tensor, saved: str) -> str:
    read = _precision_stored_as(value.dtype)
    read = f", the form of state_precision={read!r}" if read else ""
    return (f"state {name!r} of parameter {pid} was saved as {_SAVED_FORMS[saved]} ({SAVED_PRECISION_KEY}={saved!r}) "
            f"but is loaded as a {value.dtype} tensor{' without them' if saved == '8bit' else ''}{read}: "
            "torch.distributed.checkpoint reads a checkpoint into the tensors of the destination's own state "
            "dict, converting their dtype, so it no longer holds the saved values. Save and load through "
            "torch.distributed.checkpoint.state_dict's get_state_dict and set_state_dict (or "
            "get_optimizer_state_dict and set_optimizer_state_dict), whose state dicts hold fp32 states that "
            f"every state_precision reads, or load it into an optimizer with state_precision={saved!r}")


def _moment_fp32(state: dict, name: str, param: Tensor) -> Tensor:
    """State `name` of `state` (fp32, bf16 or 8-bit codes with their scales) as fp32, shaped and
    laid out like the parameter's local tensor."""
    value = local_tensor(state[name])
    local = local_tensor(param)
    if value.dtype != torch.uint8:
        return in_layout_of(value.to(torch.float32).reshape(local.shape), local)
    # The blocks of 8-bit codes run in the codes' own memory order: decoded in it, then laid out
    # like the parameter.
    codes = value if is_dense(value) else value.contiguous()
    decoded = torch.empty_like(codes, dtype=torch.float32)
    lead = block_lead(param, codec.QUANT_BLOCK)  # a shard's blocks are its parameter's
    absmax = local_tensor(state[f"{name}_absmax"])
    flat_view(decoded).copy_(ops.decode_8bit(_led(flat_view(codes), lead), absmax, signed=name == "exp_avg")[lead:])
    return in_layout_of(decoded.reshape(local.shape), local)


def _led(flat: Tensor, lead: int) -> Tensor:
    """`flat` after `lead` zeros: a shard's elements where its parameter's blocks put them."""
    return torch.cat([flat.new_zeros(lead), flat]) if lead else flat


def _quantize_shard(flat: Tensor, param: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    """(codes, absmax) of `param`'s local fp32 values `flat`, in blocks counted from the whole
    parameter's first element: a shard's first block is the part of it the shard holds."""
    lead = block_lead(param, codec.QUANT_BLOCK)
    codes, absmax = ops.encode_8bit(_led(flat, lead), signed=signed)
    return codes[lead:], absmax


def _check_hyperparameters(lr, betas, eps, weight_decay, foreach, capturable) -> tuple:
    """torch.optim.Adam's checks, in its order and with its messages; the betas as torch keeps them
    (one-element tensors as 0-d ones)."""
    if isinstance(lr, Tensor):
        if foreach and not capturable:
            raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    pair = (betas[0], betas[1])
    if not all(isinstance(b, float) for b in pair) and not all(isinstance(b, Tensor) for b in pair):
        raise ValueError("betas must be either both floats or both Tensors")
    for index, beta in enumerate(pair):
        if isinstance(beta, Tensor):
            if foreach and not capturable:
                raise ValueError(f"betas[{index}] as a Tensor is not supported for capturable=False and foreach=True")
            if beta.numel() != 1:
                raise ValueError(f"Tensor betas[{index}] must be 1-element")
    return tuple(b.reshape(()) if isinstance(b, Tensor) else b for b in pair)
