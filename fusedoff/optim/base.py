"""What every fusedoff optimizer class shares: torch.optim conventions around a fused step.

A subclass names its state tensors and declares its fused update (`FusedUpdate`, plain data: the
op, its phases and the states each reads and writes, which state feeds which argument); this base
validates input, keeps torch.optim's conventions (state_dict hooks, copies, param groups,
GradScaler's ``grad_scale``/``found_inf``, ``clip_grad_norm_``) and answers the engine's questions
(`fusedoff.offload.contract.OptimizerRules`).
The offload engine owns the rest: buckets, placement, ``opt.state`` adoption, master weights, the step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import Tensor
from torch.optim import Optimizer

from fusedoff.backends import backend_named, resolve_backend
from fusedoff.kernels import master as masters
from fusedoff.offload import OffloadEngine
from fusedoff.offload.contract import LOADED_PARAM_VALUE, FusedUpdate, StateSpec
from fusedoff.offload.transaction import StepIncompleteError
from fusedoff.optim import checkpoint, clipping
from fusedoff.optim.overlap import OverlapHandle, overlap_with
from fusedoff.optim.state import OptimizerState
from fusedoff.optim.validation import LOW_PRECISION, TORCH_FLAGS, check_group, check_torch_flags
from fusedoff.sharding import like_param, local_tensor

MASTER = StateSpec("master_param", follows_param=True)
# A split master weight: its low bits beside the bf16 parameter (see [note: split master weights] in
# csrc/include/fusedoff/master.h). It does not follow the parameter: the parameter *is* its upper
# half, so a written parameter moves the master with it, keeping the low bits.
MASTER_LOW_BITS = {"split": "master_low_bits", "split8": "master_low_byte"}  # int16, uint8
MASTER_NAMES = (MASTER.name, *MASTER_LOW_BITS.values())


def master_spec(precision: str) -> StateSpec:
    """How a master weight of `precision` ("fp32", "split", "split8") is kept."""
    if precision == "fp32":
        return MASTER
    # (a name of each precision's own: a checkpoint loaded by name, as DCP loads, never copies one into
    # the other's dtype)
    return StateSpec(MASTER_LOW_BITS[precision], masters.storage_dtype(precision))


def master_states(states: dict) -> list:
    """The master weights of a fused call's `states` (whole or split), or [] without."""
    return next((states[name] for name in MASTER_NAMES if states.get(name)), [])


def check_master_options(master_precision, master_weights_option) -> None:
    if master_precision not in masters.PRECISIONS:
        raise ValueError(f"master_precision must be one of {masters.PRECISIONS}, got {master_precision!r}")
    if master_precision != "fp32" and master_weights_option is False:
        raise ValueError(f"master_precision={master_precision!r} stores master weights, but master_weights=False "
                         "keeps none: leave master_weights at None (or True)")

# [note: who asks whether the step unscales]
# torch.amp.GradScaler.step reads `_step_supports_amp_scaling`: when true it sets `grad_scale` and
# `found_inf` on the optimizer and calls step() whatever the gradients hold, and fusedoff's kernels
# unscale the gradients in registers and skip the update on overflow, with no host synchronisation
# (as torch's fused AdamW). Training loops read the same attribute with another meaning, "this
# optimizer unscales internally, so gradients cannot be unscaled and clipped before its step":
# Lightning then refuses `gradient_clip_val` even under bf16-mixed, which has no scaler at all, and
# skips its own `scaler.unscale_` under fp16. fusedoff's step takes gradients already unscaled as
# well (GradScaler then passes grad_scale=None and only found_inf), so the attribute is true for a
# GradScaler (any subclass) and false for every other reader: loops unscale and clip as for any
# optimizer, and GradScaler still leaves unscaling (or, after an explicit `unscale_`, the overflow
# skip) to the kernel.


