"""The Triton Adam/AdamW kernel with compressed moments (fusedoff/kernels/triton_adam_compressed.py)
against the pure-PyTorch reference (``reference.adam_compressed_step_``, the ``torch`` backend), bit
for bit.

On CPU tensors through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a
GPU) nothing contracts to an FMA, so the kernel's fp32 arithmetic is exactly that of adam.h and
state_codec.h. So is the reference's but for one operation: torch's CPU ``sqrt`` of fp32 is not
correctly rounded (a fifth to two fifths of random inputs come out an ulp off ``sqrtf``, on every
ATEN_CPU_CAPABILITY of torch 2.14, contiguous or not), which moves params by an ulp and, through
Adam's L2 decay, the next step's moments. The reference therefore runs with its ``torch.sqrt``
computed through float64 (correctly rounded, like ``sqrtf`` and ``tl.sqrt_rn``), and then params,
masters, bf16 states, codes and absmax must be equal to the bit. On a GPU the compiled kernel may
contract multiply-adds (see triton_adam.py) and a code may flip: these tests run on CPU only.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from fusedoff.hyperparameters import AdamHyperparameters  # noqa: E402 (after the skip)
from fusedoff.kernels import codec, reference, triton_adam_compressed  # noqa: E402 (after the skip)
from tests.helpers import assert_bitwise_equal, bits  # noqa: E402 (after the skip)

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(not triton_adam_compressed.INTERPRETED,
                       reason="CPU tensors run only through Triton's interpreter (TRITON_INTERPRET=1 before import)"),
]

PRECISIONS = ("bf16", "8bit")
# (param dtype, grad dtype, fp32 masters)
WEIGHTS = {"fp32": (torch.float32, torch.float32, False), "bf16-master": (torch.bfloat16, torch.bfloat16, True)}
MODES = {
    "adamw": dict(decoupled_weight_decay=True, weight_decay=0.1, maximize=False),
    # The scale is not a power of two, so dividing by it rounds.
    "adam-l2-maximize-grad_scale": dict(decoupled_weight_decay=False, weight_decay=0.01, maximize=True,
                                        grad_scale=1000.0),
}
# Two tensors per call: shorter than a block, one block and a one-element tail, exactly one block,
# one short of it, several blocks with a partial last one.
SIZE_PAIRS = ((1, 257), (7, 1000), (255, 256))
# The second tensor is the range of a larger one that starts at element 512 (the origin of its
# random indices; 8-bit blocks count from the range's start whatever the offset).
OFFSETS = (0, 512)
# The second key is above 2^31: a uint32 argument, not an int32 one.
TENSOR_KEYS = (codec.tensor_key(1234, 0), 0xDEADBEEF)
INITIAL_STEPS = (3, 0)  # each tensor its own count; the second starts at t = 1
NUM_STEPS = 3

_STATE_LISTS = ("params", "exp_avgs", "exp_avg_sqs", "exp_avg_absmaxs", "exp_avg_sq_absmaxs", "master_params")


def _hyper(mode):
    flags = {k: v for k, v in MODES[mode].items() if k != "grad_scale"}
    return dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, **flags)


class _TorchWithCorrectlyRoundedSqrt:
    """torch, but ``sqrt`` rounds correctly (through float64, exact for fp32: see the module docstring)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def sqrt(x):
        return torch.sqrt(x.double()).to(x.dtype)


@pytest.fixture
def oracle(monkeypatch):
    """``reference.adam_compressed_step_`` with a correctly rounded ``sqrt`` (only in reference.py)."""
    monkeypatch.setattr(reference, "torch", _TorchWithCorrectlyRoundedSqrt())
    return reference.adam_compressed_step_


# ---- the problem: the argument lists of one fused call, plus the gradients of every step ----------


