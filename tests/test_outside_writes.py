"""A parameter written between steps by anything but the optimizer is what the next step starts from.

torch's optimizers step from what a parameter holds. fusedoff keeps fp32 master weights for
fp16/bf16 parameters; a write to the parameter (``copy_``, ``load_state_dict``, ``torch.nn.init``,
``p.data = ...``) must make the next step start from the written value: that tensor's master is
taken from the parameter, its other states are kept, every other tensor is untouched bit for bit
(see [note: master weights follow the parameters] in fusedoff/offload/bucket.py). Every case runs
resident, streamed, mixed (the written tensor resident or streamed) and streamed on the simulated
device (its race checker orders the host's read of the parameter and its write into the store).

Oracles: torch.optim.AdamW stepping an fp32 copy of the written value with fusedoff's own moments;
the run with no write, for every tensor the write did not touch; and, bit for bit, the same write
followed by the master assigned as that value through ``opt.state`` (another path into the engine).
"""

from __future__ import annotations


import pytest
import torch

import fusedoff
from tests.helpers import device_of

SHAPES = ((33, 7), (33,), (5, 33), (5,))
LR = 1e-2
STEPS_BEFORE = 3


def param_bytes(numel: int, optimizer: str) -> int:
    return numel * (16 if optimizer == "Apollo" else 12)  # states + fp32 master


PLACEMENTS = ("resident", "streamed", "mixed", "simulated")


def make_optimizer(optimizer: str, params, placement: str):
    if placement == "resident":
        where = dict(offload="none")
    elif placement == "mixed":  # the first tensor resident, the rest streamed
        where = dict(offload="stream", chunk_size=64, device_budget=param_bytes(33 * 7, optimizer))
    else:
        where = dict(offload="stream", chunk_size=64)
    if optimizer == "Apollo":
        return fusedoff.Apollo(params, lr=LR, warmup=2, backend="cpu", **where)
    return fusedoff.AdamW(params, lr=LR, weight_decay=0.1, backend="cpu", **where)


class Model(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for shape in SHAPES)


def gradients(step: int, dtype):
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=generator).to(dtype) for shape in SHAPES]


def new_value(dtype, index: int):
    return (torch.randn(SHAPES[index], generator=torch.Generator().manual_seed(7)) + 3.0).to(dtype)


def write_copy(model, index, dtype):
    with torch.no_grad():
        model.weights[index].copy_(new_value(dtype, index))


def write_load_state_dict(model, index, dtype):
    state = model.state_dict()
    state[f"weights.{index}"] = new_value(dtype, index)
    model.load_state_dict(state)


def write_init(model, index, dtype):
    torch.manual_seed(3)
    torch.nn.init.normal_(model.weights[index], mean=3.0)


def write_data(model, index, dtype):
    model.weights[index].data = new_value(dtype, index)


def write_same_bits(model, index, dtype):
    """A write that puts back what the parameter held (the version counter moves, the bits do not)."""
    with torch.no_grad():
        model.weights[index].copy_(model.weights[index].detach().clone())


WRITES = {"copy_": write_copy, "load_state_dict": write_load_state_dict, "nn.init": write_init,
          "data=": write_data}


