"""The per-step scalar hyperparameters of each optimizer family, one frozen object per fused call.

An optimizer class builds one per bucket and step (``_fused_update``); ``fusedoff.ops`` hands it
to every backend as it is, and unpacks it once, into the typed arguments of the native ops'
schemas (csrc/ops.cpp). The device scalars GradScaler sets (``grad_scale``, ``found_inf``) are
tensors that change every step without a host sync, so they travel beside it, never inside.
Imports nothing of fusedoff: the ops, the kernels and the classes all import it.
"""

from __future__ import annotations

import dataclasses

_COERCE = {"float": float, "bool": bool, "str": str}


class _Coerced:
    """Fields converted to their annotated type on construction (a 0-d tensor lr becomes a float,
    a numpy bool a bool), so that every backend receives the same Python scalars."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            object.__setattr__(self, field.name, _COERCE[field.type](getattr(self, field.name)))


@dataclasses.dataclass(frozen=True)
class AdamHyperparameters(_Coerced):
    """Adam/AdamW: ``decoupled_weight_decay`` makes it AdamW; the math is csrc/include/fusedoff/adam.h's.
    ``amsgrad`` decides whether ``max_exp_avg_sqs`` exist (compressed states have none)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled_weight_decay: bool
    amsgrad: bool = False
    maximize: bool = False


@dataclasses.dataclass(frozen=True)
class ApolloHyperparameters(_Coerced):
    """Apollo: the schedule (``lr`` after ``warmup`` steps from ``init_lr`` up to ``base_lr``), the
    moment's ``beta``, ``eps``, the rebound mode ('constant' or 'belief') and the weight decay
    ('L2', 'decoupled' or 'stable'); the math is csrc/include/fusedoff/apollo.h's."""

    lr: float
    base_lr: float
    init_lr: float
    warmup: float
    beta: float
    eps: float
    weight_decay: float
    rebound: str
    weight_decay_type: str
