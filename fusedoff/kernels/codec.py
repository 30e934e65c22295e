"""Compressed optimizer states in pure PyTorch: the ``torch`` backend's codecs, and the keys every backend uses.

It mirrors ``csrc/include/fusedoff/state_codec.h`` (see [note: compressed states] there) line for
line, with 32-bit unsigned arithmetic done in int64 tensors (products split so that none
overflows), so its codes and random bits are those of the C++, CUDA and Triton kernels, bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

QUANT_BLOCK = 256  # elements per 8-bit scale (kQuantBlock)
PRECISIONS = ("fp32", "bf16", "8bit")
# The 8-bit map: 1 the float8-like codes of the first release, 2 the tapered codes of state_codec.h.
CODEC_VERSION = 2
CODEC_VERSION_KEY = "codec_version"  # in each group of a saved state dict

_MASK = 0xFFFFFFFF
SIGNED_NAN, SIGNED_INF = 0x7F, 0x7E
UNSIGNED_NAN, UNSIGNED_INF = 0xFF, 0xFE


def state_dtype(precision: str) -> torch.dtype:
    """The storage dtype of a moment state."""
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": torch.uint8}[precision]


def num_blocks(numel: int) -> int:
    return -(-int(numel) // QUANT_BLOCK)


# ---- the counter-based random stream --------------------------------------------------------
def mix32_int(x: int) -> int:
    """`mix32` of state_codec.h on a Python int (host-side keys)."""
    x &= _MASK
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK
    x ^= x >> 16
    return x


def tensor_key(seed: int, position: int) -> int:
    """The random stream's key of the parameter at `position` (its index in the state dict) under
    the optimizer's `seed`: distinct tensors draw independent bits."""
    return mix32_int((int(seed) & _MASK) ^ mix32_int(position ^ ((int(seed) >> 32) * 0x9E3779B9)))


def _mul32(x: Tensor, constant: int) -> Tensor:
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + ((x * high) & 0xFFFF) * 65536) & _MASK