def run(optimizer, dtype, placement, write=None, index=0, assign_master=False, read_before=True):
    """STEPS_BEFORE steps, then `write` to tensor `index` (and, with `assign_master`, its master set
    to the written value through opt.state), then one more step. Returns the model, the optimizer,
    the states just before the last step and the written value."""
    with device_of(placement):
        model = Model(dtype)
        params = list(model.weights)
        opt = make_optimizer(optimizer, params, placement)
        for step in range(STEPS_BEFORE + 1):
            if step == STEPS_BEFORE:
                if write is not None:
                    write(model, index, dtype)
                    if assign_master:
                        opt.state[params[index]]["master_param"] = params[index].detach().float()
                before = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
                          for p in params] if read_before else None  # reading waits for the host
                written = params[index].detach().clone()
            for p, g in zip(params, gradients(step, dtype)):
                p.grad = g
            opt.step()
        states = [{k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)} for p in params]
    return [p.detach().clone() for p in params], states, before, written


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(got.view(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), what


def assert_runs_equal(params, states, want_params, want_states, skip: int | None = None) -> None:
    """Every tensor but `skip`: the parameter and each state bit for bit as in the other run."""
    for t in range(len(SHAPES)):
        if t != skip:
            assert_bits_equal(params[t], want_params[t], f"parameter {t}")
            for name in states[t]:
                assert_bits_equal(states[t][name], want_states[t][name], f"{name} of tensor {t}")


def torch_adamw_master(written, grad, before, dtype):
    """torch.optim.AdamW's step from the written value, with fusedoff's moments before the step."""
    master = torch.nn.Parameter(written.float())
    opt = torch.optim.AdamW([master], lr=LR, weight_decay=0.1)
    master.grad = grad.float()
    opt.step()  # creates the state: replace it with fusedoff's and step again from the written value
    with torch.no_grad():
        master.copy_(written.float())
    state = opt.state[master]
    state["exp_avg"].copy_(before["exp_avg"])
    state["exp_avg_sq"].copy_(before["exp_avg_sq"])
    state["step"].fill_(float(before["step"]))
    opt.step()
    return master.detach()


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("optimizer", ["AdamW", "Apollo"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("write", list(WRITES))
@pytest.mark.parametrize("index", [0, 2])  # mixed: 0 is resident, 2 streamed
def test_the_next_step_starts_from_the_written_parameter(placement, optimizer, dtype, write, index):
    params, states, before, written = run(optimizer, dtype, placement, WRITES[write], index)
    untouched, untouched_states, untouched_before, _ = run(optimizer, dtype, placement)
    assigned, assigned_states, _, _ = run(optimizer, dtype, placement, WRITES[write], index, assign_master=True)
    grad = gradients(STEPS_BEFORE, dtype)[index]

    # Before the step: only the master of the written tensor follows it; its other states are kept.
    for name, value in before[index].items():
        if isinstance(value, torch.Tensor) and name not in ("master_param", "step"):
            assert_bits_equal(value, untouched_before[index][name], f"{name} before the step")
    # The step started from the written value: as the master assigned that value through opt.state ...
    for name in states[index]:
        assert_bits_equal(states[index][name], assigned_states[index][name], f"{name} of the written tensor")
    assert_bits_equal(params[index], assigned[index], "the written parameter")
    # ... not from the master it had (which gives the run without the write) ...
    assert not torch.equal(params[index], untouched[index])
    if optimizer == "AdamW":  # ... one step away from it (the stale master was about 3 away), as torch.optim.AdamW steps it
        assert (params[index].float() - written.float()).abs().max() <= 2 * LR + 0.01 * written.float().abs().max()
        want = torch_adamw_master(written, grad, before[index], dtype)
        torch.testing.assert_close(states[index]["master_param"], want, rtol=2e-6, atol=1e-7)
    # Every other tensor is exactly as without the write.
    assert_runs_equal(params, states, untouched, untouched_states, skip=index)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("optimizer", ["AdamW", "Apollo"])
def test_a_write_of_the_same_bits_keeps_the_master_exactly(placement, optimizer):
    dtype = torch.bfloat16
    params, states, _, _ = run(optimizer, dtype, placement, write_same_bits, 0)
    untouched, untouched_states, _, _ = run(optimizer, dtype, placement)
    assert_runs_equal(params, states, untouched, untouched_states)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("order", ["model first", "optimizer first"])
@pytest.mark.parametrize("through", ["memory", "file"])
def test_a_resumed_run_continues_exactly_whatever_the_loading_order(placement, order, through, tmp_path):
    dtype = torch.bfloat16
    with device_of(placement):
        model = Model(dtype)
        opt = make_optimizer("AdamW", list(model.weights), placement)

        def train(model, opt, steps):
            for step in steps:
                for p, g in zip(model.weights, gradients(step, dtype)):
                    p.grad = g
                opt.step()

        train(model, opt, range(3))
        saved_model = {k: v.clone() for k, v in model.state_dict().items()}
        saved_opt = opt.state_dict()
        saved_opt = {"state": {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
                               for k, s in saved_opt["state"].items()},
                     "param_groups": saved_opt["param_groups"]}
        if through == "file":  # torch.save of the live dicts (step counts are views of one vector), then load
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "checkpoint.pt")
            loaded = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
            saved_model, saved_opt = loaded["model"], loaded["optimizer"]
        train(model, opt, range(3, 6))

        resumed = Model(dtype)
        with torch.no_grad():
            for p in resumed.weights:
                p.add_(1.0)  # other weights than the checkpoint's, until it is loaded
        resumed_opt = make_optimizer("AdamW", list(resumed.weights), placement)
        train(resumed, resumed_opt, range(1))  # masters of the other weights exist already
        if order == "model first":
            resumed.load_state_dict(saved_model)
            resumed_opt.load_state_dict(saved_opt)
        else:
            resumed_opt.load_state_dict(saved_opt)
            resumed.load_state_dict(saved_model)
        train(resumed, resumed_opt, range(3, 6))
        for t, (got, want) in enumerate(zip(resumed.weights, model.weights)):
            assert_bits_equal(got.detach(), want.detach(), f"parameter {t}")
            for name, value in opt.state[want].items():
                assert_bits_equal(resumed_opt.state[got][name], value, f"{name} of tensor {t}")


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_loaded_master_that_is_not_the_parameter_follows_the_parameter(placement):
    """An optimizer checkpoint loaded into a model holding other weights: the model's weights win."""
    dtype = torch.bfloat16
    with device_of(placement):
        model = Model(dtype)
        opt = make_optimizer("AdamW", list(model.weights), placement)
        for p, g in zip(model.weights, gradients(0, dtype)):
            p.grad = g
        opt.step()
        saved = opt.state_dict()
        other = Model(dtype)
        with torch.no_grad():
            for p in other.weights:
                p.mul_(-1.0)
        other_opt = make_optimizer("AdamW", list(other.weights), placement)
        other_opt.load_state_dict(saved)
        for p, g in zip(other.weights, gradients(1, dtype)):
            p.grad = g
        held = [p.detach().clone() for p in other.weights]
        other_opt.step()
        for p, was in zip(other.weights, held):
            assert (p.detach().float() - was.float()).abs().max() <= 3 * LR + 0.01 * was.float().abs().max()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_parameter_given_another_memory_layout_is_refused_before_anything_changes(placement):
    """States are kept in their parameter's memory order: a parameter replaced (``p.data = w``) by
    one of the same shape but other strides cannot take them over silently."""
    dtype = torch.bfloat16
    with device_of(placement):
        model = Model(dtype)
        params = list(model.weights)
        opt = make_optimizer("AdamW", params, placement)
        for p, g in zip(params, gradients(0, dtype)):
            p.grad = g
        opt.step()
        before = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
        values = [p.detach().clone() for p in params]
        transposed = torch.empty_strided(SHAPES[0], (1, SHAPES[0][0]), dtype=dtype)
        transposed.copy_(values[0])
        params[0].data = transposed
        for p, g in zip(params, gradients(1, dtype)):
            p.grad = g.contiguous() if p is not params[0] else g.t().contiguous().t()
        with pytest.raises(ValueError, match="laid out for shape"):
            opt.step()
        for p, was, state in zip(params, values, before):
            assert torch.equal(p.detach(), was)
            for name, value in state.items():
                assert torch.equal(opt.state[p][name], value), name


@pytest.mark.parametrize("optimizer", ["AdamW", "Apollo"])
@pytest.mark.parametrize("index", [0, 2])
def test_a_write_right_after_a_step_waits_for_its_copies_back_on_the_simulated_device(optimizer, index):
    """On the simulated device, with no state read between the step and the write (a read waits for
    the host): taking a streamed master from its parameter waits for the step's copies back into
    the store first. Same result as the run that read the states in between."""
    want = run(optimizer, torch.bfloat16, "simulated", write_copy, index)
    got = run(optimizer, torch.bfloat16, "simulated", write_copy, index, read_before=False)
    assert_runs_equal(got[0], got[1], want[0], want[1])
