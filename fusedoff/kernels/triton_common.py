"""What the Triton backends share: launch shape, fp64 ``pow``, the interpreter's bf16 rounding, a
program's block (with found_inf), the counter-based random stream, the loads and stores of the
weights and their master weights, and the argument checks that mirror csrc/ops.cpp.

Importing this module decorates its kernels' helpers, which is when Triton decides whether it runs
through its interpreter: ``INTERPRETED`` records that decision (TRITON_INTERPRET=1 must be set before).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# NOTE: 1024 elements x 4 warps is the usual shape for a memory-bound elementwise kernel (8 elements
# per thread: two 16-byte loads per fp32 stream); not timed (see 'GPU launch shapes' in
# benchmarks/results/RESULTS.md).
BLOCK_SIZE = 1024
NUM_WARPS = 4

STORAGE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def fp64_pow(base, exponent):
    """``pow`` for fp64 ``base`` in [0, 1] and ``exponent`` >= 0: ``exp2(exponent * log2(base))``.

    Triton has no portable ``pow`` (libdevice's is CUDA/HIP-only and the interpreter has none). For
    ``beta^t`` with x = t * |log2 beta| the relative error is about x * 2^-52, so the absolute error
    of ``1 - beta^t`` is at most ~ x * 2^-x * 2^-52 < 2^-52 for every t, and where ``1 - beta^t`` is
    small (t * (1 - beta) << 1) its relative error stays ~2^-52: after rounding to fp32 it agrees
    with C++'s ``pow``. On NVIDIA the fp64 exp2/log2 inline libdevice's code (no call; checked in
    the sm_90 PTX); a few dozen scalar operations per program, free next to the memory traffic.
    """
    return tl.exp2(exponent * tl.log2(base))


@triton.jit
def round_to_bf16(x):
    """fp32 -> bf16, round to nearest even, in integer arithmetic (NaN stays NaN).

    NOTE: only for the interpreter. Triton 3.8's interpreter truncates fp32 -> bf16 casts: 99,987 of
    200,000 random fp32 bit patterns came out one ulp low, which over 20 Adam steps puts bf16 params
    ~10 ulps off. Compiled kernels cast with ``cvt.rn.bf16.f32`` and do not use this.
    """
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def program_block(numel, found_inf_ptr, HAS_FOUND_INF: tl.constexpr, INDEX_64: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr):
    """This program's index, offsets and mask in a tensor of ``numel`` elements."""
    pid = tl.program_id(0)
    if INDEX_64:
        pid = pid.to(tl.int64)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    if HAS_FOUND_INF:
        # AMP overflow: the tensor counts as empty, so every access is masked off and nothing is
        # written. (Not `mask & (found_inf == 0)`: triton 3.8's interpreter types a scalar
        # comparison like its fp32 operands, and broadcasting it for the `&` then fails.)
        numel = tl.where(tl.load(found_inf_ptr) == 0.0, numel, 0)
    return pid, offsets, offsets < numel


@triton.jit
def load_grad_scale(grad_scale_ptr, HAS_GRAD_SCALE: tl.constexpr):
    if HAS_GRAD_SCALE:
        grad_scale = tl.load(grad_scale_ptr)
    else:
        grad_scale = 1.0
    return grad_scale


# ---- the counter-based random stream of state_codec.h (uint32 tensors) ---------------------------
# In tl.uint32 a Python int operand takes the tensor's type, multiplications wrap mod 2^32 as in C++
# and shifts are logical; where a wrap is meant the operation says ``sanitize_overflow=False`` (a
# debug build, TRITON_DEBUG=1, asserts on any other overflow).
@triton.jit
def mix32(x):
    """``mix32`` of state_codec.h."""
    x ^= x >> 16
    x = tl.mul(x, 0x7FEB352D, sanitize_overflow=False)
    x ^= x >> 15
    x = tl.mul(x, 0x846CA68B, sanitize_overflow=False)
    x ^= x >> 16
    return x


@triton.jit
def rounding_step_key(tensor_key, step):
    """``rounding_step_key`` of state_codec.h (``step``: uint32)."""
    return mix32(tensor_key ^ mix32(step))


# ---- master weights: a line-for-line mirror of csrc/include/fusedoff/master.h --------------------
# MASTER, how a call's master weights are stored: master.h's MasterPrecision.
MASTER_NONE = tl.constexpr(0)
MASTER_FP32 = tl.constexpr(1)
MASTER_SPLIT = tl.constexpr(2)  # int16: the low 16 bits; the bf16 param is the upper half
MASTER_SPLIT8 = tl.constexpr(3)  # uint8: bits 8-15 of the master rounded stochastically to 24 bits
_MASTER_OF_DTYPE = {torch.float32: MASTER_FP32.value, torch.int16: MASTER_SPLIT.value,
                    torch.uint8: MASTER_SPLIT8.value}


@triton.jit
def master_to_bf16_bits(value):
    """``master_to_bf16_bits``: the bf16 bits (uint32) of the parameter of fp32 master ``value``,
    rounded to nearest with ties away from zero; NaN quieted."""
    u = value.to(tl.uint32, bitcast=True)
    nan = (u >> 16) | 0x0040
    rounded = tl.add(u, 0x8000, sanitize_overflow=False) >> 16  # wraps only for a NaN, which takes `nan`
    return tl.where((u & 0x7FFFFFFF) > 0x7F800000, nan, rounded)


@triton.jit
def master_or_bf16_param(u, param_bits):
    """``master_or_bf16_param_lanes``: the bits the update starts from for fp32 master bits ``u``
    beside its bf16 param (bits, uint32): ``u`` where the param is one of the master's nearest
    roundings (a bit-pattern distance of at most 0x8000: both at a tie) or, for a NaN master, its
    quieted upper half; else the param's (see [note: every write is seen] in master.h)."""
    reference = tl.where((u & 0x7FFFFFFF) > 0x7F800000, ((u >> 16) | 0x0040) << 16, u)
    high = param_bits << 16
    distance = tl.add(tl.sub(reference, high, sanitize_overflow=False), 0x8000, sanitize_overflow=False)
    return tl.where(distance <= 0x10000, u, high)


@triton.jit
def master_or_fp16_param(master, param):
    """``master_or_param`` for an fp16 ``param``: ``master`` where the param is its rounding to
    nearest even or, at a tie, the other nearest fp16 value (the next bit pattern, exactly as far
    from the master); else the param's value."""
    rounded = master.to(tl.float16)
    rounded_bits = rounded.to(tl.uint16, bitcast=True).to(tl.uint32)
    param_bits = param.to(tl.uint16, bitcast=True).to(tl.uint32)
    value = param.to(tl.float32)
    step = tl.add(tl.sub(param_bits, rounded_bits, sanitize_overflow=False), 1, sanitize_overflow=False)
    other_at_tie = ((step == 0) | (step == 2)) & ((value - master) == (master - rounded.to(tl.float32)))
    return tl.where((param_bits == rounded_bits) | other_at_tie, master, value)


@triton.jit
def join_master(param_bits, low_bits):
    """``join_master``: the master whose rounding is the bf16 ``param_bits`` and whose low 16 bits are
    ``low_bits`` (both uint32 holding 16 bits)."""
    high = param_bits << 16
    offset = tl.sub(low_bits, (low_bits & 0x8000) << 1, sanitize_overflow=False)  # int16 -> uint32, sign-extended
    nan = (param_bits & 0x7FFF) > 0x7F80
    return tl.where(nan, high | low_bits, tl.add(high, offset, sanitize_overflow=False)).to(tl.float32, bitcast=True)


@triton.jit
def split8_salt(step):
    """``split8_salt``: the key of one step's random bytes for "split8" (``step``: the fp32 count
    after this step's increment)."""
    return rounding_step_key(tl.full((), 0x5B1175A8, tl.uint32), step.to(tl.uint32))


@triton.jit
def round_master_split8(value, salt):
    """``round_master_split8``: ``value`` rounded stochastically to a multiple of 256 in its bits."""
    u = value.to(tl.uint32, bitcast=True)
    random = mix32(u ^ salt) & 0xFF
    up = tl.add(u, random, sanitize_overflow=False) & 0xFFFFFF00  # wraps only for a NaN
    down = u & 0xFFFFFF00
    finite = (u & 0x7F800000) != 0x7F800000
    overflowed = finite & ((up & 0x7F800000) == 0x7F800000)
    rounded = tl.where(overflowed, down, up)
    nan = (u | 0x00400000) & 0xFFFFFF00
    return tl.where((u & 0x7FFFFFFF) > 0x7F800000, nan, rounded).to(tl.float32, bitcast=True)


@triton.jit
def load_weights(param_ptr, master_ptr, offsets, mask, MASTER: tl.constexpr):
    """``MasterWeight::load``: the fp32 weights the math updates: the master as stored (whole, or
    joined from the bf16 param and its low bits; whole: the param where it was written, see
    ``master_or_bf16_param``), else the param upcast.

    Masked-off lanes are undefined (no ``other=``, which keeps triton_adam's code as it was): a
    caller that reduces over the block masks the terms.
    """
    if MASTER == MASTER_FP32:
        p = tl.load(master_ptr + offsets, mask=mask)
        if param_ptr.dtype.element_ty == tl.bfloat16:
            param_bits = tl.load(param_ptr + offsets, mask=mask).to(tl.uint16, bitcast=True).to(tl.uint32)
            p = master_or_bf16_param(p.to(tl.uint32, bitcast=True), param_bits).to(tl.float32, bitcast=True)
        elif param_ptr.dtype.element_ty == tl.float16:
            p = master_or_fp16_param(p, tl.load(param_ptr + offsets, mask=mask))
    elif MASTER == MASTER_SPLIT:
        param_bits = tl.load(param_ptr + offsets, mask=mask).to(tl.uint16, bitcast=True).to(tl.uint32)
        low = tl.load(master_ptr + offsets, mask=mask).to(tl.uint16, bitcast=True).to(tl.uint32)
        p = join_master(param_bits, low)
    elif MASTER == MASTER_SPLIT8:
        param_bits = tl.load(param_ptr + offsets, mask=mask).to(tl.uint16, bitcast=True).to(tl.uint32)
        low = tl.load(master_ptr + offsets, mask=mask).to(tl.uint32) << 8
        p = join_master(param_bits, low)
    else:
        p = tl.load(param_ptr + offsets, mask=mask).to(tl.float32)
    return p


@triton.jit
def store_weights(param_ptr, master_ptr, offsets, p, mask, step, MASTER: tl.constexpr,
                  ROUND_BF16_IN_SOFTWARE: tl.constexpr):
    """``MasterWeight::store``: writes the updated fp32 weights ``p``. Without a master the param is
    ``p`` rounded to nearest even; with one it is the master's rounding (bf16: ties away from zero,
    ``master_to_bf16_bits``), and the master is written as stored ("split8": after
    ``round_master_split8`` with the salt of the tensor's ``step``)."""
    if MASTER == MASTER_NONE:
        if ROUND_BF16_IN_SOFTWARE:
            tl.store(param_ptr + offsets, round_to_bf16(p), mask=mask)
        else:
            tl.store(param_ptr + offsets, p.to(param_ptr.dtype.element_ty), mask=mask)
    else:
        if MASTER == MASTER_SPLIT8:
            p = round_master_split8(p, split8_salt(step))
        if param_ptr.dtype.element_ty == tl.bfloat16:
            param = master_to_bf16_bits(p).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:  # fp16 (never split) rounds to nearest even; an fp32 param is the master
            param = p.to(param_ptr.dtype.element_ty)
        tl.store(param_ptr + offsets, param, mask=mask)
        bits = p.to(tl.uint32, bitcast=True)
        if MASTER == MASTER_FP32:
            tl.store(master_ptr + offsets, p, mask=mask)
        elif MASTER == MASTER_SPLIT:
            tl.store(master_ptr + offsets, (bits & 0xFFFF).to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
        else:
            tl.store(master_ptr + offsets, ((bits >> 8) & 0xFF).to(tl.uint8), mask=mask)


# Triton picks the interpreter when a function is decorated, i.e. when this module is imported, so
# the decorated function's type (not the environment now) says whether kernels are interpreted (and
# run CPU tensors).
INTERPRETED = not isinstance(fp64_pow, triton.runtime.jit.JITFunction)


# ---- argument checks (those of csrc/ops.cpp, all made before anything is written) ---------------


def check_state(state: Tensor, param: Tensor, what: str, index: int, dtype: torch.dtype = torch.float32,
                numel: int | None = None) -> None:
    """A state (or master) tensor of ``param``: dtype, device, contiguity, size; fp32 with one value
    per element unless `dtype`/`numel` say otherwise (compressed states and their block scales)."""
    if state.dtype != dtype:
        raise ValueError(f"fusedoff: {what}[{index}] must be {str(dtype).removeprefix('torch.')}, got {state.dtype}")
    if state.device != param.device:
        raise ValueError(f"fusedoff: {what}[{index}] is on {state.device} but its parameter is on {param.device}")
    if not state.is_contiguous():
        raise ValueError(f"fusedoff: {what}[{index}] must be contiguous")
    if numel is None and state.numel() != param.numel():
        raise ValueError(
            f"fusedoff: {what}[{index}] has {state.numel()} elements but its parameter has {param.numel()}"
        )
    if numel is not None and state.numel() != numel:
        raise ValueError(f"fusedoff: {what}[{index}] has {state.numel()} elements, expected {numel}")


def master_mode(master_params, params) -> int:
    """The MASTER of a call (``master_precision_of`` in csrc/ops.cpp: the master tensors' dtype says
    how they are stored) and its checks: fp32 whole, int16 or uint8 low bits beside bf16 params."""
    if not master_params or not params:
        return MASTER_FP32.value if master_params else MASTER_NONE.value
    dtype = master_params[0].dtype
    if dtype not in _MASTER_OF_DTYPE:
        raise ValueError(f"fusedoff: master_params are float32 (whole), int16 or uint8 (split), got {dtype}")
    if dtype != torch.float32 and params[0].dtype != torch.bfloat16:
        raise ValueError(f"fusedoff: a split master weight ({dtype} low bits) needs bfloat16 parameters, got "
                         f"{params[0].dtype}")
    return _MASTER_OF_DTYPE[dtype]


def master_storage_dtype(mode: int) -> torch.dtype:
    """How each master tensor of a call of MASTER ``mode`` is stored (``master_storage_type``)."""
    return next((dtype for dtype, m in _MASTER_OF_DTYPE.items() if m == mode), torch.float32)


def check_scalar(t: Tensor | None, device: torch.device, what: str) -> None:
    """``grad_scale`` / ``found_inf``: absent, or one float32 element on the parameters' device."""
    if t is None:
        return
    if t.numel() != 1 or t.dtype != torch.float32:
        raise ValueError(f"fusedoff: {what} must be a one-element float32 tensor")
    if t.device != device:
        raise ValueError(f"fusedoff: {what} is on {t.device} but the parameters are on {device}")


def check_call_device(params, grads, grad_scale, found_inf, module: str) -> torch.device:
    """The call-wide checks: storage dtypes, a device the kernels can run on, the AMP scalars."""
    device = params[0].device
    for what, first in (("params", params[0]), ("grads", grads[0])):
        if first.dtype not in STORAGE_DTYPES:
            raise ValueError(f"fusedoff: {what} must be float32, float16 or bfloat16, got {first.dtype}")
    if device.type == "cpu" and not INTERPRETED:
        raise ValueError(
            "fusedoff: the triton backend needs GPU tensors (CPU tensors only with TRITON_INTERPRET=1 set "
            f"before {module} is imported)"
        )
    check_scalar(grad_scale, device, "grad_scale")
    check_scalar(found_inf, device, "found_inf")
    return device


def check_param_and_grad(i: int, p: Tensor, g: Tensor, params, grads, device: torch.device) -> None:
    """params[i] and grads[i] against the call: one device, one dtype each, dense, contiguous, same size."""
    if p.device != device:
        raise ValueError(
            f"fusedoff: all params of one call must be on one device; params[{i}] is on {p.device}, "
            f"params[0] on {device}"
        )
    if p.dtype != params[0].dtype:
        raise ValueError("fusedoff: all params of one call must share a dtype")
    if g.dtype != grads[0].dtype:
        raise ValueError("fusedoff: all grads of one call must share a dtype")
    if g.layout != torch.strided:
        raise ValueError(f"fusedoff: sparse gradients are not supported (grads[{i}] is {g.layout})")
    if not (p.is_contiguous() and g.is_contiguous()):
        raise ValueError(f"fusedoff: params[{i}] and grads[{i}] must be contiguous")
    if g.device != device:
        raise ValueError(f"fusedoff: grads[{i}] is on {g.device} but its parameter is on {device}")
    if g.numel() != p.numel():
        raise ValueError(f"fusedoff: grads[{i}] has {g.numel()} elements but its parameter has {p.numel()}")


def check_step(step: Tensor, i: int, device: torch.device) -> None:
    if step.numel() != 1 or step.dtype != torch.float32 or step.device != device:
        raise ValueError(f"fusedoff: steps[{i}] must be a one-element float32 tensor on {device}")
