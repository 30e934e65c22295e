"""The Triton Apollo kernels (fusedoff/kernels/triton_apollo.py) against the float64 oracle.

Without a GPU, tests/conftest.py sets TRITON_INTERPRET=1 before triton is first imported, and the
kernels run on CPU tensors through Triton's interpreter (slow: small sizes, few steps). With a GPU
the same tests also run on cuda tensors.

Every numerical test runs one problem three times: the Triton kernels in storage precision,
``reference.apollo_step_`` in the same precision (the baseline), and ``reference.apollo_step_`` on
float64 copies of every tensor (the oracle). Then per tensor of the list, for params and every state:
err(triton vs oracle) <= 2 * err(baseline vs oracle) + one ulp of the stored dtype at the largest
magnitude, what one round-to-nearest-even decision of a stored value may flip between two correct
kernels. Stats (sums over a tensor) get the fp32 summation bound instead, see ``_sum_atol``. One
test takes ``reference.ApolloReference`` (the published algorithm, whole tensors, no phases) in
float64 as the oracle instead, and one compiles the kernels for sm_90 even without a GPU.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from fusedoff.hyperparameters import ApolloHyperparameters
from fusedoff.kernels import reference, triton_apollo, triton_common
from tests.helpers import assert_bitwise_equal, non_contiguous, set_arg, swap_arg

pytestmark = pytest.mark.triton

# Odd sizes and a 0-d tensor in one list: 1 and 7 are shorter than a block, 4097 spans five
# 1024-element blocks with a one-element tail.
SHAPES = ((1,), (7,), (4097,), ())
# Each tensor has its own step count (a kernel reading another tensor's step shows). With warmup = 3
# and 6 steps, tensors 0 and 1 warm up for 3 steps then run at lr, tensor 2 for 2, tensor 3 never.
INITIAL_STEPS = (0, 0, 1, 100)
NUM_STEPS = 6
WARMUP = 3
REBOUNDS = ("constant", "belief")
STATE_LISTS = ("params", "exp_avg_grads", "approx_hessians", "updates", "master_params")
FP32_EPS = torch.finfo(torch.float32).eps


def _dtype_id(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def _devices():
    cpu_skip = pytest.mark.skipif(
        not triton_common.INTERPRETED,
        reason="CPU tensors run only through Triton's interpreter (TRITON_INTERPRET=1 before import)",
    )
    devices = [pytest.param("cpu", marks=cpu_skip)]
    if torch.cuda.is_available():  # asks the driver; creates no CUDA context
        devices.append(pytest.param("cuda", marks=pytest.mark.cuda))
    return devices


DEVICES = _devices()


def _hyper(rebound="belief", weight_decay_type="decoupled", *, weight_decay=0.1, eps=1e-4, lr=1e-2):
    # lr is large enough that bf16 params move by more than an ulp per step.
    return dict(lr=lr, base_lr=lr, init_lr=lr / 1000, warmup=float(WARMUP), beta=0.9, eps=eps,
                weight_decay=weight_decay, rebound=rebound, weight_decay_type=weight_decay_type)


def _phases(hyper) -> tuple[str, ...]:
    stable = hyper["weight_decay"] != 0 and hyper["weight_decay_type"] == "stable"
    return ("reduce", "moments", "finish") if stable else ("reduce", "full")


# ---- the problem: the argument lists of the fused calls, plus the gradients of every step ---------


def _make_problem(device, param_dtype, grad_dtype, *, master=False, grad_scale=1.0, num_steps=NUM_STEPS,
                  shapes=SHAPES, initial_steps=INITIAL_STEPS, random_states=False, seed=0):
    """Zero states (a run from the start) or, with `random_states`, states as after some steps."""
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s, generator=gen) for s in shapes]

    def states(scale):
        if not random_states:
            return [torch.zeros(s, device=device) for s in shapes]
        return [(torch.randn(s, generator=gen) * scale).to(device) for s in shapes]

    return dict(
        params=[w.to(param_dtype).to(device) for w in weights],
        exp_avg_grads=states(0.1),
        approx_hessians=states(0.03),  # around the constant rebound floor 0.01: both sides of the max
        updates=states(1.0),
        # The masters hold the exact fp32 values the low-precision params were rounded from.
        master_params=[w.to(device) for w in weights] if master else [],
        steps=[torch.tensor(float(t), device=device) for t in initial_steps],
        # Scaled as an AMP scaler would; tensor i gets gradients of magnitude ~ 10^(i - 2).
        grads=[
            [(torch.randn(s, generator=gen) * 10.0 ** (i - 2) * grad_scale).to(grad_dtype).to(device)
             for i, s in enumerate(shapes)]
            for _ in range(num_steps)
        ],
    )


def _copy(problem, dtype=None):
    """A deep copy; with `dtype`, params, states and grads become `dtype` (steps stay float32)."""
    out = {name: [t.to(dtype or t.dtype, copy=True) for t in problem[name]] for name in STATE_LISTS}
    out["steps"] = [t.clone() for t in problem["steps"]]
    out["grads"] = [[g.to(dtype or g.dtype, copy=True) for g in grads] for grads in problem["grads"]]
    return out


def _fresh_stats(problem):
    # Rows of one tensor, as fusedoff.ops hands them out: views with a storage offset.
    n, device = len(problem["params"]), problem["steps"][0].device
    return list(torch.zeros(n, triton_apollo.NUM_STATS, dtype=torch.float64, device=device).unbind(0))


def _call(problem, apollo_step_, grads, stats, phase, hyper, grad_scale=None, found_inf=None):
    apollo_step_(problem["params"], grads, problem["exp_avg_grads"], problem["approx_hessians"], problem["updates"],
                 problem["master_params"], problem["steps"], stats, [p.numel() for p in problem["params"]],
                 phase=phase, grad_scale=grad_scale, found_inf=found_inf, hyper=ApolloHyperparameters(**hyper))


def _run(problem, apollo_step_, hyper, grad_scale=None):
    """Whole steps: increment, fresh stats, every phase; keeps the last step's stats in the problem."""
    for grads in problem["grads"]:
        torch._foreach_add_(problem["steps"], 1.0)
        problem["stats"] = _fresh_stats(problem)
        for phase in _phases(hyper):
            _call(problem, apollo_step_, grads, problem["stats"], phase, hyper, grad_scale)
    return problem


