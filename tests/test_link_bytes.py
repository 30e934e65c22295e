"""The bytes a streamed step copies each way, counted by the runtime seam, against benchmarks/traffic.py.

`memory_stats()` reports what the engine's copies moved (Runtime.copy_to_device/copy_to_host count
them as they are issued, whatever the runtime). traffic.py re-derives the same figures from the
layout rule and each optimizer's passes, independently of the engine; here they must agree for every
state precision, master precision (traffic.MASTER_BYTES_PER_ELEMENT: a new entry there is a new
case here), parameter dtype, optimizer and placement, on the stream simulator, and on the other
runtimes for a few cases. The placement under a budget is re-derived here too (greedy, in order).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import fusedoff
from benchmarks import traffic
from fusedoff.offload import runtimes
from fusedoff.offload.runtime import HostRuntime
from fusedoff.testing.simulator import SimulatedRuntime
from fusedoff.testing.timed import TimedRuntime
from tests.helpers import make_params

# Tensors spanning 32-element chunks and sharing them, a 0-d one, odd lengths (partial 8-bit blocks).
SHAPES = [(33, 5), (7,), (300,), (16,), (), (40,)]
CHUNK = 32
STEPS = 3

# (optimizer, its options, traffic.py's Apollo config or None, amsgrad)
OPTIMIZERS = {
    "AdamW": (fusedoff.AdamW, dict(lr=1e-2, weight_decay=0.1), None, False),
    "Adam": (fusedoff.Adam, dict(lr=1e-2), None, False),
    "Adam-amsgrad": (fusedoff.Adam, dict(lr=1e-2, amsgrad=True), None, True),
    "Apollo-constant-L2": (fusedoff.Apollo, dict(lr=1e-2, warmup=2, weight_decay=0.01, rebound="constant",
                                                 weight_decay_type="L2"), "constant_L2", False),
    "Apollo-belief-stable": (fusedoff.Apollo, dict(lr=1e-2, warmup=2, weight_decay=0.01, rebound="belief",
                                                   weight_decay_type="stable"), "belief_stable", False),
}
# Parameter dtype and master precision (None: no master weights; fp32 parameters never keep one).
MASTERS = [(torch.float32, None), (torch.bfloat16, None), (torch.float16, None),
           *((dtype, master) for master in traffic.MASTER_BYTES_PER_ELEMENT
             for dtype in (torch.bfloat16, torch.float16) if master == "fp32" or dtype == torch.bfloat16)]
# (split masters need bf16 parameters: fp16 ones are refused, see tests/test_split_master.py)
MASTER_IDS = [f"{str(dtype).removeprefix('torch.')}-{master or 'no'}-master" for dtype, master in MASTERS]
CASES = [(name, state) for name, (_, _, config, amsgrad) in OPTIMIZERS.items()
         for state in (("fp32",) if config or amsgrad else tuple(traffic.STATE_PRECISIONS))]
CASE_IDS = [f"{name}-{state}-states" for name, state in CASES]
# The device budget: none, or half the bytes of every tensor's states (some tensors fit, some stream).
PLACEMENTS = {"streamed": None, "mixed": 0.5}


def give_grads(params, gen):
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 0.1).to(p.device, p.dtype)


def make_optimizer(name, state, params, dtype, master, **placement):
    cls, options, _, _ = OPTIMIZERS[name]
    options = dict(options, master_weights=master is not None, backend="auto", **placement)
    if state != "fp32":
        options["state_precision"] = state
    if master not in (None, "fp32"):  # the default master precision is not passed: the option may not exist
        options["master_precision"] = master
    return cls(params, **options)


def model_precision(dtype, master) -> traffic.Precision:
    size = torch.finfo(dtype).bits // 8
    return traffic.Precision(f"{dtype}-{master}", param=size, grad=size, master=master is not None,
                             master_precision=master or "fp32")


def model_placement(name, state, precision, fraction) -> tuple[int | None, list[int]]:
    """The device budget for `fraction` of every tensor's state bytes (None: no budget), and the element
    counts of the tensors whose states stream: each tensor's states (and master) stay on the device
    while they fit in what is left of the budget, in order."""
    _, _, config, amsgrad = OPTIMIZERS[name]
    stored = traffic.stored_states("apollo" if config else "adamw", precision, amsgrad,
                                   traffic.STATE_PRECISIONS[state]).values()
    sizes = [sum(nbytes * -(-math.prod(shape) // block) for nbytes, block in stored) for shape in SHAPES]
    budget = None if fraction is None else int(fraction * sum(sizes))
    streamed, left = [], budget
    for shape, size in zip(SHAPES, sizes):
        n = math.prod(shape)
        if left is not None and size <= left:
            left -= size
        else:
            streamed.append(n)
    return budget, streamed


def model_link(name, state, precision, numels) -> tuple[int, int]:
    _, _, config, amsgrad = OPTIMIZERS[name]
    if config:
        return traffic.apollo_stream_link(numels, CHUNK, precision, config)
    return traffic.adam_stream_link(numels, CHUNK, precision, amsgrad, traffic.STATE_PRECISIONS[state])


def model_host(name, state, precision, numels) -> int:
    _, _, config, amsgrad = OPTIMIZERS[name]
    return traffic.stream_host_bytes("apollo" if config else "adamw", numels, precision, amsgrad,
                                     traffic.STATE_PRECISIONS[state])


def run_and_check(name, state, dtype, master, fraction, device="cpu"):
    """Steps a fresh optimizer STEPS times; after each step its counts must be the model's."""
    precision = model_precision(dtype, master)
    budget, numels = model_placement(name, state, precision, fraction)
    h2d, d2h = model_link(name, state, precision, numels)
    assert numels and h2d > 0 and d2h > 0  # something streams (and with a budget, something stays: below)
    params = make_params(SHAPES, dtype, device=device)
    placement = dict(offload="stream", chunk_size=CHUNK) | ({} if budget is None else dict(device_budget=budget))
    opt = make_optimizer(name, state, params, dtype, master, **placement)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, STEPS + 1):
        give_grads(params, gen)
        opt.step()
        stats = opt.memory_stats()
        assert stats["link_bytes_last_step"] == {"to_device": h2d, "to_host": d2h}, step
        assert stats["link_bytes_total"] == {"to_device": step * h2d, "to_host": step * d2h}
        assert stats["streamed_params_last_step"] == stats["streamed_params"] == sum(numels)
        assert stats["link_bytes_per_param_last_step"] == {"to_device": h2d / sum(numels),
                                                           "to_host": d2h / sum(numels)}
    assert stats["host_bytes"] == model_host(name, state, precision, numels)
    assert stats["host_bytes_per_param"] == stats["host_bytes"] / sum(numels)
    if budget is not None:
        assert 0 < stats["resident_bytes"] <= budget
    return stats


