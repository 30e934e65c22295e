"""fusedoff's own work on ``load_state_dict``, as hooks placed so that a user's hooks see complete dicts.

torch's loader casts floating-point states to the parameter's dtype, which would round the states
of bf16/fp16 parameters, and moves them to the parameter's device, which for streamed states would
materialise them on the GPU. So the pre-hook (kept after every user pre-hook) validates the dict and
sets the state tensors aside, and the post-hook (first among the post-hooks) puts them in
``opt.state`` once torch has loaded the rest, and has the engine place them afresh.

[note: distributed checkpoints across forms]
torch.distributed.checkpoint (DCP) loads a checkpoint into the destination's own state dict, key by
key: the destination's keys say what is read, and each saved tensor is copied into the
destination's tensor of that key, converting its dtype. So a state dict made for DCP holds every
state in the one form that every optimizer asks for, torch's: fp32 moments (8-bit ones decoded,
bf16 ones widened, both exactly) and whole fp32 master weights (``master_param``), as
``fp32_state_dict()`` has them, while its groups keep their ``state_precision`` and
``master_precision`` (DCP restores those like lr). Loading then puts each state back into the form
its group says, and those conversions are exact: a checkpoint continues bit for bit whatever
precisions the destination was built with and whatever its topology, except 8-bit moments whose
blocks differ between the two (a shard starting inside a block), quantized once more within the
8-bit bound. The state dict knows it is made for DCP by DCP's state-dict functions on the call
stack (`for_distributed_checkpoint`; ``get_state_dict``, ``get_optimizer_state_dict``, and
``set_state_dict`` for what it loads into). A state dict made otherwise (``state_dict()`` for
torch.save) keeps the forms the optimizer keeps. Every group of an Adam state dict of either says in
``saved_state_precision`` the form its moments are in, and DCP loads that key too (a checkpoint
without it, written before it existed, is refused by DCP as missing the key): a moment whose dtype
is not that form or an exact widening of it was converted by DCP on the way (8-bit codes read as
numbers into fp32 moments, fp32 moments rounded to bf16), and the load is refused naming both forms.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from fusedoff.kernels import codec
from fusedoff.sharding import blocks_touched, local_tensor, state_for_param


def for_distributed_checkpoint() -> bool:
    """Whether the state dict being made is for torch.distributed.checkpoint: one of its
    state-dict functions is on the call stack (see [note: distributed checkpoints across forms])."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == "torch.distributed.checkpoint.state_dict":
            return True
        frame = frame.f_back
    return False


def set_states_aside(optimizer, state_dict: dict) -> dict:
    """Load pre-hook: validates, then keeps the state tensors out of torch's loader."""
    states = state_dict["state"]
    tensors = {pid: {k: v for k, v in s.items() if isinstance(v, Tensor) or k == "step"} for pid, s in states.items()}
    for group in state_dict["param_groups"]:  # options that cannot work together: refused now
        optimizer._check_group_options({**optimizer.defaults, **group})
    saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved_groups = [{**optimizer.defaults, **g} for g in state_dict["param_groups"] for _ in g["params"]]
    for group, param in zip(saved_groups, params):  # and options a parameter cannot take (an fp16 one split)
        optimizer._check_group_param(group, param)
    for pid, param in zip(saved_ids, params):  # check everything before changing anything
        saved = tensors.get(pid, {})
        for key, value in saved.items():
            if key == "step":
                continue
            value = torch.as_tensor(value)
            # Compressed states (see [note: compressed states] in csrc/include/fusedoff/state_codec.h):
            # block scales have one value per block, 8-bit codes come with their scales.
            scales = key.endswith("_absmax")
            # (a shard's: one per block of its parameter it has elements in, see fusedoff/sharding.py)
            expected = blocks_touched(param, codec.QUANT_BLOCK) if scales else param.numel()
            value = local_tensor(value) if scales else value
            if value.numel() != expected:
                raise ValueError(f"state {key!r} of parameter {pid} has {value.numel()} elements "
                                 f"but the parameter has {param.numel()}" + (" (one scale per block of "
                                 f"{codec.QUANT_BLOCK})" if scales else ""))
            codes = value.dtype == torch.uint8 and isinstance(saved.get(f"{key}_absmax"), Tensor)
            # A split master's low bits (see [note: split master weights] in csrc/include/fusedoff/master.h).
            low_bits = (key, value.dtype) in (("master_low_bits", torch.int16), ("master_low_byte", torch.uint8))
            if not value.is_floating_point() and not codes and not low_bits:
                raise ValueError(f"state {key!r} of parameter {pid} is a {value.dtype} tensor; fusedoff keeps "
                                 "floating-point states, uint8 codes with their block scales, or the int16/uint8 "
                                 "low bits of a split master (master_low_bits int16, master_low_byte uint8)")
            if not scales:
                state_for_param(value, param, key)  # raises if sharded unlike the parameter
    others = {pid: {k: v for k, v in s.items() if k not in tensors[pid]} for pid, s in states.items()}
    optimizer._states_set_aside = (saved_ids, optimizer._upgraded_states(state_dict, tensors))
    # The codec version a group was saved with describes its states, not the group: not loaded.
    groups = [{k: v for k, v in g.items() if k != codec.CODEC_VERSION_KEY} for g in state_dict["param_groups"]]
    return {**state_dict, "state": others, "param_groups": groups}


def place_states(optimizer) -> None:
    """Load post-hook: the set-aside states into ``opt.state`` (``step`` as an fp32 tensor on the
    parameter's device), then placed by the engine: streamed ones go into host memory by value."""
    saved_ids, tensors = optimizer._states_set_aside
    del optimizer._states_set_aside
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for pid, param in zip(saved_ids, params):
        loaded = tensors.get(pid)
        if not loaded:
            continue
        state = dict.setdefault(optimizer.state, param, {})
        for key, value in loaded.items():
            value = torch.as_tensor(value)  # the reference Apollo keeps `step` as an int
            if key == "step":
                state[key] = value.to(device=param.device, dtype=torch.float32, copy=True)
            else:
                state[key] = value
    optimizer._place_loaded_states()
