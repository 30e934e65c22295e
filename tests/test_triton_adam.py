"""The Triton Adam/AdamW kernel (fusedoff/kernels/triton_adam.py) against the float64 oracle.

Without a GPU, tests/conftest.py sets TRITON_INTERPRET=1 before triton is first imported, and the
kernel runs on CPU tensors through Triton's interpreter (slow: small sizes, 20 steps). With a GPU the
same tests also run on cuda tensors.

Every numerical test runs one problem three times: the Triton kernel in storage precision, the
pure-PyTorch reference in the same precision (the baseline), and the reference on float64 copies of
every tensor (the oracle). Then for params and every state, per tensor of the list:
err(triton vs oracle) <= 2 * err(baseline vs oracle) + one ulp of the stored dtype, the ulp being what
one round-to-nearest-even decision of a stored value may flip between two correct kernels.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from fusedoff.hyperparameters import AdamHyperparameters
from fusedoff.kernels import reference, triton_adam
from tests.helpers import assert_bitwise_equal, non_contiguous, set_arg, swap_arg

pytestmark = pytest.mark.triton

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Odd sizes and a 0-d tensor in one list: 1 and 7 are shorter than a block, 4097 spans five 1024-element
# blocks with a one-element tail.
SHAPES = ((1,), (7,), (4097,), ())
# Each tensor has its own step count, so a kernel reading another tensor's step shows. At t ~ 10^4
# the bias corrections are ~1 and no longer cancel the rounding of the (1 - beta2) constant: a kernel
# computing 1 - fp32(beta2) instead of fp32(1 - beta2) fails there (4.0e-6 vs 6.5e-7 for fp32 params).
INITIAL_STEPS = (0, 0, 3, 10_000)
NUM_STEPS = 20
LR = 1e-2  # large enough that bf16 params move by more than an ulp per step


def _dtype_id(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def _devices():
    cpu_skip = pytest.mark.skipif(
        not triton_adam.INTERPRETED,
        reason="CPU tensors run only through Triton's interpreter (TRITON_INTERPRET=1 before import)",
    )
    devices = [pytest.param("cpu", marks=cpu_skip)]
    if torch.cuda.is_available():  # asks the driver; creates no CUDA context
        devices.append(pytest.param("cuda", marks=pytest.mark.cuda))
    return devices


DEVICES = _devices()


def _hyper(*, decoupled=True, weight_decay=0.1, amsgrad=False, maximize=False, beta2=0.999):
    return dict(lr=LR, beta1=0.9, beta2=beta2, eps=1e-8, weight_decay=weight_decay,
                decoupled_weight_decay=decoupled, amsgrad=amsgrad, maximize=maximize)


# ---- the problem: the argument lists of one fused call, plus the gradients of every step ----------

_STATE_LISTS = ("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "master_params")


def _make_problem(device, param_dtype, grad_dtype, *, amsgrad=False, master=False, grad_scale=1.0,
                  num_steps=NUM_STEPS, shapes=SHAPES, initial_steps=INITIAL_STEPS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s, generator=gen) for s in shapes]

    def zeros():
        return [torch.zeros(s, device=device) for s in shapes]

    return dict(
        params=[w.to(param_dtype).to(device) for w in weights],
        exp_avgs=zeros(),
        exp_avg_sqs=zeros(),
        max_exp_avg_sqs=zeros() if amsgrad else [],
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
    out = {name: [t.to(dtype or t.dtype, copy=True) for t in problem[name]] for name in _STATE_LISTS}
    out["steps"] = [t.clone() for t in problem["steps"]]
    out["grads"] = [[g.to(dtype or g.dtype, copy=True) for g in grads] for grads in problem["grads"]]
    return out


def _step(problem, adam_step_, grads, hyper, grad_scale=None, found_inf=None):
    adam_step_(problem["params"], grads, problem["exp_avgs"], problem["exp_avg_sqs"], problem["max_exp_avg_sqs"],
               problem["master_params"], problem["steps"], grad_scale=grad_scale, found_inf=found_inf,
               hyper=AdamHyperparameters(**hyper))


def _run(problem, adam_step_, hyper, grad_scale=None):
    for grads in problem["grads"]:
        torch._foreach_add_(problem["steps"], 1.0)
        _step(problem, adam_step_, grads, hyper, grad_scale)
    return problem


def _max_abs_error(got, want):
    return (got.double() - want.double().to(got.device)).abs().max().item()


def _check_against_oracle(device, param_dtype, grad_dtype, hyper, *, master=False, grad_scale=None,
                          num_steps=NUM_STEPS, initial_steps=INITIAL_STEPS):
    """Runs triton, the fp32 baseline and the float64 oracle; asserts the criterion; returns the errors."""
    problem = _make_problem(device, param_dtype, grad_dtype, amsgrad=hyper["amsgrad"], master=master,
                            grad_scale=grad_scale or 1.0, num_steps=num_steps, initial_steps=initial_steps)
    scale = None if grad_scale is None else torch.tensor(grad_scale, device=device)
    got = _run(_copy(problem), triton_adam.adam_step_, hyper, scale)
    baseline = _run(_copy(problem), reference.adam_step_, hyper, scale)
    oracle = _run(_copy(problem, torch.float64), reference.adam_step_, hyper, scale)

    errors = _assert_states_within(got, baseline, oracle, param_dtype)
    # The kernel reads the steps and never writes them.
    assert [s.item() for s in got["steps"]] == [float(t + num_steps) for t in initial_steps]
    return errors


def _assert_states_within(got, baseline, oracle, param_dtype):
    """The criterion of the module docstring, per tensor of every list; returns the errors."""
    errors = {}
    for name in _STATE_LISTS:
        stored = param_dtype if name == "params" else torch.float32
        for i, (g, b, o) in enumerate(zip(got[name], baseline[name], oracle[name], strict=True)):
            assert g.dtype == stored and g.shape == o.shape
            if g.numel() == 0:
                continue
            err, base_err = _max_abs_error(g, o), _max_abs_error(b, o)
            atol = torch.finfo(stored).eps * o.abs().max().item()
            assert err <= 2 * base_err + atol, (
                f"{name}[{i}] (shape {tuple(o.shape)}): triton's error {err:.3e} vs the fp32 reference's "
                f"{base_err:.3e} (atol {atol:.1e})"
            )
            errors[f"{name}[{i}]"] = (err, base_err)
    return errors


# ---- accuracy ------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=lambda d: f"g{_dtype_id(d)}")
@pytest.mark.parametrize("param_dtype", DTYPES, ids=lambda d: f"p{_dtype_id(d)}")
def test_dtypes_against_float64_oracle(device, param_dtype, grad_dtype):
    _check_against_oracle(device, param_dtype, grad_dtype, _hyper())


# Every mode flag on and off at least once, each on two (param, grad) dtype pairs that together use
# all three dtypes on both sides.
MODES = {
    "adam-l2-amsgrad": dict(hyper=_hyper(decoupled=False, amsgrad=True)),
    "adamw-maximize-grad_scale": dict(hyper=_hyper(maximize=True), grad_scale=1000.0),  # not a power of 2
    "adam-l2-master-grad_scale": dict(hyper=_hyper(decoupled=False, weight_decay=0.01), master=True,
                                      grad_scale=512.0),
    "adamw-amsgrad-master-maximize": dict(hyper=_hyper(amsgrad=True, maximize=True), master=True),
    "no-weight-decay": dict(hyper=_hyper(weight_decay=0.0)),
}
MODE_DTYPES = {
    "adam-l2-amsgrad": [(torch.float32, torch.bfloat16), (torch.float16, torch.float32)],
    "adamw-maximize-grad_scale": [(torch.bfloat16, torch.float16), (torch.float32, torch.float32)],
    "adam-l2-master-grad_scale": [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.float32)],
    "adamw-amsgrad-master-maximize": [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)],
    "no-weight-decay": [(torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)],
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "mode,param_dtype,grad_dtype",
    [pytest.param(mode, p, g, id=f"{mode}-p{_dtype_id(p)}-g{_dtype_id(g)}")
     for mode, pairs in MODE_DTYPES.items() for p, g in pairs],
)
def test_modes_against_float64_oracle(device, mode, param_dtype, grad_dtype):
    config = MODES[mode]
    _check_against_oracle(device, param_dtype, grad_dtype, config["hyper"], master=config.get("master", False),
                          grad_scale=config.get("grad_scale"))


@pytest.mark.parametrize("device", DEVICES)
def test_bias_corrections_are_computed_in_fp64(device):
    # beta2 = 0.9999 at small t: 1 - beta2^t is ~1e-4 * t, so computing it in fp32 costs ~6e-4
    # relative in the update (fails this test by an order of magnitude); fp64 as in adam.h passes.
    _check_against_oracle(device, torch.float32, torch.float32, _hyper(beta2=0.9999), num_steps=1,
                          initial_steps=(0, 1, 6, 99))


# ---- found_inf, grad_scale, empty inputs ---------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("found_inf_shape", [(), (1,)], ids=["0d", "1elem"])
@pytest.mark.parametrize(
    "param_dtype,grad_dtype,master",
    [(torch.float32, torch.float32, False), (torch.bfloat16, torch.float16, True)],
    ids=["fp32", "bf16-fp16grads-master"],
)
def test_found_inf_changes_nothing(device, found_inf_shape, param_dtype, grad_dtype, master):
    hyper = _hyper(amsgrad=True)
    problem = _make_problem(device, param_dtype, grad_dtype, amsgrad=True, master=master, num_steps=3)
    scale = torch.tensor(2.0, device=device)
    flagged, plain = _copy(problem), _copy(problem)

    def clean_step(grads):
        for p in (flagged, plain):
            torch._foreach_add_(p["steps"], 1.0)
        _step(flagged, triton_adam.adam_step_, grads, hyper, scale, torch.zeros(found_inf_shape, device=device))
        _step(plain, triton_adam.adam_step_, grads, hyper, scale)
        assert_bitwise_equal(flagged, plain, "differs between found_inf=0 and no found_inf", names=_STATE_LISTS)

    clean_step(problem["grads"][0])
    clean_step(problem["grads"][1])

    # An overflowed step: non-finite gradients, found_inf = 1, and (as an optimizer does) no step
    # increment. Nothing may change, to the bit.
    before = _copy(flagged)
    bad_grads = [g.clone() for g in problem["grads"][2]]
    for g in bad_grads:
        g.view(-1)[0] = float("nan")
        g.view(-1)[-1] = float("inf")
    _step(flagged, triton_adam.adam_step_, bad_grads, hyper, scale, torch.ones(found_inf_shape, device=device))
    assert_bitwise_equal(flagged, before, "changed on a step with found_inf=1", names=_STATE_LISTS)

    # The next clean step continues as if the overflowed one never happened.
    clean_step(problem["grads"][2])


@pytest.mark.parametrize("device", DEVICES)
def test_grad_scale_is_read_on_device_per_call(device):
    # The same kernel, two scales: the scale is a tensor the kernel loads, not a compile-time value.
    hyper = _hyper()
    problem = _make_problem(device, torch.float32, torch.float32, num_steps=1, shapes=((5,),), initial_steps=(0,))
    grads = problem["grads"][0]
    results = []
    for scale in (1.0, 4.0):
        p = _copy(problem)
        torch._foreach_add_(p["steps"], 1.0)
        _step(p, triton_adam.adam_step_, [g * scale for g in grads], hyper, torch.tensor(scale, device=device))
        results.append(p)
    assert_bitwise_equal(results[0], results[1], "depends on the scale although grad/scale is the same",
                         names=_STATE_LISTS)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_inputs(device):
    """Empty lists return at once; empty tensors are skipped and their neighbours in the list updated
    (the criterion of the module docstring, every state)."""
    hyper = _hyper(amsgrad=True)
    triton_adam.adam_step_([], [], [], [], [], [], [], hyper=AdamHyperparameters(**hyper))  # nothing to launch, no device to pick

    shapes = ((0,), (5,), (3, 0), (1,))
    problem = _make_problem(device, torch.float16, torch.float32, amsgrad=True, master=True, num_steps=3,
                            shapes=shapes, initial_steps=(0, 0, 0, 0))
    got = _run(_copy(problem), triton_adam.adam_step_, hyper)
    baseline = _run(_copy(problem), reference.adam_step_, hyper)
    oracle = _run(_copy(problem, torch.float64), reference.adam_step_, hyper)
    _assert_states_within(got, baseline, oracle, torch.float16)
    assert not torch.equal(got["params"][1], problem["params"][1])


# ---- argument checks -----------------------------------------------------------------------------



def _set_kw(name, make):
    def mutate(call):
        call["kwargs"][name] = make(call["params"][0].device)
    return mutate



BAD_CALLS = {
    "grads-too-short": (set_arg("grads", lambda c: c["grads"][:-1]), "same length"),
    "steps-too-short": (set_arg("steps", lambda c: c["steps"][:1]), "same length"),
    "max_exp_avg_sqs-without-amsgrad": (set_arg("amsgrad", False), "max_exp_avg_sqs"),
    "master_params-too-short": (set_arg("master_params", lambda c: c["master_params"][:1]), "master_params"),
    "float64-params": (set_arg("params", lambda c: [p.double() for p in c["params"]]), "params must be float32"),
    "mixed-param-dtypes": (swap_arg("params", 2, lambda t: t.half()), "params of one call must share a dtype"),
    "float64-grads": (set_arg("grads", lambda c: [g.double() for g in c["grads"]]), "grads must be float32"),
    "mixed-grad-dtypes": (swap_arg("grads", 3, lambda t: t.half()), "grads of one call must share a dtype"),
    "fp16-state": (swap_arg("exp_avg_sqs", 3, lambda t: t.half()), r"exp_avg_sqs\[3\] must be float32"),
    "fp16-master": (swap_arg("master_params", 1, lambda t: t.half()), r"master_params\[1\] must be float32"),
    "state-numel": (swap_arg("exp_avgs", 2, lambda t: t[:-1]), r"exp_avgs\[2\] has 4096 elements"),
    "max-state-numel": (swap_arg("max_exp_avg_sqs", 1, lambda t: t[:-1]), r"max_exp_avg_sqs\[1\] has 6 elements"),
    "grad-numel": (swap_arg("grads", 2, lambda t: t[1:]), r"grads\[2\] has 4096 elements"),
    "non-contiguous-param": (swap_arg("params", 2, non_contiguous), "must be contiguous"),
    "non-contiguous-state": (swap_arg("exp_avgs", 2, non_contiguous), r"exp_avgs\[2\] must be contiguous"),
    "sparse-grad": (swap_arg("grads", 1, lambda t: t.to_sparse()), "sparse"),
    "float64-step": (swap_arg("steps", 1, lambda t: t.double()), r"steps\[1\] must be a one-element float32"),
    "two-element-step": (swap_arg("steps", 1, lambda t: t.repeat(2)), r"steps\[1\] must be a one-element float32"),
    "two-element-grad_scale": (_set_kw("grad_scale", lambda d: torch.ones(2, device=d)), "grad_scale must be"),
    "float64-found_inf": (_set_kw("found_inf", lambda d: torch.zeros((), dtype=torch.float64, device=d)),
                          "found_inf must be"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_arguments_raise_before_anything_is_written(device, case):
    mutate, message = BAD_CALLS[case]
    problem = _make_problem(device, torch.bfloat16, torch.float32, amsgrad=True, master=True, num_steps=1)
    call = {name: problem[name] for name in (*_STATE_LISTS, "steps")}
    call["grads"] = problem["grads"][0]
    call["amsgrad"] = True
    call["kwargs"] = {}
    mutate(call)
    before = _copy(problem)
    with pytest.raises(ValueError, match=message):
        triton_adam.adam_step_(call["params"], call["grads"], call["exp_avgs"], call["exp_avg_sqs"],
                               call["max_exp_avg_sqs"], call["master_params"], call["steps"],
                               hyper=AdamHyperparameters(**_hyper(amsgrad=call["amsgrad"])), **call["kwargs"])
    assert_bitwise_equal(problem, before, "was written by a call that raised", names=_STATE_LISTS)


@pytest.mark.cuda
def test_tensors_on_two_devices_raise():
    problem = _make_problem("cuda", torch.float32, torch.float32, num_steps=1)
    grads = list(problem["grads"][0])
    grads[2] = grads[2].cpu()
    with pytest.raises(ValueError, match=r"grads\[2\] is on cpu"):
        triton_adam.adam_step_(problem["params"], grads, problem["exp_avgs"], problem["exp_avg_sqs"], [], [],
                               problem["steps"], hyper=AdamHyperparameters(**_hyper()))


@pytest.mark.cuda
def test_new_hyperparameters_do_not_recompile():
    """lr, betas, eps, weight_decay and the step are run-time values: changing them compiles nothing."""
    if triton_adam.INTERPRETED:
        pytest.skip("the interpreter compiles nothing")
    import triton

    problem = _make_problem("cuda", torch.bfloat16, torch.float32, amsgrad=True, master=True, num_steps=4)
    for grads in problem["grads"][:1]:  # warm-up: compiles the variants this problem needs
        torch._foreach_add_(problem["steps"], 1.0)
        _step(problem, triton_adam.adam_step_, grads, _hyper(amsgrad=True))
    compiled = []
    previous_hook = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = lambda **kwargs: compiled.append(kwargs.get("repr"))
    try:
        for grads, (lr, beta2, wd) in zip(problem["grads"][1:], itertools.product([1e-3, 3e-4], [0.99], [0.0, 0.2])):
            torch._foreach_add_(problem["steps"], 1.0)
            hyper = dict(_hyper(amsgrad=True, beta2=beta2, weight_decay=wd), lr=lr, eps=1e-6)
            _step(problem, triton_adam.adam_step_, grads, hyper)
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.jit_cache_hook = previous_hook
    assert compiled == []
