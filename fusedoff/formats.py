"""Stored forms of optimizer states: one object per form.

An optimizer declares the *role* of each of its states (Adam: ``exp_avg`` a signed moment,
``exp_avg_sq`` a second moment, ``max_exp_avg_sq`` a running maximum; every fp16/bf16 parameter
its master weight), and a param group's options pick the *form* each is stored in:
``state_precision`` the moments' (`MOMENT_FORMS`: fp32, bf16 rounded stochastically at each step,
blockwise 8-bit), ``master_precision`` the master weight's (`MASTER_FORMS`: fp32, split, split8).

A form knows everything about itself and nothing of any optimizer: the tensors it keeps for a state
(`StateSpec`s: names, dtypes, the block of elements sharing one stored value, whence its bytes per
element), which stored tensors are in it (`holds`), how to read them as fp32 and make them from fp32
(checkpoints, ``fp32_state_dict``, torch.distributed.checkpoint, codes of an older 8-bit map), and
what it refuses (a running maximum compressed, a split master beside a parameter that is not bf16).
The kernels read and write the forms (csrc/include/fusedoff/state_codec.h, master.h); the offload
engine cuts a tensor's range on the blocks the specs declare. A new form is one object here and its
kernels.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import Tensor

from fusedoff import ops
from fusedoff.kernels import codec
from fusedoff.kernels import master as masters
from fusedoff.offload.contract import LOADED_PARAM_VALUE, StateSpec
from fusedoff.sharding import block_lead, blocks_touched, like_param, local_tensor
from fusedoff.tensor_layout import flat_view, in_layout_of, is_dense


class Role(enum.Enum):
    """What a state is to its optimizer: all a form needs to know of it."""

    SIGNED_MOMENT = "signed moment"  # 8-bit: the signed map
    SECOND_MOMENT = "second moment"  # non-negative: the unsigned map
    RUNNING_MAX = "running maximum"  # amsgrad's: kept in fp32 only
    MASTER_WEIGHT = "master weight"  # follows the parameter, which is its rounding

    @property
    def signed(self) -> bool:
        return self is Role.SIGNED_MOMENT


class StoredForm:
    """How one state is stored. `precision` is the option value that names the form."""

    precision: str
    description: str  # what a checkpoint holds in this form, for messages

    def specs(self, name: str) -> tuple[StateSpec, ...]:
        """The tensors kept for a state called `name`."""
        raise NotImplementedError

    def keys(self, name: str) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.specs(name))

    def bytes_per_element(self, name: str = "state") -> float:
        """Stored bytes per parameter element (a block's shared values spread over its elements)."""
        return sum(spec.dtype.itemsize / spec.block for spec in self.specs(name))

    def refuse(self, role: Role, options: str) -> None:
        """Raises if a state of `role` cannot be kept in this form (`options`: what chose it, for the message)."""

    def holds(self, state: dict, name: str) -> bool:
        """Whether `state[name]` (a parameter's state dict) is stored in this form."""
        raise NotImplementedError

    def to_fp32(self, state: dict, name: str, role: Role, param: Tensor) -> Tensor:
        """State `name` of `state`, stored in this form, as exact fp32 values shaped and laid out like
        the parameter's local tensor."""
        raise NotImplementedError

    def from_fp32(self, fp32: Tensor, name: str, role: Role, param: Tensor) -> dict[str, Tensor]:
        """The tensors of this form holding fp32 values `fp32` (laid out like `param`'s local tensor)."""
        raise NotImplementedError

    def keeps_loaded(self, state: dict, name: str, param: Tensor) -> bool:
        """Whether a loaded `state[name]` in this form is kept as it is (else it is read as fp32 and
        made afresh)."""
        return True


# ---- moments -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class WholeMoments(StoredForm):
    """One value per element: fp32, or bf16 (rounded stochastically by the step's kernels; a loaded
    fp32 value is rounded to nearest)."""

    precision: str
    dtype: torch.dtype
    description: str

    def specs(self, name: str) -> tuple[StateSpec, ...]:
        return (StateSpec(name, self.dtype),)

    def refuse(self, role: Role, options: str) -> None:
        if role is Role.RUNNING_MAX and self.dtype != torch.float32:
            raise _no_compressed_running_max(self.precision, options)

    def holds(self, state: dict, name: str) -> bool:
        value = state.get(name)
        return isinstance(value, Tensor) and value.dtype == self.dtype

    def to_fp32(self, state: dict, name: str, role: Role, param: Tensor) -> Tensor:
        local = local_tensor(param)
        return in_layout_of(local_tensor(state[name]).to(torch.float32).reshape(local.shape), local)

    def from_fp32(self, fp32: Tensor, name: str, role: Role, param: Tensor) -> dict[str, Tensor]:
        return {name: like_param(fp32.to(self.dtype), param)}


@dataclass(frozen=True)
class BlockwiseCodes(StoredForm):
    """8-bit codes, one per element, with one fp32 scale (the block's absolute maximum) per block of
    `block` elements, counted from the whole parameter's first element (a shard's first block is
    the part of its parameter's block it holds: see [note: compressed states of shards]). The codes'
    map is the role's (signed or not) in this version of the codec; `decode_version` reads an older one."""

    precision: str = "8bit"
    block: int = codec.QUANT_BLOCK
    description: str = "8-bit codes with their block scales"

    @staticmethod
    def scales_key(name: str) -> str:
        return f"{name}_absmax"

    def specs(self, name: str) -> tuple[StateSpec, ...]:
        return (StateSpec(name, torch.uint8), StateSpec(self.scales_key(name), torch.float32, self.block))

    def refuse(self, role: Role, options: str) -> None:
        if role is Role.RUNNING_MAX:
            raise _no_compressed_running_max(self.precision, options)

    def holds(self, state: dict, name: str) -> bool:
        value = state.get(name)
        return (isinstance(value, Tensor) and value.dtype == torch.uint8
                and isinstance(state.get(self.scales_key(name)), Tensor))

    def check_scales(self, state: dict, name: str, param: Tensor) -> None:
        blocks = blocks_touched(param, self.block)
        scales = state.get(self.scales_key(name))
        if not isinstance(scales, Tensor) or local_tensor(scales).numel() != blocks:
            raise ValueError(f"8-bit state {name!r} needs {self.scales_key(name)} with {blocks} block scales")

    def keeps_loaded(self, state: dict, name: str, param: Tensor) -> bool:
        # Blocks run in memory order: codes laid out unlike the parameter are quantized afresh.
        self.check_scales(state, name, param)
        value = state[name]
        return value.numel() <= 1 or local_tensor(value).stride() == local_tensor(param).stride()

    def to_fp32(self, state: dict, name: str, role: Role, param: Tensor) -> Tensor:
        # The blocks of 8-bit codes run in the codes' own memory order: decoded in it, then laid out
        # like the parameter.
        value, local = local_tensor(state[name]), local_tensor(param)
        codes = value if is_dense(value) else value.contiguous()
        decoded = torch.empty_like(codes, dtype=torch.float32)
        lead = block_lead(param, self.block)
        scales = local_tensor(state[self.scales_key(name)])
        flat_view(decoded).copy_(ops.decode_8bit(_led(flat_view(codes), lead), scales, signed=role.signed)[lead:])
        return in_layout_of(decoded.reshape(local.shape), local)

    def from_fp32(self, fp32: Tensor, name: str, role: Role, param: Tensor) -> dict[str, Tensor]:
        lead = block_lead(param, self.block)
        codes, scales = ops.encode_8bit(_led(flat_view(fp32), lead), signed=role.signed)
        out = torch.empty_like(fp32, dtype=torch.uint8)
        flat_view(out).copy_(codes[lead:])
        return {name: like_param(out, param), self.scales_key(name): scales}

    def decode_version(self, state: dict, name: str, role: Role, version: int) -> Tensor:
        """Codes of the codec `version` (an older map) as fp32, laid out as the codes (which this
        version then encodes afresh)."""
        codes = local_tensor(state[name])
        codes = codes if is_dense(codes) else codes.contiguous()
        decoded = torch.empty_like(codes, dtype=torch.float32)
        flat_view(decoded).copy_(codec.dequantize(flat_view(codes), local_tensor(state[self.scales_key(name)]),
                                                  signed=role.signed, version=version))
        return decoded


def _led(flat: Tensor, lead: int) -> Tensor:
    """`flat` after `lead` zeros: a shard's elements where its parameter's blocks put them."""
    return torch.cat([flat.new_zeros(lead), flat]) if lead else flat


def _no_compressed_running_max(precision: str, options: str) -> ValueError:
    return ValueError(f"amsgrad keeps fp32 states only: {options}={precision!r} compresses exp_avg and "
                      "exp_avg_sq, and a compressed running maximum is not implemented")


FP32 = WholeMoments("fp32", torch.float32, "fp32 moments")
BF16 = WholeMoments("bf16", torch.bfloat16, "bf16 moments")
EIGHT_BIT = BlockwiseCodes()
MOMENT_FORMS: dict[str, StoredForm] = {form.precision: form for form in (FP32, BF16, EIGHT_BIT)}


# ---- master weights ----------------------------------------------------------------------------
MASTER = "master_param"  # the state a master weight is, whatever its form stores


@dataclass(frozen=True)
class WholeMaster(StoredForm):
    """An fp32 copy of the parameter (see [note: master weights follow the parameters] in
    fusedoff/offload/bucket.py)."""

    precision: str = "fp32"
    description: str = "fp32 master weights"

    def specs(self, name: str = MASTER) -> tuple[StateSpec, ...]:
        return (StateSpec(MASTER, follows_param=True),)

    def holds(self, state: dict, name: str = MASTER) -> bool:
        value = state.get(MASTER)
        return isinstance(value, Tensor) and value.is_floating_point()

    def to_fp32(self, state: dict, name: str, role: Role, param: Tensor) -> Tensor:
        return state[MASTER].to(torch.float32)

    def from_fp32(self, fp32: Tensor, name: str, role: Role, param: Tensor) -> dict[str, Tensor]:
        return {MASTER: fp32}


@dataclass(frozen=True)
class SplitMaster(StoredForm):
    """The low bits of an fp32 master beside the bf16 parameter, its upper half (see [note: split
    master weights] in csrc/include/fusedoff/master.h): "split" 16 bits (every result that of an fp32
    master), "split8" 8 bits. It does not follow the parameter: the parameter *is* its upper half, so
    a written parameter moves the master with it, keeping the low bits. Each precision has a key of
    its own: a checkpoint loaded by name, as DCP loads, never copies one into the other's dtype."""

    precision: str
    key: str
    description: str = "the low bits of split master weights"

    def specs(self, name: str = MASTER) -> tuple[StateSpec, ...]:
        return (StateSpec(self.key, masters.storage_dtype(self.precision)),)

    def refuse_param(self, dtype: torch.dtype) -> None:
        if dtype != torch.bfloat16:
            raise ValueError(f"master_precision={self.precision!r} splits a master weight around its bfloat16 "
                             f"parameter; an {dtype} parameter cannot be split exactly (an fp16 value near zero is "
                             "the rounding of up to 2^30 fp32 values): use master_precision='fp32' for its group")

    def holds(self, state: dict, name: str = MASTER) -> bool:
        value = state.get(self.key)
        return isinstance(value, Tensor) and value.dtype == masters.storage_dtype(self.precision)

    def to_fp32(self, state: dict, name: str, role: Role, param: Tensor) -> Tensor:
        local = local_tensor(param).detach()
        return masters.join(local, local_tensor(state[self.key])).reshape(local.shape)

    def from_fp32(self, fp32: Tensor, name: str, role: Role, param: Tensor) -> dict[str, Tensor]:
        self.refuse_param(param.dtype)
        out = {self.key: masters.split(fp32, self.precision)}
        # A parameter cast by torch from this master (ties to even) holds, at a tie, the other nearest
        # rounding, beside which no low bits give the master back (a bf16 unit short): it takes
        # fusedoff's (ties away from zero), beside which they do, once every loaded state has
        # converted. A parameter that is no rounding of the master is left as it is (load the model first).
        local = local_tensor(param).detach()
        here = local_tensor(fp32).to(local.device)
        ties = masters.other_rounding_at_ties(here, local)
        if bool(ties.any()):
            out[LOADED_PARAM_VALUE] = torch.where(ties, masters.param_of_master(here, local.dtype).reshape(local.shape),
                                                  local)
        return out


MASTER_FORMS: dict[str, StoredForm] = {form.precision: form for form in (
    WholeMaster(), SplitMaster("split", "master_low_bits"), SplitMaster("split8", "master_low_byte"))}
MASTER_KEYS = tuple(dict.fromkeys(key for form in MASTER_FORMS.values() for key in form.keys(MASTER)))


def master_form(precision: str) -> StoredForm:
    if precision not in MASTER_FORMS:
        raise ValueError(f"master_precision must be one of {tuple(MASTER_FORMS)}, got {precision!r}")
    return MASTER_FORMS[precision]


def moment_form(precision: str) -> StoredForm:
    if precision not in MOMENT_FORMS:
        raise ValueError(f"state_precision must be one of {tuple(MOMENT_FORMS)}, got {precision!r}")
    return MOMENT_FORMS[precision]


def check_master_options(master_precision, master_weights) -> None:
    """Refuses a master precision that does not exist, or that stores masters where none are kept."""
    master_form(master_precision)
    if master_precision != "fp32" and master_weights is False:
        raise ValueError(f"master_precision={master_precision!r} stores master weights, but master_weights=False "
                         "keeps none: leave master_weights at None (or True)")


def check_master_param(master_precision: str, dtype: torch.dtype) -> None:
    """Refuses a parameter of `dtype` whose master `master_precision` cannot store."""
    form = master_form(master_precision)
    if isinstance(form, SplitMaster):
        form.refuse_param(dtype)


def stored_form(state: dict, name: str, role: Role) -> StoredForm | None:
    """The form a loaded state `name` of `state` is stored in (None: it has none)."""
    forms = MASTER_FORMS if role is Role.MASTER_WEIGHT else MOMENT_FORMS
    return next((form for form in forms.values() if form.holds(state, name)), None)


def reader_of(state: dict, name: str, role: Role) -> StoredForm | None:
    """The form that reads a loaded state `name` of `state` as fp32: its own, or for a moment of
    another floating dtype (torch.optim's of fp16 parameters, float64) fp32's, which converts it
    (None: there is nothing to read)."""
    form = stored_form(state, name, role)
    value = state.get(name)
    if form is None and role is not Role.MASTER_WEIGHT and isinstance(value, Tensor) and value.is_floating_point():
        return FP32
    return form


def precision_of_dtype(dtype: torch.dtype) -> str | None:
    """The moment precision whose values are stored as `dtype` (None: none is)."""
    return next((p for p, form in MOMENT_FORMS.items() if form.specs("x")[0].dtype == dtype), None)


def is_stored_tensor(key: str, value: Tensor, state: dict) -> bool:
    """Whether `value` under `key` of a loaded `state` is something a form stores: floating-point
    values, 8-bit codes with their scales, or a split master's low bits."""
    if value.is_floating_point():
        return True
    if EIGHT_BIT.holds(state, key):
        return True
    return any(form.holds({key: value}, MASTER) for form in MASTER_FORMS.values())


def is_block_scales(key: str) -> bool:
    """Whether `key` names the block scales of some 8-bit state."""
    return key.endswith(EIGHT_BIT.scales_key(""))


__all__ = ["BF16", "EIGHT_BIT", "FP32", "MASTER", "MASTER_FORMS", "MASTER_KEYS", "MOMENT_FORMS", "Role", "StoredForm",
           "check_master_options", "check_master_param", "master_form", "moment_form", "stored_form"]
