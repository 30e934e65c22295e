"""fusedoff.Adam and fusedoff.AdamW: torch.optim-compatible classes over the fused step."""

from __future__ import annotations

import weakref
from collections.abc import Iterable

from torch import Tensor

from fusedoff import formats
from fusedoff.formats import Role
from fusedoff.hyperparameters import AdamHyperparameters
from fusedoff.kernels import codec
from fusedoff.offload.contract import FusedUpdate, Phase, StateSpec
from fusedoff.optim.base import MASTER_NAMES, FusedOptimizer
from fusedoff.optim.validation import check_torch_flags
from fusedoff.sharding import shard_key, zero_redundancy_owner


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
        host_share: float | str = "auto",
        host_threads: int | None = None,
    ) -> None:
        # torch's refusals first, in its order; then what fusedoff cannot do (capturable, differentiable).
        betas = _check_hyperparameters(lr, betas, eps, weight_decay, foreach, capturable)
        check_torch_flags(foreach=foreach, fused=fused, capturable=capturable, differentiable=differentiable)
        self._check_options(dict(state_precision=state_precision, seed=seed, amsgrad=amsgrad))
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        decoupled_weight_decay=decoupled_weight_decay, state_precision=state_precision, seed=seed)
        super().__init__(params, defaults, backend=backend, master_weights=master_weights, offload=offload,
                         chunk_size=chunk_size, num_buffers=num_buffers, device_budget=device_budget,
                         master_precision=master_precision, host_share=host_share, host_threads=host_threads)
        owner = zero_redundancy_owner()  # ZeRO-1's local optimizer: keys by ZeRO's (global) state dict
        self._zero_owner = weakref.ref(owner) if owner is not None else None

    def _key_positions(self) -> dict[int, int]:
        """Each parameter's index in the state dict, which keys its random stream: this optimizer's,
        or for ZeRO-1's local optimizer the consolidated (global) one (see sharding.zero_redundancy_owner)."""
        owner = self._zero_owner() if getattr(self, "_zero_owner", None) is not None else None
        groups = owner.param_groups if owner is not None else self.param_groups
        return {id(p): i for i, p in enumerate(p for g in groups for p in g["params"])}

    # ---- its states: roles, whose forms the group's state_precision picks (fusedoff/formats.py) --------
    state_precisions = tuple(formats.MOMENT_FORMS)

    @classmethod
    def _state_roles(cls, group: dict) -> dict[str, Role]:
        roles = {"exp_avg": Role.SIGNED_MOMENT, "exp_avg_sq": Role.SECOND_MOMENT}
        return {**roles, "max_exp_avg_sq": Role.RUNNING_MAX} if group["amsgrad"] else roles

    @classmethod
    def _check_options(cls, group: dict) -> None:
        """The state options of `group` (its precision, amsgrad, the seed of stochastic rounding)."""
        cls._check_state_options(group)
        seed = group.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")

    def _check_group_options(self, group: dict) -> None:
        super()._check_group_options(group)
        self._check_options(group)

    @classmethod
    def _default_options(cls, **options) -> dict:
        options = super()._default_options(**options)
        check_torch_flags(**{flag: options[flag] for flag in ("foreach", "fused", "capturable", "differentiable")})
        cls._check_options(options)
        betas = _check_hyperparameters(*(options[name] for name in ("lr", "betas", "eps", "weight_decay", "foreach",
                                                                     "capturable")))
        return {**options, "betas": betas}

    @classmethod
    def _phases(cls, group: dict, names: tuple[str, ...]) -> tuple[Phase, ...]:
        return (Phase("adam", reads=names, writes=names),)

    def _fused_update(self, group, backend, grad_scale, found_inf, names, params) -> FusedUpdate:
        beta1, beta2 = group["betas"]
        hyper = AdamHyperparameters(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                                    weight_decay=group["weight_decay"],
                                    decoupled_weight_decay=group["decoupled_weight_decay"], amsgrad=group["amsgrad"],
                                    maximize=group["maximize"])
        beside = dict(phases=self._phases(group, names), hyper=hyper, backend=backend,
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
            ``p.data.copy_(w)``) is where the next step starts (see docs/guides/one-gpu.md). fp16/bf16
            gradients are upcast inside the kernel.
        master_precision: how master weights are stored: "fp32" (default) whole; "split" their low 16
            bits only, the bf16 parameter being their upper half (2 bytes per parameter instead of 4,
            every result bit for bit those of "fp32"); "split8" 8 bits (1 byte; the master rounded
            stochastically to 24 bits each step, relative error < 2^-15). bf16 parameters only: an
            fp16 parameter cannot carry the upper half of its master (see docs/guides/precision.md). With master
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
        host_share: "auto" (the default), or the fraction (0 to 1) of each bucket's streamed
            elements whose states the host steps where they live, in host memory: only the
            gradient and the parameter cross the link (see [note: the host share] in
            fusedoff/offload/placement.py). "auto" chooses it from what the steps measure, on CUDA
            parameters with streamed states and backend "cuda" (see [note: the automatic host
            share] in fusedoff/offload/auto_share.py; ``memory_stats()["host_share_auto"]``), and
            is 0 elsewhere. A param-group option; a change between steps places the states afresh,
            keeping their values. A fraction above 0 is refused with offload="none". Every result
            is the same bit for bit whatever the share.
        host_threads: the threads of the host share's kernels (default: the CPUs this process may
            use, split among a node's ranks, less one: see
            ``fusedoff.offload.host_share.default_host_threads``).
        state_precision: how the two moments are stored: "fp32" (default), "bf16" (rounded
            stochastically) or "8bit" (blockwise, one fp32 scale per 256 elements); a param-group
            option (see docs/guides/precision.md).
        seed: keys the random bits of the bf16 states' stochastic rounding (default 0, so that
            data-parallel replicas round alike); kept in the param groups, so in the state dict.

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
        host_share: float | str = "auto",
        host_threads: int | None = None,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, backend=backend, master_weights=master_weights,
                         offload=offload, chunk_size=chunk_size, num_buffers=num_buffers, device_budget=device_budget,
                         state_precision=state_precision, seed=seed, master_precision=master_precision,
                         host_share=host_share, host_threads=host_threads)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # as torch's AdamW: whatever a loaded group said
            group["decoupled_weight_decay"] = True


def adam_state_specs(state_precision: str = "fp32", amsgrad: bool = False) -> tuple[StateSpec, ...]:
    """How Adam's states are stored per parameter (besides ``step`` and ``master_param``)."""
    return Adam._state_specs(dict(state_precision=state_precision, amsgrad=amsgrad))


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
