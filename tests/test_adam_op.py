"""The fused Adam/AdamW op on every backend against the float64 oracle and torch.optim."""

from __future__ import annotations

import itertools

import pytest
import torch

from fusedoff import ops
from tests.helpers import (
    LOW_PRECISION,
    SIZES,
    STORAGE_DTYPES,
    assert_matches_oracle,
    backend_params,
    make_adam_problem,
    max_abs_error,
    run_adam,
    sizes_across_cpu_blocks,
    ulp_atol,
)

NATIVE_AND_TRITON = backend_params(("cpu", "cuda", "triton"))


def hyper(*, amsgrad=False, maximize=False, decoupled=True, weight_decay=0.1):
    return dict(
        lr=1e-2,
        beta1=0.9,
        beta2=0.99,
        eps=1e-8,
        weight_decay=weight_decay,
        decoupled_weight_decay=decoupled,
        amsgrad=amsgrad,
        maximize=maximize,
    )


def dtype_cases():
    for param_dtype, grad_dtype in itertools.product(STORAGE_DTYPES, STORAGE_DTYPES):
        yield pytest.param(param_dtype, grad_dtype, False, id=f"p{param_dtype}-g{grad_dtype}".replace("torch.", ""))
        if param_dtype in LOW_PRECISION:
            yield pytest.param(
                param_dtype, grad_dtype, True, id=f"p{param_dtype}-g{grad_dtype}-master".replace("torch.", "")
            )


def check_against_oracle(backend, device, *, param_dtype, grad_dtype, master, h, grad_scale=None, num_steps=20,
                         sizes=SIZES):
    problem = make_adam_problem(
        param_dtype=param_dtype,
        grad_dtype=grad_dtype,
        master=master,
        amsgrad=h["amsgrad"],
        num_steps=num_steps,
        sizes=sizes,
        grad_scale=grad_scale or 1.0,
    )
    scale = None if grad_scale is None else torch.tensor(grad_scale)
    got = run_adam(problem.to(device=device), backend, h, grad_scale=None if scale is None else scale.to(device))
    baseline = run_adam(problem.to(), "torch", h, grad_scale=scale)
    oracle = run_adam(problem.to(torch.float64), "torch", h, grad_scale=scale)
    assert_matches_oracle(got, baseline, oracle, param_dtype)
    assert [s.item() for s in got.steps] == [float(num_steps)] * len(got.steps)


@pytest.mark.parametrize("backend,device", NATIVE_AND_TRITON)
@pytest.mark.parametrize("param_dtype,grad_dtype,master", list(dtype_cases()))
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_dtypes_against_float64_oracle(backend, device, param_dtype, grad_dtype, master, decoupled):
    steps = 5 if backend == "triton" and device == "cpu" else 20  # the Triton interpreter is slow
    h = hyper(decoupled=decoupled)
    check_against_oracle(backend, device, param_dtype=param_dtype, grad_dtype=grad_dtype, master=master, h=h,
                         num_steps=steps)


@pytest.mark.parametrize("backend,device", NATIVE_AND_TRITON)
@pytest.mark.parametrize("amsgrad", [False, True], ids=["", "amsgrad"])
@pytest.mark.parametrize("maximize", [False, True], ids=["", "maximize"])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("param_dtype,master", [(torch.float32, False), (torch.bfloat16, True)], ids=["fp32", "bf16-master"])
def test_modes_against_float64_oracle(backend, device, amsgrad, maximize, decoupled, param_dtype, master):
    h = hyper(amsgrad=amsgrad, maximize=maximize, decoupled=decoupled)
    check_against_oracle(backend, device, param_dtype=param_dtype, grad_dtype=param_dtype, master=master, h=h)


@pytest.mark.parametrize("backend,device", backend_params(("cpu", "cuda")))
@pytest.mark.parametrize("param_dtype,master", [(torch.float32, False), (torch.bfloat16, True)], ids=["fp32", "bf16-master"])
def test_sizes_across_cpu_blocks_against_float64_oracle(backend, device, param_dtype, master):
    """Every element of tensors ending around host block boundaries (see sizes_across_cpu_blocks)."""
    # A block ending one element early leaves element 32767 of each large tensor where it was: an
    # error of ~3 * lr in the params against an allowed ~1e-7.
    check_against_oracle(backend, device, param_dtype=param_dtype, grad_dtype=param_dtype, master=master,
                         h=hyper(amsgrad=True), num_steps=3, sizes=sizes_across_cpu_blocks())


