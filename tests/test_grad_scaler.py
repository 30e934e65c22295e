"""torch.amp.GradScaler's overflow flag is a sum over devices: with gradients on two GPUs that both
overflow, ``found_inf`` is 2.0, not 1.0. Any non-zero flag must skip the step: no state, parameter or
step count changes (``1 - found_inf`` once counted such a step backwards). Every backend this machine
runs (triton through its interpreter, tiny sizes), the ops and both optimizers, resident and streamed.
"""

from __future__ import annotations

import copy

import pytest
import torch

import fusedoff
from fusedoff import ops
from tests.helpers import backend_params, make_adam_problem, run_adam

OVERFLOW_FLAGS = [2.0, 1.0, float("nan")]  # two devices, one device, and a NaN flag (skips in every kernel)
ADAM_HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled_weight_decay=True,
                  amsgrad=True, maximize=False)
APOLLO_HYPER = dict(lr=1e-2, base_lr=1e-2, init_lr=1e-3, warmup=2, beta=0.9, eps=1e-4, weight_decay=1e-2,
                    rebound="belief", weight_decay_type="stable")


@pytest.mark.parametrize("flag,stepped", [(0.0, 1.0), (1.0, 0.0), (2.0, 0.0), (0.5, 0.0), (float("nan"), 0.0)])
def test_increment_steps_skips_on_any_nonzero_flag(flag, stepped):
    steps = [torch.zeros(()), torch.full((), 5.0)]
    ops.increment_steps_(steps, torch.tensor(flag))
    assert [s.item() for s in steps] == [stepped, 5.0 + stepped]


