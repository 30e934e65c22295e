"""A parameter written between steps by anything but the optimizer is what the next step starts from.

torch's optimizers step from what a parameter holds. fusedoff keeps fp32 master weights for
fp16/bf16 parameters; a write to the parameter (``copy_``, ``load_state_dict``, ``torch.nn.init``,
``p.data = ...``, ``p.data.copy_(w)``, which no version counter sees) must make the next step start
from the written value: the written elements' masters are taken from the parameter, every other
element, state and tensor is untouched bit for bit (see [note: master weights follow the
parameters] in fusedoff/offload/bucket.py). A parameter that torch cast from its master (ties to
even) is no write: every master is kept. Every case runs resident, streamed, mixed (the written
tensor resident or streamed) and streamed on the simulated device.

Oracles: torch.optim.AdamW stepping an fp32 copy of the written value with fusedoff's own moments;
the run with no write, for every tensor and element the write did not touch; and, bit for bit, the
same write followed by the master assigned as that value through ``opt.state`` (another path into
the engine).
"""

from __future__ import annotations


import pytest
import torch

import fusedoff
from fusedoff.kernels.master import param_of_master
from tests.helpers import ParameterListModel, assert_bitwise_equal, device_of, train

SHAPES = ((33, 7), (33,), (5, 33), (5,))
LR = 1e-2
STEPS_BEFORE = 3


def param_bytes(numel: int, optimizer: str) -> int:
    return numel * (16 if optimizer == "Apollo" else 12)  # states + fp32 master


PLACEMENTS = ("resident", "streamed", "mixed", "simulated")


def placement_options(placement: str, optimizer: str = "AdamW") -> dict:
    if placement == "resident":
        return dict(offload="none")
    if placement == "mixed":  # the first tensor resident, the rest streamed
        return dict(offload="stream", chunk_size=64, device_budget=param_bytes(33 * 7, optimizer))
    return dict(offload="stream", chunk_size=64)


def make_optimizer(optimizer: str, params, placement: str):
    where = placement_options(placement, optimizer)
    if optimizer == "Apollo":
        return fusedoff.Apollo(params, lr=LR, warmup=2, backend="cpu", **where)
    return fusedoff.AdamW(params, lr=LR, weight_decay=0.1, backend="cpu", **where)


def gradients(step: int, dtype):
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=generator).to(dtype) for shape in SHAPES]


def new_value(dtype, index: int):
    # (about 8 away from the weights: no element is written with the bits it held, see below)
    return (torch.randn(SHAPES[index], generator=torch.Generator().manual_seed(7)) + 8.0).to(dtype)


def write_copy(model, index, dtype):
    with torch.no_grad():
        model.weights[index].copy_(new_value(dtype, index))


def write_load_state_dict(model, index, dtype):
    state = model.state_dict()
    state[f"weights.{index}"] = new_value(dtype, index)
    model.load_state_dict(state)


def write_init(model, index, dtype):
    torch.manual_seed(3)
    torch.nn.init.normal_(model.weights[index], mean=8.0)


def write_data(model, index, dtype):
    model.weights[index].data = new_value(dtype, index)


def write_through_data(model, index, dtype):
    """``p.data.copy_(w)``: an in-place write that autograd's version counter does not count."""
    model.weights[index].data.copy_(new_value(dtype, index))


def write_same_bits(model, index, dtype):
    """A write that puts back what the parameter held (the version counter moves, the bits do not)."""
    with torch.no_grad():
        model.weights[index].copy_(model.weights[index].detach().clone())


WRITES = {"copy_": write_copy, "load_state_dict": write_load_state_dict, "nn.init": write_init,
          "data=": write_data, "data.copy_": write_through_data}


def run(optimizer, dtype, placement, write=None, index=0, assign_master=False, read_before=True):
    """STEPS_BEFORE steps, then `write` to tensor `index` (and, with `assign_master`, its master set
    to the written value through opt.state; a callable: to ``assign_master(written, master)``), then
    one more step. Returns the model, the optimizer, the states just before the last step and the
    written value."""
    with device_of(placement):
        model = ParameterListModel(SHAPES, dtype)
        params = list(model.weights)
        opt = make_optimizer(optimizer, params, placement)
        train(params, opt, STEPS_BEFORE)  # (seeded_grads: gradients(step, dtype))
        if write is not None:
            write(model, index, dtype)
            if assign_master:
                master = params[index].detach().float()
                if callable(assign_master):
                    master = assign_master(master, opt.state[params[index]]["master_param"])
                opt.state[params[index]]["master_param"] = master
        before = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
                  for p in params] if read_before else None  # reading waits for the host
        written = params[index].detach().clone()
        train(params, opt, range(STEPS_BEFORE, STEPS_BEFORE + 1))
        states = [{k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)} for p in params]
    return [p.detach().clone() for p in params], states, before, written


