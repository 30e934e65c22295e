"""Master weights in pure PyTorch: the ``torch`` backend's reading and writing of them, and the
conversions of checkpoints and of the engine.

It mirrors ``csrc/include/fusedoff/master.h`` (see [note: split master weights] there) bit for bit:
a parameter with a master weight is the master rounded to nearest with ties away from zero (bf16),
and a "split" master is stored as its low 16 bits (int16), a "split8" one as bits 8-15 (uint8) of
its stochastic rounding to 24 bits.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusedoff.kernels import codec

PRECISIONS = ("fp32", "split", "split8")
_STORAGE = {"fp32": torch.float32, "split": torch.int16, "split8": torch.uint8}
_SPLIT8_SALT_KEY = 0x5B1175A8


def storage_dtype(precision: str) -> torch.dtype:
    """How a master weight of `precision` is stored: fp32 whole, int16 or uint8 low bits."""
    return _STORAGE[precision]


def precision_of(master: Tensor) -> str:
    """The master precision that a stored master tensor's dtype says."""
    for precision, dtype in _STORAGE.items():
        if master.dtype == dtype:
            return precision
    raise ValueError(f"a master weight is stored as float32, int16 or uint8, got {master.dtype}")


def bytes_per_element(precision: str) -> int:
    return _STORAGE[precision].itemsize


def _bits(x: Tensor) -> Tensor:
    """The fp32 bit patterns of `x`, as int64 in [0, 2^32)."""
    return x.to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _is_nan_bits(u: Tensor) -> Tensor:
    return (u & 0x7FFFFFFF) > 0x7F800000


def bf16_bits_of_master(master: Tensor) -> Tensor:
    """The bf16 bits (int64) of the parameter of fp32 `master`: ties away from zero, NaN quieted."""
    u = _bits(master)
    return torch.where(_is_nan_bits(u), (u >> 16) | 0x0040, ((u + 0x8000) >> 16) & 0xFFFF)


def _bf16_from_bits(bits: Tensor) -> Tensor:
    return torch.where(bits >= 2**15, bits - 2**16, bits).to(torch.int16).view(torch.bfloat16)


def param_of_master(master: Tensor, dtype: torch.dtype) -> Tensor:
    """The parameter a master weight writes, in `dtype`: bf16 rounded ties away from zero, others
    (fp16, fp32) rounded to nearest even as ``Tensor.to`` does."""
    if dtype != torch.bfloat16:
        return master.to(dtype)
    return _bf16_from_bits(bf16_bits_of_master(master)).reshape(master.shape)


def join(param: Tensor, low: Tensor) -> Tensor:
    """The fp32 master stored as `low` (int16 low half, or uint8 bits 8-15) beside bf16 `param`."""
    high = (param.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF) << 16
    low16 = low.to(torch.int64) & 0xFFFF if low.dtype == torch.int16 else (low.to(torch.int64) & 0xFF) << 8
    offset = torch.where(low16 >= 2**15, low16 - 2**16, low16)
    joined = torch.where(_is_nan_bits(high), high | low16, (high + offset) & 0xFFFFFFFF)
    return codec.bits_float(joined).reshape(param.shape)


def split8_salt(step: Tensor) -> Tensor:
    """`split8_salt` of master.h for `step` (a float tensor holding the count after the increment)."""
    return codec.rounding_step_key(_SPLIT8_SALT_KEY, step)


def round_split8(master: Tensor, salt: Tensor) -> Tensor:
    """`round_master_split8` of master.h: `master` rounded stochastically to a multiple of 256 in its bits."""
    u = _bits(master)
    random = codec.mix32(u ^ salt) & 0xFF
    up = (u + random) & 0xFFFFFF00
    down = u & 0xFFFFFF00
    finite = (u & 0x7F800000) != 0x7F800000
    overflowed = finite & ((up & 0x7F800000) == 0x7F800000)
    rounded = torch.where(overflowed, down, up)
    rounded = torch.where(_is_nan_bits(u), (u | 0x00400000) & 0xFFFFFF00, rounded)
    return codec.bits_float(rounded).reshape(master.shape)