def _snapshot(tensors: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    return {name: [t.clone() for t in ts] for name, ts in tensors.items()}


def _assert_unchanged(now: dict[str, list[torch.Tensor]], before: dict[str, list[torch.Tensor]], flag: float) -> None:
    for name, tensors in now.items():
        for i, (t, b) in enumerate(zip(tensors, before[name], strict=True)):
            assert torch.equal(t, b), f"{name}[{i}] changed on a step with found_inf={flag}"


@pytest.mark.parametrize("backend,device", backend_params(("cpu", "cuda", "triton", "torch")))
@pytest.mark.parametrize("flag", OVERFLOW_FLAGS, ids=str)
def test_adam_op_skips_on_any_nonzero_flag(backend, device, flag):
    problem = make_adam_problem(param_dtype=torch.bfloat16, grad_dtype=torch.bfloat16, master=True, amsgrad=True,
                                num_steps=2, sizes=((7,), (33,)), device=device)
    run_adam(problem, backend, ADAM_HYPER)
    before = _snapshot(problem.states())
    found_inf = torch.full((), flag, device=device)
    ops.increment_steps_(problem.steps, found_inf)
    ops.adam_step_(problem.params, problem.grads_per_step[0], problem.exp_avgs, problem.exp_avg_sqs,
                   problem.max_exp_avg_sqs, problem.master_params, problem.steps, found_inf=found_inf,
                   grad_scale=torch.full((), 2.0, device=device), backend=backend, **ADAM_HYPER)
    _assert_unchanged(problem.states(), before, flag)


@pytest.mark.parametrize("backend,device", backend_params(("cpu", "cuda", "triton", "torch")))
@pytest.mark.parametrize("flag", OVERFLOW_FLAGS, ids=str)
def test_apollo_op_skips_on_any_nonzero_flag(backend, device, flag):
    gen = torch.Generator().manual_seed(0)
    sizes = (7, 33)
    master = [torch.randn(n, generator=gen) for n in sizes]
    state = {
        "params": [m.to(torch.bfloat16) for m in master],
        "exp_avg_grads": [torch.randn(n, generator=gen) * 1e-2 for n in sizes],
        "approx_hessians": [torch.rand(n, generator=gen) * 1e-2 for n in sizes],
        "updates": [torch.randn(n, generator=gen) * 1e-3 for n in sizes],
        "master_params": master,
        "steps": [torch.full((), 3.0) for _ in sizes],
    }
    state = {name: [t.to(device) for t in ts] for name, ts in state.items()}
    grads = [(torch.randn(n, generator=gen) * 0.1).to(device, torch.bfloat16) for n in sizes]
    before = _snapshot(state)
    found_inf = torch.full((), flag, device=device)
    ops.increment_steps_(state["steps"], found_inf)
    ops.apollo_whole_step_(state["params"], grads, state["exp_avg_grads"], state["approx_hessians"], state["updates"],
                           state["master_params"], state["steps"], backend=backend, found_inf=found_inf,
                           grad_scale=torch.full((), 4.0, device=device), **APOLLO_HYPER)
    _assert_unchanged(state, before, flag)


# ---- the optimizers, through a GradScaler that saw two devices ------------------------------------------

OPTIMIZERS = {
    "AdamW": lambda params, **kw: fusedoff.AdamW(params, lr=1e-2, weight_decay=0.1, amsgrad=True, **kw),
    "Apollo": lambda params, **kw: fusedoff.Apollo(params, lr=1e-2, warmup=2, rebound="belief", weight_decay=1e-2,
                                                   weight_decay_type="stable", **kw),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _two_device_scaler() -> torch.amp.GradScaler:
    """A CPU GradScaler whose per-device overflow flags name a second device holding the same flag, as
    GradScaler reports them for a model split over two GPUs: it sums them into ``found_inf``."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    unscale = scaler._unscale_grads_

    def unscale_on_two_devices(*args, **kwargs):
        per_device = unscale(*args, **kwargs)
        (flag,) = per_device.values()
        return {**per_device, torch.device("cpu", 1): flag.clone()}

    scaler._unscale_grads_ = unscale_on_two_devices
    return scaler


def _record_found_inf(opt: torch.optim.Optimizer) -> list[float]:
    """The ``found_inf`` GradScaler hands each step()."""
    seen: list[float] = []
    step = opt.step

    def recording_step(*args, **kwargs):
        seen.append(float(opt.found_inf))
        return step(*args, **kwargs)

    opt.step = recording_step
    return seen


def _everything(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    """Parameters, then every state tensor and step count, as copies (streamed states read back too)."""
    out = {"param": [p.detach().clone() for p in model.parameters()]}
    for pid, state in copy.deepcopy(opt.state_dict()["state"]).items():
        for key, value in state.items():
            out[f"{pid}.{key}"] = [torch.as_tensor(value).clone()]
    return out


@pytest.mark.parametrize("offload", ["none", "stream"])
@pytest.mark.parametrize("backend", ["cpu", "torch", pytest.param("triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_skips_a_step_gradscaler_flags_on_two_devices(name, backend, offload):
    model = _model()
    kwargs = dict(backend=backend, offload=offload)
    if offload == "stream":
        kwargs["chunk_size"] = 32  # chunks of whole tensors and a tensor spanning chunks
    opt = OPTIMIZERS[name](model.parameters(), **kwargs)
    seen = _record_found_inf(opt)
    scaler = _two_device_scaler()
    gen = torch.Generator().manual_seed(1)

    def train_step(x: torch.Tensor) -> None:
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), torch.zeros(x.shape[0], 3))).backward()
        scaler.step(opt)
        scaler.update()

    for _ in range(3):
        train_step(torch.randn(4, 5, generator=gen))
    assert seen == [0.0, 0.0, 0.0]
    before = _everything(model, opt)
    assert all(v[0].item() == 3 for k, v in before.items() if k.endswith(".step"))

    train_step(torch.full((4, 5), float("inf")))  # overflows on "both devices": found_inf = 2.0
    assert seen[-1] == 2.0
    _assert_unchanged(_everything(model, opt), before, 2.0)

    train_step(torch.randn(4, 5, generator=gen))  # the next clean step counts 4, not 2
    steps = [v[0].item() for k, v in _everything(model, opt).items() if k.endswith(".step")]
    assert steps and all(s == 4 for s in steps), steps