def _make_problem(precision, weights, sizes, *, offsets=OFFSETS, grad_scale=1.0, num_steps=NUM_STEPS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    param_dtype, grad_dtype, master = WEIGHTS[weights]
    w = [torch.randn(n, generator=gen) for n in sizes]
    # Moments as after a few steps, over many orders of magnitude (8-bit: subnormal codes too), with
    # some exact zeros.
    m = [torch.randn(n, generator=gen) * 10.0 ** -torch.randint(2, 9, (n,), generator=gen) for n in sizes]
    v = [torch.rand(n, generator=gen) ** 4 * 1e-4 for n in sizes]
    for x in (*m, *v):
        x[::11] = 0.0
    problem = dict(
        params=[x.to(param_dtype) for x in w],
        master_params=[x.clone() for x in w] if master else [],
        steps=[torch.tensor(float(INITIAL_STEPS[i])) for i in range(len(sizes))],
        offsets=list(offsets),
        tensor_keys=list(TENSOR_KEYS),
        grads=[[(torch.randn(n, generator=gen) * 1e-2 * grad_scale).to(grad_dtype) for n in sizes]
               for _ in range(num_steps)],
    )
    if precision == "8bit":
        quantized_m = [codec.quantize(x, signed=True) for x in m]
        quantized_v = [codec.quantize(x, signed=False) for x in v]
        problem.update(exp_avgs=[c for c, _ in quantized_m], exp_avg_absmaxs=[a for _, a in quantized_m],
                       exp_avg_sqs=[c for c, _ in quantized_v], exp_avg_sq_absmaxs=[a for _, a in quantized_v])
    else:
        problem.update(exp_avgs=[x.bfloat16() for x in m], exp_avg_sqs=[x.bfloat16() for x in v],
                       exp_avg_absmaxs=[], exp_avg_sq_absmaxs=[])
    return problem


def _copy(problem):
    out = dict(problem)
    for name in (*_STATE_LISTS, "steps"):
        out[name] = [t.clone() for t in problem[name]]
    return out


def _step(problem, adam_compressed_step_, grads, hyper, grad_scale=None, found_inf=None):
    adam_compressed_step_(problem["params"], grads, problem["exp_avgs"], problem["exp_avg_sqs"],
                          problem["exp_avg_absmaxs"], problem["exp_avg_sq_absmaxs"], problem["master_params"],
                          problem["steps"], problem["offsets"], problem["tensor_keys"], grad_scale=grad_scale,
                          found_inf=found_inf, hyper=AdamHyperparameters(**hyper))


def _bits_up_to_nan_sign(t: torch.Tensor) -> torch.Tensor:
    """The bits, every NaN (and every NaN code: a signed one carries the NaN's sign) made one.

    A NaN's sign and payload are not the arithmetic's: x86 passes an operand's on, CUDA makes a
    canonical one, and with maximize the reference negates (``-g`` flips the sign) where adam.h
    multiplies by -1 (which keeps it on x86).
    """
    if t.dtype == torch.uint8:
        return torch.where(t & 0x7F == codec.SIGNED_NAN, codec.SIGNED_NAN, t)  # unsigned NaN is 0xff: unchanged
    return torch.where(t.isnan().reshape(-1), bits(torch.full_like(t, float("nan"))), bits(t))


def _run_both(problem, oracle, hyper, grad_scale=None, grads_per_step=None):
    """Steps the kernel and the oracle side by side, comparing every tensor after every step."""
    got, want = _copy(problem), _copy(problem)
    for k, grads in enumerate(grads_per_step or problem["grads"]):
        for p in (got, want):
            torch._foreach_add_(p["steps"], 1.0)
        _step(got, triton_adam_compressed.adam_compressed_step_, grads, hyper, grad_scale)
        _step(want, oracle, grads, hyper, grad_scale)
        assert_bitwise_equal(got, want, f"differs from the reference after step {k + 1}",
                             names=_STATE_LISTS, canonical=_bits_up_to_nan_sign)
    return got


# ---- bit for bit against the reference ---------------------------------------------------------


@pytest.mark.parametrize("sizes", SIZE_PAIRS, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("precision", PRECISIONS)
def test_matches_reference_bitwise(oracle, precision, weights, mode, sizes):
    scale = MODES[mode].get("grad_scale")
    problem = _make_problem(precision, weights, sizes, grad_scale=scale or 1.0)
    got = _run_both(problem, oracle, _hyper(mode), None if scale is None else torch.tensor(scale))
    assert [s.item() for s in got["steps"]] == [float(t + NUM_STEPS) for t in INITIAL_STEPS]  # read, not written
    for name in ("params", "exp_avgs", "exp_avg_sqs"):  # the step did something
        assert not any(torch.equal(a, b) for a, b in zip(got[name], problem[name]) if a.numel() > 1), name


def test_random_indices_are_64_bit(oracle):
    # Ranges past element 2^32 of their tensor: the index's high half enters the hash (and the
    # first range crosses 2^32).
    problem = _make_problem("bf16", "fp32", (7, 1000), offsets=(2**32 - 3, 2**33 + 512))
    got = _run_both(problem, oracle, _hyper("adamw"))
    low = _run_both(_make_problem("bf16", "fp32", (7, 1000)), oracle, _hyper("adamw"))  # offset 512
    assert not torch.equal(got["exp_avgs"][1], low["exp_avgs"][1])  # other bits, other roundings


# ---- the codec alone, on the values a few steps rarely reach ---------------------------------------


@triton.jit
def _codec_kernel(x_ptr, absmax_ptr, code_ptr, random16_ptr, signed_code_ptr, unsigned_code_ptr, signed_ptr,
                  unsigned_ptr, bf16_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    absmax = tl.load(absmax_ptr + offsets, mask=mask)
    code = tl.load(code_ptr + offsets, mask=mask)
    encode = triton_adam_compressed._encode_factor(absmax)
    decode = triton_adam_compressed._decode_factor(absmax)
    tl.store(signed_code_ptr + offsets, triton_adam_compressed._encode_signed(x, encode), mask=mask)
    tl.store(unsigned_code_ptr + offsets, triton_adam_compressed._encode_unsigned(x, encode), mask=mask)
    tl.store(signed_ptr + offsets, triton_adam_compressed._decode_signed(code, decode), mask=mask)
    tl.store(unsigned_ptr + offsets, triton_adam_compressed._decode_unsigned(code, decode), mask=mask)
    random16 = tl.load(random16_ptr + offsets, mask=mask).to(tl.uint32)
    tl.store(bf16_ptr + offsets, triton_adam_compressed._float_to_bf16_stochastic(x, random16), mask=mask)


def _codec_inputs():
    """(x, absmax): every code's value, the ties between neighbours (round to even) and an ulp either
    side, the subnormal codes' range down to below half the smallest step, random values; under
    absmax = CODE_TOP times powers of two (the factors are then exact) and random scales; signed
    zeros, infinities, quiet and signalling NaNs (bf16 must quiet them), negatives; scales below the
    smallest normal."""
    gen = torch.Generator().manual_seed(0)
    all_codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    ones = torch.ones(256)
    grid = torch.cat([codec.decode_signed(all_codes, ones), codec.decode_unsigned(all_codes, ones)])
    grid = grid[grid.isfinite()].abs().unique().double()  # sorted, from 0 to CODE_TOP
    ties = ((grid[1:] + grid[:-1]) / 2).float()  # exact: one bit more than a code
    q = torch.cat([grid.float(), ties, torch.nextafter(ties, torch.tensor(0.0)),
                   torch.nextafter(ties, torch.tensor(2.0)), torch.tensor([2.0**-35, 2.0**-34, 2.0**-18, 1e-45]),
                   torch.rand(2000, generator=gen), 2.0 ** -(40 * torch.rand(2000, generator=gen))])
    q = torch.cat([q, -q])
    xs, scales = [], []
    for scale in (1.0, 2.0**-20, 2.0**40):
        xs.append(q * scale)
        scales.append(torch.full_like(q, codec.CODE_TOP * scale))
    random_scale = torch.rand(q.numel(), generator=gen) * 10.0 ** torch.randint(-8, 3, (q.numel(),), generator=gen)
    xs.append(q * random_scale)  # q * scale / scale is not q: the division rounds
    scales.append(random_scale)
    signalling_nans = torch.tensor([0x7F800001, 0x7FA00000, -0x7F7FFFFF], dtype=torch.int32).view(torch.float32)
    specials = torch.cat([torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"), 1e-45,
                                        -3.0]), signalling_nans])
    xs.append(q * 2.0**-140)  # a block whose largest value is subnormal: scale 2^-126
    scales.append(torch.full_like(q, 2.0**-139))
    for scale in (0.0, 1.0, 1e-3):  # absmax 0: an all-zero block
        xs.append(specials)
        scales.append(torch.full_like(specials, scale))
    return torch.cat(xs), torch.cat(scales)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf / inf, on purpose
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # x * factor of x > absmax, on purpose
def test_codec_matches_codec_py_bitwise():
    x, absmax = _codec_inputs()
    n = x.numel()
    code = torch.arange(n, dtype=torch.int64).remainder(256).to(torch.uint8)  # every code under many scales
    random16 = torch.randint(0, 2**16, (n,), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    random16[:4] = torch.tensor([0, 1, 0x7FFF, 0xFFFF], dtype=torch.int32)
    outs = dict(signed_code=torch.empty(n, dtype=torch.uint8), unsigned_code=torch.empty(n, dtype=torch.uint8),
                signed=torch.empty(n), unsigned=torch.empty(n), bf16=torch.empty(n, dtype=torch.bfloat16))
    block = 1024
    _codec_kernel[(triton.cdiv(n, block),)](x, absmax, code, random16, *outs.values(), n, BLOCK=block)
    encode, decode = codec.encode_factor(absmax), codec.decode_factor(absmax)
    want = dict(signed_code=codec.encode_signed(x, encode), unsigned_code=codec.encode_unsigned(x, encode),
                signed=codec.decode_signed(code, decode), unsigned=codec.decode_unsigned(code, decode),
                bf16=codec.bf16_stochastic(x, random16.to(torch.int64)))
    for name, got in outs.items():
        differ = (bits(got) != bits(want[name])).nonzero().flatten()
        i = differ[0].item() if differ.numel() else None
        assert i is None, (
            f"{name}: {differ.numel()} of {n} differ, first x={x[i].item()!r} absmax={absmax[i].item()!r} "
            f"code={code[i].item()}: {got[i].item()!r} vs {want[name][i].item()!r}"
        )


# ---- found_inf and non-finite gradients ---------------------------------------------------------


@pytest.mark.parametrize("precision", PRECISIONS)
def test_found_inf_changes_nothing(oracle, precision):
    hyper = _hyper("adam-l2-maximize-grad_scale")
    scale = torch.tensor(1000.0)
    problem = _make_problem(precision, "bf16-master", (7, 1000), grad_scale=1000.0)
    flagged, plain = _copy(problem), _copy(problem)
    grads = problem["grads"]

    def clean_step(k):
        for p in (flagged, plain):
            torch._foreach_add_(p["steps"], 1.0)
        _step(flagged, triton_adam_compressed.adam_compressed_step_, grads[k], hyper, scale, torch.zeros(()))
        _step(plain, oracle, grads[k], hyper, scale)
        assert_bitwise_equal(flagged, plain, "with found_inf=0 differs from the reference without found_inf",
                             names=_STATE_LISTS, canonical=_bits_up_to_nan_sign)

    clean_step(0)
    # An overflowed step: non-finite gradients, found_inf = 1 and (as an optimizer does) no step
    # increment. Nothing may change, to the bit.
    before = _copy(flagged)
    bad_grads = [g.clone() for g in grads[1]]
    for g in bad_grads:
        g[0], g[-1] = float("nan"), float("inf")
    _step(flagged, triton_adam_compressed.adam_compressed_step_, bad_grads, hyper, scale, torch.ones(1))
    assert_bitwise_equal(flagged, before, "changed on a step with found_inf=1",
                         names=_STATE_LISTS, canonical=_bits_up_to_nan_sign)
    clean_step(1)  # continues as if the overflowed step never happened
    clean_step(2)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf / inf, on purpose
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # x * factor of x > absmax, on purpose
@pytest.mark.parametrize("precision", PRECISIONS)
def test_non_finite_gradients_stay_in_their_element(oracle, precision):
    """NaN, +inf and -inf gradients (one in each 8-bit block, the last block partial) make their own
    elements non-finite; the rest of each block, its absmax included, steps as if they were not there.

    It runs Adam with L2 decay. Under AdamW the kernel, like adam.h, still adds ``0 * p`` to the
    gradient (no branch per element), which is NaN once p is, where the reference skips the term:
    an element whose param is already NaN gets m = NaN from the kernel, m = inf from the reference.
    """
    size, bad = 600, {5: float("nan"), 300: float("inf"), 599: float("-inf")}
    mode = "adam-l2-maximize-grad_scale"
    hyper, scale = _hyper(mode), torch.tensor(MODES[mode]["grad_scale"])
    problem = _make_problem(precision, "fp32", (size, 7), grad_scale=scale.item())
    grads = [list(g) for g in problem["grads"]]
    grads[0][0] = grads[0][0].clone()
    for i, value in bad.items():
        grads[0][0][i] = value

    got = _run_both(problem, oracle, hyper, scale, grads_per_step=grads)
    # Against the first step with zero gradients in those elements: the other elements' params agree
    # after it (decoded with the same old absmax); after it only the bad elements are non-finite.
    zeroed = [g.clone() for g in problem["grads"][0]]
    zeroed[0][list(bad)] = 0.0
    clean = _run_both(problem, oracle, hyper, scale, grads_per_step=[zeroed])
    once = _run_both(problem, oracle, hyper, scale, grads_per_step=grads[:1])
    others = torch.ones(size, dtype=torch.bool)
    others[list(bad)] = False
    assert torch.equal(bits(once["params"][0])[others], bits(clean["params"][0])[others])
    assert not once["params"][0][list(bad)].isfinite().any()
    for p in (once, got):
        assert p["params"][0][others].isfinite().all()
        if precision == "8bit":
            assert all(a.isfinite().all() for a in (*p["exp_avg_absmaxs"], *p["exp_avg_sq_absmaxs"]))
            m = codec.dequantize(p["exp_avgs"][0], p["exp_avg_absmaxs"][0], signed=True)
            v = codec.dequantize(p["exp_avg_sqs"][0], p["exp_avg_sq_absmaxs"][0], signed=False)
        else:
            m, v = p["exp_avgs"][0].float(), p["exp_avg_sqs"][0].float()
        assert m[others].isfinite().all() and v[others].isfinite().all()
        assert not m[list(bad)].isfinite().any() and not v[list(bad)].isfinite().any()


# ---- argument checks ------------------------------------------------------------------------------


def _swap(name, index, make):
    def mutate(call):
        call[name] = list(call[name])
        call[name][index] = make(call[name][index])
    return mutate


def _set(name, make):
    def mutate(call):
        call[name] = make(call)
    return mutate


BAD_CALLS = {
    "offsets-too-short": (_set("offsets", lambda c: c["offsets"][:1]), "same length"),
    "8bit-offset-inside-a-block": (_swap("offsets", 1, lambda o: o + 128), r"offsets\[1\] is 640"),
    "negative-offset": (_swap("offsets", 0, lambda o: -256), r"offsets\[0\] is -256"),
    "64-bit-key": (_swap("tensor_keys", 1, lambda k: 2**32), r"tensor_keys\[1\] must be a 32-bit"),
    "no-absmax": (_set("exp_avg_absmaxs", lambda c: []), "8-bit states need one exp_avg_absmax"),
    "fp32-states": (_set("exp_avgs", lambda c: [t.float() for t in c["exp_avgs"]]), "bfloat16 or uint8"),
    "bf16-state-with-codes": (_swap("exp_avg_sqs", 1, lambda t: t.bfloat16()), r"exp_avg_sqs\[1\] must be uint8"),
    "absmax-numel": (_swap("exp_avg_sq_absmaxs", 1, lambda t: t[:-1]),
                     r"exp_avg_sq_absmaxs\[1\] has 3 elements, expected 4"),
    "code-numel": (_swap("exp_avgs", 0, lambda t: t[1:]), r"exp_avgs\[0\] has 6 elements, expected 7"),
    "fp16-master": (_swap("master_params", 1, lambda t: t.half()), r"master_params\[1\] must be float32"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_arguments_raise_before_anything_is_written(case):
    mutate, message = BAD_CALLS[case]
    problem = _make_problem("8bit", "bf16-master", (7, 1000))
    call = dict(problem, grads=problem["grads"][0])
    mutate(call)
    before = _copy(problem)
    with pytest.raises(ValueError, match=message):
        triton_adam_compressed.adam_compressed_step_(
            call["params"], call["grads"], call["exp_avgs"], call["exp_avg_sqs"], call["exp_avg_absmaxs"],
            call["exp_avg_sq_absmaxs"], call["master_params"], call["steps"], call["offsets"], call["tensor_keys"],
            hyper=AdamHyperparameters(**_hyper("adamw")))
    assert_bitwise_equal(problem, before, "was written by a call that raised",
                         names=_STATE_LISTS, canonical=_bits_up_to_nan_sign)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_empty_inputs(oracle, precision):
    """Empty lists return at once; an empty tensor is skipped and its neighbour updated."""
    triton_adam_compressed.adam_compressed_step_([], [], [], [], [], [], [], [], [], [],
                                                 hyper=AdamHyperparameters(**_hyper("adamw")))
    _run_both(_make_problem(precision, "bf16-master", (0, 257)), oracle, _hyper("adamw"))