def _max_abs_error(got, want):
    return (got.double() - want.double().to(got.device)).abs().max().item() if got.numel() else 0.0


def _assert_within(name, i, got, baseline, oracle, stored_dtype):
    """The criterion of the module docstring, for one tensor; returns (err, baseline err)."""
    err, base_err = _max_abs_error(got, oracle), _max_abs_error(baseline, oracle)
    atol = torch.finfo(stored_dtype).eps * oracle.abs().max().item() if oracle.numel() else 0.0
    assert err <= 2 * base_err + atol, (
        f"{name}[{i}] (shape {tuple(oracle.shape)}): triton's error {err:.3e} vs the fp32 reference's "
        f"{base_err:.3e} (atol {atol:.1e})"
    )
    return err, base_err


def _assert_states_within(got, baseline, oracle, param_dtype):
    errors = {}
    for name in STATE_LISTS:
        stored = param_dtype if name == "params" else torch.float32
        for i, (g, b, o) in enumerate(zip(got[name], baseline[name], oracle[name], strict=True)):
            assert g.dtype == stored and g.shape == o.shape
            errors[f"{name}[{i}]"] = _assert_within(name, i, g, b, o, stored)
    return errors


# ---- accuracy: whole steps -----------------------------------------------------------------------

# All six rebound x decay modes, each on two (param, grad) dtype pairs; together they use fp32, bf16
# and fp16 params (bf16 and fp32 with fp32 masters) and fp32, fp16 and bf16 grads, and grad_scale.
MODE_CASES = {
    ("constant", "L2"): [(torch.float32, torch.float32, False), (torch.bfloat16, torch.bfloat16, True)],
    ("constant", "decoupled"): [(torch.bfloat16, torch.float16, False), (torch.float32, torch.bfloat16, False)],
    ("constant", "stable"): [(torch.float32, torch.float16, True), (torch.bfloat16, torch.float32, False)],
    ("belief", "L2"): [(torch.bfloat16, torch.float32, False), (torch.float16, torch.float16, False)],
    ("belief", "decoupled"): [(torch.float32, torch.bfloat16, True), (torch.bfloat16, torch.float16, True)],
    ("belief", "stable"): [(torch.float32, torch.float32, False), (torch.bfloat16, torch.bfloat16, True)],
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "rebound,decay_type,param_dtype,grad_dtype,master,grad_scale",
    [pytest.param(rebound, decay, p, g, master, 1000.0 if k == 1 else None,
                  id=f"{rebound}-{decay}-p{_dtype_id(p)}{'-master' if master else ''}-g{_dtype_id(g)}"
                     f"{'-grad_scale' if k == 1 else ''}")
     for (rebound, decay), cases in MODE_CASES.items() for k, (p, g, master) in enumerate(cases)],
)
def test_whole_steps_against_float64_oracle(device, rebound, decay_type, param_dtype, grad_dtype, master, grad_scale):
    hyper = _hyper(rebound, decay_type)
    problem = _make_problem(device, param_dtype, grad_dtype, master=master, grad_scale=grad_scale or 1.0)
    scale = None if grad_scale is None else torch.tensor(grad_scale, device=device)  # 1000: not a power of 2
    got = _run(_copy(problem), triton_apollo.apollo_step_, hyper, scale)
    baseline = _run(_copy(problem), reference.apollo_step_, hyper, scale)
    oracle = _run(_copy(problem, torch.float64), reference.apollo_step_, hyper, scale)
    _assert_states_within(got, baseline, oracle, param_dtype)
    # The kernels read the steps and never write them.
    assert [s.item() for s in got["steps"]] == [float(t + NUM_STEPS) for t in INITIAL_STEPS]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rebound,decay_type", [("constant", "L2"), ("belief", "stable")])