def _bits16(t: Tensor) -> Tensor:
    """The bit patterns of 16-bit `t`, as int64 in [0, 2^16)."""
    return t.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF


def other_rounding_at_ties(master: Tensor, param: Tensor) -> Tensor:
    """Where bf16 `param` holds, at a tie of finite fp32 `master` (low half 0x8000), the nearest
    rounding that is not fusedoff's: the upper half (torch's round to nearest even, where it is even)."""
    u = _bits(master).reshape(param.shape)
    upper_half = _bits16(param).reshape(param.shape) == (u >> 16)
    return ((u & 0xFFFF) == 0x8000) & ((u & 0x7F800000) != 0x7F800000) & upper_half


def master_or_param(master: Tensor, param: Tensor) -> Tensor:
    """master.h's ``master_or_param``: an fp32 `master` where `param` is one of its nearest roundings
    (bf16: within half a bf16 step in bit pattern, both at a tie, or for a NaN master its quieted
    upper half; fp16: nearest even, or at a tie the other nearest value), else the parameter's
    value: a written parameter is taken element by element (see [note: every write is seen] there)."""
    if master.dtype != torch.float32 or param.dtype not in (torch.bfloat16, torch.float16):
        return master
    p = _bits16(param).reshape(master.shape)
    value = param.to(torch.float32).reshape(master.shape)
    if param.dtype == torch.bfloat16:
        u = _bits(master).reshape(master.shape)
        reference = torch.where(_is_nan_bits(u), ((u >> 16) | 0x0040) << 16, u)
        keep = ((reference - (p << 16) + 0x8000) & 0xFFFFFFFF) <= 0x10000
    else:
        rounded = master.to(torch.float16)
        rounded_bits = _bits16(rounded).reshape(master.shape)
        step = p - rounded_bits + 1
        other_at_tie = ((step == 0) | (step == 2)) & ((value - master) == (master - rounded.to(torch.float32)))
        keep = (p == rounded_bits) | other_at_tie
    return torch.where(keep, master, value)


def load(master: Tensor, param: Tensor) -> Tensor:
    """The fp32 value the update starts from: the master as stored (fp32 whole, or split; whole: the
    parameter where it was written, `master_or_param`)."""
    return master_or_param(master, param) if master.dtype.is_floating_point else join(param, master)


def stored(master: Tensor, param: Tensor, value: Tensor, step: Tensor) -> list[tuple[Tensor, Tensor]]:
    """The (target, value) writes of an updated master `value` (fp32) and of its parameter."""
    if master.dtype.is_floating_point:
        return [(master, value), (param, param_of_master(value, param.dtype))]
    if master.dtype == torch.uint8:
        value = round_split8(value, split8_salt(step))
    u = _bits(value)
    low = (u & 0xFFFF) if master.dtype == torch.int16 else ((u >> 8) & 0xFF)
    low = torch.where(low >= 2**15, low - 2**16, low) if master.dtype == torch.int16 else low
    return [(master, low.to(master.dtype).reshape(master.shape)), (param, param_of_master(value, param.dtype))]


def split(master: Tensor, precision: str) -> Tensor:
    """The stored form, in `precision`, of fp32 `master` (a loaded checkpoint's) beside the parameter
    that is its rounding (fusedoff's: at a tie, `other_rounding_at_ties` gives no exact split): its
    low 16 bits ("split", exact); "split8": its offset from the parameter
    rounded to nearest on the 8-bit grid (and kept in the parameter's range, so that the parameter
    stays the rounding of the stored master)."""
    if precision == "fp32":
        return master.to(torch.float32)
    low16 = _bits(master) & 0xFFFF
    offset = torch.where(low16 >= 2**15, low16 - 2**16, low16)
    if precision == "split":
        return offset.to(torch.int16).reshape(master.shape)
    grid = torch.clamp(torch.div(offset + 128, 256, rounding_mode="floor"), -128, 127)
    return (grid & 0xFF).to(torch.uint8).reshape(master.shape)
