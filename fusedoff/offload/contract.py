"""The optimizer-engine contract: what an optimizer class tells the engine, and nothing more.

`OptimizerRules` is what the engine asks of an optimizer class: how a param group's tensors keep
their states (`StateSpec`s), what it refuses, how a loaded state converts, and the fused update of
one bucket for one step. The engine answers with everything else: buckets, placement, adoption of
``opt.state``, master weights that follow the parameters, streaming.

An optimizer declares, for one bucket and one step, a `FusedUpdate`: plain data, frozen. It names
the op (an entry of ``fusedoff.ops``' table), its phases in order (Adam one, Apollo a reduction then
an apply) with the states each reads and writes, which state feeds which of the op's arguments,
the hyperparameters object, the backend, ``grad_scale``/``found_inf``, per-tensor values (the
compressed op's random keys) and the per-tensor float64 statistics the phases accumulate
(whole-tensor sums). The engine runs a phase over lists of tensors (`UpdateArgs`) with one call,
``ops.run_update(update, phase, args)``; where the states live, and whether the call sees whole
tensors on the device or pieces of chunk buffers, is the engine's business: the call is the same.
Nothing in the optimizer class runs during the step.

Phase semantics: phase k+1 of a tensor may read what phase k accumulated over the whole tensor
(its row of `stats`), so between two phases every piece of a tensor must have finished the earlier
one; then the phase's `reductions` combine a sharded tensor's partial sums over the ranks holding
its other shards (``sharding.all_reduce_over_shards_``), so that the next phase sees whole-tensor sums.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


@dataclass(frozen=True)
class StateSpec:
    """One state tensor of a parameter: its name, storage dtype, and how many of the parameter's
    elements share one stored value (1: one per element, in the parameter's shape and memory
    order; more: one per block of that many consecutive elements, counted from the first, flat)."""

    name: str
    dtype: torch.dtype = torch.float32
    block: int = 1
    # A copy of the parameter kept in more precision (master weights): it starts as the parameter,
    # and follows it when something other than the step writes the parameter (see [note: master
    # weights follow the parameters] in bucket.py). Every other state starts at zero.
    follows_param: bool = False

    def numel(self, param_numel: int) -> int:
        return -(-int(param_numel) // self.block)

    def nbytes(self, param_numel: int) -> int:
        return self.numel(param_numel) * self.dtype.itemsize


def state_specs(states: Iterable[str | StateSpec]) -> tuple[StateSpec, ...]:
    """Names (fp32, one value per element) or specs, as specs."""
    return tuple(s if isinstance(s, StateSpec) else StateSpec(s) for s in states)


# A loaded state (`OptimizerRules._loaded_states`) may hold, under this key, the value its parameter's
# local tensor takes once every loaded state has converted: the load changes nothing if one cannot.
LOADED_PARAM_VALUE = "fusedoff: the parameter's value at load"


@dataclass(frozen=True)
class ShardReduction:
    """Columns ``first:end`` of a phase's statistics, combined over the shards of a sharded tensor
    with `op` ("sum" or "max") once the phase is done."""

    first: int
    end: int
    op: str


@dataclass(frozen=True)
class Phase:
    name: str
    reads: tuple[str, ...]  # states the phase reads (parameters and gradients are always available)
    writes: tuple[str, ...]  # states the phase writes
    reductions: tuple[ShardReduction, ...] = ()  # after the phase: sharded tensors' sums completed


def moved(phases: Iterable[Phase]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(every state some phase reads or writes, every state some phase writes): what a pass running
    all of `phases` moves in, and out."""
    phases = tuple(phases)
    return (tuple(dict.fromkeys(n for p in phases for n in p.reads + p.writes)),
            tuple(dict.fromkeys(n for p in phases for n in p.writes)))


@dataclass
class UpdateArgs:
    """The tensors of one fused call: whole tensors, or pieces of them (ranges of their elements).

    `tensors` are the bucket positions of the pieces; `total_numels` the whole tensors' sizes
    (every shard's, for a sharded tensor); `stats` one row per piece (a tensor's pieces share it).
    """

    tensors: list[int]
    params: list[Tensor]
    grads: list[Tensor]
    states: dict[str, list[Tensor]]
    steps: list[Tensor]
    stats: list[Tensor]
    total_numels: list[int]
    offsets: list[int]  # each piece's first element in its tensor (0 for whole tensors)


@dataclass(frozen=True)
class FusedUpdate:
    """One bucket's update for one step, as data (see the module's docstring)."""

    op: str  # the op's name in fusedoff.ops' table
    phases: tuple[Phase, ...]
    # (the op's argument, the state that feeds it): a name, which the bucket keeps; or a tuple of
    # names, the first the bucket keeps feeding it (none: an empty list), as the master weight in
    # whichever form it is kept, or a state only some buckets keep.
    states: tuple[tuple[str, str | tuple[str, ...]], ...]
    hyper: object  # the op's hyperparameters object (fusedoff.hyperparameters)
    backend: str
    grad_scale: Tensor | None = None
    found_inf: Tensor | None = None
    # (the op's argument, one value per tensor of the bucket): the call passes its tensors' values.
    per_tensor: tuple[tuple[str, tuple], ...] = ()
    stats_columns: int = 0  # float64 statistics per tensor that the phases accumulate (0: none)

    @property
    def reads(self) -> tuple[str, ...]:
        """Every state some phase reads or writes (a pass running all phases moves these in)."""
        return moved(self.phases)[0]

    @property
    def writes(self) -> tuple[str, ...]:
        return moved(self.phases)[1]


class OptimizerRules(Protocol):
    """What the engine asks of an optimizer class (fusedoff.optim.base.FusedOptimizer implements it)."""

    def _bucket_specs(self, group: dict, dtype: torch.dtype) -> tuple[StateSpec, ...]:
        """The states a parameter of `dtype` in `group` keeps (master weights included when kept)."""

    def _check_group_options(self, group: dict) -> None:
        """Raises if `group`'s options cannot work together."""

    def _check_group_param(self, group: dict, param: Tensor) -> None:
        """Raises if `param` cannot be stepped with `group`'s options."""

    def _loaded_states(self, group: dict, param: Tensor, state: dict) -> dict:
        """A loaded state in the form `group` keeps (and, under `LOADED_PARAM_VALUE`, a value for the
        parameter where the form needs one); raises, changing nothing, if it cannot be."""

    def _resolve_backend(self, group: dict, device: torch.device) -> str:
        """The backend a bucket of `group` on `device` runs (chosen once per bucket)."""

    def _fused_update(self, group: dict, backend: str, grad_scale: Tensor | None, found_inf: Tensor | None,
                     names: tuple[str, ...], params: list[Tensor]) -> FusedUpdate:
        """The fused update of one bucket of `group` (states `names`, parameters `params`) for this step."""
