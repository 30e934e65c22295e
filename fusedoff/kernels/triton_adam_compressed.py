"""Triton Adam/AdamW with compressed moments: the ``triton`` backend of ``fusedoff.ops.adam_compressed_step_``.

Per element, the update of ``triton_adam`` (its ``_adam_scalars`` and ``_adam_update``, i.e. adam.h's
``adam_scalars`` and ``adam_update`` without amsgrad), with the moments decoded before it and encoded
after it in the same pass, as [note: compressed states] in ``csrc/include/fusedoff/state_codec.h``
describes: bf16 states written with stochastic rounding, or 8-bit codes with one fp32 absmax per
block of ``QUANT_BLOCK`` elements (decoded with the old absmax's factor, encoded with the block's new one's).
The codec below is a line-for-line mirror of state_codec.h (with ``triton_common``'s ``mix32`` and
``rounding_step_key``, which master weights share): ``_rounding_bits`` is ``rounding_bits``,
``_float_to_bf16_stochastic`` ``float_to_bf16_stochastic``, ``_signed_magnitude_code`` and
``_unsigned_magnitude_code`` ``magnitude_code<SignedMap>`` and ``<UnsignedMap>`` (likewise
``_*_magnitude_value``), ``_encode_factor``/``_decode_factor``, ``_encode_signed``/``_decode_signed``,
``_encode_unsigned``/``_decode_unsigned`` and ``_finite_magnitude`` their namesakes; the maps' pieces
are codec.py's. Change one, change the other, and ``fusedoff/kernels/codec.py``;
the loop is that of ``csrc/cpu/adam_compressed_cpu.cpp``.

How it stays faithful to the C++:

- The conventions of ``triton_adam.py``: fp64 run-time hyperparameters, only mode flags
  ``tl.constexpr``; the step count, ``grad_scale`` and ``found_inf`` loaded in the kernel (no host
  sync; with ``found_inf`` non-zero every access is masked off, so nothing changes); IEEE ``div_rn``
  and ``sqrt_rn``; the weights and their master (``MASTER``) read and written by ``triton_common``'s
  ``load_weights``/``store_weights``. One launch per non-empty tensor.
- The codec works on bit views (``.to(tl.uint32, bitcast=True)``) in ``tl.uint32``: a Python int
  operand takes the tensor's type (Triton range-checks it), multiplications wrap mod 2^32 as in C++
  and shifts are logical. Where a wrap is meant (the hash; ``normal - bias`` below the smallest
  normal; ``u + random16`` of a NaN) the operation says ``sanitize_overflow=False``, as Triton's own
  Philox does: a debug build (``TRITON_DEBUG=1``) asserts on any other overflow. The step key takes
  ``uint32(step)`` of the fp32 count, like the C++ ``static_cast``; the tensor key is a ``tl.uint32``
  argument and the range's ``offset`` a ``tl.int64`` one (neither specialised: a new key or offset
  compiles nothing), so element ``e`` draws ``rounding_bits(step_key, offset + e)`` in 64 bits.
- The only fp32 roundings in the codec are the block's factors (``div_rn``), ``q = |x| * factor``
  and the decode's ``value * factor``; no product feeds an addition but ``q * 2^k + 2^23``, which is
  exact whether or not it contracts to an FMA. So, given the same
  decoded-and-updated fp32 moments, codes and bf16 bits are those of the C++. The Adam update itself
  may contract multiply-adds to FMAs in a compiled kernel (see triton_adam.py), and an ulp there
  can flip a stored code. Under the interpreter nothing contracts and the results are bitwise those
  of ``reference.adam_compressed_step_`` once its ``torch.sqrt`` (not correctly rounded on CPU) is
  made to round like ``sqrtf``, as tests/test_triton_adam_compressed.py does.
- Layout: a program takes ``BLOCK_SIZE // QUANT_BLOCK`` 8-bit blocks as a [rows, QUANT_BLOCK] tile,
  one block per row (as the CUDA kernel gives one to a warp), so a block's new absmax is a ``tl.max``
  over its row of finite magnitudes (absent lanes count 0, so a partial last block takes the max
  over its elements only), and no block is split between programs (8-bit ranges start on a block).
  bf16 states take the same tile without the reduction.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusedoff.hyperparameters import AdamHyperparameters
from fusedoff.kernels import codec
from fusedoff.kernels.triton_adam import _adam_scalars, _adam_update
from fusedoff.kernels.triton_common import (
    BLOCK_SIZE,
    INTERPRETED,
    NUM_WARPS,
    check_call_device,
    check_param_and_grad,
    check_state,
    check_step,
    load_grad_scale,
    load_weights,
    master_mode,
    master_storage_dtype,
    mix32,
    program_block,
    rounding_step_key,
    store_weights,
)

# A program's tile is whole 8-bit blocks (the static_assert of adam_compressed_cpu.cpp).
assert BLOCK_SIZE % codec.QUANT_BLOCK == 0

_SIGNED_NAN = tl.constexpr(codec.SIGNED_NAN)  # kSignedNan
_SIGNED_INF = tl.constexpr(codec.SIGNED_INF)
_UNSIGNED_NAN = tl.constexpr(codec.UNSIGNED_NAN)
_UNSIGNED_INF = tl.constexpr(codec.UNSIGNED_INF)
# (inf and NaN are written as bits, as in the header: a NaN constexpr global, used by two functions
# of one kernel, fails compilation, nan != nan making Triton see two values for it.)


# ---- the counter-based random stream (uint32 tensors) ---------------------------------------------
@triton.jit
def _rounding_bits(step_key, index):
    """32 random bits for the elements at int64 ``index`` of the tensor."""
    high = tl.mul((index >> 32).to(tl.uint32), 0x9E3779B9, sanitize_overflow=False)
    return mix32(index.to(tl.uint32) ^ step_key ^ high)  # int64 -> uint32 keeps the low half


# ---- bf16 with stochastic rounding ------------------------------------------------------------
@triton.jit
def _float_to_bf16_stochastic(value, random16):
    """The bf16 (as stored) of fp32 ``value``; ``random16`` in [0, 65536), uint32."""
    u = value.to(tl.uint32, bitcast=True)
    nan = (u >> 16) | 0x0040
    rounded = tl.add(u, random16, sanitize_overflow=False) >> 16  # wraps only for a NaN, which takes `nan`
    bits = tl.where((u & 0x7FFFFFFF) > 0x7F800000, nan, rounded)
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


# ---- 8-bit codes ------------------------------------------------------------------------------
# The maps' pieces as constexprs (first_bits, first_code, shift, bias), lowest first; see codec.py.
_CODE_TOP = tl.constexpr(codec.CODE_TOP)
_MIN_CODE_SCALE = tl.constexpr(codec.MIN_CODE_SCALE)
_S = [tl.constexpr(tuple(piece)) for piece in codec.SIGNED_MAP.pieces]
_U = [tl.constexpr(tuple(piece)) for piece in codec.UNSIGNED_MAP.pieces]
_S0, _S1, _S2, _S3 = _S
_U0, _U1, _U2 = _U


@triton.jit
def _code_scale(absmax):
    return tl.where(absmax > _MIN_CODE_SCALE, absmax, _MIN_CODE_SCALE)


@triton.jit
def _encode_factor(absmax):
    return tl.div_rn(tl.full(absmax.shape, _CODE_TOP, tl.float32), _code_scale(absmax))


@triton.jit
def _decode_factor(absmax):
    return tl.div_rn(_code_scale(absmax), tl.full(absmax.shape, _CODE_TOP, tl.float32))


@triton.jit
def _pick(key, index: tl.constexpr, field: tl.constexpr, shift, value, piece: tl.constexpr):
    inside = key >= piece[index]
    return tl.where(inside, piece[2], shift), tl.where(inside, piece[field], value)


@triton.jit
def _round_piece(u, shift, offset):
    # wraps mod 2^32 as in C++ (CodePiece::round_offset): not in the piece the result is not taken
    total = tl.add(tl.add(u, offset, sanitize_overflow=False), (u >> shift) & 1, sanitize_overflow=False)
    return total >> shift


@triton.jit
def _subnormal_code(q, scale):
    return (q * scale + 8388608.0).to(tl.uint32, bitcast=True) - 0x4B000000


@triton.jit
def _signed_magnitude_code(q):
    """``magnitude_code<SignedMap>``."""
    u = q.to(tl.uint32, bitcast=True)
    shift = tl.full(u.shape, _S0[2], tl.uint32)
    offset = tl.full(u.shape, _S0[4], tl.uint32)
    shift, offset = _pick(u, 0, 4, shift, offset, _S1)
    shift, offset = _pick(u, 0, 4, shift, offset, _S2)
    shift, offset = _pick(u, 0, 4, shift, offset, _S3)
    code = tl.where(u >= _S0[0], _round_piece(u, shift, offset), _subnormal_code(q, 131072.0))  # 2^17
    return tl.minimum(code, 125)


@triton.jit
def _unsigned_magnitude_code(q):
    """``magnitude_code<UnsignedMap>``."""
    u = q.to(tl.uint32, bitcast=True)
    shift = tl.full(u.shape, _U0[2], tl.uint32)
    offset = tl.full(u.shape, _U0[4], tl.uint32)
    shift, offset = _pick(u, 0, 4, shift, offset, _U1)
    shift, offset = _pick(u, 0, 4, shift, offset, _U2)
    code = tl.where(u >= _U0[0], _round_piece(u, shift, offset), _subnormal_code(q, 4294967296.0))  # 2^32
    return tl.minimum(code, 253)


@triton.jit
def _signed_magnitude_value(c):
    """``magnitude_value<SignedMap>``."""
    shift = tl.full(c.shape, _S0[2], tl.uint32)
    bias = tl.full(c.shape, _S0[3], tl.uint32)
    shift, bias = _pick(c, 1, 3, shift, bias, _S1)
    shift, bias = _pick(c, 1, 3, shift, bias, _S2)
    shift, bias = _pick(c, 1, 3, shift, bias, _S3)
    normal = ((c + bias) << shift).to(tl.float32, bitcast=True)
    return tl.where(c >= _S0[1], normal, c.to(tl.float32) * 7.62939453125e-06)  # 2^-17


@triton.jit
def _unsigned_magnitude_value(c):
    """``magnitude_value<UnsignedMap>``."""
    shift = tl.full(c.shape, _U0[2], tl.uint32)
    bias = tl.full(c.shape, _U0[3], tl.uint32)
    shift, bias = _pick(c, 1, 3, shift, bias, _U1)
    shift, bias = _pick(c, 1, 3, shift, bias, _U2)
    normal = ((c + bias) << shift).to(tl.float32, bitcast=True)
    return tl.where(c >= _U0[1], normal, c.to(tl.float32) * 2.3283064365386962890625e-10)  # 2^-32


@triton.jit
def _encode_signed(x, factor):
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude_bits = bits & 0x7FFFFFFF
    code = _signed_magnitude_code(magnitude_bits.to(tl.float32, bitcast=True) * factor)  # inf, NaN: replaced below
    code = tl.where(magnitude_bits == 0x7F800000, _SIGNED_INF, code)
    code = tl.where(magnitude_bits > 0x7F800000, _SIGNED_NAN, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def _decode_signed(code, factor):
    code = code.to(tl.uint32)
    magnitude = code & 0x7F
    value = (_signed_magnitude_value(magnitude) * factor).to(tl.uint32, bitcast=True)
    value = tl.where(magnitude == _SIGNED_INF, 0x7F800000, value)
    value = tl.where(magnitude == _SIGNED_NAN, 0x7FC00000, value)
    return (value | ((code & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _encode_unsigned(x, factor):
    bits = x.to(tl.uint32, bitcast=True)
    magnitude_bits = bits & 0x7FFFFFFF
    code = _unsigned_magnitude_code(magnitude_bits.to(tl.float32, bitcast=True) * factor)
    code = tl.where((code == 0) & (magnitude_bits != 0), 1, code)  # positive stays positive
    code = tl.where(magnitude_bits == 0x7F800000, _UNSIGNED_INF, code)
    code = tl.where((magnitude_bits > 0x7F800000) | (bits > 0x80000000), _UNSIGNED_NAN, code)
    return code.to(tl.uint8)


@triton.jit
def _decode_unsigned(code, factor):
    c = code.to(tl.uint32)
    value = (_unsigned_magnitude_value(c) * factor).to(tl.uint32, bitcast=True)
    value = tl.where((c != 0) & (value == 0), 1, value)  # a positive code never decodes to 0
    value = tl.where(c == _UNSIGNED_INF, 0x7F800000, value)
    value = tl.where(c == _UNSIGNED_NAN, 0x7FC00000, value)
    return value.to(tl.float32, bitcast=True)


@triton.jit
def _finite_magnitude(x):
    magnitude_bits = x.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    return tl.where(magnitude_bits < 0x7F800000, magnitude_bits.to(tl.float32, bitcast=True), 0.0)


# ---- the kernel -------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["offset", "tensor_key"])
def _adam_compressed_kernel(
    param_ptr,
    grad_ptr,
    exp_avg_ptr,  # bf16 values or uint8 codes
    exp_avg_sq_ptr,
    exp_avg_absmax_ptr,  # None unless BLOCK8
    exp_avg_sq_absmax_ptr,  # None unless BLOCK8
    master_ptr,  # None unless MASTER
    step_ptr,
    grad_scale_ptr,  # None unless HAS_GRAD_SCALE
    found_inf_ptr,  # None unless HAS_FOUND_INF
    numel,
    offset: tl.int64,  # the range's first element in its tensor
    tensor_key: tl.uint32,
    lr: tl.float64,
    beta1: tl.float64,
    beta2: tl.float64,
    eps: tl.float64,
    weight_decay: tl.float64,
    BLOCK8: tl.constexpr,
    MASTER: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    DECOUPLED_WEIGHT_DECAY: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    INDEX_64: tl.constexpr,
    ROUND_BF16_IN_SOFTWARE: tl.constexpr,
    QUANT_BLOCK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One range's step over BLOCK_SIZE elements per program, a [BLOCK_SIZE // QUANT_BLOCK, QUANT_BLOCK] tile."""
    ROWS: tl.constexpr = BLOCK_SIZE // QUANT_BLOCK
    pid, offsets, mask = program_block(numel, found_inf_ptr, HAS_FOUND_INF, INDEX_64, BLOCK_SIZE)
    offsets = tl.reshape(offsets, (ROWS, QUANT_BLOCK))
    mask = tl.reshape(mask, (ROWS, QUANT_BLOCK))
    grad_scale = load_grad_scale(grad_scale_ptr, HAS_GRAD_SCALE)
    step = tl.load(step_ptr)
    s = _adam_scalars(lr, beta1, beta2, eps, weight_decay, step, DECOUPLED_WEIGHT_DECAY, MAXIMIZE)

    p = load_weights(param_ptr, master_ptr, offsets, mask, MASTER)
    grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
    if BLOCK8:
        blocks = pid * ROWS + tl.arange(0, ROWS)  # this program's blocks, one per row
        block_mask = tl.max(mask.to(tl.int32), axis=1) != 0  # none with found_inf set
        m_scale = tl.load(exp_avg_absmax_ptr + blocks, mask=block_mask)[:, None]
        v_scale = tl.load(exp_avg_sq_absmax_ptr + blocks, mask=block_mask)[:, None]
        m = _decode_signed(tl.load(exp_avg_ptr + offsets, mask=mask), _decode_factor(m_scale))
        v = _decode_unsigned(tl.load(exp_avg_sq_ptr + offsets, mask=mask), _decode_factor(v_scale))
    else:
        m = tl.load(exp_avg_ptr + offsets, mask=mask).to(tl.float32)
        v = tl.load(exp_avg_sq_ptr + offsets, mask=mask).to(tl.float32)

    p, m, v, _ = _adam_update(p, grad, m, v, 0.0, grad_scale, s, False)

    if BLOCK8:
        m_max = tl.max(tl.where(mask, _finite_magnitude(m), 0.0), axis=1)
        v_max = tl.max(tl.where(mask, _finite_magnitude(v), 0.0), axis=1)
        tl.store(exp_avg_absmax_ptr + blocks, m_max, mask=block_mask)
        tl.store(exp_avg_sq_absmax_ptr + blocks, v_max, mask=block_mask)
        tl.store(exp_avg_ptr + offsets, _encode_signed(m, _encode_factor(m_max)[:, None]), mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, _encode_unsigned(v, _encode_factor(v_max)[:, None]), mask=mask)
    else:
        # (The interpreter passes a key below 2^31 as int32: the cast makes it uint32 there too.)
        step_key = rounding_step_key(tensor_key.to(tl.uint32), step.to(tl.uint32))
        bits = _rounding_bits(step_key, offsets.to(tl.int64) + offset)
        tl.store(exp_avg_ptr + offsets, _float_to_bf16_stochastic(m, bits & 0xFFFF), mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, _float_to_bf16_stochastic(v, bits >> 16), mask=mask)
    store_weights(param_ptr, master_ptr, offsets, p, mask, step, MASTER, ROUND_BF16_IN_SOFTWARE)


