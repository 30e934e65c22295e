"""Compressed optimizer states: ``state_precision='bf16'`` (stochastic rounding) and ``'8bit'``.

Oracles: torch's own float8_e4m3fn conversion for the first-moment codes, the nearest value of
the float64 grid for the second-moment codes, a float64 Adam step with the error bound the
quantization step allows (derived in each test), the statistics of stochastic rounding, the fp32
mode for NaN/inf propagation, hand counts for the bytes, and torch.optim.AdamW for checkpoints.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import fusedoff
from fusedoff import _ext, ops
from fusedoff.kernels import codec
from tests.helpers import assert_bitwise_equal, backend_params, make_params, native_selftests, seeded_grads, train

BACKENDS = backend_params(("cpu", "cuda", "torch", "triton"))
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled_weight_decay=True, maximize=False)
SIZES = (1, 7, 255, 256, 257, 1000)  # partial, whole and several 8-bit blocks


# ---- the codes against independent oracles ------------------------------------------------------------
def spanning_values(n: int, seed: int, low: float = -12, high: float = 0) -> torch.Tensor:
    """Signed values whose magnitudes span 10^low..10^high, with zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * 10 ** (torch.rand(n, generator=gen) * (high - low) + low)
    x[::17] = 0
    return x


# The 8-bit maps by their definition ([note: compressed states]): the mantissa bits of each binade
# [2^e, 2^(e+1)) of q = |x| * CODE_TOP / absmax, and the step of the codes below the lowest.
SIGNED_BINADES = {0: 5, -1: 4, -2: 4, -3: 3, -4: 3, **{e: 2 for e in range(-15, -4)}}
UNSIGNED_BINADES = {0: 5, -1: 5, **{e: 4 for e in range(-7, -1)}, **{e: 2 for e in range(-30, -7)}}
SUBNORMAL_STEP = {True: 2.0**-17, False: 2.0**-32}
MAX_CODE = {True: 125, False: 253}


def binades(signed: bool) -> dict:
    return SIGNED_BINADES if signed else UNSIGNED_BINADES


def map_grid(signed: bool) -> torch.Tensor:
    """Every magnitude of a map in code order: 0 and the steps below the lowest binade, then each
    binade's 2^bits values, up to the largest code (1 + 29/32)."""
    values = [k * SUBNORMAL_STEP[signed] for k in range(4)]
    for e, bits in sorted(binades(signed).items()):
        values += [(1 + m / 2**bits) * 2.0**e for m in range(2**bits)]
    return torch.tensor(values[: MAX_CODE[signed] + 1], dtype=torch.float64)


def half_step(q: torch.Tensor, signed: bool) -> torch.Tensor:
    """Half the distance between the codes around each q >= 0 (float64): the largest rounding error."""
    table = binades(signed)
    lowest = min(table)
    e = torch.floor(torch.log2(q.clamp(min=2.0**lowest))).clamp(lowest, 0).long()
    bits = torch.tensor([table[int(k)] for k in range(lowest, 1)], dtype=torch.float64)[e - lowest]
    step = torch.where(q >= 2.0**lowest, 2.0 ** (e.double() - bits), SUBNORMAL_STEP[signed])
    return step / 2


def test_the_maps_are_the_tapered_grids_of_the_note():
    for signed in (True, False):
        grid = map_grid(signed)
        assert grid.numel() == MAX_CODE[signed] + 1 and torch.all(grid[1:] > grid[:-1])
        assert grid[-1] == codec.CODE_TOP
        codes = torch.arange(MAX_CODE[signed] + 1).to(torch.uint8)
        decode = codec.decode_signed if signed else codec.decode_unsigned
        assert torch.equal(decode(codes, torch.ones(codes.shape)).double(), grid)
        if signed:  # the sign bit
            assert torch.equal(decode(codes | 0x80, torch.ones(codes.shape)).double(), -grid)


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_codes_round_to_the_nearest_grid_value_ties_to_even(signed):
    grid = map_grid(signed)
    q = spanning_values(20_000, 1, low=-12, high=0.28).abs().clamp(max=codec.CODE_TOP)
    q = torch.cat([q, torch.tensor([codec.CODE_TOP, 1.0, 2.0**-15, 2.0**-17, 2.0**-18, 2.0**-30, 2.0**-33, 2.0**-40,
                                    1e-45]), grid.float(), ((grid[1:] + grid[:-1]) / 2).float()])  # exact midpoints
    encode = codec.encode_signed if signed else codec.encode_unsigned
    codes = encode(q, torch.ones_like(q)).long()
    distance = (q.double()[:, None] - grid[None]).abs()
    nearest = distance.min(dim=1).values
    got = (q.double() - grid[codes]).abs()
    # a positive second moment never becomes 0: the smallest code instead
    positive_floor = (q > 0) & (codes == 1) & (q.double() <= grid[1] / 2) & (not signed)
    assert torch.all((got == nearest) | positive_floor)
    assert torch.all((got <= half_step(q.double(), signed)) | positive_floor)
    ties = ((distance == nearest[:, None]).sum(dim=1) == 2) & ~positive_floor
    assert ties.sum() > 100 and torch.all(codes[ties] % 2 == 0)  # ties to the even code
    if not signed:
        assert torch.all(codes[q > 0] > 0)
    else:  # the sign is a bit of its own
        assert torch.equal(codec.encode_signed(-q, torch.ones_like(q)).long(), codes | 0x80)


