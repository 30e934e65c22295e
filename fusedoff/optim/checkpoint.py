"""fusedoff's own work on ``load_state_dict``, as hooks placed so that a user's hooks see complete dicts.

torch's loader casts floating-point states to the parameter's dtype, which would round the states
of bf16/fp16 parameters, and moves them to the parameter's device, which for streamed states would
materialise them on the GPU. So the pre-hook (kept after every user pre-hook) validates the dict and
sets the state tensors aside, and the post-hook (first among the post-hooks) puts them in
``opt.state`` once torch has loaded the rest, and has the engine place them afresh.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusedoff.kernels import codec
from fusedoff.sharding import blocks_touched, local_tensor, state_for_param


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