def test_whole_steps_against_the_eager_apollo(device, rebound, decay_type):
    """The same criterion with ``ApolloReference`` (the published algorithm, no code shared with the
    phases) in float64 as the oracle: the phase split itself is checked, not only its mirrors."""
    hyper = _hyper(rebound, decay_type)
    problem = _make_problem(device, torch.float32, torch.float32, initial_steps=(0, 0, 0, 0))
    got = _run(_copy(problem), triton_apollo.apollo_step_, hyper)
    baseline = _run(_copy(problem), reference.apollo_step_, hyper)
    eager = [w.double().clone() for w in problem["params"]]
    opt = reference.ApolloReference(eager, lr=hyper["lr"], beta=hyper["beta"], eps=hyper["eps"], rebound=rebound,
                                    warmup=WARMUP, init_lr=hyper["init_lr"], weight_decay=hyper["weight_decay"],
                                    weight_decay_type=decay_type)
    for grads in problem["grads"]:
        for p, g in zip(eager, grads):
            p.grad = g.double()
        opt.step()
    for name, key in (("params", None), ("exp_avg_grads", "exp_avg_grad"), ("approx_hessians", "approx_hessian"),
                      ("updates", "update")):
        for i, p in enumerate(eager):
            want = p if key is None else opt.state[p][key]
            _assert_within(name, i, got[name][i], baseline[name][i], want, torch.float32)


# ---- accuracy: one phase at a time, from the same inputs --------------------------------------------


def _sum_atol(sum_of_magnitudes: float) -> float:
    """What summing terms in fp32 may cost, given sum |term|: rounding each term (eps / 2) plus eps / 2
    per level of a 1024-element block's addition tree (the blocks are then added in float64)."""
    levels = math.ceil(math.log2(triton_common.BLOCK_SIZE)) + 1
    return levels * FP32_EPS / 2 * sum_of_magnitudes


