"""master_precision "split" and "split8": the master weight stored as low bits beside its bf16 parameter.

The claims of [note: split master weights] (csrc/include/fusedoff/master.h), each against an
independent oracle:
- the encoding, over all 2^32 fp32 values (a C++ loop), and why it needs ties away from zero
  (torch's own round-to-nearest-even leaves 2^16 + 1 masters on an even bf16 value);
- "split" gives the bits of "fp32" (the run with whole fp32 masters) for every parameter, state and
  master, resident, streamed, mixed and on the simulated device, for AdamW with every state
  precision and Apollo with every decay, on the cpu and torch backends (the others: see
  test_split_master_backends.py);
- "split8" keeps, per step, the master within 256 units in the last place of the fp32 step from
  the same state, and equals its stochastic rounding's definition in master.py;
- checkpoints convert both ways, refusals come before anything changes, and a written parameter
  carries its master's low bits with it.
"""

from __future__ import annotations

import copy

import pytest
import torch

import fusedoff
from fusedoff import _ext, ops
from fusedoff.hyperparameters import AdamHyperparameters
from fusedoff.kernels import master as masters
from tests.helpers import assert_bitwise_equal, device_of, make_params, native_selftests, train

SHAPES = ((33, 7), (1,), (300,), (5, 33))
PLACEMENTS = ("resident", "streamed", "mixed", "simulated")
STEPS = 4


@pytest.mark.exhaustive
def test_the_split_encoding_is_exact_for_every_fp32_value():
    """master.h's functions over all 2^32 bit patterns (two salts for split8): the split master
    comes back bit for bit, split8's rounding comes back and stays within 256 units, and the
    parameter is the rounding to nearest with ties away from zero. A few seconds of C++."""
    selftests = native_selftests()
    for salt in (0, 0x9E3779B9):
        split, split8, split8_bound, rounding = selftests.split_master_selftest(salt, torch.get_num_threads())
        assert (split, split8, split8_bound, rounding) == (0, 0, 0, 0)


@pytest.mark.exhaustive
def test_an_fp32_master_is_kept_beside_exactly_its_nearest_roundings():
    """master.h's ``master_or_param`` over all 2^32 fp32 masters, each beside the 4 bf16 params
    around its upper half: the master is kept where the param is one of its nearest roundings
    (either at a tie: torch's cast too), the param taken elsewhere (see [note: every write is seen])."""
    assert native_selftests().written_param_selftest(torch.get_num_threads()) == 0


@pytest.mark.exhaustive
def test_the_host_kernels_16_lane_masters_give_the_definitions_bits_for_every_fp32_value():
    """The AVX-512 host kernels split and join masters 16 at a time (csrc/cpu/master_lanes.h, the same
    templates of master.h on vectors): over all 2^32 masters, the parameter, the low bits (split and
    split8, one salt) and the master joined back equal master.h's scalar form. About 15 s of C++."""
    differing = native_selftests().split_master_lanes_selftest(0x5B1175A8, torch.get_num_threads())
    if not differing:
        pytest.skip(f"the host kernels have no AVX-512 form on this CPU ({_ext.cpu_isa()}): nothing to compare")
    assert differing == [0, 0]


def test_round_to_nearest_even_leaves_one_master_too_many_for_16_bits():
    """Why the parameter of a master rounds ties away: under torch's round-to-nearest-even, the fp32
    values that round to the even bf16 1.0 number 2^16 + 1, and to its odd neighbour 2^16 - 1."""
    around = torch.arange(0x3F7F0000, 0x3F810000, dtype=torch.int64)  # the upper halves 0x3f7f, 0x3f80
    values = around.to(torch.int32).view(torch.float32)
    rne = values.to(torch.bfloat16).view(torch.int16).to(torch.int64)
    assert int((rne == 0x3F80).sum()) == 2**16 + 1  # 1.0 (even): both ties round to it
    assert int((rne == 0x3F7F).sum()) < 2**16  # its odd neighbour below (its lower half is cut off here)
    rna = masters.param_of_master(values, torch.bfloat16).view(torch.int16).to(torch.int64)
    assert int((rna == 0x3F80).sum()) == 2**16