def assert_runs_equal(params, states, want_params, want_states, skip: int | None = None) -> None:
    """Every tensor but `skip`: the parameter and each state bit for bit as in the other run."""
    for t in range(len(SHAPES)):
        if t != skip:
            assert_bitwise_equal(params[t], want_params[t], f"parameter {t}")
            for name in states[t]:
                assert_bitwise_equal(states[t][name], want_states[t][name], f"{name} of tensor {t}")


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
    # Every element written with other bits than its master's rounding (one written with the bits it
    # held is an unwritten element: see test_only_the_written_elements_take_the_parameter).
    held = param_of_master(before[index]["master_param"], dtype)
    assert not (written.view(torch.int16) == held.view(torch.int16)).any()

    # Before the step: only the master of the written tensor follows it; its other states are kept.
    for name, value in before[index].items():
        if isinstance(value, torch.Tensor) and name not in ("master_param", "step"):
            assert_bitwise_equal(value, untouched_before[index][name], f"{name} before the step")
    # The step started from the written value: as the master assigned that value through opt.state ...
    for name in states[index]:
        assert_bitwise_equal(states[index][name], assigned_states[index][name], f"{name} of the written tensor")
    assert_bitwise_equal(params[index], assigned[index], "the written parameter")
    # ... not from the master it had (which gives the run without the write) ...
    assert not torch.equal(params[index], untouched[index])
    if optimizer == "AdamW":  # ... one step away from it (the stale master was about 8 away), as torch.optim.AdamW steps it
        assert (params[index].float() - written.float()).abs().max() <= 2 * LR + 0.01 * written.float().abs().max()
        want = torch_adamw_master(written, grad, before[index], dtype)
        torch.testing.assert_close(states[index]["master_param"], want, rtol=2e-6, atol=1e-7)
    # Every other tensor is exactly as without the write.
    assert_runs_equal(params, states, untouched, untouched_states, skip=index)


WRITTEN = slice(1, None, 3)  # the elements of the flat parameter that a partial write writes


def write_some_elements(through_data: bool):
    """A write of every third element (from the second) of the flat parameter, through ``.data``
    (no version counter moves) or under ``torch.no_grad()`` (it moves)."""
    def write(model, index, dtype):
        param = model.weights[index]
        target = param.data if through_data else param
        with torch.no_grad():
            target.view(-1)[WRITTEN] = new_value(dtype, index).view(-1)[WRITTEN]
    return write


def written_elements(shape) -> torch.Tensor:
    """Where a partial write writes (`WRITTEN` of the flat parameter), as a mask of `shape`."""
    flat = torch.zeros(shape, dtype=torch.bool).view(-1)
    flat[WRITTEN] = True
    return flat.view(shape)


