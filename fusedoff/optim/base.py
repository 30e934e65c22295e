"""What every fusedoff optimizer class shares: torch.optim conventions around a fused step.

A subclass names its fp32 state tensors and declares its fused update (`FusedUpdate`: phases,
the states each reads and writes, the call); this base validates input, keeps the states in
``opt.state`` (created lazily: fp32, plus fp32 master weights for fp16/bf16 parameters), hands
every bucket's step to the offload engine, which decides where the states live, and honours
GradScaler's ``grad_scale``/``found_inf`` and ``clip_grad_norm_``.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import Tensor
from torch.optim import Optimizer

from fusedoff import ops
from fusedoff.backends import resolve_backend
from fusedoff.offload import OffloadEngine, placement
from fusedoff.offload.update import FusedUpdate, StateSpec
from fusedoff.optim import checkpoint, clipping
from fusedoff.optim.state import OptimizerState, param_state
from fusedoff.optim.validation import LOW_PRECISION, TORCH_FLAGS, check_group, check_param, check_torch_flags
from fusedoff.sharding import local_tensor
from fusedoff.tensor_layout import flat_view, in_layout_of

OFFLOAD_MODES = ("auto", "none", "stream")

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


class FusedOptimizer(Optimizer):
    @property
    def _step_supports_amp_scaling(self) -> bool:
        """True for torch.amp.GradScaler only: see [note: who asks whether the step unscales]."""
        return isinstance(sys._getframe(1).f_locals.get("self"), torch.amp.GradScaler)

    def __init__(self, params, defaults: dict, *, backend: str, master_weights: bool | None, offload: str = "auto",
                 chunk_size: int | None = None, num_buffers: int = 2, device_budget: int | None = None) -> None:
        if backend not in ("auto", *ops.BACKENDS, *ops.TEST_BACKENDS):
            raise ValueError(f"backend must be 'auto' or one of {ops.BACKENDS}, got {backend!r}")
        if master_weights not in (None, True, False):
            raise ValueError(f"master_weights must be None, True or False, got {master_weights!r}")
        self._start_engine(dict(offload=offload, chunk_size=chunk_size, num_buffers=num_buffers,
                                device_budget=device_budget))
        super().__init__(params, {**defaults, "backend": backend, "master_weights": master_weights})
        self._wrap_state()
        self._register_hooks()

    def _start_engine(self, config: dict) -> None:
        offload, budget = config["offload"], config["device_budget"]
        if offload not in OFFLOAD_MODES:
            raise ValueError(f"offload must be one of {OFFLOAD_MODES}, got {offload!r}")
        if budget is not None:
            if offload == "none":
                raise ValueError("device_budget applies to offload='stream' or 'auto'; offload='none' keeps every "
                                 "state on the device")
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
                raise ValueError(f"device_budget must be None or a number of bytes >= 0, got {budget!r}")
        self._config = dict(config)
        self._engine = OffloadEngine(offload, config["chunk_size"], config["num_buffers"], budget)
        for device, limit in config.get("decided", {}).items():  # a copy keeps the original's decision
            self._engine.decide(device, limit)

    def _wrap_state(self) -> None:
        self.state = OptimizerState(self._engine.wait_host, dict.items(self.state))

    def _register_hooks(self) -> None:
        self._set_aside_hook = self.register_load_state_dict_pre_hook(checkpoint.set_states_aside)
        self.register_load_state_dict_post_hook(checkpoint.place_states, prepend=True)

    # ---- subclass interface ----------------------------------------------------------------
    def _state_names(self, group: dict) -> tuple[str, ...]:
        """The state tensors of one parameter, besides `step` and `master_param`."""
        raise NotImplementedError

    def _state_specs(self, group: dict) -> tuple[StateSpec, ...]:
        """How those states are stored (default: fp32, one value per element)."""
        return tuple(StateSpec(name) for name in self._state_names(group))

    def _loaded_states(self, group: dict, param: Tensor, state: dict) -> dict:
        """A loaded parameter state (a checkpoint's, or torch.optim's) in the form `group` keeps
        (default: as it is). Raises before anything changes if it cannot be."""
        return state

    def _check_group_options(self, group: dict) -> None:
        """Raises if `group`'s fusedoff options cannot work together (a loaded group, or one
        changed since it was added); default: nothing to check."""

    def _check_group_param(self, group: dict, param: Tensor) -> None:
        """Raises if `param` cannot be stepped with `group`'s options; default: nothing to check."""

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

    # ---- placement -----------------------------------------------------------------------------
    def set_device_budget(self, device_budget: int | None) -> None:
        """Changes the bytes of state kept on the parameters' device (None: as at construction,
        for offload='auto' decided again at the next step). Every state is placed afresh at the
        next step, keeping its value; until then states stay where they are."""
        self._engine.wait_host()
        self._start_engine({**self._config, "device_budget": device_budget})
        self._wrap_state()

    def memory_stats(self) -> dict:
        """Where the optimizer's bytes are.

        ``resident_bytes``: states (and master weights) kept on the parameters' device;
        ``streamed_bytes``/``host_bytes``: states in host memory (``host_pinned``: page-locked);
        ``device_bytes``: what the optimizer holds on the parameters' device now, resident states
        plus streaming buffers, and ``device_peak_bytes`` the most it has held; ``device_budget``:
        the budget in force (None before it is decided, and where nothing limits it);
        ``chunk_size`` (elements, after rounding up to 16) and ``num_buffers``.
        """
        return self._engine.memory_stats()

    # ---- torch.optim conventions -----------------------------------------------------------
    def __getstate__(self) -> dict:
        # torch keeps defaults, state and param_groups only: a copy also needs the engine's
        # configuration (and the budget decided at the first step, so that it places alike).
        self._engine.wait_host()
        decided = dict(self._engine.budget.limits) if self._config["device_budget"] is None else {}
        return {**super().__getstate__(), "_fusedoff_config": {**self._config, "decided": decided}}

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
        super().add_param_group(param_group)

    def register_load_state_dict_pre_hook(self, hook, prepend: bool = False):
        handle = super().register_load_state_dict_pre_hook(hook, prepend=prepend)
        if hasattr(self, "_set_aside_hook"):  # keep fusedoff's last, after every user pre-hook
            self._optimizer_load_state_dict_pre_hooks.move_to_end(self._set_aside_hook.id)
        return handle

    @staticmethod
    def _uses_master(group: dict, param: Tensor) -> bool:
        wanted = group["master_weights"]
        return param.dtype in LOW_PRECISION and (wanted is None or wanted)

    def _bucket_specs(self, group: dict, master: bool) -> tuple[StateSpec, ...]:
        return self._state_specs(group) + ((StateSpec("master_param"),) if master else ())

    def _layout(self, group_index: int, param: Tensor):
        """The engine layout of `param`'s bucket: the parameters of its group sharing its device,
        dtype and master-weight setting (fixed when the bucket first steps)."""
        group = self.param_groups[group_index]
        master = self._uses_master(group, param)
        key = (group_index, param.device, param.dtype, master)
        layout = self._engine.layouts.get(key)
        if layout is not None:
            return layout
        members = [p for p in group["params"]
                   if p.device == param.device and p.dtype == param.dtype and self._uses_master(group, p) == master]
        return self._engine.layout(key, members, self._bucket_specs(group, master), _initial_state)

    def _decide_budgets(self, devices) -> None:
        """The automatic budget of each device that has none yet (see fusedoff/offload/placement.py)."""
        for device in devices:
            if not self._engine.needs_decision(device):
                continue
            needed, buffers = 0, 0
            for group in self.param_groups:
                for p in group["params"]:
                    if p.device == device:
                        specs = self._bucket_specs(group, self._uses_master(group, p))
                        needed += sum(s.nbytes(local_tensor(p).numel()) for s in specs)
                        buffers = max(buffers, self._engine.buffer_bytes_for(specs))
            total, peak = self._engine.runtime(device).memory_info()
            self._engine.decide(device, placement.auto_budget(total, peak, needed, buffers))

    def _storage_changed(self) -> bool:
        """True when a group's options now store its states otherwise than its placed layouts do
        (``group["state_precision"]`` changed since the last step)."""
        for (index, _, _, master), layout in self._engine.layouts.items():
            if index < len(self.param_groups):
                specs = self._bucket_specs(self.param_groups[index], master)
                if tuple(layout.specs.values()) != specs:
                    return True
        return False

    def _place_loaded_states(self) -> None:
        """After load_state_dict: every state placed afresh (budgets of 'auto' decided again at the
        next step), values taken from ``opt.state``; those that cannot be placed before that step
        stay where they are, in fp32."""
        self._engine.wait_host()
        self._start_engine({**self._config, "decided": {}})
        converted = {}
        for group in self.param_groups:  # everything converted before anything changes
            for p in group["params"]:
                state = dict.get(self.state, p)
                if state:
                    converted[p] = dict(self._loaded_states(group, p, state))
        for index, group in enumerate(self.param_groups):
            for p in group["params"]:
                state = dict.get(self.state, p)
                if not state:
                    continue
                state.clear()
                state.update(converted[p])
                if self._engine.needs_decision(p.device):
                    fp32 = {s.name for s in self._bucket_specs(group, True) if s.dtype == torch.float32}
                    for key, value in state.items():
                        if key in fp32 and isinstance(value, Tensor) and value.dtype != torch.float32:
                            state[key] = value.to(torch.float32)
                    continue
                layout = self._layout(index, p)
                layout.adopt(layout.index[id(p)], state)
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

        # Validate everything before any state changes: a bad gradient leaves the optimizer untouched.
        work = []
        for index, group in enumerate(self.param_groups):
            self._check_group_options(group)
            buckets: dict[tuple, list[Tensor]] = defaultdict(list)
            for p in group["params"]:
                if p.grad is not None:
                    buckets[(p.device, p.dtype, self._uses_master(group, p))].append(p)
            for (device, _, master), params in buckets.items():
                backend = resolve_backend(group["backend"], device)
                for p in params:
                    check_param(p)
                    self._check_group_param(group, p)
                work.append((index, group, device, master, params, backend))
        if self._storage_changed():
            self._place_loaded_states()  # states kept afresh in the groups' new form, values converted
        self._decide_budgets({device for _, _, device, _, _, _ in work})
        placed = []
        for index, group, device, master, params, backend in work:
            layout = self._layout(index, params[0])
            states, grads, steps = {}, {}, {}
            for p in params:
                t = layout.index[id(p)]
                state = states[t] = param_state(self.state, p)
                if "step" not in state:
                    # A new or reset state (`del opt.state[p]`): every state starts afresh, as in torch.
                    state.clear()
                    state["step"] = torch.zeros((), dtype=torch.float32, device=device)
                layout.adopt(t, state)
                grads[t] = flat_view(in_layout_of(local_tensor(p.grad), local_tensor(p)))
                steps[t] = state["step"]
            placed.append((group, device, master, backend, layout, states, grads, steps))

        for _, _, _, _, layout, _, grads, _ in placed:
            self._engine.check_capturable(layout, grads)
        clip = getattr(self, "_clip_coef", None)
        for group, device, master, backend, layout, states, grads, steps in placed:
            divisor = clipping.grad_divisor(grad_scale, clip, device)
            inf = found_inf.to(device, torch.float32, non_blocking=True) if found_inf is not None else None
            ops.increment_steps_(list(steps.values()), inf)
            update = self._fused_update(group, backend, divisor, inf, layout.names, layout.params)
            self._engine.step(layout, update, states, grads, steps)
        self._clip_coef = None  # a clip factor applies to the one step after clip_grad_norm_
        return loss


def _initial_state(name: str, param: Tensor) -> Tensor | None:
    """A state's starting value: master weights start as the parameter, every other state at zero."""
    return param.detach() if name == "master_param" else None