def _reduce_magnitudes(problem, hyper, grad_scale):
    """Per tensor, sum |term| of the first three sums of 'reduce' (float64, for `_sum_atol`)."""
    out = []
    for i, p in enumerate(problem["params"]):
        w = (problem["master_params"][i] if problem["master_params"] else p).double()
        g = problem["grads"][0][i].double() / grad_scale
        if hyper["weight_decay_type"] == "L2":
            g = g + hyper["weight_decay"] * w
        m, b, d = (problem[name][i].double() for name in ("exp_avg_grads", "approx_hessians", "updates"))
        out.append([(d**4).sum().item(), ((g - m) * d).abs().sum().item(), (b * d * d).abs().sum().item()])
    return out


# Every phase in every mode it runs in; 'reduce' depends on the decay only through L2.
PHASE_CASES = [("reduce", "belief", "L2"), ("reduce", "constant", "decoupled")]
PHASE_CASES += [("full", rebound, decay) for rebound in REBOUNDS for decay in ("L2", "decoupled", "none")]
PHASE_CASES += [(phase, rebound, "stable") for phase in ("moments", "finish") for rebound in REBOUNDS]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("phase,rebound,decay_type", PHASE_CASES, ids=["-".join(c) for c in PHASE_CASES])
def test_each_phase_against_float64_oracle(device, phase, rebound, decay_type):
    if decay_type == "none":
        hyper = _hyper(rebound, "L2", weight_decay=0.0)
    else:
        hyper = _hyper(rebound, decay_type)
    # States as after some steps; steps 1 and 2 (k = 0, 1 < warmup) warm up, 5 and 100 do not.
    problem = _make_problem(device, torch.bfloat16, torch.float16, master=True, grad_scale=8.0, num_steps=1,
                            initial_steps=(1, 2, 5, 100), random_states=True)
    scale = torch.tensor(8.0, device=device)
    # The stats an apply phase starts from: the oracle's, identical for all three runs.
    oracle_stats = _fresh_stats(problem)
    oracle_input = _copy(problem, torch.float64)
    _call(oracle_input, reference.apollo_step_, oracle_input["grads"][0], oracle_stats, "reduce", hyper, scale)
    if phase == "finish":
        _call(oracle_input, reference.apollo_step_, oracle_input["grads"][0], oracle_stats, "moments", hyper, scale)
        problem["exp_avg_grads"] = [t.float() for t in oracle_input["exp_avg_grads"]]
        problem["approx_hessians"] = [t.float() for t in oracle_input["approx_hessians"]]
    if phase == "reduce":  # a range added to sums already there: the kernel must accumulate
        oracle_stats = [torch.tensor([1.0, -2.0, 3.0, 0.5, 0.0], dtype=torch.float64, device=device)
                        for _ in oracle_stats]

    runs = {}
    for name, fn, dtype in (("got", triton_apollo.apollo_step_, None), ("baseline", reference.apollo_step_, None),
                            ("oracle", reference.apollo_step_, torch.float64)):
        run = _copy(problem, dtype)
        run["stats"] = [s.clone() for s in oracle_stats]
        _call(run, fn, run["grads"][0], run["stats"], phase, hyper, scale)
        runs[name] = run
    got, baseline, oracle = runs["got"], runs["baseline"], runs["oracle"]
    _assert_states_within(got, baseline, oracle, torch.bfloat16)

    magnitudes = _reduce_magnitudes(problem, hyper, 8.0)
    for i, (g, b, o) in enumerate(zip(got["stats"], baseline["stats"], oracle["stats"], strict=True)):
        for k in range(triton_apollo.NUM_STATS):
            err, base_err = abs(g[k].item() - o[k].item()), abs(b[k].item() - o[k].item())
            if k == 3:  # max|y| is one fp32 value: one ulp
                atol = FP32_EPS * abs(o[k].item())
            elif k == 4:  # sum D: positive terms
                atol = _sum_atol(abs(o[k].item()))
            else:
                atol = _sum_atol(magnitudes[i][k])
            assert err <= 2 * base_err + atol, f"stats[{i}][{k}]: error {err:.3e} vs {base_err:.3e} (atol {atol:.1e})"
    # What each phase leaves alone.
    for i, s in enumerate(got["stats"]):
        untouched = {"reduce": [4], "moments": [0, 1, 2, 3], "full": range(5), "finish": range(5)}[phase]
        for k in untouched:
            assert s[k].item() == oracle_stats[i][k].item(), f"{phase} wrote stats[{i}][{k}]"
    if phase == "reduce":
        for name in STATE_LISTS:
            for g, before in zip(got[name], problem[name]):
                assert torch.equal(g, before), f"reduce wrote {name}"


