"""fusedoff.Adam and fusedoff.AdamW: torch.optim-compatible classes over the fused step."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

import torch
from torch import Tensor
from torch.optim import Optimizer

from fusedoff import ops
from fusedoff.backends import resolve_backend

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_SUPPORTED = (torch.float32, *_LOW_PRECISION)


class AdamW(Optimizer):
    """AdamW (decoupled weight decay) with a fused step, a drop-in for ``torch.optim.AdamW``.

    Args:
        params: parameters or param groups, as for any torch optimizer.
        lr: learning rate (float, or a 0-d tensor).
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator for numerical stability.
        weight_decay: decoupled weight decay (``p *= 1 - lr * weight_decay``).
        amsgrad: use the maximum of past squared-gradient averages.
        maximize: maximise the objective instead of minimising it.
        backend: "auto" (the fastest available for the parameters' device), "cpu" (C++), "cuda",
            "triton" or "torch" (pure PyTorch).
        master_weights: keep fp32 master weights for fp16/bf16 parameters (the kernel updates the
            master and writes the rounded value to the parameter). None means True for fp16/bf16
            parameters. States are always fp32; fp16/bf16 gradients are upcast inside the kernel.

    ``state_dict()`` uses torch's keys (``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``),
    plus ``master_param`` when master weights are kept. Honours ``torch.amp.GradScaler`` like
    torch's fused AdamW: gradients are unscaled inside the kernel and an overflowing step changes
    nothing, without a host synchronisation.
    """

    _decoupled_weight_decay = True

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        backend: str = "auto",
        master_weights: bool | None = None,
    ) -> None:
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("lr as a Tensor must have exactly one element")
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
        if backend not in ("auto", *ops.BACKENDS):
            raise ValueError(f"backend must be 'auto' or one of {ops.BACKENDS}, got {backend!r}")
        if master_weights not in (None, True, False):
            raise ValueError(f"master_weights must be None, True or False, got {master_weights!r}")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            backend=backend,
            master_weights=master_weights,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            self._check_group(group)
        # torch.amp.GradScaler sets `grad_scale` and `found_inf` on the optimizer and lets it
        # unscale in the kernel and skip on overflow (as torch's fused AdamW does).
        self._step_supports_amp_scaling = True

    def __setstate__(self, state: dict) -> None:
        # A torch.optim checkpoint's groups lack fusedoff's options: fill them from the defaults.
        super().__setstate__(state)
        for group in self.param_groups:
            for key in ("amsgrad", "maximize", "backend", "master_weights"):
                group.setdefault(key, self.defaults[key])

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_step_supports_amp_scaling"):  # after __init__; __init__ checks all at once
            self._check_group(self.param_groups[-1])

    @staticmethod
    def _check_group(group: dict) -> None:
        for p in group["params"]:
            if p.dtype not in _SUPPORTED:
                raise ValueError(f"fusedoff supports float32, float16 and bfloat16 parameters, got {p.dtype}")

    def _uses_master(self, group: dict, param: Tensor) -> bool:
        wanted = group["master_weights"]
        return param.dtype in _LOW_PRECISION and (wanted is None or wanted)

    def _init_state(self, group: dict, param: Tensor) -> dict:
        state = self.state[param]
        if not state:
            zeros = dict(dtype=torch.float32, device=param.device, memory_format=torch.preserve_format)
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            state["exp_avg"] = torch.zeros_like(param, **zeros)
            state["exp_avg_sq"] = torch.zeros_like(param, **zeros)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(param, **zeros)
            if self._uses_master(group, param):
                state["master_param"] = param.detach().to(torch.float32, copy=True)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a fusedoff or torch.optim Adam/AdamW state dict, keeping every state in fp32.

        torch's loader casts floating-point states to the parameter's dtype, which would round the
        moments of bf16/fp16 parameters; so the tensors are set aside, torch loads the rest (groups,
        hyperparameters, hooks), and the states are then placed on each parameter's device in fp32.
        """
        tensors = {
            pid: {k: v for k, v in s.items() if isinstance(v, Tensor)} for pid, s in state_dict["state"].items()
        }
        others = {pid: {k: v for k, v in s.items() if not isinstance(v, Tensor)} for pid, s in state_dict["state"].items()}
        super().load_state_dict({**state_dict, "state": others})
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, param in zip(saved_ids, params):
            for key, value in tensors.get(pid, {}).items():
                self.state[param][key] = value.to(device=param.device, dtype=torch.float32, copy=True)

    @staticmethod
    def _check_grad(param: Tensor) -> None:
        grad = param.grad
        if grad.is_sparse:
            raise RuntimeError("fusedoff.AdamW does not support sparse gradients")
        if grad.shape != param.shape:
            raise RuntimeError(f"gradient shape {tuple(grad.shape)} does not match parameter shape {tuple(param.shape)}")
        if grad.device != param.device:
            raise RuntimeError(f"gradient on {grad.device} but parameter on {param.device}")
        if grad.dtype not in _SUPPORTED:
            raise RuntimeError(f"fusedoff supports float32, float16 and bfloat16 gradients, got {grad.dtype}")

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
            for p in params:
                self._check_grad(p)
            work.append((group, params))

        for group, params in work:
            buckets: dict[tuple, list[Tensor]] = defaultdict(list)
            for p in params:
                key = (p.device, p.dtype, p.grad.dtype, self._uses_master(group, p))
                buckets[key].append(p)
            for (device, _, _, master), bucket in buckets.items():
                self._step_bucket(group, bucket, device, master, grad_scale, found_inf)
        return loss

    def _step_bucket(self, group, params, device, master, grad_scale, found_inf) -> None:
        backend = resolve_backend(group["backend"], device)
        states = [self._init_state(group, p) for p in params]
        steps = [s["step"] for s in states]
        scale = grad_scale.to(device, non_blocking=True) if grad_scale is not None else None
        inf = found_inf.to(device, torch.float32, non_blocking=True) if found_inf is not None else None
        ops.increment_steps_(steps, inf)
        beta1, beta2 = group["betas"]
        ops.adam_step_(
            [p.detach() for p in params],
            [p.grad.contiguous() for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else [],
            [s["master_param"] for s in states] if master else [],
            steps,
            lr=float(group["lr"]),
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            decoupled_weight_decay=self._decoupled_weight_decay,
            amsgrad=group["amsgrad"],
            maximize=group["maximize"],
            grad_scale=scale,
            found_inf=inf,
            backend=backend,
        )


class Adam(AdamW):
    """Adam with L2 weight decay (added to the gradient), a drop-in for ``torch.optim.Adam``.

    Same arguments as :class:`AdamW`, with ``weight_decay`` defaulting to 0.
    """

    _decoupled_weight_decay = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)
