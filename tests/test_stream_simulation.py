"""The engine's device side, run in CI: real optimizer classes through the stream simulator, launching
the host kernels or the CUDA kernels on the host (backend 'cuda_emulated').

Each case trains with the simulator standing in for a GPU (fusedoff/testing/simulator.py: queued
side streams in a seeded random interleaving, copies landing late, a happens-before race checker)
and compares every parameter and state, bit for bit, with the same optimizer run through the
synchronous host loopback (and, for the elementwise AdamW/Adam, with the resident run). After each
step the test does what training code does next on the main stream: the forward reads the
parameters, zero_grad writes the gradients in place; the checker must find every such access
ordered after the step's work.

`python tools/stream_mutations.py` removes each wait and event record of the engine in turn and
checks that these tests fail.
"""

from __future__ import annotations

import copy

import pytest
import torch

import fusedoff
from fusedoff.offload import runtimes
from fusedoff.testing.simulator import RaceError, SimulatedRuntime
from tests.helpers import assert_bitwise_equal, make_params

SHAPES = [(33, 5), (7,), (300,), (16,), (), (40,)]  # tensors spanning 32-element chunks and sharing them
SEEDS = range(6)
ADAM = dict(lr=1e-2, weight_decay=0.1)
APOLLO = dict(lr=1e-2, warmup=2, weight_decay=0.01)


def training_run(make_opt, dtype, *, steps=5, sim=None, scaler_skip=None, clip_at=None, load_at=None,
          user_stream_at=None, read_state=True, device="cpu"):
    """Trains, doing between steps what training code does; returns the parameters and every
    state as read right after each step."""
    params = make_params(SHAPES, dtype, device=device)
    groups = [{"params": params[:3]}, {"params": params[3:], "lr": 3e-3}]  # two buckets share the pipeline
    opt = make_opt(groups)
    gen = torch.Generator().manual_seed(1)
    seen = []
    for step in range(steps):
        for i, p in enumerate(params):
            grad = (torch.randn(p.shape, generator=gen) * 0.1).to(device, dtype)
            if p.grad is None or i % 2:
                p.grad = grad
            else:
                p.grad.copy_(grad)  # written in place on the main stream
            if sim is not None:
                sim.main_access([p.grad], write=True, what="backward writes a gradient")
        if step == scaler_skip:  # GradScaler found an inf: the step changes nothing
            opt.grad_scale, opt.found_inf = torch.full((), 8.0, device=device), torch.ones((), device=device)
        if step == clip_at:
            opt.clip_grad_norm_(0.05)
        if step == user_stream_at and sim is not None:
            with sim.user_stream():
                opt.step()
                after_step(params, sim)
        elif step == user_stream_at and device != "cpu":  # the same on a real GPU
            user = torch.cuda.Stream(device)
            user.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(user):
                opt.step()
            torch.cuda.current_stream(device).wait_stream(user)
        else:
            opt.step()
            after_step(params, sim)
        if step == scaler_skip:
            del opt.grad_scale, opt.found_inf
        if read_state:  # right after the step, no synchronisation of ours
            seen.append([{k: v.clone() for k, v in opt.state[p].items()} for p in params])
        if step == load_at:
            saved = copy.deepcopy(opt.state_dict())  # right after step(): must wait for the copies back
            opt.load_state_dict(saved)
        opt.zero_grad(set_to_none=False)
        if sim is not None:
            sim.main_access([p.grad for p in params], write=True, what="zero_grad")
    return [p.detach().clone() for p in params], seen


def after_step(params, sim):
    if sim is not None:  # the next forward reads the parameters on the main stream
        sim.main_access([p.detach() for p in params], write=False, what="the forward reads a parameter")


def simulated(seed, make_opt, dtype, **kwargs):
    sims = []

    def factory(device):
        sims.append(SimulatedRuntime(device, seed=seed + 1000 * len(sims)))
        return sims[-1]

    with runtimes.simulate(factory):
        result = training_run(make_opt, dtype, sim=_LatestSim(sims), **kwargs)
    assert sims and all(sim.ops_run > 0 and sim.checked > 0 for sim in sims)  # the device side did run
    return result


class _LatestSim:
    """The simulator of the optimizer's current engine: made at its first step, and again when
    load_state_dict places every state afresh (before the first one there is nothing to record)."""

    def __init__(self, sims):
        self.sims = sims

    def main_access(self, *args, **kwargs):
        if self.sims:
            self.sims[-1].main_access(*args, **kwargs)

    def user_stream(self):
        return self.sims[-1].user_stream()


