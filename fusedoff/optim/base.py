"""What every fusedoff optimizer class shares: torch.optim conventions around a fused step.

A subclass names its state tensors and declares its fused update (`FusedUpdate`, plain data: the
op, its phases and the states each reads and writes, which state feeds which argument); this base
validates input, keeps torch.optim's conventions (state_dict hooks, copies, param groups,
GradScaler's ``grad_scale``/``found_inf``, ``clip_grad_norm_``) and answers the engine's questions
(`fusedoff.offload.contract.OptimizerRules`).
The offload engine owns the rest: buckets, placement, ``opt.state`` adoption, master weights, the step.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import torch
from torch import Tensor
from torch.optim import Optimizer

from fusedoff import formats
from fusedoff.backends import backend_named, resolve_backend
from fusedoff.formats import MASTER, Role, StoredForm, check_master_options
from fusedoff.kernels import codec
from fusedoff.offload import OffloadEngine
from fusedoff.offload.contract import FusedUpdate, Phase, StateSpec
from fusedoff.offload.auto_share import AUTO
from fusedoff.offload.host_share import HOST_SHARE_KEY, check_host_share, check_host_threads
from fusedoff.offload.transaction import StepIncompleteError
from fusedoff.optim import checkpoint, clipping
from fusedoff.optim.overlap import OverlapHandle, overlap_with
from fusedoff.optim.state import OptimizerState
from fusedoff.optim.validation import LOW_PRECISION, TORCH_FLAGS, check_group, check_torch_flags

MASTER_NAMES = formats.MASTER_KEYS  # the keys a master weight is stored under, whatever its form


def master_spec(precision: str) -> StateSpec:
    """How a master weight of `precision` ("fp32", "split", "split8") is kept."""
    (spec,) = formats.master_form(precision).specs(MASTER)
    return spec


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
                 master_precision: str = "fp32", host_share: float | str = "auto",
                 host_threads: int | None = None) -> None:
        if backend != "auto":
            backend_named(backend)  # raises, naming the backends there are
        if master_weights not in (None, True, False):
            raise ValueError(f"master_weights must be None, True or False, got {master_weights!r}")
        check_master_options(master_precision, master_weights)
        check_host_share(host_share, offload)
        check_host_threads(host_threads)
        if "state_precision" in defaults:
            # which 8-bit map the group's codes are in: in every group, so that whatever copies the
            # groups (a state dict, DCP, ZeRO-1's consolidation) carries it with the codes
            defaults = {**defaults, codec.CODEC_VERSION_KEY: codec.CODEC_VERSION}
        self._config = dict(offload=offload, chunk_size=chunk_size, num_buffers=num_buffers, device_budget=device_budget,
                            host_threads=host_threads)
        self._start_engine(self._config)
        super().__init__(params, {**defaults, "backend": backend, "master_weights": master_weights,
                                  "master_precision": master_precision, HOST_SHARE_KEY: host_share})
        self._wrap_state()
        self._register_hooks()

    def _start_engine(self, config: dict) -> None:
        self._engine = OffloadEngine(config["offload"], config["chunk_size"], config["num_buffers"],
                                     config["device_budget"], config.get("decided"), config.get("host_threads"))

    def _wrap_state(self) -> None:
        self.state = OptimizerState(self._engine.wait_host, dict.items(self.state))

    def _register_hooks(self) -> None:  # at construction and in every copy (deepcopy, pickle)
        self.register_load_state_dict_pre_hook(checkpoint.keep_own_host_share)
        self.register_load_state_dict_pre_hook(checkpoint.checked_against_saved_forms)
        self._set_aside_hook = self.register_load_state_dict_pre_hook(checkpoint.set_states_aside)
        self.register_load_state_dict_post_hook(checkpoint.place_states, prepend=True)
        self.register_state_dict_post_hook(FusedOptimizer._states_as_saved)

    @staticmethod
    def _states_as_saved(optimizer: "FusedOptimizer", state_dict: dict) -> dict:
        """State-dict post-hook: for torch.distributed.checkpoint every state in torch's fp32 form
        (see [note: distributed checkpoints across forms] in fusedoff/optim/checkpoint.py), otherwise
        as the optimizer keeps them; the optimizer's own states are unchanged."""
        if checkpoint.for_distributed_checkpoint():
            return checkpoint.states_in_fp32(optimizer, state_dict)
        return checkpoint.states_as_kept(optimizer, state_dict)

    # ---- subclass interface ----------------------------------------------------------------
    # The state precisions a group of this optimizer may choose (see fusedoff/formats.py), and why
    # it takes no others (the end of the refusal's message).
    state_precisions: tuple[str, ...] = ("fp32",)
    why_not_other_precisions: str = ""

    @classmethod
    def _state_roles(cls, group: dict) -> dict[str, Role]:
        """The states of one parameter in `group` (besides ``step`` and its master weight) and
        their roles: a group's options pick each one's stored form."""
        raise NotImplementedError

    @classmethod
    def _phases(cls, group: dict, names: tuple[str, ...]) -> tuple[Phase, ...]:
        """The phases of a step of a bucket of `group` keeping states `names` (the states each reads
        and writes): what its `FusedUpdate` runs, and what ``fusedoff.memory.predict`` counts."""
        raise NotImplementedError

    @classmethod
    def _default_options(cls, **options) -> dict:
        """A param group's options with `options` and this class's defaults for the rest (what
        ``fusedoff.memory.predict`` asks the class without making an optimizer)."""
        signature = inspect.signature(cls.__init__)
        signature.bind(None, (), **options)  # an option the class does not take: its constructor's TypeError
        defaults = {name: p.default for name, p in signature.parameters.items() if p.default is not inspect.Parameter.empty}
        return {**defaults, **options}

    # ---- stored forms (fusedoff/formats.py) ------------------------------------------------------
    @classmethod
    def _stored_forms(cls, group: dict, dtype: torch.dtype) -> dict[str, tuple[Role, StoredForm]]:
        """Each state a parameter of `dtype` in `group` keeps, with its role and stored form: the
        subclass's states in the group's ``state_precision``, and the master weight (in its
        ``master_precision``) for fp16/bf16 parameters unless ``master_weights=False``."""
        moments = formats.moment_form(group.get("state_precision", "fp32"))
        forms = {name: (role, moments) for name, role in cls._state_roles(group).items()}
        for role, form in forms.values():
            form.refuse(role, "state_precision")
        if keeps_master(dtype, group["master_weights"]):
            forms[MASTER] = (Role.MASTER_WEIGHT, formats.master_form(group.get("master_precision", "fp32")))
        return forms

    @classmethod
    def _state_specs(cls, group: dict) -> tuple[StateSpec, ...]:
        """The tensors a parameter's states are stored in, besides ``step`` and master weights: each
        state's values first, then what their forms keep beside them (8-bit block scales)."""
        moments = formats.moment_form(group.get("state_precision", "fp32"))
        roles = cls._state_roles(group)
        for role in roles.values():
            moments.refuse(role, "state_precision")
        per_state = [moments.specs(name) for name in roles]
        return tuple(specs[k] for k in range(max(map(len, per_state), default=0)) for specs in per_state
                     if k < len(specs))

    @classmethod
    def _state_names(cls, group: dict) -> tuple[str, ...]:
        return tuple(spec.name for spec in cls._state_specs(group))

    @classmethod
    def _check_state_options(cls, group: dict) -> None:
        """Refuses a state precision this optimizer does not take, or whose form cannot keep one of
        its states (amsgrad's running maximum compressed)."""
        precision = group.get("state_precision", "fp32")
        if precision not in cls.state_precisions:
            if cls.why_not_other_precisions:
                raise ValueError(f"fusedoff.{cls.__name__} keeps {' or '.join(cls.state_precisions)} states only, "
                                 f"got state_precision={precision!r}{cls.why_not_other_precisions}")
            raise ValueError(f"state_precision must be one of {cls.state_precisions}, got {precision!r}")
        form = formats.moment_form(precision)
        for role in cls._state_roles(group).values():
            form.refuse(role, "state_precision")

    # ---- what the engine asks (fusedoff.offload.contract.OptimizerRules) ----------------------
    def _bucket_specs(self, group: dict, dtype: torch.dtype) -> tuple[StateSpec, ...]:
        """The states of a parameter of `dtype` in `group`, master weights last (when kept)."""
        keeps = keeps_master(dtype, group["master_weights"])
        return self._state_specs(group) + ((master_spec(group.get("master_precision", "fp32")),) if keeps else ())

    @staticmethod
    def _resolve_backend(group: dict, device: torch.device) -> str:
        return resolve_backend(group["backend"], device)

    def _loaded_states(self, group: dict, param: Tensor, state: dict) -> dict:
        """A loaded parameter state (a checkpoint's, or torch.optim's) in the forms `group` keeps
        (see `checkpoint.loaded_states`); raises before anything changes if it cannot be."""
        return checkpoint.loaded_states(self, group, param, state)

    def _check_group_options(self, group: dict) -> None:
        """Raises if `group`'s fusedoff options cannot work together (a loaded group, or one
        changed since it was added); subclasses add their own."""
        check_master_options(group.get("master_precision", "fp32"), group.get("master_weights"))
        check_host_share(group.get(HOST_SHARE_KEY, AUTO), self._config["offload"])
        self._check_state_options(group)

    def _check_group_param(self, group: dict, param: Tensor) -> None:
        """Raises if `param` cannot be stepped with `group`'s options."""
        if keeps_master(param.dtype, group["master_weights"]):
            formats.check_master_param(group.get("master_precision", "fp32"), param.dtype)

    def fp32_state_dict(self) -> dict:
        """``state_dict()`` with every state in torch's fp32 form: compressed moments decoded (their
        block scales left out), master weights whole (fp32 ``master_param``): what torch.optim's
        ``load_state_dict`` takes. The groups keep fusedoff's options (torch ignores them), saying
        fp32 as their states are (``state_precision``, ``master_precision``)."""
        state_dict = checkpoint.states_in_fp32(self, self.state_dict())
        state_dict["param_groups"] = [{**g, "master_precision": "fp32",
                                       **({"state_precision": "fp32"} if "state_precision" in g else {})}
                                      for g in state_dict["param_groups"]]
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
        nothing streamed). ``streamed_params``: the parameter elements whose states stream from
        host memory, and ``host_bytes_per_param`` their host bytes per element (None when none do).

        The host share (``host_share``): ``host_computed_params``, the parameter elements whose
        states the host steps in host memory; ``host_computed_bytes``, those states' bytes (in
        ``host_bytes``, not in ``streamed_bytes``); ``host_share_buffer_bytes``, the page-locked
        buffers of their parameters, gradients and step counts. ``streamed_params_last_step``
        counts the host-computed elements of that step too (their gradients and parameters
        crossed the link).
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
        if isinstance(param_group, dict):  # the group's own options, checked before torch adds it
            self._check_group_options({**getattr(self, "defaults", {}), **param_group})
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