def simulator():
    sims = []

    def factory(device):
        sims.append(SimulatedRuntime(device, seed=len(sims)))
        return sims[-1]

    return sims, factory


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("dtype,master", MASTERS, ids=MASTER_IDS)
@pytest.mark.parametrize("name,state", CASES, ids=CASE_IDS)
def test_simulated_step_copies_the_bytes_traffic_py_predicts(name, state, dtype, master, placement):
    sims, factory = simulator()
    with runtimes.simulate(factory):
        run_and_check(name, state, dtype, master, PLACEMENTS[placement])
    assert len(sims) == 1 and sims[0].ops_run > 0  # the simulator ran the copies it counted


@pytest.mark.parametrize("runtime", ["loopback", "timed"])
@pytest.mark.parametrize("name,state", [("AdamW", "8bit"), ("Apollo-constant-L2", "fp32")])
def test_every_runtime_counts_alike(runtime, name, state):
    """The counting is the Runtime base class's: the host loopback and the timed runtime count what the
    simulator counts (and CUDA too: test_cuda_step_copies_the_bytes_traffic_py_predicts)."""
    made = []

    def factory(device):
        made.append(HostRuntime(device) if runtime == "loopback" else TimedRuntime(device))
        return made[-1]

    with runtimes.simulate(factory):
        run_and_check(name, state, torch.bfloat16, "fp32", PLACEMENTS["mixed"])
    assert [type(rt) for rt in made] == [HostRuntime if runtime == "loopback" else TimedRuntime]