# ---- a tensor split into ranges --------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rebound,decay_type", [("constant", "L2"), ("belief", "stable")])
def test_ranges_across_calls_share_stats(device, rebound, decay_type):
    """One 4097-element tensor as two ranges (split inside a block), each phase two calls sharing one
    stats tensor: the result is the unsplit run's, to fp32 reduction-order tolerance."""
    hyper = _hyper(rebound, decay_type)
    problem = _make_problem(device, torch.bfloat16, torch.float32, master=True, num_steps=3, shapes=((4097,),),
                            initial_steps=(1,))
    whole = _run(_copy(problem), triton_apollo.apollo_step_, hyper)
    split = _copy(problem)
    ranges = [(0, 1500), (1500, 4097)]
    for grads in split["grads"]:
        torch._foreach_add_(split["steps"], 1.0)
        stats = _fresh_stats(split)
        for phase in _phases(hyper):
            for begin, end in ranges:
                part = {name: [t.view(-1)[begin:end] for t in split[name]] for name in STATE_LISTS}
                triton_apollo.apollo_step_(
                    part["params"], [grads[0].view(-1)[begin:end]], part["exp_avg_grads"], part["approx_hessians"],
                    part["updates"], part["master_params"], split["steps"], stats, [4097], phase=phase,
                    hyper=ApolloHyperparameters(**hyper))
    for name in STATE_LISTS:
        for w, s in zip(whole[name], split[name]):
            # Different block sums change den, delta and mean D by ~1e-7 relative; the states follow
            # (a few fp32 ulps; one bf16 ulp where a rounding flips). Measured: 29% of this tolerance.
            rtol = max(torch.finfo(w.dtype).eps, 1e-6)
            torch.testing.assert_close(s, w, rtol=rtol, atol=1e-7 * w.abs().max().item())


# ---- NaN, found_inf, grad_scale, empty inputs --------------------------------------------------


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")  # the interpreter's 0 / 0
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["constant-eps0", "belief-nan-grad"])
def test_nan_propagates_like_the_reference(device, case):
    # constant with eps = 0: d = 0 at step 1, so den = 0 and B = NaN; D = max(|B|, 0.01) must stay NaN
    # (fmaxf would drop it). belief with one NaN gradient (in the first of five blocks): max|y| is NaN,
    # the block's and then the tensor's (the stats), so D is NaN everywhere.
    hyper = _hyper("constant", "L2", eps=0.0) if case == "constant-eps0" else _hyper("belief", "stable")
    problem = _make_problem(device, torch.float32, torch.float32, num_steps=1, initial_steps=(0, 0, 0, 0))
    if case == "belief-nan-grad":
        problem["grads"][0][2][100] = float("nan")
    got = _run(_copy(problem), triton_apollo.apollo_step_, hyper)
    want = _run(_copy(problem), reference.apollo_step_, hyper)
    for name in (*STATE_LISTS, "stats"):
        for i, (g, w) in enumerate(zip(got[name], want[name])):
            assert torch.equal(g.isnan(), w.isnan()), f"{name}[{i}]"
    assert got["params"][2].isnan().all()
    if case == "belief-nan-grad":
        assert got["stats"][2][3].isnan()