def test_the_torch_mirror_agrees_with_the_definition_on_random_values():
    """fusedoff/kernels/master.py: split and join give random masters back (NaN quieted), and the
    parameter differs from torch's rounding only at ties."""
    bits = torch.randint(-2**31, 2**31, (1 << 18,), dtype=torch.int64, generator=torch.Generator().manual_seed(0))
    bits[:4] = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000 - (1 << 32), 0x7F7FFFFF])  # ties, FLT_MAX
    values = bits.to(torch.int32).view(torch.float32)
    param = masters.param_of_master(values, torch.bfloat16)
    joined = masters.join(param, masters.split(values, "split"))
    nan = values.isnan()
    assert torch.equal(joined[~nan].view(torch.int32), values[~nan].view(torch.int32))
    assert joined[nan].isnan().all()
    ties = (bits & 0xFFFF) == 0x8000
    differs = param.view(torch.int16) != values.to(torch.bfloat16).view(torch.int16)
    assert not (differs & ~ties & ~nan).any() and differs[:3].tolist() == [True, False, True]


# ---- the optimizers, split against fp32 ---------------------------------------------------------
def where(placement: str, bytes_per_element: int) -> dict:
    if placement == "resident":
        return dict(offload="none")
    if placement == "mixed":  # the first tensor resident, the rest streamed
        return dict(offload="stream", chunk_size=64, device_budget=33 * 7 * bytes_per_element)
    return dict(offload="stream", chunk_size=64)


OPTIMIZERS = {
    "AdamW fp32": (fusedoff.AdamW, dict(weight_decay=0.1), 8),
    "AdamW bf16": (fusedoff.AdamW, dict(weight_decay=0.1, state_precision="bf16"), 4),
    "AdamW 8bit": (fusedoff.AdamW, dict(weight_decay=0.1, state_precision="8bit"), 2),
    "Adam L2": (fusedoff.Adam, dict(weight_decay=0.1), 8),
    "Apollo L2": (fusedoff.Apollo, dict(warmup=2, weight_decay=0.1, weight_decay_type="L2"), 12),
    "Apollo stable": (fusedoff.Apollo, dict(warmup=2, weight_decay=0.1, weight_decay_type="stable",
                                            rebound="belief"), 12),
}


def trained(name, master_precision, placement, backend="cpu", steps=STEPS, params=None, opt=None):
    """Trains the bf16 tensors of SHAPES (or `params`, with `opt` when given) for `steps` steps; the
    parameters, the optimizer and a copy of its tensor states."""
    cls, options, state_bytes = OPTIMIZERS[name]
    with device_of(placement):
        params = params if params is not None else make_params(SHAPES, torch.bfloat16)
        if opt is None:
            opt = cls(params, lr=1e-2, backend=backend, master_precision=master_precision,
                      **where(placement, state_bytes + 4), **options)
        train(params, opt, steps)
        states = [{k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)} for p in params]
    return params, opt, states


def master_of(state: dict, param: torch.Tensor) -> torch.Tensor:
    if "master_param" in state:
        return state["master_param"]
    return masters.join(param.detach(), state.get("master_low_bits", state.get("master_low_byte")))


# The torch backend (the reference) resident and streamed; the cpu backend in every placement.
BACKEND_PLACEMENTS = [("cpu", placement) for placement in PLACEMENTS] + [("torch", "resident"), ("torch", "streamed")]


@pytest.mark.parametrize("backend, placement", BACKEND_PLACEMENTS)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_split_gives_the_bits_of_fp32(placement, name, backend):
    want_params, _, want_states = trained(name, "fp32", placement, backend)
    params, opt, states = trained(name, "split", placement, backend)
    for t, (p, want) in enumerate(zip(params, want_params)):
        assert_bitwise_equal(p.detach(), want.detach(), f"parameter {t}")
        assert states[t]["master_low_bits"].dtype == torch.int16 and "master_param" not in states[t]
        assert_bitwise_equal(master_of(states[t], p), want_states[t]["master_param"], f"master {t}")
        for key, value in want_states[t].items():
            if key != "master_param":
                assert_bitwise_equal(states[t][key], value, f"{key} of tensor {t}")