CASES = {
    "AdamW-fp32": (fusedoff.AdamW, dict(ADAM, amsgrad=True), torch.float32),
    "AdamW-bf16-master": (fusedoff.AdamW, ADAM, torch.bfloat16),
    "Adam-fp32": (fusedoff.Adam, ADAM, torch.float32),
    # Compressed states: 8-bit blocks of 256 (the plan's chunks rounded up to whole blocks) and
    # bf16 with stochastic rounding, whose random indices must follow a tensor across chunks.
    "AdamW-8bit-states-bf16-master": (fusedoff.AdamW, dict(ADAM, state_precision="8bit"), torch.bfloat16),
    "Adam-bf16-states": (fusedoff.Adam, dict(ADAM, state_precision="bf16", seed=7), torch.float32),
    "Apollo-constant-L2": (fusedoff.Apollo, dict(APOLLO, rebound="constant", weight_decay_type="L2"), torch.float32),
    "Apollo-belief-stable-bf16": (fusedoff.Apollo, dict(APOLLO, rebound="belief", weight_decay_type="stable"),
                                  torch.bfloat16),
    "Apollo-belief-decoupled": (fusedoff.Apollo, dict(APOLLO, rebound="belief", weight_decay_type="decoupled"),
                                torch.float32),
}
PLACEMENTS = {
    "streamed": dict(offload="stream", chunk_size=32),
    # 2000 bytes: some tensors of each case stay resident (8-16 bytes of state per element), the rest stream.
    "mixed": dict(offload="stream", chunk_size=32, device_budget=2000),
}


# The kernels the simulated streams launch: the host kernels, and the CUDA kernels themselves run
# by the CUDA emulation (csrc/emulation), so that the whole device path but torch.cuda runs here.
KERNELS = ["cpu", pytest.param("cuda_emulated", marks=pytest.mark.emulated)]


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("case", list(CASES))
def test_simulated_device_equals_the_host_loopback(case, placement, backend):
    cls, kwargs, dtype = CASES[case]

    def make(groups):
        return cls(groups, **kwargs, **PLACEMENTS[placement], backend=backend)

    extras = dict(scaler_skip=1, clip_at=2, load_at=3, user_stream_at=4)
    want = training_run(make, dtype, **extras)
    if cls is not fusedoff.Apollo:  # elementwise: streaming changes nothing at all
        resident = training_run(lambda groups: cls(groups, **kwargs, offload="none", backend=backend), dtype, **extras)
        assert_bitwise_equal(want, resident)
    for seed in SEEDS:
        assert_bitwise_equal(simulated(seed, make, dtype, **extras), want)