@pytest.mark.parametrize("backend,device", backend_params(("cpu", "cuda", "triton", "torch")))
@pytest.mark.parametrize("grad_dtype", STORAGE_DTYPES, ids=str)
def test_grad_scale_divides_in_kernel(backend, device, grad_dtype):
    """The kernel unscales as torch's fused AdamW does, g / scale in fp32 (torch writes exactly that
    back into its gradients): the step with a grad scale is bit for bit the step without one on the
    gradients torch divided beforehand, params and every state. 1000 is not a power of two, so a
    kernel multiplying by the rounded reciprocal 1/1000 differs in about half the elements."""
    h = hyper(amsgrad=True)
    steps = 5 if backend == "triton" and device == "cpu" else 20
    if backend != "torch":  # the torch backend is the oracle's own code: against itself it cannot fail
        check_against_oracle(backend, device, param_dtype=torch.float32, grad_dtype=grad_dtype, master=False, h=h,
                             grad_scale=1000.0, num_steps=steps)

    problem = make_adam_problem(grad_dtype=grad_dtype, amsgrad=True, num_steps=steps, grad_scale=1000.0)
    scale = torch.tensor(1000.0, device=device)
    scaled = run_adam(problem.to(device=device), backend, h, grad_scale=scale)
    unscaled = problem.to(device=device)
    unscaled.grads_per_step = [[g.float() / scale for g in grads] for grads in unscaled.grads_per_step]
    run_adam(unscaled, backend, h)
    differ = {name: sum((a != b).sum().item() for a, b in zip(tensors, unscaled.states()[name], strict=True))
              for name, tensors in scaled.states().items()}
    assert not any(differ.values()), f"elements that differ, of {sum(p.numel() for p in scaled.params)}: {differ}"


@pytest.mark.parametrize("backend,device", backend_params(("cpu", "cuda", "triton", "torch")))
@pytest.mark.parametrize("param_dtype,master", [(torch.float32, False), (torch.float16, True)], ids=["fp32", "fp16-master"])
def test_found_inf_changes_nothing(backend, device, param_dtype, master):
    h = hyper(amsgrad=True)
    problem = make_adam_problem(param_dtype=param_dtype, grad_dtype=param_dtype, master=master, amsgrad=True,
                                num_steps=3)
    got = run_adam(problem.to(device=device), backend, h)
    before = {k: [t.clone() for t in v] for k, v in got.states().items()}
    overflow = torch.ones((), device=device)
    ops.increment_steps_(got.steps, overflow)
    ops.adam_step_(got.params, got.grads_per_step[0], got.exp_avgs, got.exp_avg_sqs, got.max_exp_avg_sqs,
                   got.master_params, got.steps, found_inf=overflow, grad_scale=torch.full((), 2.0, device=device),
                   backend=backend, **h)
    for name, tensors in got.states().items():
        for t, b in zip(tensors, before[name]):
            assert torch.equal(t, b), f"{name} changed on a step with found_inf=1"

    # A clean step afterwards continues as if the skipped step never happened.
    clean = torch.zeros((), device=device)
    got.grads_per_step = got.grads_per_step[:1]
    run_adam(got, backend, h, found_inf=clean)
    problem.grads_per_step = problem.grads_per_step + problem.grads_per_step[:1]
    oracle = run_adam(problem.to(torch.float64), "torch", h)
    baseline = run_adam(problem.to(), "torch", h)
    assert_matches_oracle(got, baseline, oracle, param_dtype)
    assert [s.item() for s in got.steps] == [4.0] * len(got.steps)


@pytest.mark.parametrize("backend,device", backend_params(("cpu", "cuda", "triton", "torch")))
@pytest.mark.parametrize("amsgrad", [False, True], ids=["", "amsgrad"])
@pytest.mark.parametrize("maximize", [False, True], ids=["", "maximize"])
@pytest.mark.parametrize("optim_cls", [torch.optim.Adam, torch.optim.AdamW], ids=["Adam", "AdamW"])
def test_against_torch_optim(backend, device, amsgrad, maximize, optim_cls):
    """fp32: fusedoff's error against torch.optim in float64 is at most twice torch.optim's own in fp32."""
    decoupled = optim_cls is torch.optim.AdamW
    h = hyper(amsgrad=amsgrad, maximize=maximize, decoupled=decoupled)
    steps = 5 if backend == "triton" and device == "cpu" else 20
    problem = make_adam_problem(amsgrad=amsgrad, num_steps=steps)
    got = run_adam(problem.to(device=device), backend, h)

    def torch_optim(dtype):
        params = [p.to(dtype).requires_grad_() for p in problem.params]
        opt = optim_cls(params, lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                        weight_decay=h["weight_decay"], amsgrad=amsgrad, maximize=maximize, foreach=False)
        for grads in problem.grads_per_step:
            for p, g in zip(params, grads):
                p.grad = g.to(dtype)
            opt.step()
        states = [opt.state[p] for p in params]
        return {
            "param": [p.detach() for p in params],
            "exp_avg": [s["exp_avg"] for s in states],
            "exp_avg_sq": [s["exp_avg_sq"] for s in states],
            "max_exp_avg_sq": [s["max_exp_avg_sq"] for s in states] if amsgrad else [],
        }

    oracle, baseline = torch_optim(torch.float64), torch_optim(torch.float32)
    for name, want in oracle.items():
        if not want:
            continue
        err = max_abs_error(got.states()[name], want)
        base_err = max_abs_error(baseline[name], want)
        atol = ulp_atol(torch.float32, want)
        assert err <= 2 * base_err + atol, f"{name}: {err:.3e} vs torch.optim's {base_err:.3e}"