def test_resident_states_copy_nothing_and_counts_survive_replacing():
    params = make_params(SHAPES, torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    opt = fusedoff.AdamW(params, offload="none")
    give_grads(params, gen)
    opt.step()
    stats = opt.memory_stats()
    assert stats["link_bytes_total"] == stats["link_bytes_last_step"] == {"to_device": 0, "to_host": 0}
    assert stats["link_bytes_per_param_last_step"] is None and stats["host_bytes_per_param"] is None

    opt = fusedoff.AdamW(params, offload="stream", chunk_size=CHUNK)
    precision = model_precision(torch.bfloat16, "fp32")
    h2d, d2h = traffic.adam_stream_link([math.prod(s) for s in SHAPES], CHUNK, precision)
    give_grads(params, gen)
    opt.step()
    opt.load_state_dict(opt.state_dict())  # the engine places every state afresh
    assert opt.memory_stats()["link_bytes_total"] == {"to_device": h2d, "to_host": d2h}
    give_grads(params, gen)
    opt.step()
    # A loaded master is checked against its parameter by the kernels, on the device: no parameter
    # crosses the link (see [note: every write is seen] in csrc/include/fusedoff/master.h).
    opt.set_device_budget(10**9)  # everything resident from the next step: it copies nothing
    assert opt.memory_stats()["link_bytes_last_step"] == {"to_device": h2d, "to_host": d2h}
    give_grads(params, gen)
    opt.step()
    stats = opt.memory_stats()
    assert stats["link_bytes_last_step"] == {"to_device": 0, "to_host": 0}
    assert stats["link_bytes_total"] == {"to_device": 2 * h2d, "to_host": 2 * d2h}


def test_a_step_of_some_tensors_counts_their_chunks_only():
    """Tensors without a gradient sit the step out: only chunks holding a stepping tensor move."""
    params = [torch.nn.Parameter(torch.randn(n)) for n in (64, 64, 64)]  # one 32-element chunk pair each
    opt = fusedoff.AdamW(params, offload="stream", chunk_size=CHUNK)
    params[1].grad = torch.randn(64)
    opt.step()
    stats = opt.memory_stats()
    assert stats["link_bytes_last_step"] == {"to_device": 2 * 4 * 64, "to_host": 2 * 4 * 64}  # two fp32 moments
    assert stats["streamed_params_last_step"] == 64 and stats["streamed_params"] == 3 * 64


@pytest.mark.cuda
@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("name,state", CASES, ids=CASE_IDS)
def test_cuda_step_copies_the_bytes_traffic_py_predicts(name, state, placement):
    run_and_check(name, state, torch.bfloat16, "fp32", PLACEMENTS[placement], device="cuda")


def test_readme_table_of_bytes_per_parameter_is_traffic_pys():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    begin, end = readme.index(traffic.README_TABLE_BEGIN), readme.index(traffic.README_TABLE_END)
    assert readme[begin:end + len(traffic.README_TABLE_END)] == traffic.bytes_per_parameter_markdown()


def test_bytes_per_parameter_rows_by_hand():
    """The issue's figures for AdamW on bf16 parameters, each way: fp32 states and an fp32 master 12,
    bf16 states 8, 8-bit states 2 x (1 + 4/256) + 4; and Apollo's reduction pass copying in only."""
    rows = {(label, state, master): figures for label, state, master, *figures in traffic.bytes_per_parameter_rows()}
    assert rows["AdamW", "fp32", "fp32"] == [12, 12, 12, 12]
    assert rows["AdamW", "bf16", "fp32"] == [8, 8, 8, 8]
    assert rows["AdamW", "8bit", "fp32"] == [2 * (1 + 4 / 256) + 4] * 4
    assert rows["AdamW", "8bit", "none"] == [2 * (1 + 4 / 256)] * 4
    # split masters (issue 22): 10 (fp32 states, split), 6 (bf16, split), 4.03 (8-bit, split), 3.03 (8-bit, split8)
    assert rows["AdamW", "fp32", "split"] == [10] * 4
    assert rows["AdamW", "bf16", "split"] == [6] * 4
    assert rows["AdamW", "8bit", "split"] == [2 * (1 + 4 / 256) + 2] * 4
    assert rows["AdamW", "8bit", "split8"] == [2 * (1 + 4 / 256) + 1] * 4
    # constant + L2, fp32 master: reduce copies m, B, d and the master in (16), full all in and out (16)
    assert rows["Apollo, constant + L2", "fp32", "fp32"] == [16, 32, 16, 16]
    # belief + stable, no master: reduce in 12; moments in 12, m and B out 8; finish m, B in 8 + d in 4, d out 4
    assert rows["Apollo, belief + stable", "fp32", "none"] == [12, 36, 12, 12]
    masters = {master for _, _, master in rows}
    assert masters == {"none", *traffic.MASTER_BYTES_PER_ELEMENT}


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_a_parameter_written_between_steps_costs_nothing_over_the_link(placement):
    """A streamed master follows its parameter: after an outside write the next step's kernels read
    the parameter beside the master on the device, and nothing more crosses the link."""
    precision = model_precision(torch.bfloat16, "fp32")
    budget, numels = model_placement("AdamW", "fp32", precision, PLACEMENTS[placement])
    h2d, d2h = model_link("AdamW", "fp32", precision, numels)
    params = make_params(SHAPES, torch.bfloat16)
    written = params[2]  # 300 elements: streamed in both placements
    sims, factory = simulator()
    gen = torch.Generator().manual_seed(1)
    with runtimes.simulate(factory):
        opt = make_optimizer("AdamW", "fp32", params, torch.bfloat16, "fp32", offload="stream", chunk_size=CHUNK,
                             **({} if budget is None else dict(device_budget=budget)))
        counted = []
        for step in range(3):
            give_grads(params, gen)
            if step == 1:
                with torch.no_grad():
                    written.mul_(0.5)
            opt.step()
            counted.append(opt.memory_stats()["link_bytes_last_step"])
    assert math.prod(written.shape) in numels
    assert counted == [{"to_device": h2d, "to_host": d2h}] * 3


@pytest.mark.parametrize("offload", ["none", "stream"])
@pytest.mark.parametrize("precision, master", [("fp32", "fp32"), ("bf16_master", "fp32"), ("bf16_master", "split"),
                                               ("bf16_master", "split8")])
@pytest.mark.parametrize("state", list(traffic.STATE_PRECISIONS))
def test_adam_update_bytes_match_the_tensors_the_fused_call_gets(monkeypatch, state, precision, master, offload):
    """traffic.py's memory bytes of the update (the GPU suite's memory bound) against the tensors the
    optimizer hands its fused op (whole tensors, or pieces of chunk buffers): the grad read; every
    state, scale and master read and written; the param written, and read too where it is the fp32
    weight or the upper half of a split master."""
    import dataclasses

    from fusedoff import ops

    numels = [7, 300, 1000, 4097]  # partial 8-bit blocks; with chunks of 256, tensors spanning chunks
    counted = {"bytes": 0}

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    def counting(name, num_state_lists):
        original = getattr(ops, name)

        def spy(params, grads, *rest, **kwargs):
            states, masters = rest[:num_state_lists], rest[num_state_lists]
            counted["bytes"] += (nbytes(grads) + 2 * nbytes(t for ts in states for t in ts) + 2 * nbytes(masters)
                                 + nbytes(params) * (1 if masters and masters[0].is_floating_point() else 2))
            return original(params, grads, *rest, **kwargs)

        monkeypatch.setattr(ops, name, spy)

    counting("adam_step_", 3)  # exp_avgs, exp_avg_sqs, max_exp_avg_sqs, then the masters
    counting("adam_compressed_step_", 4)  # codes (or bf16) of both moments, both scales, then the masters
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    params = [torch.nn.Parameter(torch.randn(n).to(dtype)) for n in numels]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = fusedoff.AdamW(params, offload=offload, chunk_size=256, backend="torch", state_precision=state,
                         master_precision=master)
    opt.step()
    model = dataclasses.replace(traffic.PRECISIONS[precision], master_precision=master)
    states = traffic.STATE_PRECISIONS[state]
    assert counted["bytes"] == traffic.adam_tensors_update_bytes(numels, model, state=states)
    assert traffic.fusedoff_traffic("adamw", model, offload, numels, 256, "cpu", state=states).memory == counted["bytes"]
