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

from fusedoff import formats
from fusedoff.formats import MASTER, Role
from fusedoff.kernels import codec
from fusedoff.offload.auto_share import AUTO
from fusedoff.offload.host_share import HOST_SHARE_KEY
from fusedoff.sharding import blocks_touched, is_dtensor, like_param, local_tensor, state_for_param

# An empty tensor beside the decoded 8-bit moments of a shard in a state dict for torch.save (see
# [note: checkpoints of compressed shards]).
DECODED_MARK = "8bit_moments_decoded"
# In each group that chooses a state precision, in a state dict: the precision its moments are in
# there (see [note: distributed checkpoints across forms]); loading drops it.
SAVED_PRECISION_KEY = "saved_state_precision"


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
            # Compressed states (see fusedoff/formats.py): block scales have one value per block (a
            # shard's: one per block of its parameter it has elements in, see fusedoff/sharding.py),
            # 8-bit codes come with their scales.
            scales = formats.is_block_scales(key)
            block = formats.EIGHT_BIT.block
            expected = blocks_touched(param, block) if scales else param.numel()
            value = local_tensor(value) if scales else value
            if value.numel() != expected:
                raise ValueError(f"state {key!r} of parameter {pid} has {value.numel()} elements "
                                 f"but the parameter has {param.numel()}" + (" (one scale per block of "
                                 f"{block})" if scales else ""))
            if not formats.is_stored_tensor(key, value, saved):
                raise ValueError(f"state {key!r} of parameter {pid} is a {value.dtype} tensor; fusedoff keeps "
                                 "floating-point states, uint8 codes with their block scales, or the int16/uint8 "
                                 "low bits of a split master (master_low_bits int16, master_low_byte uint8)")
            if not scales:
                state_for_param(value, param, key)  # raises if sharded unlike the parameter
    others = {pid: {k: v for k, v in s.items() if k not in tensors[pid]} for pid, s in states.items()}
    optimizer._states_set_aside = (saved_ids, upgraded_states(optimizer, state_dict, tensors))
    # The codec version a group was saved with describes its states, not the group: not loaded.
    groups = [{k: v for k, v in g.items() if k != codec.CODEC_VERSION_KEY} for g in state_dict["param_groups"]]
    return {**state_dict, "state": others, "param_groups": groups}


def keep_own_host_share(optimizer, state_dict: dict) -> dict:
    """The pre-hook that keeps each group's own ``host_share``: where a tensor is stepped is this
    run's choice, as its device budget is (the checkpoint may come from another machine, or from an
    optimizer with ``offload='none'``), and every share gives the same bits. A group torch cannot
    match by position is left as saved (torch refuses the dict)."""
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
        return state_dict
    kept = [{**saved, HOST_SHARE_KEY: own.get(HOST_SHARE_KEY, AUTO)} if isinstance(saved, dict) else saved
            for saved, own in zip(groups, optimizer.param_groups)]
    return {**state_dict, "param_groups": kept}


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


# ---- conversions between stored forms ----------------------------------------------------------
def _params_and_groups(optimizer) -> list[tuple[Tensor, dict]]:
    return [(p, g) for g in optimizer.param_groups for p in g["params"]]


def _moment_roles(optimizer, group: dict) -> dict[str, Role]:
    return optimizer._state_roles({**optimizer.defaults, **group})


def loaded_states(optimizer, group: dict, param: Tensor, state: dict) -> dict:
    """A loaded parameter state (a checkpoint's, or torch.optim's) in the forms `group` keeps: each
    state kept where it is stored as the group keeps it, otherwise read as fp32 and stored afresh
    (fp32 moments compressed: bf16 rounded to nearest, 8-bit quantized; compressed ones decoded;
    master weights joined or split; a split master read beside the parameter as it is now: load
    the model first). Raises before anything changes if it cannot be."""
    forms = optimizer._stored_forms(group, param.dtype)
    out = dict(state)
    if MASTER not in forms:  # no master kept: none loaded
        out = {k: v for k, v in out.items() if k not in formats.MASTER_KEYS}
    kept = set()
    for name, (role, form) in forms.items():
        found = formats.reader_of(state, name, role)
        if found is None:
            continue
        if found is not form or not form.holds(state, name) or not form.keeps_loaded(state, name, param):
            fp32 = found.to_fp32(state, name, role, param)
            for key in found.keys(name):
                out.pop(key, None)
            out.update(form.from_fp32(fp32, name, role, param))
        kept.update(form.keys(name))
    # (block scales that belong to no state kept in their form: left behind by a conversion)
    return {k: v for k, v in out.items() if k in kept or not formats.is_block_scales(k)}


