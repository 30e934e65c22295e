"""fusedoff.Adam and fusedoff.AdamW: torch.optim-compatible classes over the fused step."""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor

from fusedoff import ops
from fusedoff.offload.update import FusedUpdate, Phase, UpdateArgs
from fusedoff.optim.base import FusedOptimizer
from fusedoff.optim.validation import check_torch_flags


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
    ) -> None:
        # torch's refusals first, in its order; then what fusedoff cannot do (capturable, differentiable).
        betas = _check_hyperparameters(lr, betas, eps, weight_decay, foreach, capturable)
        check_torch_flags(foreach=foreach, fused=fused, capturable=capturable, differentiable=differentiable)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults, backend=backend, master_weights=master_weights, offload=offload,
                         chunk_size=chunk_size, num_buffers=num_buffers, device_budget=device_budget)

    def _state_names(self, group: dict) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else ("exp_avg", "exp_avg_sq")

    def _fused_update(self, group, backend, grad_scale, found_inf, names) -> FusedUpdate:
        beta1, beta2 = group["betas"]
        hyper = dict(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=group["eps"],
                     weight_decay=group["weight_decay"], decoupled_weight_decay=group["decoupled_weight_decay"],
                     amsgrad=group["amsgrad"], maximize=group["maximize"], grad_scale=grad_scale,
                     found_inf=found_inf, backend=backend)

        def call(phase: Phase, args: UpdateArgs) -> None:
            states = args.states
            ops.adam_step_(args.params, args.grads, states["exp_avg"], states["exp_avg_sq"],
                           states.get("max_exp_avg_sq", []), states.get("master_param", []), args.steps, **hyper)

        return FusedUpdate(phases=(Phase("adam", reads=names, writes=names),), call=call)


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
            parameters. States are always fp32; fp16/bf16 gradients are upcast inside the kernel.
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
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, backend=backend, master_weights=master_weights,
                         offload=offload, chunk_size=chunk_size, num_buffers=num_buffers, device_budget=device_budget)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # as torch's AdamW: whatever a loaded group said
            group["decoupled_weight_decay"] = True


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