def keeps_master(dtype: torch.dtype, master_weights: bool | None) -> bool:
    """Whether a parameter of `dtype` keeps fp32 master weights (``master_weights=None``: fp16/bf16 do)."""
    return dtype in LOW_PRECISION and master_weights in (None, True)


class FusedOptimizer(Optimizer):
    @property
    def _step_supports_amp_scaling(self) -> bool:
        """True for torch.amp.GradScaler only: see [note: who asks whether the step unscales]."""
        return isinstance(sys._getframe(1).f_locals.get("self"), torch.amp.GradScaler)

    def __init__(self, params, defaults: dict, *, backend: str, master_weights: bool | None, offload: str = "auto",
                 chunk_size: int | None = None, num_buffers: int = 2, device_budget: int | None = None,
                 master_precision: str = "fp32") -> None:
        if backend != "auto":
            backend_named(backend)  # raises, naming the backends there are
        if master_weights not in (None, True, False):
            raise ValueError(f"master_weights must be None, True or False, got {master_weights!r}")
        check_master_options(master_precision, master_weights)
        self._config = dict(offload=offload, chunk_size=chunk_size, num_buffers=num_buffers, device_budget=device_budget)
        self._start_engine(self._config)
        super().__init__(params, {**defaults, "backend": backend, "master_weights": master_weights,
                                  "master_precision": master_precision})
        self._wrap_state()
        self._register_hooks()

    def _start_engine(self, config: dict) -> None:
        self._engine = OffloadEngine(config["offload"], config["chunk_size"], config["num_buffers"],
                                     config["device_budget"], config.get("decided"))

    def _wrap_state(self) -> None:
        self.state = OptimizerState(self._engine.wait_host, dict.items(self.state))

    def _register_hooks(self) -> None:
        self._set_aside_hook = self.register_load_state_dict_pre_hook(checkpoint.set_states_aside)
        self.register_load_state_dict_post_hook(checkpoint.place_states, prepend=True)
        self.register_state_dict_post_hook(FusedOptimizer._states_as_saved)

    @staticmethod
    def _states_as_saved(optimizer: "FusedOptimizer", state_dict: dict) -> dict:
        """State-dict post-hook: for torch.distributed.checkpoint every state in torch's fp32 form
        (see [note: distributed checkpoints across forms] in fusedoff/optim/checkpoint.py), otherwise
        as the optimizer keeps them; the optimizer's own states are unchanged."""
        if checkpoint.for_distributed_checkpoint():
            return optimizer._states_in_fp32(state_dict)
        return optimizer._states_as_kept(state_dict)

    # ---- subclass interface ----------------------------------------------------------------
    def _state_names(self, group: dict) -> tuple[str, ...]:
        """The state tensors of one parameter, besides `step` and `master_param`."""
        raise NotImplementedError

    def _state_specs(self, group: dict) -> tuple[StateSpec, ...]:
        """How those states are stored (default: fp32, one value per element)."""
        return tuple(StateSpec(name) for name in self._state_names(group))

    # ---- what the engine asks (fusedoff.offload.contract.OptimizerRules) ----------------------
    def _bucket_specs(self, group: dict, dtype: torch.dtype) -> tuple[StateSpec, ...]:
        """The states of a parameter of `dtype` in `group`: the subclass's, and master weights (in
        the group's ``master_precision``) for fp16/bf16 parameters unless ``master_weights=False``."""
        keeps = keeps_master(dtype, group["master_weights"])
        return self._state_specs(group) + ((master_spec(group.get("master_precision", "fp32")),) if keeps else ())

    @staticmethod
    def _resolve_backend(group: dict, device: torch.device) -> str:
        return resolve_backend(group["backend"], device)

    def _upgraded_states(self, state_dict: dict, states: dict) -> dict:
        """The loaded states of `state_dict` ({param id: {name: tensor}}) in this version's encoding,
        where an older one wrote them (default: as they are)."""
        return states

    def _loaded_states(self, group: dict, param: Tensor, state: dict) -> dict:
        """A loaded parameter state (a checkpoint's, or torch.optim's) in the form `group` keeps:
        here the master weight, whole or split as the group keeps it (a split one read beside the
        parameter as it is now: load the model first); subclasses convert their own states. Raises
        before anything changes if it cannot be."""
        loaded = {name: state[name] for name in MASTER_NAMES if isinstance(state.get(name), Tensor)}
        if not loaded:
            return state
        if not keeps_master(param.dtype, group["master_weights"]):  # no master kept: none loaded
            return {k: v for k, v in state.items() if k not in MASTER_NAMES}
        precision = group.get("master_precision", "fp32")
        name, value = next(iter(loaded.items()))
        spec = master_spec(precision)
        if name == spec.name and value.dtype == spec.dtype:
            return state
        if precision != "fp32" and param.dtype != torch.bfloat16:
            raise ValueError(f"master_precision={precision!r} needs bfloat16 parameters, got {param.dtype}")
        local = local_tensor(param).detach()
        fp32 = value.to(torch.float32) if value.is_floating_point() else masters.join(local, local_tensor(value))
        out = {k: v for k, v in state.items() if k not in MASTER_NAMES}
        out[spec.name] = fp32 if precision == "fp32" else masters.split(fp32, precision)
        if precision != "fp32":
            # A parameter cast by torch from this master (ties to even) holds, at a tie, the other
            # nearest rounding, beside which no low bits give the master back (a bf16 unit short): it
            # takes fusedoff's (ties away from zero), beside which they do, once every loaded state has
            # converted. A parameter that is no rounding of the master is left as it is (load the model first).
            here = local_tensor(fp32).to(local.device)
            ties = masters.other_rounding_at_ties(here, local)
            if bool(ties.any()):
                out[LOADED_PARAM_VALUE] = torch.where(
                    ties, masters.param_of_master(here, local.dtype).reshape(local.shape), local)
        return out

    def _check_group_options(self, group: dict) -> None:
        """Raises if `group`'s fusedoff options cannot work together (a loaded group, or one
        changed since it was added); subclasses add their own."""
        check_master_options(group.get("master_precision", "fp32"), group.get("master_weights"))

    def _check_group_param(self, group: dict, param: Tensor) -> None:
        """Raises if `param` cannot be stepped with `group`'s options; subclasses add their own."""
        precision = group.get("master_precision", "fp32")
        if precision != "fp32" and keeps_master(param.dtype, group["master_weights"]) and param.dtype != torch.bfloat16:
            raise ValueError(f"master_precision={precision!r} splits a master weight around its bfloat16 parameter; "
                             f"an {param.dtype} parameter cannot be split exactly (an fp16 value near zero is the "
                             "rounding of up to 2^30 fp32 values): use master_precision='fp32' for its group")

    def fp32_state_dict(self) -> dict:
        """``state_dict()`` with master weights whole (fp32 ``master_param``), as torch's form has them."""
        state_dict = self._states_in_fp32(self.state_dict())
        state_dict["param_groups"] = [{**g, "master_precision": "fp32"} for g in state_dict["param_groups"]]
        return state_dict

    def _states_as_kept(self, state_dict: dict) -> dict:
        """`state_dict` (torch's, made by ``state_dict()``) for torch.save: as it is here."""
        return state_dict

    def _states_in_fp32(self, state_dict: dict) -> dict:
        """`state_dict` with every state in torch's fp32 form: here split masters joined with their
        parameters into whole fp32 ``master_param``; subclasses convert their own states. The
        groups are left as they are."""
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, state in list(state_dict["state"].items()):
            low = next((state[name] for name in MASTER_LOW_BITS.values() if isinstance(state.get(name), Tensor)), None)
            if low is not None:
                state = state_dict["state"][pid] = {k: v for k, v in state.items() if k not in MASTER_NAMES}
                local = local_tensor(params[pid]).detach()
                state[MASTER.name] = like_param(masters.join(local, local_tensor(low)).reshape(local.shape), params[pid])
        return state_dict

    def _fused_update(self, group: dict, backend: str, grad_scale: Tensor | None,
                      found_inf: Tensor | None, names: tuple[str, ...], params: list[Tensor]) -> FusedUpdate:
        """The fused update of one bucket of `group` whose states are `names` (master_param included
        when kept) and whose parameters are `params` (``UpdateArgs.tensors`` index them), for this step."""
        raise NotImplementedError

    # ---- gradient clipping -------------------------------------------------------------------
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clips the gradients of all parameters by their total norm, inside the next step.

        Returns the total norm (a tensor on the first gradient's device), computed from the
        gradients as they are stored (fp16/bf16/fp32, accumulated in fp32; on CPU torch's norm copies
        one low-precision gradient at a time to fp32, never all of them). The
        clip factor min(1, max_norm / (norm + 1e-6)) is not applied to the gradients: it is folded
        into the divisor the next ``step()`` applies inside its kernels, so nothing synchronises
        with the host and no gradient is rewritten. With ``torch.amp.GradScaler`` call
        ``scaler.unscale_(opt)`` first, as for ``torch.nn.utils.clip_grad_norm_``.
        """
        max_norm, norm_type = float(max_norm), float(norm_type)
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not params:
            return torch.zeros(())
        total = clipping.total_grad_norm(params, norm_type)
        self._clip_coef = clipping.clip_coefficient(max_norm, total)
        return total

    # ---- overlap with the next forward ---------------------------------------------------------------
    def overlap_with(self, model: torch.nn.Module, order=None) -> "OverlapHandle":
        """Lets the next forward start while the streamed step still runs: each module's forward
        waits only for the chunks holding its own parameters (see [note: overlap with the next
        forward] in fusedoff/optim/overlap.py). Returns a handle: ``remove()`` takes the hooks away,
        ``wait()`` waits for the whole step (before reading parameters outside their module's forward)."""
        return overlap_with(self, model, order)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none:  # zeroed in place on the main stream: after the chunks that read them
            self._engine.join()
        super().zero_grad(set_to_none)

    # ---- placement -----------------------------------------------------------------------------
    def set_device_budget(self, device_budget: int | None) -> None:
        """Changes the bytes of state kept on the parameters' device (None: as at construction,
        for offload='auto' decided again at the next step). Every state is placed afresh at the
        next step, keeping its value; until then states stay where they are."""
        self._engine.set_device_budget(device_budget)  # refused before anything changes if it cannot be
        self._config = {**self._config, "device_budget": device_budget}

    def memory_stats(self) -> dict:
        """Where the optimizer's bytes are.

        ``resident_bytes``: states (and master weights) kept on the parameters' device;
        ``streamed_bytes``/``host_bytes``: states in host memory (``host_pinned``: page-locked);
        ``device_bytes``: what the optimizer holds on the parameters' device now, resident states
        plus streaming buffers, and ``device_peak_bytes`` the most it has held; ``device_budget``:
        the budget in force (None before it is decided, and where nothing limits it);
        ``chunk_size`` (elements, after rounding up to 16) and ``num_buffers``.

        Bytes over the host-device link, counted as the engine issues its copies (every runtime:
        CUDA, the host loopback, the simulators): ``link_bytes_last_step`` and ``link_bytes_total``
        (over the optimizer's life), each ``{"to_device": bytes, "to_host": bytes}``;
        ``streamed_params_last_step``, the parameter elements whose states streamed in the last
        step, and ``link_bytes_per_param_last_step``, the bytes per such element each way (None when
        nothing streamed). ``streamed_params``: the parameter elements whose states live in host
        memory, and ``host_bytes_per_param`` their host bytes per element (None when none do).
        """
        return self._engine.memory_stats()

    # ---- torch.optim conventions -----------------------------------------------------------
    def _refuse_if_incomplete(self) -> None:
        """A step that failed among its changes left half a step in the states: a checkpoint or a
        copy of them would hold it silently (see [note: the step as a transaction])."""
        if self._engine.incomplete is not None:
            raise StepIncompleteError(self._engine.incomplete)

    def state_dict(self) -> dict:
        self._refuse_if_incomplete()
        return super().state_dict()

    def __getstate__(self) -> dict:
        self._refuse_if_incomplete()
        # torch keeps defaults, state and param_groups only: a copy also needs the engine's
        # configuration (and the budget decided at the first step, so that it places alike).
        self._engine.wait_host()
        return {**super().__getstate__(), "_fusedoff_config": {**self._config, "decided": self._engine.config()["decided"]}}

    def __setstate__(self, state: dict) -> None:
        config = state.pop("_fusedoff_config", None)
        super().__setstate__(state)
        # torch's __setstate__ adds 'differentiable' to the defaults, whence add_param_group would
        # copy it into every later group: fusedoff has no such option (see check_torch_flags).
        self.defaults.pop("differentiable", None)
        # A torch.optim (or reference) checkpoint's groups lack fusedoff's options: fill them in.
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        if config is not None:  # a copy (deepcopy, pickle): its own engine; states placed at its first step
            self._config = {k: v for k, v in config.items() if k != "decided"}
            self._start_engine(config)
            self._register_hooks()
        self._wrap_state()

    def add_param_group(self, param_group: dict) -> None:
        # torch checks the group's form (a dict, no set, tensors or (name, tensor) pairs, not both,
        # no parameter twice) and raises its own errors; fusedoff's checks come first, on the
        # tensors, so that a group either of them refuses leaves no trace.
        if isinstance(param_group, dict) and not isinstance(param_group.get("params", set()), set):
            params = param_group["params"]
            params = [params] if isinstance(params, Tensor) else list(params)  # read a generator once
            param_group = {**param_group, "params": params}
            check_group([p[1] if isinstance(p, tuple) else p for p in params])
            check_torch_flags(**{key: param_group[key] for key in TORCH_FLAGS if key in param_group})
        if isinstance(param_group, dict):
            merged = {**getattr(self, "defaults", {}), **param_group}
            check_master_options(merged.get("master_precision", "fp32"), merged.get("master_weights"))
        super().add_param_group(param_group)

    def register_load_state_dict_pre_hook(self, hook, prepend: bool = False):
        handle = super().register_load_state_dict_pre_hook(hook, prepend=prepend)
        if hasattr(self, "_set_aside_hook"):  # keep fusedoff's last, after every user pre-hook
            self._optimizer_load_state_dict_pre_hooks.move_to_end(self._set_aside_hook.id)
        return handle

    def _place_loaded_states(self) -> None:
        """After load_state_dict: every state placed afresh by the engine, values from ``opt.state``."""
        self._engine.place_loaded(self.param_groups, self.state, self)
        self._wrap_state()

    # ---- the step ------------------------------------------------------------------------------
    @torch.compiler.disable  # a graph break around the fused step: it runs eagerly under torch.compile
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)

        clip = getattr(self, "_clip_coef", None)

        def scaling(device: torch.device) -> tuple[Tensor | None, Tensor | None]:
            inf = found_inf.to(device, torch.float32, non_blocking=True) if found_inf is not None else None
            return clipping.grad_divisor(grad_scale, clip, device), inf

        taken = self._engine.steps_taken
        try:
            self._engine.step(self.param_groups, self.state, self, scaling)
        finally:
            # A clip factor applies to the one step after clip_grad_norm_: kept for the retry of a step
            # that failed before changing anything, spent by a whole one (an interrupt may follow it).
            if self._engine.steps_taken != taken:
                self._clip_coef = None
        return loss