# ---- argument checks and the launcher -----------------------------------------------------------
def _check_call(params, grads, exp_avgs, exp_avg_sqs, exp_avg_absmaxs, exp_avg_sq_absmaxs, master_params, steps,
                offsets, tensor_keys, grad_scale, found_inf) -> tuple[bool, int]:
    """The checks of ``describe_compressed_adam_call`` in csrc/ops.cpp, all made before anything is
    written; returns whether the states are 8-bit, and the call's MASTER."""
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(steps) == len(offsets) == len(tensor_keys) == n):
        raise ValueError("fusedoff: params, grads, exp_avgs, exp_avg_sqs, steps, offsets and tensor_keys must have "
                         "the same length")
    if master_params and len(master_params) != n:
        raise ValueError("fusedoff: master_params must be empty or have one tensor per parameter")
    master = master_mode(master_params, params)
    if n == 0:
        return False, master
    state_dtype = exp_avgs[0].dtype
    if state_dtype not in (torch.bfloat16, torch.uint8):
        raise ValueError(f"fusedoff: compressed states are bfloat16 or uint8 (8-bit codes), got {state_dtype}")
    block8 = state_dtype == torch.uint8
    if not (len(exp_avg_absmaxs) == (n if block8 else 0) and len(exp_avg_sq_absmaxs) == len(exp_avg_absmaxs)):
        raise ValueError("fusedoff: 8-bit states need one exp_avg_absmax and exp_avg_sq_absmax per parameter, "
                         "bf16 states none")
    device = check_call_device(params, grads, grad_scale, found_inf, __name__)
    for i, (p, g) in enumerate(zip(params, grads)):
        check_param_and_grad(i, p, g, params, grads, device)
        check_step(steps[i], i, device)
        check_state(exp_avgs[i], p, "exp_avgs", i, state_dtype, p.numel())
        check_state(exp_avg_sqs[i], p, "exp_avg_sqs", i, state_dtype, p.numel())
        if block8:
            blocks = codec.num_blocks(p.numel())
            check_state(exp_avg_absmaxs[i], p, "exp_avg_absmaxs", i, torch.float32, blocks)
            check_state(exp_avg_sq_absmaxs[i], p, "exp_avg_sq_absmaxs", i, torch.float32, blocks)
        if master_params:
            check_state(master_params[i], p, "master_params", i, master_storage_dtype(master))
        if offsets[i] < 0 or (block8 and offsets[i] % codec.QUANT_BLOCK != 0):
            raise ValueError(f"fusedoff: offsets[{i}] is {offsets[i]}; ranges of 8-bit states start on a block of "
                             f"{codec.QUANT_BLOCK} elements")
        if not 0 <= tensor_keys[i] <= 0xFFFFFFFF:
            raise ValueError(f"fusedoff: tensor_keys[{i}] must be a 32-bit unsigned value")
    return block8, master