def master_of_written_elements(written: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """The master that holds the written values where written, and `master` elsewhere."""
    return torch.where(written_elements(written.shape), written, master.detach().float())


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("optimizer", ["AdamW", "Apollo"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("through_data", [True, False], ids=["data", "no_grad"])
@pytest.mark.parametrize("index", [0, 2])
def test_only_the_written_elements_take_the_parameter(placement, optimizer, dtype, through_data, index):
    """The masters of the written elements are taken from the parameter; every other element of the
    written tensor keeps its master, and steps as in the run without the write, bit for bit."""
    write = write_some_elements(through_data)
    params, states, before, written = run(optimizer, dtype, placement, write, index)
    untouched, untouched_states, _, _ = run(optimizer, dtype, placement)
    assigned, assigned_states, _, _ = run(optimizer, dtype, placement, write, index,
                                          assign_master=master_of_written_elements)
    # As the masters assigned the written values through opt.state, the others kept, bit for bit ...
    assert_bitwise_equal(params[index], assigned[index], "the written parameter")
    for name in states[index]:
        assert_bitwise_equal(states[index][name], assigned_states[index][name], f"{name} of the written tensor")
    # ... the unwritten elements: the parameter and every state as without the write (no sum of
    # Apollo's reads the weights without weight decay) ...
    kept = ~written_elements(written.shape)
    assert_bitwise_equal(params[index][kept], untouched[index][kept], "unwritten elements of the parameter")
    for name, value in states[index].items():
        want = untouched_states[index][name]
        assert_bitwise_equal(value if name == "step" else value[kept], want if name == "step" else want[kept],
                          f"unwritten elements' {name}")
    # ... and the written ones stepped from the written values, as torch.optim.AdamW steps them.
    if optimizer == "AdamW":
        want = torch_adamw_master(written, gradients(STEPS_BEFORE, dtype)[index], before[index], dtype)
        torch.testing.assert_close(states[index]["master_param"][~kept], want[~kept], rtol=2e-6, atol=1e-7)
    assert not torch.equal(params[index][~kept], untouched[index][~kept])
    assert_runs_equal(params, states, untouched, untouched_states, skip=index)


def masters_with_ties(shape, seed: int) -> torch.Tensor:
    """fp32 masters of which every fourth is an exact bf16 tie (low half 0x8000) with an even upper
    half: torch's cast (ties to even) rounds those down in magnitude, fusedoff's (ties away) up."""
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    ties = values.view(torch.int32).view(-1)[::4]
    ties.copy_((ties & ~0x1FFFF) | 0x8000)
    return values


def params_cast_by_torch_from_masters_with_ties() -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    """bf16 parameters of SHAPES cast by torch (ties to even) from fp32 masters with ties, and the masters."""
    params = list(ParameterListModel(SHAPES, torch.bfloat16).weights)
    masters = [masters_with_ties(p.shape, seed=20 + t) for t, p in enumerate(params)]
    with torch.no_grad():
        for p, m in zip(params, masters):
            p.copy_(m.to(torch.bfloat16))
    return params, masters


def load_masters(opt, params, masters, through: str) -> None:
    """`masters` as the fp32 ``master_param`` of `params` beside zero moments, through torch's state
    dict form or assigned through ``opt.state`` (with a step count: a state without one starts afresh)."""
    if through == "load_state_dict":
        state = {t: {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(m), "exp_avg_sq": torch.zeros_like(m),
                     "master_param": m.clone()} for t, m in enumerate(masters)}
        opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})
    else:
        for p, m in zip(params, masters):
            opt.state[p]["step"] = torch.tensor(1.0)
            opt.state[p]["master_param"] = m.clone()


def zero_gradient_step(opt, params) -> None:
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("precision,through", [("fp32", "load_state_dict"), ("fp32", "opt.state"),
                                               ("split", "load_state_dict")])
def test_a_master_loaded_beside_torch_s_cast_keeps_every_bit(placement, precision, through):
    """fp32 masters loaded as ``master_param`` beside bf16 parameters that torch cast from them (as
    torchao's tests start mixed precision): a step that changes no weight (zero gradients, no weight
    decay) keeps every master bit for bit, ties included; a parameter at a tie may take fusedoff's
    rounding (ties away from zero), the other nearest one."""
    with device_of(placement):
        params, masters = params_cast_by_torch_from_masters_with_ties()
        opt = fusedoff.AdamW(params, lr=LR, weight_decay=0.0, backend="cpu", master_precision=precision,
                             **placement_options(placement))
        load_masters(opt, params, masters, through)
        zero_gradient_step(opt, params)
        loaded = opt.fp32_state_dict()["state"]
        for t, (p, m) in enumerate(zip(params, masters)):
            assert_bitwise_equal(loaded[t]["master_param"].reshape(m.shape), m, f"master {t}")
            u = m.view(torch.int32).long() & 0xFFFFFFFF
            torch_cast = m.to(torch.bfloat16).view(torch.int16).long() & 0xFFFF
            assert (torch_cast != (u >> 16) + 1).logical_and((u & 0xFFFF) == 0x8000).sum() > 0  # ties it rounds down
            either = (p.detach().view(torch.int16).long() & 0xFFFF == torch_cast) | (
                ((u & 0xFFFF) == 0x8000) & (p.detach().view(torch.int16).long() & 0xFFFF == (u >> 16) + 1))
            assert either.all(), f"parameter {t} is not a nearest rounding of its master"


def test_a_split_load_refused_after_its_ties_were_found_leaves_the_parameters_as_they_were(monkeypatch):
    """The parameter at a tie takes fusedoff's rounding only once every loaded state has converted:
    a load that fails at a later tensor leaves every parameter bit for bit."""
    params, masters = params_cast_by_torch_from_masters_with_ties()
    before = [p.detach().clone() for p in params]
    opt = fusedoff.AdamW(params, lr=LR, weight_decay=0.0, backend="cpu", master_precision="split")
    convert = type(opt)._loaded_states

    def fails_at_the_last(self, group, param, state):
        if param is params[-1]:
            raise ValueError("a state that cannot be converted")
        return convert(self, group, param, state)

    monkeypatch.setattr(type(opt), "_loaded_states", fails_at_the_last)
    with pytest.raises(ValueError, match="cannot be converted"):
        load_masters(opt, params, masters, "load_state_dict")
    for t, (p, b) in enumerate(zip(params, before)):
        assert_bitwise_equal(p.detach(), b, f"parameter {t}")
    monkeypatch.undo()
    load_masters(opt, params, masters, "load_state_dict")  # the same load, converted: the ties move
    assert any(not torch.equal(p.detach().view(torch.int16), b.view(torch.int16)) for p, b in zip(params, before))


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("through", ["load_state_dict", "opt.state"])
def test_an_fp16_parameter_rounded_away_at_a_tie_keeps_its_master(placement, through):
    """fp16 parameters rounded to nearest with ties away from zero (another tool's cast) beside fp32
    masters with exact fp16 ties: the other nearest rounding, not a write; every master is kept."""
    with device_of(placement):
        model = ParameterListModel(SHAPES, torch.float16)
        params = list(model.weights)
        masters = []
        for t, p in enumerate(params):
            m = torch.randn(p.shape, generator=torch.Generator().manual_seed(40 + t)).to(torch.float16).float()
            up = (m.to(torch.float16).view(torch.int16) + 1).view(torch.float16)  # the next fp16 value in magnitude
            m.view(-1)[::4] = ((m + up.float()) / 2).view(-1)[::4]  # exact ties between the two
            masters.append(m)
            with torch.no_grad():  # ties away from zero: the upper of the two
                p.copy_(torch.where(m.to(torch.float16).float() == m, m.to(torch.float16), up))
        assert (params[0].detach() != masters[0].to(torch.float16)).sum() > 0  # torch's cast differs at some ties
        opt = fusedoff.AdamW(params, lr=LR, weight_decay=0.0, backend="cpu", **placement_options(placement))
        load_masters(opt, params, masters, through)
        zero_gradient_step(opt, params)
        for t, (p, m) in enumerate(zip(params, masters)):
            assert_bitwise_equal(opt.state[p]["master_param"].reshape(m.shape), m, f"master {t}")


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
        model = ParameterListModel(SHAPES, dtype)
        opt = make_optimizer("AdamW", list(model.weights), placement)
        train(list(model.weights), opt, range(3))
        saved_model = {k: v.clone() for k, v in model.state_dict().items()}
        saved_opt = opt.state_dict()
        saved_opt = {"state": {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
                               for k, s in saved_opt["state"].items()},
                     "param_groups": saved_opt["param_groups"]}
        if through == "file":  # torch.save of the live dicts (step counts are views of one vector), then load
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "checkpoint.pt")
            loaded = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
            saved_model, saved_opt = loaded["model"], loaded["optimizer"]
        train(list(model.weights), opt, range(3, 6))

        resumed = ParameterListModel(SHAPES, dtype)
        with torch.no_grad():
            for p in resumed.weights:
                p.add_(1.0)  # other weights than the checkpoint's, until it is loaded
        resumed_opt = make_optimizer("AdamW", list(resumed.weights), placement)
        train(list(resumed.weights), resumed_opt, range(1))  # masters of the other weights exist already
        if order == "model first":
            resumed.load_state_dict(saved_model)
            resumed_opt.load_state_dict(saved_opt)
        else:
            resumed_opt.load_state_dict(saved_opt)
            resumed.load_state_dict(saved_model)
        train(list(resumed.weights), resumed_opt, range(3, 6))
        for t, (got, want) in enumerate(zip(resumed.weights, model.weights)):
            assert_bitwise_equal(got.detach(), want.detach(), f"parameter {t}")
            for name, value in opt.state[want].items():
                assert_bitwise_equal(resumed_opt.state[got][name], value, f"{name} of tensor {t}")


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_loaded_master_that_is_not_the_parameter_follows_the_parameter(placement):
    """An optimizer checkpoint loaded into a model holding other weights: the model's weights win."""
    dtype = torch.bfloat16
    with device_of(placement):
        model = ParameterListModel(SHAPES, dtype)
        opt = make_optimizer("AdamW", list(model.weights), placement)
        for p, g in zip(model.weights, gradients(0, dtype)):
            p.grad = g
        opt.step()
        saved = opt.state_dict()
        other = ParameterListModel(SHAPES, dtype)
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
        model = ParameterListModel(SHAPES, dtype)
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
    the host): the next step's kernels read the written parameter beside the streamed master. Same
    result as the run that read the states in between."""
    want = run(optimizer, torch.bfloat16, "simulated", write_copy, index)
    got = run(optimizer, torch.bfloat16, "simulated", write_copy, index, read_before=False)
    assert_runs_equal(got[0], got[1], want[0], want[1])