@pytest.mark.cuda
@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_runtime_runs_the_same_cases(case, placement):
    """The simulated cases on a real GPU: streamed and mixed runs against the resident run on the
    same device (bit for bit for the elementwise Adam; Apollo to fp32 reduction order)."""
    cls, kwargs, dtype = CASES[case]
    extras = dict(scaler_skip=1, clip_at=2, load_at=3, user_stream_at=4, device="cuda")
    got = training_run(lambda groups: cls(groups, **kwargs, **PLACEMENTS[placement], backend="cuda"), dtype, **extras)
    want = training_run(lambda groups: cls(groups, **kwargs, offload="none", backend="cuda"), dtype, **extras)
    if cls is not fusedoff.Apollo:
        assert_bitwise_equal(got, want)
        return
    for a, b in zip(got[0], want[0]):  # the masters differ in the order of their partial sums only
        torch.testing.assert_close(a.float(), b.float(), rtol=torch.finfo(dtype).eps, atol=1e-6)
    for g, w in zip(got[1], want[1]):
        for gs, ws in zip(g, w):
            for key in ws:
                torch.testing.assert_close(gs[key].float(), ws[key].float(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_pass_starting_at_a_later_chunk_waits_for_the_stores_previous_pass(seed):
    """Two 32-element tensors, one chunk each: when only the second steps, its chunk goes to buffer
    set 0, whose last copy back was the first chunk's, not its own: the copy in must wait for the
    store's previous pass, not only for the buffer set."""
    def make(groups):
        return fusedoff.AdamW([p for g in groups for p in g["params"]], lr=1e-2, offload="stream", chunk_size=32)

    def run(sim_factory=None):
        params = [torch.nn.Parameter(torch.full((32,), float(i + 1))) for i in range(2)]
        opt = make([{"params": params}])
        for step in range(6):
            params[0].grad = torch.full((32,), 0.1) if step % 2 == 0 else None  # sits out every other step
            params[1].grad = torch.full((32,), -0.2 * (step + 1))
            opt.step()
        return [p.detach().clone() for p in params], [opt.state[p]["exp_avg"].clone() for p in params]

    want = run()
    sims = []
    with runtimes.simulate(lambda device: sims.append(SimulatedRuntime(device, seed=seed)) or sims[-1]):
        got = run()
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("seed", SEEDS)
def test_host_writes_into_the_store_wait_for_the_copies_back(seed):
    """Two 16-element tensors share a chunk. The second steps for the first time (its states are
    created in host memory) and the first has its state deleted (created afresh), each right after
    a step whose copy back of that chunk may still be queued: the host must wait for it, or the
    late copy overwrites the new states with the chunk's old contents."""
    def run():
        params = [torch.nn.Parameter(torch.full((16,), float(i + 1), dtype=torch.bfloat16)) for i in range(2)]
        opt = fusedoff.AdamW(params, lr=1e-2, offload="stream", chunk_size=32)
        for step in range(5):
            params[0].grad = torch.full((16,), 0.1 * (step + 1), dtype=torch.bfloat16)
            params[1].grad = torch.full((16,), -0.2, dtype=torch.bfloat16) if step >= 2 else None
            opt.step()
            if step == 3:
                del opt.state[params[0]]  # no read of the state: nothing has waited for the copies back
        return [p.detach().clone() for p in params] + [opt.state[p][k].clone() for p in params
                                                       for k in ("exp_avg", "master_param")]

    want = run()
    sims = []
    with runtimes.simulate(lambda device: sims.append(SimulatedRuntime(device, seed=seed)) or sims[-1]):
        got = run()
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_auto_decides_the_budget_from_the_simulated_device_memory():
    needed = 8 * sum(torch.Size(s).numel() for s in SHAPES)  # AdamW fp32: two states

    def factory(device):
        # 90% of the total, less the peak, leaves room for all but 100 bytes of the states.
        return SimulatedRuntime(device, seed=0, total_memory=100_000, peak_memory=90_000 - needed + 100)

    with runtimes.simulate(factory):
        params = make_params(SHAPES)
        opt = fusedoff.AdamW(params, chunk_size=32)  # offload="auto"
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        stats = opt.memory_stats()
    # Not everything fits: the budget is what is left after the streaming buffers.
    buffers = 2 * 2 * 32 * 4
    assert stats["device_budget"] == needed - 100 - buffers
    assert 0 < stats["resident_bytes"] <= stats["device_budget"] and stats["streamed_bytes"] > 0
    assert stats["host_pinned"]


def test_a_streamed_step_under_graph_capture_is_refused_before_anything_changes():
    with runtimes.simulate(lambda device: SimulatedRuntime(device, capturing=True)):
        params = make_params(SHAPES)
        opt = fusedoff.AdamW(params, offload="stream", chunk_size=32)
        for p in params:
            p.grad = torch.ones_like(p)
        before = [p.detach().clone() for p in params]
        with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
            opt.step()
        assert all(torch.equal(p, b) for p, b in zip(params, before))
        assert len(opt.state) == 0  # not even the fresh states the refused step had made
        # Every state resident: nothing streams, and the step may be captured.
        resident = fusedoff.AdamW(params, offload="stream", chunk_size=32, device_budget=10**6)
        resident.step()
        assert float(resident.state[params[0]]["step"]) == 1


def test_pinning_refused_falls_back_to_pageable_memory_with_a_warning():
    def make(groups):
        return fusedoff.AdamW(groups, **ADAM, offload="stream", chunk_size=32)

    want = training_run(make, torch.float32, steps=3)
    with runtimes.simulate(lambda device: SimulatedRuntime(device, pin_fails=True)):
        with pytest.warns(UserWarning, match="could not pin host memory"):
            got = training_run(make, torch.float32, steps=3)
    assert_bitwise_equal(got, want)


def test_the_race_checker_reports_an_unordered_pair_and_accepts_an_ordered_one():
    sim = SimulatedRuntime(torch.device("cpu"), seed=0)
    a, b = sim.new_stream(), sim.new_stream()
    buffer, host = torch.zeros(64), torch.ones(64)
    sim.copy(a, buffer, host)
    with pytest.raises(RaceError, match=r"write by 'copy of \(64,\) on side stream 1'.*read by 'kernel"):
        sim.launch(b, lambda: None, reads=[buffer[16:32]])
    sim.wait_event(b, sim.record(a))
    sim.launch(b, lambda: None, reads=[buffer[16:32]])  # ordered now
    sim.drain()
    assert torch.equal(buffer, host)
    # The host reading what a side stream writes needs a synchronisation.
    sim.copy(a, host, buffer)
    with pytest.raises(RaceError, match="host"):
        sim.host_access([host], write=False)


def test_copies_land_late_but_before_their_event_completes():
    landed_early = 0
    for seed in range(20):
        sim = SimulatedRuntime(torch.device("cpu"), seed=seed)
        stream = sim.new_stream()
        dst, src = torch.zeros(4), torch.arange(4.0)
        sim.copy(stream, dst, src)
        landed_early += int(torch.equal(dst, src))
        event = sim.record(stream)
        sim.synchronize(event)
        assert torch.equal(dst, src)
    assert 0 < landed_early < 20  # sometimes visible at once, sometimes only later