def mix32(x: Tensor) -> Tensor:
    """`mix32` on an int64 tensor of 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def rounding_step_key(key: int, step: Tensor) -> Tensor:
    """The key of one tensor at `step` (a float tensor holding the count after the increment)."""
    return mix32(mix32(step.to(torch.int64) & _MASK) ^ key)


def rounding_bits(step_key: Tensor, index: Tensor) -> Tensor:
    """32 random bits (int64 tensor) for the elements at `index` (int64) of a tensor."""
    high = _mul32((index >> 32) & _MASK, 0x9E3779B9)
    return mix32((index & _MASK) ^ step_key ^ high)


# ---- bit views --------------------------------------------------------------------------------
def float_bits(x: Tensor) -> Tensor:
    return x.contiguous().view(torch.int32).to(torch.int64) & _MASK


def bits_float(u: Tensor) -> Tensor:
    return torch.where(u >= 2**31, u - 2**32, u).to(torch.int32).view(torch.float32)


# ---- bf16 with stochastic rounding -------------------------------------------------------------
def bf16_stochastic(x: Tensor, random16: Tensor) -> Tensor:
    """fp32 `x` to bf16, rounded up in magnitude with probability (dropped bits) / 2^16."""
    u = float_bits(x.to(torch.float32))
    nan = (u >> 16) | 0x0040
    rounded = (u + random16) >> 16
    out = torch.where((u & 0x7FFFFFFF) > 0x7F800000, nan, rounded)
    return torch.where(out >= 2**15, out - 2**16, out).to(torch.int16).view(torch.bfloat16)


# ---- 8-bit codes -------------------------------------------------------------------------------
CODE_TOP = 1.90625  # kCodeTop: the code value a block's scale maps to
MIN_CODE_SCALE = 2.0**-126  # kMinCodeScale


class _Map:
    """A tapered map (SignedMap / UnsignedMap): pieces (first_bits, first_code, shift, bias, round_offset),
    lowest first."""

    def __init__(self, max_code: int, subnormal_exponent: int, pieces):
        self.max_code, self.subnormal_scale, self.subnormal_step = max_code, 2.0**subnormal_exponent, 2.0**-subnormal_exponent
        self.pieces = []
        for exponent, code, bits in pieces:
            shift, bias = 23 - bits, (exponent << bits) - code
            round_offset = ((1 << (shift - 1)) - 1 - (bias << shift)) & _MASK  # CodePiece::round_offset
            self.pieces.append((exponent << 23, code, shift, bias, round_offset))


# (exponent field of the piece's smallest value, its code, mantissa bits)
SIGNED_MAP = _Map(125, 17, [(112, 4, 2), (123, 48, 3), (125, 64, 4), (127, 96, 5)])
UNSIGNED_MAP = _Map(253, 32, [(97, 4, 2), (120, 96, 4), (126, 192, 5)])


def code_scale(absmax: Tensor) -> Tensor:
    return torch.where(absmax > MIN_CODE_SCALE, absmax, torch.full_like(absmax, MIN_CODE_SCALE))


def encode_factor(absmax: Tensor) -> Tensor:
    """The per-block factor q = |x| * encode_factor (fp32, correctly rounded division)."""
    return torch.full_like(absmax, CODE_TOP, dtype=torch.float32) / code_scale(absmax.to(torch.float32))


def decode_factor(absmax: Tensor) -> Tensor:
    """The per-block factor value = decode(code) * decode_factor. (Both divide by a tensor: torch's
    CUDA division by a Python scalar multiplies by its reciprocal, which rounds differently.)"""
    scale = code_scale(absmax.to(torch.float32))
    return scale / torch.full_like(scale, CODE_TOP)


def _select_piece(key: Tensor, pieces, index: int, field: int) -> tuple[Tensor, Tensor]:
    """(shift, pieces' `field`) of the piece each key (q's bits: index 0; a code: index 1) is in."""
    shift = torch.full_like(key, pieces[0][2])
    value = torch.full_like(key, pieces[0][field])
    for piece in pieces[1:]:
        inside = key >= piece[index]
        shift = torch.where(inside, piece[2], shift)
        value = torch.where(inside, piece[field], value)
    return shift, value


def _magnitude_code(q: Tensor, m: _Map) -> Tensor:
    u = float_bits(q)
    shift, offset = _select_piece(u, m.pieces, 0, 4)
    normal = ((u + offset + ((u >> shift) & 1)) & _MASK) >> shift
    subnormal = float_bits(q * m.subnormal_scale + 8388608.0) - 0x4B000000
    return torch.where(u >= m.pieces[0][0], normal, subnormal).clamp(max=m.max_code)


def _magnitude_value(c: Tensor, m: _Map) -> Tensor:
    shift, bias = _select_piece(c, m.pieces, 1, 3)
    normal = bits_float(((c + bias) << shift) & _MASK)
    subnormal = c.to(torch.float32) * m.subnormal_step
    return torch.where(c >= m.pieces[0][1], normal, subnormal)


def encode_signed(x: Tensor, factor: Tensor) -> Tensor:
    """uint8 codes of fp32 `x` under its block's `encode_factor` (broadcast), first-moment map."""
    bits = float_bits(x)
    sign = (bits >> 24) & 0x80
    magnitude_bits = bits & 0x7FFFFFFF
    code = _magnitude_code(bits_float(magnitude_bits) * factor, SIGNED_MAP)  # inf, NaN: replaced below
    code = torch.where(magnitude_bits == 0x7F800000, SIGNED_INF, code)
    code = torch.where(magnitude_bits > 0x7F800000, SIGNED_NAN, code)
    return (code | sign).to(torch.uint8)


def decode_signed(code: Tensor, factor: Tensor) -> Tensor:
    """fp32 values of first-moment codes under their block's `decode_factor` (broadcast)."""
    c = code.to(torch.int64)
    magnitude = c & 0x7F
    value = float_bits(_magnitude_value(magnitude, SIGNED_MAP) * factor)
    value = torch.where(magnitude == SIGNED_INF, 0x7F800000, value)
    value = torch.where(magnitude == SIGNED_NAN, 0x7FC00000, value)
    return bits_float(value | ((c & 0x80) << 24))