# The -0.0 put into stats[4] makes 'full' and 'finish' compute wd / mean D = -inf (and -inf * the
# masked-off p = 0) before they write nothing; the interpreter warns about it.
@pytest.mark.filterwarnings("ignore:divide by zero encountered in divide:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("found_inf_shape", [(), (1,)], ids=["0d", "1elem"])
@pytest.mark.parametrize("rebound,decay_type", [("constant", "L2"), ("belief", "stable")])
def test_found_inf_changes_nothing(device, found_inf_shape, rebound, decay_type):
    hyper = _hyper(rebound, decay_type)
    problem = _make_problem(device, torch.bfloat16, torch.float16, master=True, num_steps=2, random_states=True)
    scale = torch.tensor(2.0, device=device)
    flagged, plain = _copy(problem), _copy(problem)

    # found_inf = 0 is the same as no found_inf, to the bit.
    for run, found_inf in ((flagged, torch.zeros(found_inf_shape, device=device)), (plain, None)):
        torch._foreach_add_(run["steps"], 1.0)
        run["stats"] = _fresh_stats(run)
        for phase in _phases(hyper):
            _call(run, triton_apollo.apollo_step_, run["grads"][0], run["stats"], phase, hyper, scale, found_inf)
    assert_bitwise_equal(flagged, plain, "differs between found_inf=0 and no found_inf", names=(*STATE_LISTS, "stats"))

    # An overflowed step: non-finite gradients, found_inf = 1. No phase may change anything, stats
    # included (they hold sums already, as after the first range of a tensor).
    bad_grads = [g.clone() for g in problem["grads"][1]]
    for g in bad_grads:
        g.view(-1)[0] = float("nan")
        g.view(-1)[-1] = float("inf")
    for s in flagged["stats"]:  # -0.0 + 0.0 is +0.0: adding a masked (zero) partial would show
        s[2], s[4] = -0.0, -0.0
    before = _copy(flagged)
    before["stats"] = [s.clone() for s in flagged["stats"]]
    for phase in ("reduce", "full", "moments", "finish"):
        _call(flagged, triton_apollo.apollo_step_, bad_grads, flagged["stats"], phase, hyper, scale,
              torch.ones(found_inf_shape, device=device))
        assert_bitwise_equal(flagged, before, f"changed in phase {phase!r} with found_inf=1",
                             names=(*STATE_LISTS, "stats"))


@pytest.mark.parametrize("device", DEVICES)
def test_grad_scale_is_read_on_device_per_call(device):
    # The same kernels, two scales: the scale is a tensor the kernels load, not a compile-time value.
    # (g * 4) / 4 == g exactly, so the results must agree to the bit.
    hyper = _hyper("belief", "L2")
    problem = _make_problem(device, torch.float32, torch.float32, num_steps=1, shapes=((5,),), initial_steps=(3,),
                            random_states=True)
    results = []
    for scale in (1.0, 4.0):
        run = _copy(problem)
        run["stats"] = _fresh_stats(run)
        grads = [g * scale for g in problem["grads"][0]]
        scale = torch.tensor(scale, device=device)
        for phase in _phases(hyper):
            _call(run, triton_apollo.apollo_step_, grads, run["stats"], phase, hyper, scale)
        results.append(run)
    assert_bitwise_equal(results[0], results[1], "depends on the scale although grad / scale is the same",
                         names=(*STATE_LISTS, "stats"))


@pytest.mark.parametrize("device", DEVICES)
def test_empty_inputs(device):
    """Empty lists return at once; empty tensors are skipped (their sums stay 0) and their neighbours
    in the list updated (the criterion of the module docstring, every state)."""
    hyper = _hyper("belief", "stable")
    for phase in ("reduce", "full", "moments", "finish"):  # nothing to launch, no device to pick
        triton_apollo.apollo_step_([], [], [], [], [], [], [], [], [], phase=phase,
                                   hyper=ApolloHyperparameters(**hyper))

    shapes = ((0,), (5,), (3, 0), (1,))
    problem = _make_problem(device, torch.float16, torch.float32, master=True, num_steps=2, shapes=shapes,
                            initial_steps=(WARMUP,) * 4)
    got = _run(_copy(problem), triton_apollo.apollo_step_, hyper)
    baseline = _run(_copy(problem), reference.apollo_step_, hyper)
    oracle = _run(_copy(problem, torch.float64), reference.apollo_step_, hyper)
    _assert_states_within(got, baseline, oracle, torch.float16)
    for i in (0, 2):
        assert torch.equal(got["stats"][i], torch.zeros_like(got["stats"][i])), f"stats[{i}] of an empty tensor"
    assert not torch.equal(got["params"][1], problem["params"][1])


# ---- argument checks -----------------------------------------------------------------------------




BAD_CALLS = {
    "bad-phase": (set_arg("phase", "apply"), "phase must be"),
    "bad-rebound": (set_arg("rebound", "max"), "rebound must be"),
    "bad-decay-type": (set_arg("weight_decay_type", "l2"), "weight_decay_type must be"),
    "grads-too-short": (set_arg("grads", lambda c: c["grads"][:-1]), "same length"),
    "stats-too-short": (set_arg("stats", lambda c: c["stats"][:-1]), "same length"),
    "total_numels-too-short": (set_arg("total_numels", lambda c: c["total_numels"][:-1]), "same length"),
    "master_params-too-short": (set_arg("master_params", lambda c: c["master_params"][:1]), "master_params"),
    "float64-params": (set_arg("params", lambda c: [p.double() for p in c["params"]]), "params must be float32"),
    "mixed-grad-dtypes": (swap_arg("grads", 3, lambda t: t.half()), "grads of one call must share a dtype"),
    "fp16-state": (swap_arg("approx_hessians", 3, lambda t: t.half()), r"approx_hessians\[3\] must be float32"),
    "state-numel": (swap_arg("updates", 2, lambda t: t[:-1]), r"updates\[2\] has 4096 elements"),
    "non-contiguous-param": (swap_arg("params", 2, non_contiguous), "must be contiguous"),
    "float32-stats": (swap_arg("stats", 1, lambda t: t.float()), r"stats\[1\] must be a contiguous float64"),
    "short-stats": (swap_arg("stats", 1, lambda t: t[:4]), r"stats\[1\] must be a contiguous float64"),
    "total_numel-below-range": (swap_arg("total_numels", 2, lambda n: 4096), r"total_numels\[2\] = 4096"),
    "float64-step": (swap_arg("steps", 1, lambda t: t.double()), r"steps\[1\] must be a one-element float32"),
    "two-element-grad_scale": (set_arg("grad_scale", lambda c: torch.ones(2, device=c["params"][0].device)),
                               "grad_scale must be"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_arguments_raise_before_anything_is_written(device, case):
    mutate, message = BAD_CALLS[case]
    problem = _make_problem(device, torch.bfloat16, torch.float32, master=True, num_steps=1, random_states=True)
    problem["stats"] = [torch.ones(5, dtype=torch.float64, device=device) for _ in SHAPES]
    call = {name: problem[name] for name in (*STATE_LISTS, "steps", "stats")}
    call.update(grads=problem["grads"][0], total_numels=[p.numel() for p in problem["params"]], phase="reduce",
                grad_scale=None, **_hyper("belief", "L2"))
    mutate(call)
    before = _copy(problem)
    before["stats"] = [s.clone() for s in problem["stats"]]
    lists = [call.pop(name) for name in ("params", "grads", "exp_avg_grads", "approx_hessians", "updates",
                                         "master_params", "steps", "stats", "total_numels")]
    hyper = ApolloHyperparameters(**{f.name: call.pop(f.name) for f in dataclasses.fields(ApolloHyperparameters)})
    with pytest.raises(ValueError, match=message):
        triton_apollo.apollo_step_(*lists, hyper=hyper, **call)
    assert_bitwise_equal(problem, before, "was written by a call that raised", names=(*STATE_LISTS, "stats"))


# ---- compiled code -------------------------------------------------------------------------------

# Compiles the kernels for sm_90 (no GPU needed: Triton ships ptxas), in a process of its own since
# this one runs them through the interpreter, and prints the PTX instructions that matter.
_COMPILE_FOR_SM90 = r"""
import os, re
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fusedoff.kernels import triton_apollo as ta

POINTERS = {"param_ptr": "*bf16", "grad_ptr": "*fp16", "stats_ptr": "*fp64", "master_ptr": "*u8"}

def compile_(kernel, **constexprs):
    signature = {}
    for p in kernel.params:
        if p.is_constexpr or p.name in constexprs:
            signature[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            signature[p.name] = POINTERS.get(p.name, "*fp32")
        else:
            signature[p.name] = p.annotation or "i32"
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    return "\n".join(line.split("//")[0] for line in ptx.splitlines())  # without comments (debug info)

flags = dict(MASTER=3, HAS_GRAD_SCALE=True, HAS_FOUND_INF=True, INDEX_64=False, BLOCK_SIZE=1024)  # 3: "split8"
ptx = [compile_(ta._apollo_reduce_kernel, DECAY=ta.DECAY_L2, **flags)]
for phase in (ta.PHASE_FULL, ta.PHASE_MOMENTS, ta.PHASE_FINISH):
    no_partials = {} if phase == ta.PHASE_MOMENTS else {"partials_ptr": None}
    ptx.append(compile_(ta._apollo_apply_kernel, PHASE=phase, BELIEF=True, DECAY=ta.DECAY_STABLE,
                        ROUND_BF16_IN_SOFTWARE=False, **no_partials, **flags))
for reduce in (True, False):
    ptx.append(compile_(ta._apollo_combine_kernel, REDUCE=reduce, HAS_FOUND_INF=True, ROWS=ta.COMBINE_ROWS))
for op in ("div.full.f32", "div.approx", "sqrt.approx", "atom.", "call"):
    print(op, sum(len(re.findall(r"\b" + re.escape(op), p)) for p in ptx))
print("div.rn.f32", sum(p.count("div.rn.f32") for p in ptx))
"""


def test_kernels_compile_for_sm90_with_ieee_division_and_no_atomics():
    """Without a GPU the interpreter never compiles the kernels: this does, for one variant of each
    phase with every flag on, and checks what the module docstring promises about the PTX."""
    import os
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90], capture_output=True, text=True, timeout=300,
                            env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert result.returncode == 0, result.stderr[-3000:]
    counts = {line.rsplit(" ", 1)[0]: int(line.rsplit(" ", 1)[1]) for line in result.stdout.splitlines()}
    assert counts == {"div.full.f32": 0, "div.approx": 0, "sqrt.approx": 0, "atom.": 0, "call": 0,
                      "div.rn.f32": counts["div.rn.f32"]}
    assert counts["div.rn.f32"] > 0


# ---- GPU only --------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_new_hyperparameters_do_not_recompile():
    """lr, beta, eps, weight_decay, the step and the stats are run-time values: changing them compiles
    nothing."""
    if triton_common.INTERPRETED:
        pytest.skip("the interpreter compiles nothing")
    import triton

    problem = _make_problem("cuda", torch.bfloat16, torch.float32, master=True, num_steps=5)
    configs = [_hyper("belief", "stable", lr=lr, weight_decay=wd) | dict(beta=beta, eps=eps)
               for lr, wd, beta, eps in itertools.product([1e-2, 3e-4], [0.1, 0.2], [0.9], [1e-4, 1e-6])]
    first, *others = problem["grads"]
    torch._foreach_add_(problem["steps"], 1.0)
    stats = _fresh_stats(problem)
    for phase in _phases(configs[0]):  # warm-up: compiles the variants this problem needs
        _call(problem, triton_apollo.apollo_step_, first, stats, phase, configs[0])
    compiled = []
    previous_hook = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = lambda **kwargs: compiled.append(kwargs.get("repr"))
    try:
        for grads, hyper in zip(others, configs[1:]):
            torch._foreach_add_(problem["steps"], 1.0)
            stats = _fresh_stats(problem)
            for phase in _phases(hyper):
                _call(problem, triton_apollo.apollo_step_, grads, stats, phase, hyper)
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.jit_cache_hook = previous_hook
    assert compiled == []