@pytest.mark.exhaustive
def test_the_host_kernels_avx512_codec_gives_the_definitions_codes_for_every_value():
    """csrc/cpu/state_codec_avx512.h computes the codes in float arithmetic from tables derived from
    the maps ([note: the codec as float arithmetic]); over every fp32 bit pattern and every code,
    under block factors across the fp32 range, it must give state_codec.h's results bit for bit.
    (The other backends' agreement with state_codec.h: test_codes_and_random_bits_are_the_same_on_every_backend.)"""
    differing = native_selftests().state_codec_selftest(torch.get_num_threads())
    if not differing:
        pytest.skip(f"no AVX-512 on this CPU (the host kernels run the {_ext.cpu_isa()} form of the scalar codec)")
    assert differing == [0, 0, 0, 0]


def test_a_positive_second_moment_never_decodes_to_0():
    tiny = torch.tensor([1e-45, 1e-40, 2.0**-126, 1e-30])
    for absmax in tiny:
        codes, scales = codec.quantize(tiny.clamp(max=absmax), signed=False)
        assert torch.all(codes > 0) and torch.all(codec.dequantize(codes, scales, signed=False) > 0)


def test_version_1_codes_decode_as_they_were_written():
    """The first map (kept to read its checkpoints): float8_e4m3fn of x / absmax * 2^8 for first
    moments; for second moments (1 + m/8) 2^e, e in [-30, 0], and m/8 2^-30 below, 1.0 at 0xf8."""
    codes = torch.arange(256).to(torch.uint8)
    absmax = torch.full((256,), 3.0)
    want = codes.view(torch.float8_e4m3fn).double() / 256 * 3.0
    got = codec.decode_signed_v1(codes, absmax).double()
    finite = torch.isfinite(got) & ((codes & 0x7F) < 0x7E)
    assert torch.equal(got[finite], want[finite])
    assert torch.isinf(got[[0x7E, 0xFE]]).all() and torch.isnan(got[[0x7F, 0xFF]]).all()
    grid = [m / 8 * 2.0**-30 for m in range(8)] + [(1 + m / 8) * 2.0**e for e in range(-30, 1) for m in range(8)]
    grid = torch.tensor(grid[:249], dtype=torch.float64) * 3.0
    assert torch.equal(codec.decode_unsigned_v1(codes[:249], absmax[:249]).double(), grid)


def test_special_values_keep_their_own_codes():
    one = torch.ones(4)
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), -1.0])
    signed = codec.decode_signed(codec.encode_signed(special, one), one)
    assert torch.isnan(signed[0]) and signed[1] == math.inf and signed[2] == -math.inf and signed[3] == -1
    unsigned = codec.decode_unsigned(codec.encode_unsigned(special, one), one)
    # a second moment is never negative or -inf: those read back as NaN, never as a wrong value
    assert torch.isnan(unsigned[0]) and unsigned[1] == math.inf and torch.isnan(unsigned[2:]).all()