@pytest.mark.parametrize("placement", PLACEMENTS[1:])
@pytest.mark.parametrize("name", ["AdamW fp32", "AdamW 8bit", "Apollo stable"])
def test_split8_gives_the_same_bits_in_every_placement(placement, name):
    want_params, _, want_states = trained(name, "split8", "resident")
    params, _, states = trained(name, "split8", placement)
    for t in range(len(SHAPES)):
        assert_bitwise_equal(params[t].detach(), want_params[t].detach(), f"parameter {t}")
        assert states[t]["master_low_byte"].dtype == torch.uint8 and "master_low_bits" not in states[t]
        for key in want_states[t]:
            assert_bitwise_equal(states[t][key], want_states[t][key], f"{key} of tensor {t}")


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_split8_keeps_each_step_within_256_units_of_the_fp32_step(backend):
    """Each step from the split8 state, taken once with an fp32 master (the oracle) and once split8:
    the split8 master is the stochastic rounding of the fp32 one as master.py defines it (the
    kernel and the definition agree bit for bit), within 256 units in the last place, unbiased."""
    generator = torch.Generator().manual_seed(1)
    n = 1 << 16
    param = (torch.randn(n, generator=generator) * 0.05).to(torch.bfloat16)
    low = torch.zeros(n, dtype=torch.uint8)
    m, v = torch.zeros(n), torch.zeros(n)
    hyper = AdamHyperparameters(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                                decoupled_weight_decay=True, amsgrad=False, maximize=False)
    drift = []
    for step in range(1, 6):
        grad = torch.randn(n, generator=generator).to(torch.bfloat16)
        count = torch.tensor(float(step))
        whole = [masters.join(param, low).clone()]
        p32, m32, v32 = param.clone(), m.clone(), v.clone()
        ops.adam_step_([p32], [grad], [m32], [v32], [], whole, [count], hyper=hyper, backend=backend)
        ops.adam_step_([param], [grad], [m], [v], [], [low], [count], hyper=hyper, backend=backend)
        assert torch.equal(m, m32) and torch.equal(v, v32)
        got = masters.join(param, low)
        assert torch.equal(got.view(torch.int32), masters.round_split8(whole[0], masters.split8_salt(count)).view(torch.int32))
        assert torch.equal(param.view(torch.int16), masters.param_of_master(got, torch.bfloat16).view(torch.int16))
        units = got.view(torch.int32).to(torch.int64) - whole[0].view(torch.int32).to(torch.int64)
        assert units.abs().max() < 256 and (got.sign() == whole[0].sign()).all()
        assert (got.view(torch.int32) & 0xFF).eq(0).all()
        drift.append(units.double().mean())
    assert abs(sum(drift) / len(drift)) < 2.0  # unbiased: the mean of 65536 roundings is ~0 +- 0.3


# ---- checkpoints -----------------------------------------------------------------------------------
@pytest.mark.parametrize("placement", ["resident", "streamed"])
@pytest.mark.parametrize("saved, loaded", [("split", "fp32"), ("fp32", "split"), ("split", "split8"),
                                           ("split8", "split"), ("fp32", "split8"), ("split8", "fp32")])