def _decoded_moments(state: dict, param: Tensor, roles: dict[str, Role]) -> dict:
    """A copy of `state` (torch's state dict holds the optimizer's own) with its compressed moments
    as fp32, their block scales left out: exactly their values."""
    state = dict(state)
    for name, role in roles.items():
        form = formats.reader_of(state, name, role)
        if form is not None and not (form is formats.FP32 and form.holds(state, name)):
            fp32 = like_param(form.to_fp32(state, name, role, param), param)  # a DTensor where sharded
            for key in form.keys(name):
                state.pop(key, None)
            state[name] = fp32
    return state


def states_in_fp32(optimizer, state_dict: dict) -> dict:
    """`state_dict` (made by ``state_dict()``) with every state in torch's fp32 form: moments
    decoded, split masters joined with their parameters into whole fp32 ``master_param``; groups
    that choose a state precision say they were saved in fp32."""
    params = _params_and_groups(optimizer)
    for pid, state in list(state_dict["state"].items()):
        param, group = params[pid]
        state = _decoded_moments(state, param, _moment_roles(optimizer, group))
        state.pop(DECODED_MARK, None)
        master = formats.stored_form(state, MASTER, Role.MASTER_WEIGHT)
        if master is not None and master is not formats.MASTER_FORMS["fp32"]:
            local = local_tensor(param).detach()
            fp32 = master.to_fp32(state, MASTER, Role.MASTER_WEIGHT, param)
            state = {k: v for k, v in state.items() if k not in formats.MASTER_KEYS}
            state[MASTER] = like_param(fp32.reshape(local.shape), param)
        state_dict["state"][pid] = state
    state_dict["param_groups"] = [{**g, SAVED_PRECISION_KEY: "fp32"} if "state_precision" in g else g
                                  for g in state_dict["param_groups"]]
    return state_dict


def states_as_kept(optimizer, state_dict: dict) -> dict:
    """`state_dict` for torch.save: the states as kept, each group that chooses a state precision
    saying its moments' form; but fp32 in groups whose 8-bit moments belong to sharded parameters
    (DTensors: see [note: checkpoints of compressed shards]) or are in several forms (so that the
    group says one)."""
    params = _params_and_groups(optimizer)
    groups = []
    for group in state_dict["param_groups"]:
        if "state_precision" not in group:
            groups.append(group)
            continue
        pids = [pid for pid in group["params"] if pid in state_dict["state"]]
        roles = _moment_roles(optimizer, group)
        found = {formats.stored_form(state_dict["state"][pid], name, role) for pid in pids
                 for name, role in roles.items()} - {None}
        precisions = {form.precision for form in found}
        mixed = len(precisions) > 1
        saved = "fp32" if mixed else next(iter(precisions), group["state_precision"])
        if mixed or saved == formats.EIGHT_BIT.precision and any(is_dtensor(params[pid][0]) for pid in pids):
            saved = "fp32"
            for pid in pids:
                state_dict["state"][pid] = {**_decoded_moments(state_dict["state"][pid], params[pid][0], roles),
                                            DECODED_MARK: torch.zeros(0)}
        groups.append({**group, SAVED_PRECISION_KEY: saved})
    state_dict["param_groups"] = groups
    return state_dict