def encode_unsigned(x: Tensor, factor: Tensor) -> Tensor:
    """uint8 codes of fp32 `x` under its block's `encode_factor` (broadcast), second-moment map."""
    bits = float_bits(x)
    magnitude_bits = bits & 0x7FFFFFFF
    code = _magnitude_code(bits_float(magnitude_bits) * factor, UNSIGNED_MAP)
    code = torch.where((code == 0) & (magnitude_bits != 0), 1, code)
    code = torch.where(magnitude_bits == 0x7F800000, UNSIGNED_INF, code)
    code = torch.where((magnitude_bits > 0x7F800000) | (bits > 0x80000000), UNSIGNED_NAN, code)
    return code.to(torch.uint8)


def decode_unsigned(code: Tensor, factor: Tensor) -> Tensor:
    c = code.to(torch.int64)
    value = float_bits(_magnitude_value(c, UNSIGNED_MAP) * factor)
    value = torch.where((c != 0) & (value == 0), 1, value)
    value = torch.where(c == UNSIGNED_INF, 0x7F800000, value)
    value = torch.where(c == UNSIGNED_NAN, 0x7FC00000, value)
    return bits_float(value)


# ---- the first 8-bit map (CODEC_VERSION 1), kept to read its checkpoints --------------------------
def decode_signed_v1(code: Tensor, absmax: Tensor) -> Tensor:
    """Version 1's first moments: float8_e4m3fn codes of x / absmax * 2^8."""
    c = code.to(torch.int64)
    magnitude = c & 0x7F
    field, mantissa = magnitude >> 3, magnitude & 7
    normal = bits_float(((field + 112) << 23) | (mantissa << 20))
    subnormal = mantissa.to(torch.float32) * 2.0**-17
    value = torch.where(field != 0, normal, subnormal) * absmax
    value = torch.where(magnitude == SIGNED_INF, torch.inf, value)
    value = torch.where(magnitude == SIGNED_NAN, torch.nan, value)
    return bits_float(float_bits(value) | ((c & 0x80) << 24))


def decode_unsigned_v1(code: Tensor, absmax: Tensor) -> Tensor:
    """Version 1's second moments: 5 exponent and 3 mantissa bits of x / absmax, 1.0 at code 0xf8."""
    c = code.to(torch.int64)
    field, mantissa = c >> 3, c & 7
    normal = bits_float(((field + 96) << 23) | (mantissa << 20))
    subnormal = mantissa.to(torch.float32) * 2.0**-33
    value = torch.where(field != 0, normal, subnormal) * absmax
    value = torch.where(c == UNSIGNED_INF, torch.inf, value)
    return torch.where(c == UNSIGNED_NAN, torch.nan, value)


def finite_magnitude(x: Tensor) -> Tensor:
    return torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x))


# ---- whole tensors (flat): blocks counted from element 0 ---------------------------------------
def _blocked(flat: Tensor) -> Tensor:
    """`flat` padded with zeros to whole blocks, as (blocks, QUANT_BLOCK)."""
    pad = num_blocks(flat.numel()) * QUANT_BLOCK - flat.numel()
    return torch.cat([flat, flat.new_zeros(pad)]).view(-1, QUANT_BLOCK)


def block_absmax(x: Tensor) -> Tensor:
    """The fp32 scale of each block of flat fp32 `x`: its largest finite magnitude."""
    return _blocked(finite_magnitude(x)).amax(dim=1) if x.numel() else x.new_zeros(0)


def _per_element(per_block: Tensor, numel: int) -> Tensor:
    return per_block.repeat_interleave(QUANT_BLOCK)[:numel]


def quantize(x: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    """(codes, absmax) of flat fp32 `x`."""
    absmax = block_absmax(x)
    factor = _per_element(encode_factor(absmax), x.numel())
    return (encode_signed if signed else encode_unsigned)(x, factor), absmax


def dequantize(codes: Tensor, absmax: Tensor, signed: bool, version: int | None = None) -> Tensor:
    """Flat fp32 values of `codes` (flat uint8) under `absmax`, written by codec `version` (this one's
    by default)."""
    if version is not None and version != CODEC_VERSION:
        if version != 1:
            raise ValueError(f"fusedoff: 8-bit states of codec version {version} are unknown to this version "
                             f"(it reads 1 to {CODEC_VERSION})")
        scale = _per_element(absmax.to(torch.float32), codes.numel())
        return (decode_signed_v1 if signed else decode_unsigned_v1)(codes, scale)
    factor = _per_element(decode_factor(absmax), codes.numel())
    return (decode_signed if signed else decode_unsigned)(codes, factor)