def test_a_checkpoint_moves_between_master_precisions(placement, saved, loaded):
    """Saved at one master precision, loaded (model first) with the group's precision changed in the
    dict: the run continues bit for bit as the saved optimizer does with its own group changed at
    that point (the same conversion reached through opt.param_groups), and, where the new precision
    loses nothing of the old (into fp32 or split, or from fp32 into split), as the run that never
    changed; into split8, within its rounding of that run."""
    params, opt, _ = trained("AdamW fp32", saved, placement)
    model_state = [p.detach().clone() for p in params]
    checkpoint = copy.deepcopy(opt.state_dict())  # the live dict holds the states the next steps change
    unchanged = copy.deepcopy(opt)
    unchanged_params = [p for g in unchanged.param_groups for p in g["params"]]
    opt.param_groups[0]["master_precision"] = loaded  # converted at the next step
    want_params, _, want_states = trained("AdamW fp32", loaded, placement, params=params, opt=opt)
    plain_params, _, plain_states = trained("AdamW fp32", saved, placement, params=unchanged_params, opt=unchanged)

    resumed = make_params(SHAPES, torch.bfloat16, seed=9)  # other values: the model's load must bring them back
    cls, options, _ = OPTIMIZERS["AdamW fp32"]
    with device_of(placement), torch.no_grad():
        for p, value in zip(resumed, model_state):
            p.copy_(value)
    new_opt = cls(resumed, lr=1e-2, backend="cpu", master_precision=saved, **where(placement, 12), **options)
    checkpoint["param_groups"][0]["master_precision"] = loaded
    new_opt.load_state_dict(checkpoint)
    assert new_opt.param_groups[0]["master_precision"] == loaded
    kept = {"fp32": ("master_param", torch.float32), "split": ("master_low_bits", torch.int16),
            "split8": ("master_low_byte", torch.uint8)}[loaded]
    assert all(new_opt.state[p][kept[0]].dtype == kept[1] for p in resumed)
    got_params, _, got_states = trained("AdamW fp32", loaded, placement, params=resumed, opt=new_opt)
    for t in range(len(SHAPES)):
        got_master = master_of(got_states[t], got_params[t])
        assert_bitwise_equal(got_params[t].detach(), want_params[t].detach(), f"parameter {t}")
        assert_bitwise_equal(got_master, master_of(want_states[t], want_params[t]), f"master {t}")
        assert_bitwise_equal(got_states[t]["exp_avg"], want_states[t]["exp_avg"], f"exp_avg {t}")
        plain_master = master_of(plain_states[t], plain_params[t])
        units = (got_master.view(torch.int32).to(torch.int64) - plain_master.view(torch.int32).to(torch.int64)).abs()
        if loaded == "split8" and saved != "split8":
            # the conversion rounds the offset to the 8-bit grid (128 units), each step rounds within
            # 256, and the runs' updates differ only through weight decay
            assert 0 < units.max() < 128 + STEPS * 256, f"master {t}"
        elif saved != "split8":
            assert units.max() == 0, f"master {t}"


def test_fp32_state_dict_holds_the_whole_master_and_loads_into_torch():
    params, opt, states = trained("AdamW fp32", "split", "streamed")
    want_params, _, want_states = trained("AdamW fp32", "fp32", "streamed")
    state_dict = opt.fp32_state_dict()
    assert {g["master_precision"] for g in state_dict["param_groups"]} == {"fp32"}
    for t in range(len(SHAPES)):
        saved = state_dict["state"][t]
        assert "master_low_bits" not in saved and "master_low_byte" not in saved
        assert_bitwise_equal(saved["master_param"], want_states[t]["master_param"], f"master {t}")
    fp32_opt = fusedoff.AdamW(make_params(SHAPES, torch.bfloat16), lr=1e-2, master_precision="fp32")
    fp32_opt.load_state_dict(state_dict)
    assert fp32_opt.param_groups[0]["master_precision"] == "fp32"