def adam_compressed_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    exp_avg_absmaxs: Sequence[Tensor],
    exp_avg_sq_absmaxs: Sequence[Tensor],
    master_params: Sequence[Tensor],
    steps: Sequence[Tensor],
    offsets: Sequence[int],
    tensor_keys: Sequence[int],
    *,
    hyper: AdamHyperparameters,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """In-place Adam/AdamW step on compressed moments, one kernel launch per non-empty tensor; the
    arguments are those of ``fusedoff.ops.adam_compressed_step_``."""
    block8, master = _check_call(params, grads, exp_avgs, exp_avg_sqs, exp_avg_absmaxs, exp_avg_sq_absmaxs,
                                 master_params, steps, offsets, tensor_keys, grad_scale, found_inf)
    if not params:
        return
    device = params[0].device
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with guard:
        for i, param in enumerate(params):
            numel = param.numel()
            if numel == 0:
                continue
            num_programs = triton.cdiv(numel, BLOCK_SIZE)
            _adam_compressed_kernel[(num_programs,)](
                param,
                grads[i],
                exp_avgs[i],
                exp_avg_sqs[i],
                exp_avg_absmaxs[i] if block8 else None,
                exp_avg_sq_absmaxs[i] if block8 else None,
                master_params[i] if master_params else None,
                steps[i],
                grad_scale,
                found_inf,
                numel,
                int(offsets[i]),
                int(tensor_keys[i]),
                hyper.lr,
                hyper.beta1,
                hyper.beta2,
                hyper.eps,
                hyper.weight_decay,
                BLOCK8=block8,
                MASTER=master,
                HAS_GRAD_SCALE=grad_scale is not None,
                HAS_FOUND_INF=found_inf is not None,
                DECOUPLED_WEIGHT_DECAY=hyper.decoupled_weight_decay,
                MAXIMIZE=hyper.maximize,
                # 32-bit offsets unless the last block's would overflow.
                INDEX_64=num_programs * BLOCK_SIZE > 2**31 - 1,
                ROUND_BF16_IN_SOFTWARE=INTERPRETED and param.dtype == torch.bfloat16,
                QUANT_BLOCK=codec.QUANT_BLOCK,
                BLOCK_SIZE=BLOCK_SIZE,
                num_warps=NUM_WARPS,
            )