def quantization_bound(x: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """The largest error of a stored value (float64): half the step around q = |x| CODE_TOP / scale,
    in x's units (for a positive second moment at least the smallest code), with 2^-21 of the value
    for the fp32 roundings of the factors, q and the decode."""
    scale = absmax.double().clamp(min=codec.MIN_CODE_SCALE)
    q = x.double().abs() * codec.CODE_TOP / scale
    rounding = half_step(q, signed)
    if not signed:  # a positive value below half the smallest code takes that code
        rounding = torch.where(q > 0, torch.maximum(rounding, torch.full_like(q, SUBNORMAL_STEP[False])), rounding)
    return rounding * scale / codec.CODE_TOP + 2.0**-21 * x.double().abs()


def test_quantize_uses_one_scale_per_block_of_finite_magnitudes():
    x = spanning_values(1000, 2, low=-6, high=1)
    x[300] = float("inf")
    for signed in (True, False):
        values = x if signed else x.abs()
        codes, absmax = codec.quantize(values, signed=signed)
        blocks = torch.cat([values, values.new_zeros(24)]).view(4, 256)
        want = torch.where(torch.isfinite(blocks), blocks.abs(), 0).amax(dim=1)
        assert torch.equal(absmax, want)
        back = codec.dequantize(codes, absmax, signed=signed)
        assert back[300] == math.inf
        finite = torch.isfinite(values)
        scale = absmax.repeat_interleave(256)[:1000]
        error = (back[finite].double() - values[finite].double()).abs()
        bound = quantization_bound(values[finite], scale[finite], signed)
        assert torch.all(error <= bound) and (error / bound).max() > 0.25
        largest = torch.where(torch.isfinite(blocks), blocks.abs(), -1).argmax(dim=1) + torch.arange(4) * 256
        largest = largest[largest < 1000]
        assert torch.allclose(back[largest], values[largest], rtol=2.0**-22, atol=0)  # the scale, within an ulp


# ---- one step against the float64 oracle --------------------------------------------------------------
def compressed_problem(precision: str, sizes, seed: int, param_dtype=torch.float32, device="cpu"):
    """Tensors for one compressed call, with states whose values span many orders of magnitude."""
    gen = torch.Generator().manual_seed(seed)
    params, grads, m, v, m_scale, v_scale, masters = [], [], [], [], [], [], []
    for i, n in enumerate(sizes):
        m0 = spanning_values(n, seed + 10 * i, low=-8, high=-1)
        v0 = m0 * m0 * (1 + 3 * torch.rand(n, generator=gen))
        p = torch.randn(n, generator=gen)
        params.append(p.to(param_dtype))
        if param_dtype != torch.float32:
            masters.append(p.clone())
        grads.append(spanning_values(n, seed + 10 * i + 1, low=-6, high=1).to(param_dtype))
        if precision == "bf16":
            m.append(m0.to(torch.bfloat16))
            v.append(v0.to(torch.bfloat16))
        else:
            for values, signed, codes, scales in ((m0, True, m, m_scale), (v0, False, v, v_scale)):
                c, s = codec.quantize(values, signed=signed)
                codes.append(c)
                scales.append(s)
    steps = [torch.tensor(float(3 + i)) for i in range(len(sizes))]
    tensors = [params, grads, m, v, m_scale, v_scale, masters, steps]
    return [[t.to(device) for t in ts] for ts in tensors]


def decoded(precision, codes, scales, signed) -> torch.Tensor:
    if precision == "bf16":
        return codes.to(torch.float64)
    return codec.dequantize(codes, scales, signed=signed).double()


def oracle_step(p, g, m, v, step, h):
    p = p * (1 - h["lr"] * h["weight_decay"])
    m = h["beta1"] * m + (1 - h["beta1"]) * g
    v = h["beta2"] * v + (1 - h["beta2"]) * g * g
    bias1, bias2 = 1 - h["beta1"] ** step, math.sqrt(1 - h["beta2"] ** step)
    return p - h["lr"] / bias1 * m / (v.sqrt() / bias2 + h["eps"]), m, v


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-master"])
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_one_step_error_is_bounded_by_the_quantization_step(backend, device, precision, param_dtype):
    """Error of the stored moments against the float64 step from the same decoded states:
    fp32 arithmetic (a few roundings: 2^-22 of the terms) plus the storage's rounding: for bf16
    one bf16 ulp (< 2^-7 |x|, stochastic rounding moves to either neighbour); for 8-bit half a
    step of the value's binade, or for a positive second moment below the smallest code that code
    itself (positive values never round to zero): quantization_bound. The parameter is updated from the fp32 moments before
    they are stored: only fp32 arithmetic error."""
    sizes = (1000, 257, 7) if backend == "triton" else SIZES
    tensors = compressed_problem(precision, sizes, seed=3, param_dtype=param_dtype, device=device)
    params, grads, m, v, m_scale, v_scale, masters, steps = tensors
    before = copy.deepcopy(tensors)
    ops.adam_compressed_step_(*tensors, [0] * len(sizes), list(range(len(sizes))), backend=backend, **HYPER)
    ratios = {"m": 0.0, "v": 0.0}
    for i in range(len(sizes)):
        p0 = (before[6][i] if masters else before[0][i]).double()
        g = before[1][i].double()
        m0 = decoded(precision, before[2][i], before[4][i] if before[4] else None, True)
        v0 = decoded(precision, before[3][i], before[5][i] if before[5] else None, False)
        p64, m64, v64 = oracle_step(p0, g, m0, v0, steps[i].item(), HYPER)
        arithmetic_m = 2.0**-22 * (HYPER["beta1"] * m0.abs() + (1 - HYPER["beta1"]) * g.abs())
        arithmetic_v = 2.0**-22 * (HYPER["beta2"] * v0 + (1 - HYPER["beta2"]) * g * g)
        got_m = decoded(precision, m[i], m_scale[i] if m_scale else None, True)
        got_v = decoded(precision, v[i], v_scale[i] if v_scale else None, False)
        if precision == "bf16":
            bound_m = 2.0**-7 * m64.abs() * (1 + 2.0**-20) + arithmetic_m + 1e-40
            bound_v = 2.0**-7 * v64 * (1 + 2.0**-20) + arithmetic_v + 1e-40
        else:
            scale_m = m_scale[i].repeat_interleave(256)[: sizes[i]]
            scale_v = v_scale[i].repeat_interleave(256)[: sizes[i]]
            bound_m = quantization_bound(m64, scale_m, True) * (1 + 2.0**-20) + arithmetic_m
            bound_v = quantization_bound(v64, scale_v, False) * (1 + 2.0**-20) + arithmetic_v
        err_m, err_v = (got_m - m64).abs(), (got_v - v64).abs()
        assert torch.all(err_m <= bound_m), (i, (err_m / bound_m).max().item())
        assert torch.all(err_v <= bound_v), (i, (err_v / bound_v).max().item())
        ratios["m"] = max(ratios["m"], (err_m / bound_m).max().item())
        ratios["v"] = max(ratios["v"], (err_v / bound_v).max().item())
        weights = (masters[i] if masters else params[i]).double()
        update = (p64 - p0 * (1 - HYPER["lr"] * HYPER["weight_decay"])).abs()
        assert torch.all((weights - p64).abs() <= 2.0**-21 * (p0.abs() + update) + 1e-30), i
        if masters:  # the parameter is its master, rounded to nearest even
            assert torch.equal(params[i], masters[i].to(param_dtype))
    # The bound is the quantization step, not a margin: the errors come close to it.
    assert ratios["m"] > 0.25 and ratios["v"] > 0.25, ratios


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_stochastic_rounding_is_unbiased(backend, device):
    """m = 0.5 * 0 + 0.5 * (2x) = x exactly and v = 0.25 * (2x)^2 = x^2 exactly (beta1 = 0.5,
    beta2 = 0.75, zero states): stored in bf16 they must average to x and x^2 over many elements,
    within 5 standard deviations of the Bernoulli choice between the two neighbours
    (round-to-nearest would be off by a quarter and half an ulp)."""
    n = 4096 if backend == "triton" else 65536
    x = 1 + 3 * 2.0**-9  # 3/4 of a bf16 ulp (2^-7) above 1
    grads = [torch.full((n,), 2 * x, device=device)]
    m = [torch.zeros(n, dtype=torch.bfloat16, device=device)]
    v = [torch.zeros(n, dtype=torch.bfloat16, device=device)]
    params = [torch.zeros(n, device=device)]
    hyper = dict(HYPER, beta1=0.5, beta2=0.75, weight_decay=0.0)
    ops.adam_compressed_step_(params, grads, m, v, [], [], [], [torch.tensor(1.0, device=device)], [0], [12345],
                              backend=backend, **hyper)
    for stored, exact in ((m[0], x), (v[0], x * x)):
        low = float(torch.tensor(exact).to(torch.bfloat16).float())
        low = low if low <= exact else low - 2.0**-7 * (1 if low < 2 else 2)
        ulp = 2.0**-7 if low < 2 else 2.0**-6
        p_up = (exact - low) / ulp
        values = stored.double().cpu()
        assert set(values.unique().tolist()) <= {low, low + ulp}
        sigma = ulp * math.sqrt(p_up * (1 - p_up) / n)
        assert abs(values.mean().item() - exact) < 5 * sigma, (values.mean().item(), exact, sigma)


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_ranges_of_a_tensor_give_the_whole_tensors_bits(backend, device, precision):
    """A streamed tensor is stepped in ranges (chunks): with their offsets the random indices and the
    8-bit blocks are the whole tensor's, so the results are identical bit for bit."""
    n = 1280 if backend == "triton" else 5000
    whole = compressed_problem(precision, (n,), seed=5, device=device)
    parts = copy.deepcopy(whole)
    ops.adam_compressed_step_(*whole, [0], [99], backend=backend, **HYPER)
    cuts = (0, 512, 1024, n)
    pieces = [[] for _ in range(8)]
    for a, b in zip(cuts, cuts[1:]):
        for k in range(4):
            pieces[k].append(parts[k][0][a:b])
        for k in (4, 5):
            pieces[k].extend([parts[k][0][a // 256 : -(-b // 256)]] if parts[k] else [])
        pieces[7].append(parts[7][0])
    ops.adam_compressed_step_(*pieces, list(cuts[:-1]), [99] * 3, backend=backend, **HYPER)
    for got, want in zip(parts, whole):
        for a, b in zip(got, want):
            assert torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b)


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_nan_and_inf_stay_in_their_element_as_in_fp32_mode(backend, device, precision):
    n = 600
    tensors = compressed_problem(precision, (n,), seed=7, device=device)
    grads = tensors[1][0]
    grads[10], grads[300], grads[301] = float("nan"), float("inf"), -float("inf")
    fp32 = [[t.clone() for t in tensors[0]], [grads.clone()],
            [decoded(precision, tensors[2][0], tensors[4][0] if tensors[4] else None, True).float()],
            [decoded(precision, tensors[3][0], tensors[5][0] if tensors[5] else None, False).float()],
            [], [], [s.clone() for s in tensors[7]]]
    ops.adam_compressed_step_(*tensors, [0], [3], backend=backend, **HYPER)
    ops.adam_step_(*fp32, backend="torch", amsgrad=False, **HYPER)
    got = [tensors[0][0], decoded(precision, tensors[2][0], tensors[4][0] if tensors[4] else None, True),
           decoded(precision, tensors[3][0], tensors[5][0] if tensors[5] else None, False)]
    for a, b in zip(got, [fp32[0][0], fp32[2][0], fp32[3][0]]):
        assert torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.isinf(a), torch.isinf(b))
        assert torch.isfinite(a).sum() == n - 3  # the rest of each block is untouched by them


def test_found_inf_changes_nothing():
    for precision in ("bf16", "8bit"):
        tensors = compressed_problem(precision, SIZES, seed=11)
        before = copy.deepcopy(tensors)
        ops.adam_compressed_step_(*tensors, [0] * len(SIZES), list(range(len(SIZES))), backend="cpu",
                                  found_inf=torch.ones(()), grad_scale=torch.full((), 4.0), **HYPER)
        for got, want in zip(tensors, before):
            for a, b in zip(got, want):
                assert torch.equal(a, b)


def test_the_op_checks_its_arguments_and_passes_opcheck():
    tensors = compressed_problem("8bit", (300,), seed=1)
    with pytest.raises(RuntimeError, match="start on a block"):
        ops.adam_compressed_step_(*tensors, [16], [0], backend="cpu", **HYPER)
    short = copy.deepcopy(tensors)
    short[4] = [short[4][0][:1]]
    with pytest.raises(RuntimeError, match="exp_avg_absmaxs"):
        ops.adam_compressed_step_(*short, [0], [0], backend="cpu", **HYPER)
    fusedoff._ext.load_extension()
    torch.library.opcheck(torch.ops.fusedoff.adam_compressed_step_.default, (*tensors, [0], [0]), HYPER)
    bf16 = compressed_problem("bf16", (7,), seed=1)
    torch.library.opcheck(torch.ops.fusedoff.adam_compressed_step_.default, (*bf16, [0], [5]), HYPER)


# ---- the optimizer classes --------------------------------------------------------------------------------
SHAPES = [(33, 5), (7,), (300,), (16,), (), (600,)]


GRADS = seeded_grads(0.1)


def snapshot(opt, params):
    return [p.detach().clone() for p in params], [{k: v.clone() for k, v in opt.state[p].items()} for p in params]


PLACEMENTS = {"resident": dict(offload="none"), "streamed": dict(offload="stream", chunk_size=32),
              # 1024: chunks holding blocks of several tensors, pieces starting at blocks other than the first
              "streamed-1024": dict(offload="stream", chunk_size=1024),
              "mixed": dict(offload="stream", chunk_size=32, device_budget=600)}


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("precision", ["bf16", "8bit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-master"])
def test_streamed_and_mixed_equal_resident_bit_for_bit(precision, dtype, backend):
    runs = {}
    for name, placement in PLACEMENTS.items():
        params = make_params(SHAPES, dtype)
        opt = fusedoff.AdamW(params, lr=1e-2, state_precision=precision, backend=backend, **placement)
        train(params, opt, 4, GRADS)
        runs[name] = snapshot(opt, params)
        if name == "mixed":
            stats = opt.memory_stats()
            assert stats["resident_bytes"] > 0 and stats["streamed_bytes"] > 0
    for name in ("streamed", "streamed-1024", "mixed"):
        assert_bitwise_equal(runs[name], runs["resident"])


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
def test_state_dict_holds_compressed_states_and_resumes_bit_for_bit(precision):
    for placement in PLACEMENTS.values():
        params = make_params(SHAPES)
        opt = fusedoff.AdamW(params, lr=1e-2, state_precision=precision, seed=3, **placement)
        train(params, opt, 3, GRADS)
        saved = copy.deepcopy(opt.state_dict())
        at_save = [p.detach().clone() for p in params]
        group = saved["param_groups"][0]
        assert group["state_precision"] == precision and group["seed"] == 3
        state = saved["state"][5]
        assert state["exp_avg"].dtype == codec.state_dtype(precision) and state["exp_avg"].shape == (600,)
        if precision == "8bit":
            assert state["exp_avg_absmax"].shape == state["exp_avg_sq_absmax"].shape == (3,)
        train(params, opt, range(3, 5), GRADS)
        want = snapshot(opt, params)

        resumed = [torch.nn.Parameter(t) for t in at_save]
        opt2 = fusedoff.AdamW(resumed, lr=1e-2, **placement)  # fp32, seed 0: the checkpoint brings its own
        opt2.load_state_dict(saved)
        train(resumed, opt2, range(3, 5), GRADS)
        assert_bitwise_equal(snapshot(opt2, resumed), want)


def test_the_seed_drives_the_rounding():
    runs = []
    for seed in (0, 0, 1):
        params = make_params(SHAPES)
        opt = fusedoff.AdamW(params, lr=1e-2, state_precision="bf16", seed=seed)
        train(params, opt, 2, GRADS)
        runs.append(opt.state[params[5]]["exp_avg"].clone())
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
def test_a_torch_checkpoint_loads_compressed_and_converts_back(precision):
    params = make_params(SHAPES)
    reference = torch.optim.AdamW(params, lr=1e-2)
    train(params, reference, 3, GRADS)
    opt = fusedoff.AdamW(params, lr=1e-2, state_precision=precision, offload="stream", chunk_size=32)
    opt.load_state_dict(reference.state_dict())
    for p in params:
        torch_state, state = reference.state[p], opt.state[p]
        for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            if precision == "8bit":
                codes, absmax = codec.quantize(torch_state[name].reshape(-1), signed=signed)
                assert torch.equal(state[name].reshape(-1), codes) and torch.equal(state[f"{name}_absmax"], absmax)
            else:
                assert torch.equal(state[name], torch_state[name].to(torch.bfloat16))
    exported = opt.fp32_state_dict()
    back = torch.optim.AdamW(params, lr=1e-2)
    back.load_state_dict(exported)
    for p in params:
        assert set(back.state[p]) == {"step", "exp_avg", "exp_avg_sq"}
        for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            stored = opt.state[p][name]
            want = (stored.float() if precision == "bf16" else
                    codec.dequantize(stored.reshape(-1), opt.state[p][f"{name}_absmax"], signed).reshape(p.shape))
            assert back.state[p][name].dtype == torch.float32 and torch.equal(back.state[p][name], want)
            # within the storage's rounding of torch's own state
            ref = reference.state[p][name]
            if precision == "bf16":
                assert torch.all((want - ref).abs() <= 2.0**-8 * ref.abs())
            else:
                scale = opt.state[p][f"{name}_absmax"].repeat_interleave(256)[: p.numel()].reshape(p.shape)
                assert torch.all((want - ref).double().abs() <= quantization_bound(ref, scale, signed))
    assert isinstance(opt.state[params[0]]["exp_avg"], torch.Tensor)  # the optimizer's own states untouched
    assert opt.state[params[0]]["exp_avg"].dtype == codec.state_dtype(precision)


def version_1_codes(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """What the first 8-bit map wrote for flat fp32 `x`, by its definition: per block of 256 the
    absmax, and float8_e4m3fn of x / absmax * 2^8 (signed) or the nearest value of its grid
    (unsigned); with the values those codes stand for (float64)."""
    absmax = codec.block_absmax(x)
    scale = absmax.double().repeat_interleave(256)[: x.numel()]
    if signed:
        codes = (x.double() / scale * 256).to(torch.float8_e4m3fn)
        return codes.view(torch.uint8), absmax, codes.double() / 256 * scale
    grid = [m / 8 * 2.0**-30 for m in range(8)] + [(1 + m / 8) * 2.0**e for e in range(-30, 1) for m in range(8)]
    grid = torch.tensor(grid[:249], dtype=torch.float64)
    codes = (x.double()[:, None] / scale[:, None] - grid[None]).abs().argmin(dim=1)
    return codes.to(torch.uint8), absmax, grid[codes] * scale


@pytest.mark.parametrize("offload", ["none", "stream"])
def test_a_checkpoint_of_the_first_8bit_map_loads_converted(offload):
    """A state dict without the codec version (written before the tapered map) is read with the
    first map and encoded with this one; a dict this version saves says its version."""
    params = make_params(SHAPES)
    opt = fusedoff.AdamW(params, lr=1e-2, state_precision="8bit")
    train(params, opt, 3, GRADS)
    old = copy.deepcopy(opt.state_dict())
    for group in old["param_groups"]:
        assert group.pop(codec.CODEC_VERSION_KEY) == codec.CODEC_VERSION
    want = {}
    for pid, state in old["state"].items():
        for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            values = codec.dequantize(state[name].reshape(-1), state[f"{name}_absmax"], signed)
            codes, state[f"{name}_absmax"], meant = version_1_codes(values, signed)
            state[name] = codes.reshape(state[name].shape)
            want[pid, name] = codec.quantize(meant.float(), signed)
    resumed = fusedoff.AdamW(params, lr=1e-2, state_precision="8bit", offload=offload, chunk_size=32)
    resumed.load_state_dict(old)
    for pid, p in enumerate(params):
        for name in ("exp_avg", "exp_avg_sq"):
            codes, absmax = want[pid, name]
            assert torch.equal(resumed.state[p][name].reshape(-1), codes)
            assert torch.equal(resumed.state[p][f"{name}_absmax"], absmax)
    # The groups say the codes' version now: converted, they are this one's.
    assert all(group[codec.CODEC_VERSION_KEY] == codec.CODEC_VERSION for group in resumed.param_groups)
    train(params, resumed, 1, GRADS)  # and it steps on
    assert all(g[codec.CODEC_VERSION_KEY] == codec.CODEC_VERSION for g in resumed.state_dict()["param_groups"])
    future = {**old, "param_groups": [{**g, codec.CODEC_VERSION_KEY: codec.CODEC_VERSION + 1} for g in old["param_groups"]]}
    with pytest.raises(ValueError, match="codec version"):
        fusedoff.AdamW(params, lr=1e-2, state_precision="8bit").load_state_dict(future)


def test_an_fp32_optimizer_decodes_a_compressed_checkpoint():
    params = make_params(SHAPES)
    opt = fusedoff.AdamW(params, lr=1e-2, state_precision="8bit")
    train(params, opt, 2, GRADS)
    saved = copy.deepcopy(opt.state_dict())
    for group in saved["param_groups"]:
        group["state_precision"] = "fp32"
    plain = fusedoff.AdamW(params, lr=1e-2)
    plain.load_state_dict(saved)
    for p in params:
        want = codec.dequantize(opt.state[p]["exp_avg"].reshape(-1), opt.state[p]["exp_avg_absmax"], True)
        assert torch.equal(plain.state[p]["exp_avg"].reshape(-1), want)
        assert "exp_avg_absmax" not in plain.state[p]


def test_bytes_are_the_compressed_ones():
    """Host bytes by hand: 1000 elements, streamed. fp32: 2 states x 1008 (16-aligned) x 4; bf16:
    2 x 1008 x 2; 8-bit: 2 x 1024 (256-aligned) codes + 2 x 4 scales x 4 bytes. Buffers (chunk 256,
    two sets): per set 2 x 256 x 4 / 2 x 256 x 2 / 2 x 256 + 2 x 64 (scales region rounded to 64 bytes)."""
    expected = {"fp32": (8064, 2 * 2048), "bf16": (4032, 2 * 1024), "8bit": (2080, 2 * 640)}
    for precision, (host, buffers) in expected.items():
        p = torch.nn.Parameter(torch.randn(1000))
        opt = fusedoff.AdamW([p], state_precision=precision, offload="stream", chunk_size=256)
        p.grad = torch.randn(1000)
        opt.step()
        stats = opt.memory_stats()
        assert stats["host_bytes"] == stats["streamed_bytes"] == host, precision
        assert stats["device_bytes"] == buffers, precision


def test_bad_options_are_refused_before_anything_changes():
    params = make_params(SHAPES)
    with pytest.raises(ValueError, match="state_precision"):
        fusedoff.AdamW(params, state_precision="fp16")
    with pytest.raises(ValueError, match="amsgrad"):
        fusedoff.Adam(params, amsgrad=True, state_precision="8bit")
    with pytest.raises(ValueError, match="seed"):
        fusedoff.AdamW(params, state_precision="bf16", seed=-1)
    with pytest.raises(ValueError, match="Apollo keeps fp32 states"):
        fusedoff.Apollo(params, lr=1e-2, state_precision="8bit")
    opt = fusedoff.AdamW(params[:2], state_precision="bf16")
    with pytest.raises(ValueError, match="amsgrad"):
        opt.add_param_group({"params": params[2:], "amsgrad": True})
    assert len(opt.param_groups) == 1
    train(params[:2], opt, 1, GRADS)
    before = snapshot(opt, params[:2])
    opt.state[params[0]]["exp_avg"] = torch.zeros(params[0].shape)  # fp32 into a bf16 state
    with pytest.raises(ValueError, match="bfloat16"):
        train(params[:2], opt, range(1, 2), GRADS)
    after = snapshot(opt, params[:2])
    assert_bitwise_equal((after[0], after[1][1:]), (before[0], before[1][1:]))  # parameters, the other state: untouched
    assert {k: v for k, v in after[1][0].items() if k != "exp_avg"}.keys() == before[1][0].keys() - {"exp_avg"}
    for key in ("step", "exp_avg_sq"):
        assert torch.equal(after[1][0][key], before[1][0][key]), key
    group = copy.deepcopy(opt.state_dict())
    group["param_groups"][0]["amsgrad"] = True  # a checkpoint whose group cannot work: refused on load
    with pytest.raises(ValueError, match="amsgrad"):
        opt.load_state_dict(group)
    assert opt.param_groups[0]["amsgrad"] is False
    apollo = fusedoff.Apollo(params[:2], lr=1e-2)
    with pytest.raises(ValueError, match="Apollo keeps fp32 states"):
        apollo.add_param_group({"params": params[2:], "state_precision": "bf16"})
    assert len(apollo.param_groups) == 1


@pytest.mark.parametrize("precision,final_tolerance", [("bf16", 0.02), ("8bit", 0.04)])
def test_training_quality_matches_fp32_states(precision, final_tolerance):
    """A small regression network trained 300 steps from one seed: the final loss with compressed
    states within 2% (bf16) / 4% (8-bit) of the fp32-state run (the demo measures the same on its
    transformer)."""
    def run(state_precision):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                                    torch.nn.GELU(), torch.nn.Linear(256, 1))
        teacher = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
        opt = fusedoff.AdamW(model.parameters(), lr=2e-3, state_precision=state_precision)
        losses = []
        for _ in range(300):
            x = torch.randn(128, 32)
            with torch.no_grad():
                y = teacher(x)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return sum(losses[-50:]) / 50

    fp32, compressed = run("fp32"), run(precision)
    assert abs(compressed - fp32) <= final_tolerance * fp32, (compressed, fp32)


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
def test_a_deep_copy_steps_exactly_as_the_original(precision):
    params = make_params(SHAPES)
    opt = fusedoff.AdamW(params, lr=1e-2, state_precision=precision, seed=5, offload="stream", chunk_size=32)
    train(params, opt, 2, GRADS)
    twin_params, twin = copy.deepcopy((params, opt))
    assert twin.param_groups[0]["state_precision"] == precision and twin.param_groups[0]["seed"] == 5
    train(params, opt, range(2, 4), GRADS)
    train(twin_params, twin, range(2, 4), GRADS)
    assert_bitwise_equal(snapshot(twin, twin_params), snapshot(opt, params))


@pytest.mark.parametrize("states", ["spanning", "tiny_scales", "zero"])
def test_the_host_kernels_blocks_of_every_kind_give_the_references_codes(states):
    """The host kernel updates a whole 8-bit block in AVX-512 where the CPU has it and the block's
    scales fold into the codec's steps, and in scalar code otherwise (a tensor's last, partial
    block; a scale between 0 and about 2^-93): three steps from states of each kind must store the
    torch reference's codes and scales bit for bit (the parameters may differ by the reference's
    fused multiply-adds)."""

    def run(backend):
        tensors = compressed_problem("8bit", (4096, 1000), seed=3)
        if states == "tiny_scales":
            tensors[1] = [g * 2.0**-50 for g in tensors[1]]
            tensors[4] = [s * 2.0**-50 for s in tensors[4]]
            tensors[5] = [s * 2.0**-100 for s in tensors[5]]
        elif states == "zero":
            for t in tensors[2] + tensors[3] + tensors[4] + tensors[5]:
                t.zero_()
        for _ in range(3):
            ops.adam_compressed_step_(*tensors, [0, 0], [1, 2], backend=backend, **HYPER)
            tensors[7] = [step + 1 for step in tensors[7]]
        return tensors[2] + tensors[3] + tensors[4] + tensors[5]

    got, want = run("cpu"), run("torch")
    if states == "tiny_scales":  # the second moments' scales are below the fold: the scalar path ran
        assert all(float(s.max()) < 2.0**-93 for s in want[6:])
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_codes_and_random_bits_are_the_same_on_every_backend(backend, device, precision):
    """From zero states with beta1 = 0.5, beta2 = 0.75 and gradients of 10 significant bits, the
    moments 0.5 g and 0.25 g^2 are exact in fp32 on every backend (fused multiply-adds or not), so
    their stored form (codes, scales, stochastically rounded bf16) must be the torch reference's bit
    for bit: one definition of the codecs and of the random stream everywhere. A range past
    element 2^32 takes the high half of its indices into the random bits."""
    n = 1000
    gen = torch.Generator().manual_seed(9)
    grads = (torch.randint(-1023, 1024, (n,), generator=gen) * 2.0 ** torch.randint(-20, 0, (n,), generator=gen))

    def run(which, dev):
        tensors = compressed_problem(precision, (n,), seed=0, device=dev)
        tensors[2][0].zero_()
        tensors[3][0].zero_()
        for scales in tensors[4] + tensors[5]:
            scales.zero_()
        tensors[1] = [grads.to(dev)]
        offset = 2**32 - 256 if precision == "bf16" else 2**32
        ops.adam_compressed_step_(*tensors, [offset], [0x9E3779B9], backend=which,
                                  **dict(HYPER, beta1=0.5, beta2=0.75))
        return [t.cpu() for t in tensors[2] + tensors[3] + tensors[4] + tensors[5]]

    for got, want in zip(run(backend, device), run("torch", "cpu")):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
def test_a_checkpoint_loads_into_a_parameter_of_another_memory_layout(precision):
    """8-bit blocks run in memory order: codes saved from a contiguous parameter, loaded for a
    channels_last one, must decode to the same values (quantized afresh in the new order)."""
    weight = torch.nn.Parameter(torch.randn(4, 32, 3, 3))
    opt = fusedoff.AdamW([weight], lr=1e-2, state_precision=precision)
    weight.grad = torch.randn_like(weight)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    decoded = opt.fp32_state_dict()["state"][0]
    other = torch.nn.Parameter(weight.detach().to(memory_format=torch.channels_last))
    loaded = fusedoff.AdamW([other], lr=1e-2)
    loaded.load_state_dict(saved)
    again = loaded.fp32_state_dict()["state"][0]
    for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
        assert loaded.state[other][name].stride() == other.stride()
        # one more rounding (bf16 and codes are exact in fp32, so only 8-bit requantizes): within a step
        if precision == "bf16":
            assert torch.equal(again[name], decoded[name]), name
            continue
        absmax = loaded.state[other][f"{name}_absmax"]  # blocks in the new memory order
        scale = absmax.repeat_interleave(256)[: other.numel()].as_strided(other.shape, other.stride())
        bound = quantization_bound(decoded[name], scale, signed)
        assert torch.all((again[name] - decoded[name]).double().abs() <= bound), name


@pytest.mark.parametrize("placement", ["resident", "streamed"])
def test_changing_a_groups_precision_keeps_the_values(placement):
    params = make_params(SHAPES)
    opt = fusedoff.AdamW(params, lr=1e-2, **PLACEMENTS[placement])
    train(params, opt, 2, GRADS)
    fp32 = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    opt.param_groups[0]["state_precision"] = "8bit"
    train(params, opt, range(2, 3), GRADS)  # placed afresh, quantized from the fp32 values, then stepped
    assert opt.state[params[0]]["exp_avg"].dtype == torch.uint8
    assert all(opt.state[p]["step"].item() == 3 for p in params)
    reference = [torch.nn.Parameter(p.detach().clone()) for p in make_params(SHAPES)]
    ref = fusedoff.AdamW(reference, lr=1e-2, **PLACEMENTS[placement])
    train(reference, ref, 2, GRADS)
    ref.param_groups[0]["state_precision"] = "8bit"
    ref_sd = copy.deepcopy(ref.state_dict())
    for p in params:
        assert fp32[id(p)]["exp_avg"].dtype == torch.float32
    fresh = fusedoff.AdamW(reference, lr=1e-2, state_precision="8bit", **PLACEMENTS[placement])
    fresh.load_state_dict(ref_sd)  # fp32 moments into an 8-bit group: the same conversion
    train(reference, fresh, range(2, 3), GRADS)
    assert_bitwise_equal(snapshot(fresh, reference), snapshot(opt, params))
    opt.param_groups[0]["amsgrad"] = True  # cannot work with 8-bit states: refused before anything changes
    with pytest.raises(ValueError, match="amsgrad"):
        train(params, opt, range(3, 4), GRADS)
    assert all(opt.state[p]["step"].item() == 3 for p in params)


def test_pinned_slabs_never_share_a_page():
    """Page-locking works on whole pages and a page locked twice fails (the store would fall back
    to pageable memory): the tiny 8-bit scale slabs must not share a page with any other slab."""
    import mmap

    from fusedoff.offload.plan import ChunkPlan
    from fusedoff.offload.store import HostStateStore
    from fusedoff.optim.adam import adam_state_specs

    locked = []

    def pin(slab):
        first = slab.data_ptr() // mmap.PAGESIZE
        last = (slab.data_ptr() + slab.numel() * slab.element_size() - 1) // mmap.PAGESIZE
        pages = set(range(first, last + 1))
        if any(pages & other for other in locked):
            return False  # what cudaHostRegister answers for a page already locked
        locked.append(pages)
        return True

    plan = ChunkPlan([1000, 300, 7], 256, 512, align=256)  # several segments, small slabs
    store = HostStateStore(plan, adam_state_specs("8bit"), pin=pin)
    assert store.pinned and len(locked) == 4 * len(plan.segment_sizes)
    assert all(s.data_ptr() % mmap.PAGESIZE == 0 for slabs in store.slabs.values() for s in slabs)