# ---- refusals and writes ---------------------------------------------------------------------------
def test_refusals_come_before_anything_changes():
    with pytest.raises(ValueError, match="master_precision must be one of"):
        fusedoff.AdamW(make_params(SHAPES, torch.bfloat16), master_precision="bf16")
    with pytest.raises(ValueError, match="master_weights=False"):
        fusedoff.AdamW(make_params(SHAPES, torch.bfloat16), master_precision="split", master_weights=False)
    with pytest.raises(ValueError, match="master_precision must be one of"):
        fusedoff.Apollo(make_params(SHAPES, torch.bfloat16), lr=0.1, master_precision="split16")
    half = [torch.nn.Parameter(torch.randn(8).to(torch.float16))]
    opt = fusedoff.AdamW(half, master_precision="split", backend="cpu")
    half[0].grad = torch.ones_like(half[0])
    before = half[0].detach().clone()
    with pytest.raises(ValueError, match="cannot be split exactly"):
        opt.step()
    assert torch.equal(half[0].detach(), before) and not opt.state
    fp32 = [torch.nn.Parameter(torch.randn(8))]  # no master to split: the option changes nothing
    opt = fusedoff.AdamW(fp32, master_precision="split", backend="cpu")
    fp32[0].grad = torch.ones_like(fp32[0])
    opt.step()
    assert "master_low_bits" not in opt.state[fp32[0]] and "master_param" not in opt.state[fp32[0]]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_written_parameter_carries_the_master_low_bits(placement):
    """A write between steps: the next step starts from the written bf16 value plus the master's old
    low bits (the oracle: an fp32-master run whose master is assigned that value through opt.state);
    the same bits written back keep everything exact (the oracle: the run without the write)."""
    def run(write, assign=None, precision="split"):
        params, opt, states = trained("AdamW fp32", precision, placement, steps=2)
        low = states[2].get("master_low_bits")
        with device_of(placement), torch.no_grad():
            value = write(params[2])
            if value is not None:
                params[2].copy_(value)
            if assign is not None:
                opt.state[params[2]]["master_param"] = masters.join(params[2].detach(), assign)
        return trained("AdamW fp32", precision, placement, steps=1, params=params, opt=opt), low

    (split_params, _, split_states), low = run(lambda p: (p.float() * 2 + 1).to(torch.bfloat16))
    (want_params, _, want_states), _ = run(lambda p: (p.float() * 2 + 1).to(torch.bfloat16), assign=low,
                                           precision="fp32")
    assert_bitwise_equal(split_params[2].detach(), want_params[2].detach(), "the written parameter")
    assert_bitwise_equal(master_of(split_states[2], split_params[2]), want_states[2]["master_param"], "its master")

    (same_params, _, same_states), _ = run(lambda p: p.detach().clone())
    (plain_params, _, plain_states), _ = run(lambda p: None)
    for t in range(len(SHAPES)):
        assert_bitwise_equal(same_params[t].detach(), plain_params[t].detach(), f"parameter {t}")
        assert_bitwise_equal(same_states[t]["master_low_bits"], plain_states[t]["master_low_bits"], f"master {t}")


def test_the_quality_benchmark_trains_split_exactly_as_fp32(tmp_path):
    """benchmarks/quality_master_precision.py, a few steps: the split run's losses are the fp32 run's."""
    import csv
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "quality_master_precision.py"
    spec = importlib.util.spec_from_file_location("quality_master_precision", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--steps", "6", "--window", "3", "--out", str(tmp_path)])
    rows = {r["optimizer"]: r for r in csv.DictReader(open(tmp_path / "quality_master_precision.csv"))
            if r.get("optimizer")}
    assert rows["fusedoff_split"]["same_losses_as_fusedoff_fp32"] == "True"
    assert float(rows["fusedoff_split"]["master_bytes_per_param"]) == 2.0
    assert float(rows["fusedoff_split8"]["master_bytes_per_param"]) == 1.0
    assert float(rows["fusedoff_fp32"]["master_bytes_per_param"]) == 4.0


def test_a_dcp_checkpoint_of_one_split_precision_loads_into_the_other(tmp_path):
    """torch.distributed.checkpoint loads by name into the destination's tensors (copying across
    dtypes). Before issue 31 split's int16 low bits and split8's uint8 byte were saved under names of
    their own, and loading one into the other failed as a missing key; a state dict for DCP now holds
    the whole fp32 master (see [note: distributed checkpoints across forms] in
    fusedoff/optim/checkpoint.py), which the destination splits again in the checkpoint's precision:
    the saved low bits, exactly."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    params, opt, saved = trained("AdamW fp32", "split", "resident")
    model_sd, optim_sd = get_state_dict(torch.nn.ParameterList(params), opt)
    assert {k for k in optim_sd["state"]["0"] if k.startswith("master")} == {"master_param"}
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path))
    fresh = [torch.nn.Parameter(p.detach() + 1) for p in params]
    other = fusedoff.AdamW(fresh, lr=1e-2, backend="cpu", master_precision="split8")
    model_sd, other_sd = get_state_dict(torch.nn.ParameterList(fresh), other)
    state = {"model": model_sd, "optim": other_sd}
    dcp.load(state, checkpoint_id=str(tmp_path))
    set_state_dict(torch.nn.ParameterList(fresh), other, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    assert {g["master_precision"] for g in other.param_groups} == {"split"}
    for t, p in enumerate(fresh):
        assert_bitwise_equal(p.detach(), params[t].detach(), f"parameter {t}")
        assert_bitwise_equal(other.state[p]["master_low_bits"], saved[t]["master_low_bits"], f"master {t}")
