"""fusedoff.Apollo: the diagonal quasi-Newton optimizer, fused and exact."""

from __future__ import annotations

import torch

from fusedoff import ops
from fusedoff.formats import Role
from fusedoff.hyperparameters import ApolloHyperparameters
from fusedoff.offload.contract import FusedUpdate, Phase, ShardReduction
from fusedoff.optim.base import MASTER_NAMES, FusedOptimizer

# How the shards of a sharded (FSDP2) tensor combine their partial sums, after the phase that fills
# them: columns of `stats` (ApolloStat in csrc/include/fusedoff/apollo.h). The sums add up; the
# belief bound max |g - m| is a max.
_SHARD_REDUCTIONS = {
    "reduce": (ShardReduction(0, 3, "sum"), ShardReduction(3, 4, "max")),
    "moments": (ShardReduction(4, 5, "sum"),),
}


class Apollo(FusedOptimizer):
    """Apollo (Ma, "Apollo: An Adaptive Parameter-wise Diagonal Quasi-Newton Method for Nonconvex
    Stochastic Optimization", arXiv 2009.13586), fused, with the reference implementation's
    semantics (XuezheMax/apollo, ``optim/apollo.py``, the revision with sigma = 0.01).

    Not to be confused with the unrelated 2024 "APOLLO" optimizer (a low-rank, memory-efficient
    AdamW variant): this is the diagonal quasi-Newton method, which keeps three fp32 states per
    parameter: ``exp_avg_grad`` (m), ``approx_hessian`` (B) and ``update`` (d).

    Args:
        params: parameters or param groups.
        lr: learning rate after warmup (required, > 0).
        beta: coefficient of the running average of the gradient, in [0, 1).
        eps: >= 0. With ``rebound='constant'`` the step uses eps / 0.01 in the denominator of the
            4-norm; eps = 0 is accepted as the reference accepts it, and then yields NaN at step 1
            in constant mode (the previous update d is zero, so 0 / 0), exactly as the reference does.
        rebound: ``'constant'`` (curvature floored at 0.01) or ``'belief'`` (floored at the
            largest ``|g - m|`` of the tensor, plus eps / alpha).
        warmup: steps of linear warmup from ``init_lr`` to ``lr``, per parameter tensor.
        init_lr: learning rate at step 0 of the warmup; defaults to lr / 1000; 0 <= init_lr <= lr.
        weight_decay: >= 0.
        weight_decay_type: ``'L2'`` (added to the gradient), ``'decoupled'`` (added to the update) or
            ``'stable'`` (added to the update, divided by the mean curvature); defaults to 'L2' for
            constant rebound and 'decoupled' for belief.
        state_precision: "fp32" only (see "Compressed optimizer states" in docs/guides/precision.md).
        backend, master_weights, master_precision, offload, chunk_size, num_buffers, device_budget, host_share, host_threads:
            as for :class:`fusedoff.AdamW`.

    Streamed chunks holding only whole tensors run every phase in one visit; the chunks of tensors
    spanning chunks are streamed once per phase (reduce, apply; with 'stable' decay reduce,
    moments, finish), since the sums cover whole tensors. Every sum, max and mean of the step runs
    over the whole parameter tensor, as in the reference, computed as a deterministic reduction
    followed by an apply pass, without host synchronisation.
    ``state_dict()`` uses the reference's keys and keeps ``step`` as an int, so checkpoints move
    between the reference implementation and fusedoff in both directions.
    """

    def __init__(self, params, lr: float, beta: float = 0.9, eps: float = 1e-4, rebound: str = "constant",
                 warmup: int = 500, init_lr: float | None = None, weight_decay: float = 0,
                 weight_decay_type: str | None = None, *, backend: str = "auto",
                 master_weights: bool | None = None, offload: str = "auto", chunk_size: int | None = None,
                 num_buffers: int = 2, device_budget: int | None = None, state_precision: str = "fp32",
                 master_precision: str = "fp32", host_share: float | str = "auto",
                 host_threads: int | None = None) -> None:
        self._check_state_options({"state_precision": state_precision})
        defaults = _checked_defaults(lr, beta, eps, rebound, warmup, init_lr, weight_decay, weight_decay_type)
        super().__init__(params, defaults, backend=backend, master_weights=master_weights, offload=offload,
                         chunk_size=chunk_size, num_buffers=num_buffers, device_budget=device_budget,
                         master_precision=master_precision, host_share=host_share, host_threads=host_threads)

    def _register_hooks(self) -> None:  # at construction and in every copy (deepcopy, pickle)
        super()._register_hooks()
        self.register_state_dict_post_hook(Apollo._steps_as_ints, prepend=True)

    # Compressed Apollo states: see `why_not_other_precisions`.
    why_not_other_precisions = (": compressed Apollo states are not implemented (its curvature B and update d feed "
                                "whole-tensor sums every step, and no quality check has been run for them "
                                "compressed); fusedoff.AdamW and fusedoff.Adam take 'bf16' and '8bit'")

    @classmethod
    def _state_roles(cls, group: dict) -> dict[str, Role]:
        # (kept in fp32 only: a role would choose the 8-bit map of a compressed form)
        return {"exp_avg_grad": Role.SIGNED_MOMENT, "approx_hessian": Role.SIGNED_MOMENT, "update": Role.SIGNED_MOMENT}

    @classmethod
    def _phases(cls, group: dict, names: tuple[str, ...]) -> tuple[Phase, ...]:
        moments = cls._state_names(group)
        master = tuple(n for n in names if n in MASTER_NAMES)
        # Every backend reads the parameter in 'reduce' and 'moments' only with L2 decay.
        l2 = group["weight_decay"] != 0 and group["weight_decay_type"] == "L2"
        touched = {  # phase: (states read, states written)
            "reduce": (moments + (master if l2 else ()), ()),
            "full": (moments + master, moments + master),
            "moments": (moments + (master if l2 else ()), moments[:2]),
            "finish": (moments[:2] + master, moments[2:] + master),
        }
        return tuple(Phase(name, *touched[name], reductions=_SHARD_REDUCTIONS.get(name, ()))
                     for name in ops.apollo_phases(group["weight_decay"], group["weight_decay_type"]))

    @classmethod
    def _default_options(cls, **options) -> dict:
        options = super()._default_options(**options)
        cls._check_state_options(options)
        hyper = _checked_defaults(*(options[name] for name in _HYPERPARAMETERS))
        return {**options, **hyper}

    def _fused_update(self, group, backend, grad_scale, found_inf, names, params) -> FusedUpdate:
        hyper = ApolloHyperparameters(lr=group["lr"], base_lr=group["base_lr"], init_lr=group["init_lr"],
                                      warmup=group["warmup"], beta=group["beta"], eps=group["eps"],
                                      weight_decay=group["weight_decay"], rebound=group["rebound"],
                                      weight_decay_type=group["weight_decay_type"])
        phases = self._phases(group, names)
        states = (("exp_avg_grads", "exp_avg_grad"), ("approx_hessians", "approx_hessian"), ("updates", "update"),
                  ("master_params", MASTER_NAMES))
        return FusedUpdate("apollo_step_", phases, states, hyper=hyper, backend=backend, grad_scale=grad_scale,
                           found_inf=found_inf, stats_columns=ops.APOLLO_NUM_STATS)

    @staticmethod
    def _steps_as_ints(self: "Apollo", state_dict: dict) -> dict:
        """State-dict post-hook: the reference's layout keeps ``step`` as an int (reading it
        synchronises with the device). torch packs the live per-parameter dicts: replace them."""
        state_dict["state"] = {
            pid: {**state, "step": int(state["step"].item())} if isinstance(state.get("step"), torch.Tensor) else state
            for pid, state in state_dict["state"].items()
        }
        return state_dict


