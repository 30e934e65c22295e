"""The streamed step overlapped with the next forward (``opt.overlap_with(model)``), on the simulated device.

A small network trains with its forward and backward run for real on the simulated device's main
stream: each module's forward is recorded as reading its parameters there (after fusedoff's own
pre-hook), backward as writing the gradients, ``zero_grad`` (in place, or to None) likewise. The
race checker then holds every access of the next forward, the gradients' reuse and the state
reads against the step's streams: a missing wait is a reported race, whatever the interleaving.
The oracle for the values is the same run without overlap, bit for bit, in every state precision
and placement; with two param groups (decayed weights, undecayed biases) the chunks of both
buckets interleave in forward order.
"""

from __future__ import annotations

import shutil
from unittest import mock

import pytest
import torch

import fusedoff
from fusedoff import ops
from fusedoff.offload import runtimes
from fusedoff.testing.simulator import RaceError, SimulatedRuntime
from fusedoff.testing.timed import Rates, TimedRuntime, predict
from tests.helpers import assert_bitwise_equal

WIDTH, LAYERS, STEPS = 24, 4, 4
PLACEMENTS = {"streamed": dict(offload="stream", chunk_size=256),
              "mixed": dict(offload="stream", chunk_size=256, device_budget=WIDTH * WIDTH * 16),
              "resident": dict(offload="none")}
PRECISIONS = ("fp32", "bf16", "8bit")