@pytest.mark.parametrize("backend,device", backend_params(("cpu", "cuda", "triton", "torch")))
def test_empty_tensors_are_skipped_and_their_neighbours_updated(backend, device):
    """Empty lists return at once (the native op could not pick a device from them); empty tensors
    between others take no block and leave the others' blocks where they were."""
    ops.adam_step_([], [], [], [], [], [], [], backend=backend, **hyper())
    h = hyper(amsgrad=True)
    steps = 3 if backend == "triton" and device == "cpu" else 20
    problem = make_adam_problem(param_dtype=torch.bfloat16, grad_dtype=torch.float16, master=True, amsgrad=True,
                                num_steps=steps, sizes=((0,), (4097,), (3, 0), (7,), (0,)))
    got = run_adam(problem.to(device=device), backend, h)
    for name, tensors in got.states().items():
        assert [t.shape for t in tensors] == [t.shape for t in problem.states()[name]], name
    if backend != "torch":  # the torch backend is the oracle's own code
        baseline = run_adam(problem.to(), "torch", h)
        oracle = run_adam(problem.to(torch.float64), "torch", h)
        assert_matches_oracle(got, baseline, oracle, torch.bfloat16)


@pytest.mark.parametrize("backend,device", backend_params(("cpu", "cuda", "triton")))
def test_bad_input_raises_before_writing(backend, device):
    """A call that raises leaves params and every state as they were, to the bit."""
    problem = make_adam_problem(num_steps=2).to(device=device)
    run_adam(problem, backend, hyper())  # non-zero states: a partial write of any value shows
    problem.grads_per_step = problem.grads_per_step[:1]
    ops.increment_steps_(problem.steps)
    before = {name: [t.clone() for t in tensors] for name, tensors in problem.states().items()}
    bad_grads = list(problem.grads_per_step[0])
    bad_grads[-1] = bad_grads[-1][:-1]  # one element short, on the last tensor
    with pytest.raises((RuntimeError, ValueError), match="element|numel|size|shape"):
        ops.adam_step_(problem.params, bad_grads, problem.exp_avgs, problem.exp_avg_sqs, [], [], problem.steps,
                       backend=backend, **hyper())
    bad_states = list(problem.exp_avgs)
    bad_states[-1] = bad_states[-1].double()
    with pytest.raises((RuntimeError, ValueError), match="float32"):
        ops.adam_step_(problem.params, problem.grads_per_step[0], bad_states, problem.exp_avg_sqs, [], [],
                       problem.steps, backend=backend, **hyper())
    for name, tensors in problem.states().items():
        for i, (t, b) in enumerate(zip(tensors, before[name], strict=True)):
            assert torch.equal(t, b), f"{name}[{i}] written by a call that raised"


def test_cpu_backend_rejects_other_devices():
    with pytest.raises(ValueError, match="backend='cuda'"):
        ops.adam_step_([torch.zeros(2)], [torch.zeros(2)], [torch.zeros(2)], [torch.zeros(2)], [], [],
                       [torch.ones(())], backend="cuda", **hyper())
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.adam_step_([], [], [], [], [], [], [], backend="fortran", **hyper())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("amsgrad,master", [(False, False), (True, True)], ids=["plain", "amsgrad-master"])
def test_opcheck(device, amsgrad, master):
    from fusedoff._ext import load_extension

    load_extension()
    dtype = torch.bfloat16 if master else torch.float32
    problem = make_adam_problem(param_dtype=dtype, grad_dtype=dtype, master=master, amsgrad=amsgrad, num_steps=1,
                                sizes=((3,), (5, 2))).to(device=device)
    ops.increment_steps_(problem.steps)
    args = (problem.params, problem.grads_per_step[0], problem.exp_avgs, problem.exp_avg_sqs,
            problem.max_exp_avg_sqs, problem.master_params, problem.steps)
    kwargs = dict(hyper(amsgrad=amsgrad), grad_scale=torch.ones((), device=device),
                  found_inf=torch.zeros((), device=device))
    torch.library.opcheck(torch.ops.fusedoff.adam_step_.default, args, kwargs)
