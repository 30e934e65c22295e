"""What every fusedoff optimizer class shares: torch.optim conventions around a fused step.

A subclass names its fp32 state tensors and runs one fused step for a bucket of parameters that
share a device and dtypes; this base validates input, creates states lazily (fp32, plus fp32
master weights for fp16/bf16 parameters), honours GradScaler's `grad_scale`/`found_inf`, and keeps
states in fp32 through `load_state_dict`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
from torch import Tensor
from torch.optim import Optimizer

from fusedoff import ops
from fusedoff.backends import resolve_backend
from fusedoff.offload import OffloadedBucket, OffloadEngine
from fusedoff.sharding import all_reduce_over_shards_, is_dtensor, like_param, local_tensor, state_for_param

LOW_PRECISION = (torch.float16, torch.bfloat16)
SUPPORTED_DTYPES = (torch.float32, *LOW_PRECISION)
# Group options that fusedoff adds to torch's (filled from the defaults for foreign checkpoints).
FUSEDOFF_OPTIONS = ("backend", "master_weights")


OFFLOAD_MODES = ("auto", "none", "stream")


class FusedOptimizer(Optimizer):
    def __init__(self, params, defaults: dict, *, backend: str, master_weights: bool | None, offload: str = "auto",
                 chunk_size: int | None = None, num_buffers: int = 2) -> None:
        if offload not in OFFLOAD_MODES:
            raise ValueError(f"offload must be one of {OFFLOAD_MODES}, got {offload!r}")
        self._offload = offload
        self._engine = OffloadEngine(chunk_size, num_buffers)
        if backend not in ("auto", *ops.BACKENDS):
            raise ValueError(f"backend must be 'auto' or one of {ops.BACKENDS}, got {backend!r}")
        if master_weights not in (None, True, False):
            raise ValueError(f"master_weights must be None, True or False, got {master_weights!r}")
        super().__init__(params, {**defaults, "backend": backend, "master_weights": master_weights})
        # fusedoff's own state-dict work runs as hooks, placed so that a user's hooks see complete
        # dicts: packing first among the post-hooks, setting states aside after the user's pre-hooks,
        # placing them first among the load post-hooks.
        self.register_state_dict_post_hook(FusedOptimizer._pack_host_states, prepend=True)
        self._set_aside_hook = self.register_load_state_dict_pre_hook(FusedOptimizer._set_states_aside)
        self.register_load_state_dict_post_hook(FusedOptimizer._place_states, prepend=True)
        # torch.amp.GradScaler sets `grad_scale` and `found_inf` on the optimizer and lets it
        # unscale in the kernel and skip on overflow (as torch's fused AdamW does).
        self._step_supports_amp_scaling = True

    # ---- subclass interface ----------------------------------------------------------------
    def _state_names(self, group: dict) -> tuple[str, ...]:
        """The fp32 state tensors of one parameter, besides `step` and `master_param`."""
        raise NotImplementedError

    def _fused_step(self, group: dict, bucket: "ParamBucket") -> None:
        """One fused step over `bucket` (steps already incremented)."""
        raise NotImplementedError

    def _streamed_step(self, group: dict, bucket: "ParamBucket", offloaded: OffloadedBucket,
                       grads: dict[int, Tensor]) -> None:
        """One fused step with the states in `offloaded` (host memory), through its pipeline;
        `grads` maps the positions of the stepping tensors in `offloaded.params` to their gradients."""
        raise NotImplementedError

    # ---- gradient clipping -------------------------------------------------------------------
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clips the gradients of all parameters by their total norm, inside the next step.

        Returns the total norm (a tensor on the first gradient's device), computed from the
        gradients as they are stored (fp16/bf16/fp32, accumulated in fp32, no fp32 copies). The
        clip factor min(1, max_norm / (norm + 1e-6)) is not applied to the gradients: it is folded
        into the divisor the next ``step()`` applies inside its kernels, so nothing synchronises
        with the host and no gradient is rewritten. With ``torch.amp.GradScaler`` call
        ``scaler.unscale_(opt)`` first, as for ``torch.nn.utils.clip_grad_norm_``.
        """
        max_norm, norm_type = float(max_norm), float(norm_type)
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not params:
            return torch.zeros(())
        by_device: dict[torch.device, list[int]] = defaultdict(list)
        for t, p in enumerate(params):
            by_device[p.grad.device].append(t)
        first = params[0].grad.device
        # An empty gradient (a rank's empty shard of a small FSDP2 parameter) has norm 0, the identity
        # of both ways of combining norms; torch's inf-norm of nothing raises instead.
        norms: list[Tensor] = [torch.zeros((), device=first)] * len(params)
        for rows in by_device.values():
            rows = [t for t in rows if local_tensor(params[t].grad).numel()]
            local_grads = [local_tensor(params[t].grad) for t in rows]
            for t, n in zip(rows, torch._foreach_norm(local_grads, norm_type, dtype=torch.float32)):
                norms[t] = n.to(first, non_blocking=True)
        stacked = torch.stack(norms)
        inf = norm_type == float("inf")
        if any(is_dtensor(p) for p in params):
            # A sharded gradient's norm combines the shards' norms: max, or the p-th root of the
            # sum of p-th powers, over the ranks holding its shards.
            partial = stacked if inf else stacked.pow(norm_type)
            all_reduce_over_shards_(partial, params, "max" if inf else "sum")
            total = partial.max() if inf else partial.sum().pow(1.0 / norm_type)
        elif inf:
            total = stacked.max()
        else:
            total = torch.linalg.vector_norm(stacked, norm_type)
        self._clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return total

    def _grad_divisor(self, grad_scale: Tensor | None, device: torch.device) -> Tensor | None:
        """What the kernels divide gradients by: the AMP scale and, after clip_grad_norm_, 1 / clip factor."""
        clip = getattr(self, "_clip_coef", None)
        scale = grad_scale.to(device, non_blocking=True) if grad_scale is not None else None
        if clip is None:
            return scale
        clip = clip.to(device, non_blocking=True)
        return (scale / clip if scale is not None else 1.0 / clip).reshape(()).to(torch.float32)

    # ---- offload -----------------------------------------------------------------------------
    def _streams(self, device: torch.device) -> bool:
        """Whether states of parameters on `device` live in host memory and stream through the engine."""
        return self._offload == "stream" or (self._offload == "auto" and device.type == "cuda")

    def _offloaded_bucket(self, group: dict, param: Tensor) -> OffloadedBucket:
        """The engine bucket holding `param`'s states: every parameter of its group sharing its
        device, dtype and master-weight setting (fixed at first use)."""
        found = self._engine.find(param)
        if found is not None:
            return found[0]
        master = self._uses_master(group, param)
        group_index = next(i for i, g in enumerate(self.param_groups) if g is group)  # by identity
        key = (group_index, param.device, param.dtype, master)
        members = [p for p in group["params"]
                   if p.device == param.device and p.dtype == param.dtype and self._uses_master(group, p) == master]
        names = self._state_names(group) + (("master_param",) if master else ())
        return self._engine.bucket(key, members, names,
                                   lambda name, p: local_tensor(p) if name == "master_param" else None)

    def memory_stats(self) -> dict:
        """Where the optimizer's bytes are: host state (and whether it is pinned) and device memory.

        ``device_bytes`` is what the optimizer holds on the device now (its streaming buffers, and
        for offload='none' its states); ``device_peak_bytes`` the most it has held.
        """
        stats = self._engine.memory_stats()
        resident = sum(
            local_tensor(t).numel() * t.element_size()
            for state in self.state.values()
            for key, t in state.items()
            if isinstance(t, Tensor) and key != "step" and t.device.type == "cuda"
        )
        stats["device_bytes"] += resident
        stats["device_peak_bytes"] = max(stats["device_peak_bytes"], stats["device_bytes"])
        return stats

    # ---- torch.optim conventions -----------------------------------------------------------
    def __setstate__(self, state: dict) -> None:
        # A torch.optim (or reference) checkpoint's groups lack fusedoff's options: fill them in.
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        self._check_group({"params": params})  # before torch appends the group: a bad one leaves no trace
        super().add_param_group({**param_group, "params": params})

    def _check_group(self, group: dict) -> None:
        devices = {p.device for p in group["params"]}
        if len(devices) > 1:
            raise ValueError(f"the parameters of one param group must be on one device, got {sorted(map(str, devices))}")
        for p in group["params"]:
            if p.dtype not in SUPPORTED_DTYPES:
                raise ValueError(f"fusedoff supports float32, float16 and bfloat16 parameters, got {p.dtype}")
            if self._streams(p.device) and not local_tensor(p).is_contiguous():
                # The host store lays each tensor out flat, in memory order, and a bucket holds every
                # parameter of its group: refuse now rather than at the first step.
                raise ValueError(f"offload='stream' needs contiguous parameters, got one of shape {tuple(p.shape)} "
                                 f"with strides {p.stride()}; make it contiguous or use offload='none'")

    @staticmethod
    def _uses_master(group: dict, param: Tensor) -> bool:
        wanted = group["master_weights"]
        return param.dtype in LOW_PRECISION and (wanted is None or wanted)

    def _init_state(self, group: dict, param: Tensor) -> dict:
        """The parameter's state, with whatever is missing created (a torch.optim checkpoint has no
        master weights, for instance)."""
        state = self.state[param]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
        for name in self._state_names(group):
            if name not in state:
                state[name] = torch.zeros_like(param, dtype=torch.float32, memory_format=torch.preserve_format)
        if self._uses_master(group, param) and "master_param" not in state:
            state["master_param"] = param.detach().to(torch.float32, copy=True)
        return state

    def register_load_state_dict_pre_hook(self, hook, prepend: bool = False):
        handle = super().register_load_state_dict_pre_hook(hook, prepend=prepend)
        if hasattr(self, "_set_aside_hook"):  # keep fusedoff's last, after every user pre-hook
            self._optimizer_load_state_dict_pre_hooks.move_to_end(self._set_aside_hook.id)
        return handle

    @staticmethod
    def _set_states_aside(self: "FusedOptimizer", state_dict: dict) -> dict:
        """Load pre-hook: validates, then keeps the state tensors out of torch's loader.

        torch's loader casts floating-point states to the parameter's dtype, which would round the
        states of bf16/fp16 parameters, and moves them to the parameter's device, which for
        streamed states would materialise them on the GPU. So they are set aside here and placed by
        `_place_states` (fp32, on the device or in host memory) once torch has loaded the rest.
        """
        states = state_dict["state"]
        tensors = {pid: {k: v for k, v in s.items() if isinstance(v, Tensor) or k == "step"} for pid, s in states.items()}
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, param in zip(saved_ids, params):  # check everything before changing anything
            for key, value in tensors.get(pid, {}).items():
                if key != "step" and torch.as_tensor(value).numel() != param.numel():
                    raise ValueError(f"state {key!r} of parameter {pid} has {torch.as_tensor(value).numel()} elements "
                                     f"but the parameter has {param.numel()}")
                if key != "step":
                    state_for_param(value, param, key)  # raises if sharded unlike the parameter
        self._states_set_aside = (saved_ids, tensors)
        others = {pid: {k: v for k, v in s.items() if k not in tensors[pid]} for pid, s in states.items()}
        return {**state_dict, "state": others}

    @staticmethod
    def _place_states(self: "FusedOptimizer") -> None:
        """Load post-hook: puts the set-aside states in place, in fp32; streamed ones in host memory."""
        saved_ids, tensors = self._states_set_aside
        del self._states_set_aside
        self._engine.wait_host()
        self._engine.buckets.clear()  # host states start afresh, like torch's self.state
        owners = [(g, p) for g in self.param_groups for p in g["params"]]
        for pid, (group, param) in zip(saved_ids, owners):
            streamed = self._offloaded_bucket(group, param) if self._streams(param.device) else None
            for key, value in tensors.get(pid, {}).items():
                value = torch.as_tensor(value)  # the reference Apollo keeps `step` as an int
                if streamed is not None and key in streamed.names:
                    # Host states stay in host memory: a large run resumes without touching the GPU.
                    local = state_for_param(value, param, key)
                    streamed.store.write(key, streamed.index[id(param)], local.to(torch.float32))
                else:
                    self.state[param][key] = value.to(device=param.device, dtype=torch.float32, copy=True)

    def _check_param(self, param: Tensor, backend: str) -> None:
        """Everything the fused ops and the engine would reject, checked before any state changes."""
        if not local_tensor(param).is_contiguous() and backend != "torch":
            # The native and Triton kernels walk a tensor's elements in memory order.
            raise ValueError(f"backend={backend!r} needs contiguous parameters, got one of shape {tuple(param.shape)} "
                             f"with strides {param.stride()}; make it contiguous or use backend='torch'")
        self._check_grad(param)

    @staticmethod
    def _check_grad(param: Tensor) -> None:
        grad = param.grad
        if grad.is_sparse:
            raise RuntimeError("fusedoff does not support sparse gradients")
        if grad.shape != param.shape:
            raise RuntimeError(f"gradient shape {tuple(grad.shape)} does not match parameter shape {tuple(param.shape)}")
        if grad.device != param.device:
            raise RuntimeError(f"gradient on {grad.device} but parameter on {param.device}")
        if grad.dtype not in SUPPORTED_DTYPES:
            raise RuntimeError(f"fusedoff supports float32, float16 and bfloat16 gradients, got {grad.dtype}")
        if is_dtensor(grad) != is_dtensor(param) or (is_dtensor(param) and grad.placements != param.placements):
            raise RuntimeError(f"gradient sharded as {getattr(grad, 'placements', 'a plain tensor')} "
                               f"but parameter as {getattr(param, 'placements', 'a plain tensor')}")

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
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            buckets: dict[tuple, list[Tensor]] = defaultdict(list)
            for p in params:
                buckets[(p.device, p.dtype, p.grad.dtype, self._uses_master(group, p))].append(p)
            for (device, _, _, master), bucket in buckets.items():
                backend = resolve_backend(group["backend"], device)
                for p in bucket:
                    self._check_param(p, backend)
                work.append((group, device, master, bucket, backend))

        for group, device, master, params, backend in work:
            if self._streams(device):
                self._step_streamed(group, device, params, backend, grad_scale, found_inf)
                continue
            states = [self._init_state(group, p) for p in params]
            bucket = ParamBucket(
                originals=params,
                params=[local_tensor(p.detach()) for p in params],
                grads=[local_tensor(p.grad).contiguous() for p in params],
                states=states,
                master_params=[local_tensor(s["master_param"]) for s in states] if master else [],
                steps=[s["step"] for s in states],
                grad_scale=self._grad_divisor(grad_scale, device),
                found_inf=found_inf.to(device, torch.float32, non_blocking=True) if found_inf is not None else None,
                backend=backend,
            )
            ops.increment_steps_(bucket.steps, bucket.found_inf)
            self._fused_step(group, bucket)
        self._clip_coef = None  # a clip factor applies to the one step after clip_grad_norm_
        return loss


    def _step_streamed(self, group, device, params, backend, grad_scale, found_inf) -> None:
        by_bucket: dict[int, tuple[OffloadedBucket, dict[int, Tensor]]] = {}
        for p in params:
            offloaded = self._offloaded_bucket(group, p)
            by_bucket.setdefault(id(offloaded), (offloaded, {}))[1][offloaded.index[id(p)]] = local_tensor(p.grad).contiguous()
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=device)
        for offloaded, grads in by_bucket.values():
            stepping = [offloaded.params[t] for t in grads]
            bucket = ParamBucket(
                originals=stepping,
                params=[local_tensor(p.detach()) for p in stepping],
                grads=list(grads.values()),
                states=[self.state[p] for p in stepping],
                master_params=[],
                steps=[self.state[p]["step"] for p in stepping],
                grad_scale=self._grad_divisor(grad_scale, device),
                found_inf=found_inf.to(device, torch.float32, non_blocking=True) if found_inf is not None else None,
                backend=backend,
            )
            ops.increment_steps_(bucket.steps, bucket.found_inf)
            self._streamed_step(group, bucket, offloaded, grads)

    @staticmethod
    def _pack_host_states(self: "FusedOptimizer", state_dict: dict) -> dict:
        """State-dict post-hook: adds the streamed states, read from host memory (views where a
        state lies in one slab, copies otherwise) once the last copies back have finished."""
        self._engine.wait_host()
        if not self._engine.buckets:
            return state_dict
        ids = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        packed = dict(state_dict["state"])
        for offloaded in self._engine.buckets.values():
            for t, p in enumerate(offloaded.params):
                pid = ids[id(p)]
                if pid in packed:  # parameters that never stepped have no state, as in torch
                    states = {name: like_param(offloaded.store.read(name, t), p) for name in offloaded.names}
                    packed[pid] = {**packed[pid], **states}
        return {**state_dict, "state": packed}


class ParamBucket:
    """Parameters of one group that share a device and dtypes, with their states: one fused call.

    `params`, `grads` and `master_params` are what the kernels update (a sharded parameter's local
    shard); `originals` the parameters as the user holds them (whole-tensor sizes, shard groups).
    """

    def __init__(self, *, originals, params, grads, states, master_params, steps, grad_scale, found_inf, backend):
        self.originals = originals
        self.params = params
        self.grads = grads
        self.states = states
        self.master_params = master_params
        self.steps = steps
        self.grad_scale = grad_scale
        self.found_inf = found_inf
        self.backend = backend

    def state_list(self, name: str) -> list[Tensor]:
        """State `name` of each parameter, as the kernels see it (a sharded state's local shard)."""
        return [local_tensor(s[name]) for s in self.states]