class Net(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.to(dtype)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def record_forward_reads(model, sims):
    """A pre-hook after fusedoff's on each layer: the layer's forward reads its parameters on main."""
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if own:
            module.register_forward_pre_hook(
                lambda m, args, own=own: sims[-1].main_access([p.detach() for p in own], write=False,
                                                              what="the forward reads a parameter") if sims else None)


def training_run(dtype, precision, placement, *, overlap, seed=0, set_to_none=True, remove_at=None, optimizer="AdamW",
          read_state=False, options=None):
    """`read_state`: read every state right after each step (a host synchronisation, which orders
    everything the main stream does after it: off, the waits alone order the next forward);
    `options`: more of the optimizer's (tests/test_host_share.py's ``host_share``)."""
    options = {**PLACEMENTS[placement], **(options or {})}
    sims = []

    def factory(device):
        sims.append(SimulatedRuntime(device, seed=seed + 1000 * len(sims)))
        return sims[-1]

    with runtimes.simulate(factory):
        model = Net(dtype)
        weights = [layer.weight for layer in model.layers]
        biases = [layer.bias for layer in model.layers]
        groups = [{"params": weights}, {"params": biases, "weight_decay": 0.0}]
        if optimizer == "Apollo":  # several phases: tensors spanning chunks take a pass per phase
            opt = fusedoff.Apollo(groups, lr=1e-2, warmup=2, rebound="belief", **options)
        else:
            opt = fusedoff.AdamW(groups, lr=1e-2, weight_decay=0.1, state_precision=precision, **options)
        handle = opt.overlap_with(model) if overlap else None
        record_forward_reads(model, sims)
        gen = torch.Generator().manual_seed(1)
        seen = []
        for step in range(STEPS):
            if step == remove_at:
                handle.remove()
            x = torch.randn(8, WIDTH, generator=gen).to(dtype)
            loss = model(x).float().square().mean()
            loss.backward()
            if sims:
                sims[-1].main_access([p.grad for p in model.parameters()], write=True, what="backward writes gradients")
            opt.step()
            if read_state:
                seen.append([{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()])
            opt.zero_grad(set_to_none=set_to_none)
            if sims and not set_to_none:
                sims[-1].main_access([p.grad for p in model.parameters()], write=True, what="zero_grad in place")
        state = model.state_dict()  # right after the last step: waits for its chunks
        sims[-1].main_access([v for v in state.values()], write=False, what="the model's state dict is read")
        seen.append([{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()])
    return [p.detach().clone() for p in model.parameters()], seen


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(3))
def test_the_overlapped_step_equals_the_plain_one_without_a_race(placement, precision, dtype, seed):
    plain = training_run(dtype, precision, placement, overlap=False, seed=seed)
    assert_bitwise_equal(training_run(dtype, precision, placement, overlap=True, seed=seed), plain)


@pytest.mark.parametrize("placement", ["streamed", "mixed"])
def test_states_read_right_after_each_overlapped_step_are_that_steps(placement):
    plain = training_run(torch.bfloat16, "8bit", placement, overlap=False, read_state=True)
    assert_bitwise_equal(training_run(torch.bfloat16, "8bit", placement, overlap=True, read_state=True), plain)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("seed", range(2))
def test_an_overlapped_apollo_step_equals_the_plain_one_without_a_race(placement, seed):
    """Apollo's phases: the chunks of tensors spanning chunks pass once per phase, joined between
    phases (the next phase reads whole-tensor sums); only the last pass is left to the forward."""
    plain = training_run(torch.float32, "fp32", placement, overlap=False, seed=seed, optimizer="Apollo")
    assert_bitwise_equal(training_run(torch.float32, "fp32", placement, overlap=True, seed=seed,
                                      optimizer="Apollo"), plain)


@pytest.mark.parametrize("seed", range(3))
def test_zero_grad_in_place_waits_for_the_chunks_that_read_the_gradients(seed):
    plain = training_run(torch.float32, "fp32", "streamed", overlap=False, seed=seed, set_to_none=False)
    assert_bitwise_equal(training_run(torch.float32, "fp32", "streamed", overlap=True, seed=seed,
                                      set_to_none=False), plain)


def test_a_removed_handle_joins_the_step_again():
    plain = training_run(torch.float32, "fp32", "streamed", overlap=False)
    assert_bitwise_equal(training_run(torch.float32, "fp32", "streamed", overlap=True, remove_at=2), plain)


def test_a_forward_without_the_hooks_races_with_the_overlapped_step():
    """The race checker sees the overlap: the forward's reads, with fusedoff's hooks taken off the
    modules (and the step still overlapped), race with the chunks that write the parameters."""
    with runtimes.simulate(lambda device: SimulatedRuntime(device, seed=0)):
        model = Net(torch.float32)
        opt = fusedoff.AdamW(model.parameters(), lr=1e-2, offload="stream", chunk_size=256)
        handle = opt.overlap_with(model)
        for hook in handle._handles[:-1]:  # the forward pre-hooks (the state-dict hook stays)
            hook.remove()
        model(torch.randn(2, WIDTH)).sum().backward()
        opt.step()
        sim = opt._engine.runtimes[torch.device("cpu")]
        with pytest.raises(RaceError, match="the forward reads a parameter"):
            for layer in model.layers:
                sim.main_access([layer.weight.detach()], write=False, what="the forward reads a parameter")


def updates_in_order(overlap: bool) -> list[tuple[str, int]]:
    """The (kind, layer) of each tensor in the order the step updates them (bias chunks hold several)."""
    with runtimes.simulate(lambda device: SimulatedRuntime(device, seed=0)):
        model = Net(torch.float32)
        weights = [layer.weight for layer in model.layers]
        biases = [layer.bias for layer in model.layers]
        opt = fusedoff.AdamW([{"params": weights}, {"params": biases, "weight_decay": 0.0}], lr=1e-2,
                             offload="stream", chunk_size=WIDTH * WIDTH)
        if overlap:
            opt.overlap_with(model)
        order, kinds = [], {}
        make, run_update = opt._fused_update, ops.run_update

        def spy(group, *args, **kwargs):  # which bucket an update is for
            update = make(group, *args, **kwargs)
            kinds[id(update)] = "weight" if group is opt.param_groups[0] else "bias"
            return update

        def run_spied(update, phase, a):
            order.extend((kinds[id(update)], t) for t in a.tensors)
            run_update(update, phase, a)

        opt._fused_update = spy
        model(torch.randn(2, WIDTH)).sum().backward()
        with mock.patch.object(ops, "run_update", run_spied):  # (queued chunks run by drain)
            opt.step()
            opt._engine.join()
            opt._engine.runtimes[torch.device("cpu")].drain()
    return order


def layer_done_before_next_weight(order) -> bool:
    """Every layer's tensors are updated before the next layer's weight (what its forward waits for)."""
    where = {entry: k for k, entry in enumerate(order)}
    return all(max(where["weight", k], where["bias", k]) < where["weight", k + 1] for k in range(LAYERS - 1))


def test_the_chunks_run_in_forward_order_across_buckets():
    """Decayed weights and undecayed biases are two buckets: overlapped, the step updates layer k's
    tensors (both buckets') before layer k + 1's weight, so the first layers' forwards wait for little;
    the plain step runs one bucket after the other."""
    overlapped, plain = updates_in_order(True), updates_in_order(False)
    assert sorted(overlapped) == sorted(plain) == sorted((kind, k) for kind in ("weight", "bias") for k in range(LAYERS))
    assert layer_done_before_next_weight(overlapped)
    assert not layer_done_before_next_weight(plain)


def test_overlap_hides_the_step_behind_the_next_forward_on_the_timed_device():
    """On the timed device (fusedoff/testing/timed.py), with the next forward one main-stream
    operation per layer: plain, the forward waits for the whole step; overlapped, it is delayed by
    no less than the link time it cannot cover (link-bound time - forward time), and by little more
    than one layer's share of the step."""
    rates = Rates(host_call=0.0)
    layer_s = 2e-3

    def exposed(overlap: bool):
        rts = []
        with runtimes.simulate(lambda device: rts.append(TimedRuntime(device, scale=2**16)) or rts[-1]):
            model = Net(torch.float32)
            opt = fusedoff.AdamW(model.parameters(), lr=1e-2, offload="stream", chunk_size=WIDTH * WIDTH)
            if overlap:
                opt.overlap_with(model)
            model(torch.randn(2, WIDTH)).sum().backward()
            opt.step()
            rt = rts[-1]
            opt._engine.join()
            rt.drain()
            first = rt.mark()
            opt.step()
            between = rt.mark()
            for layer in model.layers:  # the next forward: fusedoff's hook, then the layer's work
                for hook in layer._forward_pre_hooks.values():
                    hook(layer, ())
                rt.main_work(layer_s, "a layer's forward")
            return predict(rt, rates, range(first, between), range(between, rt.mark()))

    plain, overlapped = exposed(False), exposed(True)
    assert plain.exposed_s >= plain.link_bound_s - 1e-9  # the forward starts after the step's last copy
    uncovered = plain.link_bound_s - LAYERS * layer_s
    assert uncovered > 0
    assert uncovered - 1e-9 <= overlapped.exposed_s <= uncovered + 2 * plain.step_s / LAYERS
    assert overlapped.exposed_s < plain.exposed_s


def training_run_on_cuda(precision: str, overlap: bool):
    """The same training on a GPU's real streams: the next forward runs as soon as its layer's
    chunks are done (a long forward kernel of another layer would expose a missing wait)."""
    model = Net(torch.bfloat16).cuda()
    weights = [layer.weight for layer in model.layers]
    biases = [layer.bias for layer in model.layers]
    opt = fusedoff.AdamW([{"params": weights}, {"params": biases, "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1,
                         state_precision=precision, offload="stream", chunk_size=256, backend="cuda")
    if overlap:
        opt.overlap_with(model)
    gen = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(STEPS):
        x = torch.randn(8, WIDTH, generator=gen).to("cuda", torch.bfloat16)
        model(x).float().square().mean().backward()
        opt.step()
        torch.cuda._sleep(1_000_000)  # the main stream busy while the chunks are still queued
        seen.append([{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()])
        opt.zero_grad(set_to_none=True)
    return [p.detach().cpu() for p in model.parameters()], seen


@pytest.mark.cuda
@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_overlapped_step_equals_the_plain_one_on_a_gpu(precision):
    assert_bitwise_equal(training_run_on_cuda(precision, True), training_run_on_cuda(precision, False))


def streamed_net(overlap: bool):
    """The network and a streamed AdamW over it, overlapping its forward when asked."""
    model = Net(torch.float32)
    opt = fusedoff.AdamW(model.parameters(), lr=1e-2, offload="stream", chunk_size=256)
    if overlap:
        opt.overlap_with(model)
    return model, opt


def final(model, opt):
    """The parameters and every state, in training_run()'s form (one read of the states, at the end)."""
    return [p.detach().clone() for p in model.parameters()], [
        [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]]


@pytest.mark.parametrize("seed", range(3))
def test_a_step_with_no_forward_before_it_waits_for_the_last_one(seed):
    """Two steps in a row (no forward, hence no hook, between them): the second counts its steps and
    reads its gradients on the main stream only after the first one's chunks."""

    def run(overlap: bool):
        with runtimes.simulate(lambda device: SimulatedRuntime(device, seed=seed)):
            model, opt = streamed_net(overlap)
            model(torch.randn(2, WIDTH)).sum().backward()
            opt.step()
            opt.step()  # the same gradients again
            return final(model, opt)

    assert_bitwise_equal(run(True), run(False))


# torch.compile's default backend (inductor) generates C++ for the CPU; where no C++ compiler is found (the
# wheel's proof runs the suite without one) the forward is compiled by dynamo and AOT autograd alone,
# which is where the pre-hooks are kept or lost.
COMPILE_BACKEND = "inductor" if shutil.which("g++") or shutil.which("c++") else "aot_eager"


@pytest.mark.parametrize("seed", range(2))
def test_a_compiled_forward_still_waits_for_its_chunks(seed):
    """A compiled model keeps its pre-hooks: the compiled, overlapped run equals the compiled plain
    one on the simulated device. (The hook is also kept out of tracing, so that on a GPU it waits on
    each step's own events; the simulator's CPU run cannot tell a traced hook from an eager one.)"""

    def run(overlap: bool):
        with runtimes.simulate(lambda device: SimulatedRuntime(device, seed=seed)):
            model, opt = streamed_net(overlap)
            forward = torch.compile(model, backend=COMPILE_BACKEND)
            gen = torch.Generator().manual_seed(1)
            for _ in range(STEPS):
                forward(torch.randn(8, WIDTH, generator=gen)).square().mean().backward()
                opt.step()
                opt.zero_grad()
            model.state_dict()
            return final(model, opt)

    assert_bitwise_equal(run(True), run(False))
