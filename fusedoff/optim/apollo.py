"""fusedoff.Apollo: the diagonal quasi-Newton optimizer, fused and exact."""

from __future__ import annotations

import torch

from fusedoff import ops
from fusedoff.optim.base import FusedOptimizer, ParamBucket
from fusedoff.sharding import all_reduce_over_shards_, shard_groups

# How the shards of a sharded (FSDP2) tensor combine their partial sums, after the phase that fills
# them: columns of `stats` (ApolloStat in csrc/include/fusedoff/apollo.h). The sums add up; the
# belief bound max |g - m| is a max.
_SHARD_REDUCTIONS = {
    "reduce": ((slice(0, 3), "sum"), (slice(3, 4), "max")),
    "moments": ((slice(4, 5), "sum"),),
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
            largest |g - m| of the tensor, plus eps / alpha).
        warmup: steps of linear warmup from ``init_lr`` to ``lr``, per parameter tensor.
        init_lr: learning rate at step 0 of the warmup; defaults to lr / 1000; 0 <= init_lr <= lr.
        weight_decay: >= 0.
        weight_decay_type: ``'L2'`` (added to the gradient), ``'decoupled'`` (added to the update) or
            ``'stable'`` (added to the update, divided by the mean curvature); defaults to 'L2' for
            constant rebound and 'decoupled' for belief.
        backend, master_weights, offload, chunk_size, num_buffers: as for :class:`fusedoff.AdamW`.
            With offload='stream' each step streams the states once per phase (reduce, apply; with
            'stable' decay reduce, moments, finish), since the sums cover whole tensors.

    Every sum, max and mean of the step runs over the whole parameter tensor, as in the reference,
    computed as a deterministic reduction followed by an apply pass, without host synchronisation.
    ``state_dict()`` uses the reference's keys and keeps ``step`` as an int, so checkpoints move
    between the reference implementation and fusedoff in both directions.
    """

    def __init__(self, params, lr: float, beta: float = 0.9, eps: float = 1e-4, rebound: str = "constant",
                 warmup: int = 500, init_lr: float | None = None, weight_decay: float = 0,
                 weight_decay_type: str | None = None, *, backend: str = "auto",
                 master_weights: bool | None = None, offload: str = "auto", chunk_size: int | None = None,
                 num_buffers: int = 2) -> None:
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
            weight_decay_type = "L2" if rebound == "constant" else "decoupled"
        if weight_decay_type not in ("L2", "decoupled", "stable"):
            raise ValueError(f"Invalid weight decay type: {weight_decay_type}")
        defaults = dict(lr=lr, beta=beta, eps=eps, rebound=rebound, warmup=warmup, init_lr=init_lr, base_lr=lr,
                        weight_decay=weight_decay, weight_decay_type=weight_decay_type)
        super().__init__(params, defaults, backend=backend, master_weights=master_weights, offload=offload,
                         chunk_size=chunk_size, num_buffers=num_buffers)
        self.register_state_dict_post_hook(Apollo._steps_as_ints, prepend=True)

    def _state_names(self, group: dict) -> tuple[str, ...]:
        return ("exp_avg_grad", "approx_hessian", "update")

    def _fused_step(self, group: dict, bucket: ParamBucket) -> None:
        ops.apollo_whole_step_(
            bucket.params, bucket.grads, bucket.state_list("exp_avg_grad"), bucket.state_list("approx_hessian"),
            bucket.state_list("update"), bucket.master_params, bucket.steps, backend=bucket.backend,
            total_numels=[p.numel() for p in bucket.originals],  # whole tensors: every shard of a sharded one
            after_phase=lambda stats, phase: self._combine_shards(stats, bucket.originals, phase),
            **self._hyper(group, bucket),
        )

    @staticmethod
    def _combine_shards(stats: torch.Tensor, params, phase: str) -> None:
        """Completes the partial sums of sharded tensors over the ranks holding their other shards
        (nothing for unsharded ones), so that the next phase sees whole-tensor sums."""
        for columns, op in _SHARD_REDUCTIONS.get(phase, ()):
            all_reduce_over_shards_(stats[:, columns], params, op)

    def _streamed_step(self, group: dict, bucket: ParamBucket, offloaded, grads) -> None:
        """Chunks that hold only whole tensors run every phase while resident: one copy in, one out.
        Tensors that span chunks, and sharded tensors, need their sums over all their chunks (and
        all ranks) first, so their chunks make one pass of the pipeline per phase; the sums gather in
        `stats` on the device. Collectives never depend on this rank's chunks: every rank calls the
        same ones, even one whose shards are empty."""
        hyper = self._hyper(group, bucket)
        device = offloaded.params[0].device
        stats = torch.zeros(len(offloaded.params), ops.APOLLO_NUM_STATS, dtype=torch.float64, device=device)
        steps = {t: self.state[offloaded.params[t]]["step"] for t in grads}
        phases = ops.apollo_phases(group["weight_decay"], group["weight_decay_type"])
        moments = ("exp_avg_grad", "approx_hessian", "update")
        master = ("master_param",) if "master_param" in offloaded.names else ()
        l2 = group["weight_decay"] != 0 and group["weight_decay_type"] == "L2"
        # Every backend reads the parameter in 'reduce' and 'moments' only with L2 decay.
        passes = {  # phase: (states read in, states written back)
            "reduce": (moments + (master if l2 else ()), ()),
            "full": (moments + master, moments + master),
            "moments": (moments + (master if l2 else ()), moments[:2]),
            "finish": (moments[:2] + master, moments[2:] + master),
        }

        def run_phases(chunk, buffers, chunk_phases):
            for phase in chunk_phases:
                for call in offloaded.calls(chunk, buffers, grads):
                    ops.apollo_step_(
                        call.params, call.grads, call.states["exp_avg_grad"], call.states["approx_hessian"],
                        call.states["update"], call.states.get("master_param", []),
                        [steps[p.tensor] for p in call.pieces], [stats[p.tensor] for p in call.pieces],
                        [offloaded.params[p.tensor].numel() for p in call.pieces],
                        phase=phase, backend=bucket.backend, **hyper,
                    )

        inputs = [stats, *grads.values()]
        sharded = [bool(shard_groups(p)) for p in offloaded.params]
        resident, spanning = [], []
        for c in offloaded.plan.chunks:
            whole = offloaded.plan.whole_tensors_only(c) and not any(sharded[p.tensor] for p in c.pieces)
            (resident if whole else spanning).append(c)
        if resident:
            offloaded.run(read=moments + master, write=moments + master, device_inputs=inputs, chunks=resident,
                          compute=lambda chunk, buffers: run_phases(chunk, buffers, phases))
        for phase in phases if spanning or any(sharded) else ():
            read, write = passes[phase]
            if spanning:
                offloaded.run(read=read, write=write, device_inputs=inputs, chunks=spanning,
                              compute=lambda chunk, buffers, phase=phase: run_phases(chunk, buffers, (phase,)))
            self._combine_shards(stats, offloaded.params, phase)

    @staticmethod
    def _hyper(group: dict, bucket: ParamBucket) -> dict:
        return dict(
            lr=float(group["lr"]),
            base_lr=float(group["base_lr"]),
            init_lr=float(group["init_lr"]),
            warmup=float(group["warmup"]),
            beta=group["beta"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            rebound=group["rebound"],
            weight_decay_type=group["weight_decay_type"],
            grad_scale=bucket.grad_scale,
            found_inf=bucket.found_inf,
        )

    @staticmethod
    def _steps_as_ints(self: "Apollo", state_dict: dict) -> dict:
        """State-dict post-hook: the reference's layout keeps ``step`` as an int (reading it
        synchronises with the device). torch packs the live per-parameter dicts: replace them."""
        state_dict["state"] = {
            pid: {**state, "step": int(state["step"].item())} if isinstance(state.get("step"), torch.Tensor) else state
            for pid, state in state_dict["state"].items()
        }
        return state_dict