_HYPERPARAMETERS = ("lr", "beta", "eps", "rebound", "warmup", "init_lr", "weight_decay", "weight_decay_type")


def _checked_defaults(lr, beta, eps, rebound, warmup, init_lr, weight_decay, weight_decay_type) -> dict:
    """The reference's checks, in its order and with its messages; the group's hyperparameters."""
    if not 0.0 < lr:
        raise ValueError(f"Invalid learning rate value: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"Invalid beta parameter: {beta}")
    if rebound not in ("constant", "belief"):
        raise ValueError(f"Invalid rectify bound: {rebound}")
    if not 0 <= warmup:
        raise ValueError(f"Invalid warmup updates: {warmup}")
    if init_lr is None:
        init_lr = lr / 1000
    if not 0.0 <= init_lr <= lr:
        raise ValueError(f"Invalid initial learning rate: {init_lr}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if weight_decay_type is None:
        weight_decay_type = default_weight_decay_type(rebound)
    if weight_decay_type not in ("L2", "decoupled", "stable"):
        raise ValueError(f"Invalid weight decay type: {weight_decay_type}")
    return dict(lr=lr, beta=beta, eps=eps, rebound=rebound, warmup=warmup, init_lr=init_lr, base_lr=lr,
                weight_decay=weight_decay, weight_decay_type=weight_decay_type)


def default_weight_decay_type(rebound: str) -> str:
    """The reference's default decay for `rebound`: 'L2' for constant rebound, 'decoupled' for belief."""
    return "L2" if rebound == "constant" else "decoupled"