def checked_against_saved_forms(optimizer, state_dict: dict) -> dict | None:
    """Load pre-hook: refuses moments that are not what their group says it saved (see [note:
    distributed checkpoints across forms]), before anything changes; returns the state dict without
    the keys the post-hooks add (the user's dict unchanged)."""
    saved_as = {pid: group for group in state_dict["param_groups"] for pid in group["params"]}
    for pid, state in state_dict["state"].items():
        group = saved_as.get(pid, {})
        saved, kept = group.get(SAVED_PRECISION_KEY), group.get("state_precision")
        for name in _moment_roles(optimizer, group) if saved is not None else ():
            value = state.get(name)
            if isinstance(value, Tensor) and not _holds_saved_values(value, state, name, saved, kept):
                raise ValueError(_converted_on_the_way(pid, name, value, saved))
    if not any(SAVED_PRECISION_KEY in g for g in state_dict["param_groups"]) and not any(
            DECODED_MARK in state for state in state_dict["state"].values()):
        return None
    states = {pid: {k: v for k, v in state.items() if k != DECODED_MARK} for pid, state in state_dict["state"].items()}
    groups = [{k: v for k, v in g.items() if k != SAVED_PRECISION_KEY} for g in state_dict["param_groups"]]
    return {**state_dict, "state": states, "param_groups": groups}


def _holds_saved_values(value: Tensor, state: dict, name: str, saved: str, kept: str | None) -> bool:
    """Whether moment `name` of a loaded `state`, whose group says it was saved in precision `saved`
    and is kept in `kept`, holds the saved values: in the saved form, or bf16 widened to fp32
    (exact); or in the kept form where that differs (a dict whose states were converted after it
    was made, as ZeRO-1's consolidated groups can be)."""
    def in_form(precision: str) -> bool:
        return formats.MOMENT_FORMS[precision].holds(state, name)

    widened = saved == formats.BF16.precision and value.dtype == torch.float32
    return in_form(saved) or widened or (kept in formats.MOMENT_FORMS and kept != saved and in_form(kept))


def _converted_on_the_way(pid, name: str, value: Tensor, saved: str) -> str:
    read = formats.precision_of_dtype(value.dtype)
    read = f", the form of state_precision={read!r}" if read else ""
    without = " without them" if saved == formats.EIGHT_BIT.precision else ""
    return (f"state {name!r} of parameter {pid} was saved as {formats.MOMENT_FORMS[saved].description} "
            f"({SAVED_PRECISION_KEY}={saved!r}) but is loaded as a {value.dtype} tensor{without}{read}: "
            "torch.distributed.checkpoint reads a checkpoint into the tensors of the destination's own state "
            "dict, converting their dtype, so it no longer holds the saved values. Save and load through "
            "torch.distributed.checkpoint.state_dict's get_state_dict and set_state_dict (or "
            "get_optimizer_state_dict and set_optimizer_state_dict), whose state dicts hold fp32 states that "
            f"every state_precision reads, or load it into an optimizer with state_precision={saved!r}")


def upgraded_states(optimizer, state_dict: dict, states: dict) -> dict:
    """The loaded states of `state_dict` ({param id: {name: tensor}}) with 8-bit codes of an older
    map decoded with it, to fp32 moments (laid out as the codes), which `loaded_states` then
    encodes with this version's."""
    groups = {pid: group for group in state_dict["param_groups"] for pid in group["params"]}
    versions = {pid: group.get(codec.CODEC_VERSION_KEY, 1) for pid, group in groups.items()}
    if all(v == codec.CODEC_VERSION for v in versions.values()):
        return states
    upgraded = {}
    for pid, state in states.items():
        state, version = dict(state), versions.get(pid, 1)
        roles = _moment_roles(optimizer, groups.get(pid, {})) if version != codec.CODEC_VERSION else {}
        for name, role in roles.items():
            if formats.EIGHT_BIT.holds(state, name):
                state[name] = formats.EIGHT_BIT.decode_version(state, name, role, version)
                del state[formats.EIGHT_BIT.scales_key(name)]
        upgraded[pid] = state
    return upgraded
