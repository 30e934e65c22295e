"""Streamed state is optimizer state: ``opt.state`` is the one source of truth in every placement.

Every test runs the optimizer resident (offload="none"), streamed (all states in host memory,
32-element chunks so tensors span chunks) and mixed (a device budget that keeps some tensors'
states in place and streams the others). The oracle is torch.optim.AdamW (or the eager reference
Apollo) doing the same things to its own ``state``; the streamed and mixed runs must also equal
the resident run bit for bit (the same kernel on the same values).
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import fusedoff
from fusedoff.kernels.reference import ApolloReference
from fusedoff.offload import placement
from tests.helpers import make_params, seeded_grads, train

SHAPES = [(33, 5), (7,), (300,), (16,), ()]  # 165, 7, 300, 16, 1 elements
ADAM = dict(lr=1e-2, weight_decay=0.1, betas=(0.8, 0.9))
APOLLO = dict(lr=1e-2, warmup=2, rebound="belief", weight_decay=0.01, weight_decay_type="decoupled")


def modes(bytes_per_element: int) -> dict[str, dict]:
    # Budget for the mix, filled greedily in order: the 165- and 7-element tensors fit, the
    # 300-element one does not, the 16-element one fits the rest exactly, the scalar streams.
    budget = bytes_per_element * (165 + 7 + 16)
    return {"resident": dict(offload="none"),
            "streamed": dict(offload="stream", chunk_size=32),
            "mixed": dict(offload="stream", chunk_size=32, device_budget=budget)}


MODES = list(modes(8))
GRADS = seeded_grads(0.1)  # a step's gradients: GRADS(params, step), or train(..., GRADS)


def snapshot(opt, params) -> list[dict]:
    return [{k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
            for p in params]


def assert_same(got_params, got_states, want_params, want_states, *, exact=True, rtol=0.0, atol=0.0):
    for a, b in zip(got_params, want_params):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=rtol, atol=atol) if not exact else \
            torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=0)
    for got, want in zip(got_states, want_states):
        assert set(got) == set(want)
        for key in want:
            if key == "step":
                assert float(got[key]) == float(want[key])
            elif exact:
                torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)
            else:
                # check_dtype=False: fusedoff keeps an assigned float64 state in fp32; torch keeps float64.
                torch.testing.assert_close(got[key], want[key], rtol=rtol, atol=atol, check_dtype=False)


# ---- the state is in opt.state, in every placement -----------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_states_are_entries_of_opt_state_and_read_after_step_sees_that_step(mode):
    params, ref_params = make_params(SHAPES), make_params(SHAPES)
    opt = fusedoff.AdamW(params, **ADAM, **modes(8)[mode])
    ref = torch.optim.AdamW(ref_params, **ADAM, foreach=False)
    for step in range(4):
        train(params, opt, range(step, step + 1), GRADS)
        train(ref_params, ref, range(step, step + 1), GRADS)
        # torch's fp32 AdamW rounds a few operations differently: measured 1.2e-7 relative at most
        # over these steps; the bound leaves 10x (the bugs this guards are 1e-2 and larger).
        assert_same(params, snapshot(opt, params), ref_params, snapshot(ref, ref_params), exact=False,
                    rtol=1e-6, atol=1e-8)
    stats = opt.memory_stats()
    streamed = [opt.state[p]["exp_avg"] for p in params]
    assert all(s.device.type == "cpu" and s.dtype == torch.float32 and s.shape == p.shape
               for s, p in zip(streamed, params))
    store_ptrs = {slab.untyped_storage().data_ptr() for layout in opt._engine.buckets.values()
                  if layout.store is not None for slab in layout.store.slabs["exp_avg"]}
    in_store = [s.untyped_storage().data_ptr() in store_ptrs for s in streamed]
    want_in_store = {"resident": [False] * 5, "streamed": [True] * 5, "mixed": [False, False, True, False, True]}[mode]
    assert in_store == want_in_store  # streamed states are views of the host store, never copies
    # By hand: 8 bytes of moments per element; host slabs pad each tensor to 16 elements.
    want_resident = {"resident": 8 * 489, "streamed": 0, "mixed": 8 * (165 + 7 + 16)}[mode]
    want_streamed = {"resident": 0, "streamed": 8 * (176 + 16 + 304 + 16 + 16), "mixed": 8 * (304 + 16)}[mode]
    assert stats["resident_bytes"] == want_resident and stats["streamed_bytes"] == want_streamed


def scenario_reset(opt, params, step):
    if step == 2:
        del opt.state[params[1]]  # ReLoRA-style: this parameter's moments start afresh
        opt.state[params[2]].clear()


def scenario_edit(opt, params, step):
    if step == 1:
        opt.state[params[0]]["exp_avg"].zero_()  # in place
        opt.state[params[2]]["exp_avg_sq"].mul_(0.5)
        opt.state[params[3]]["exp_avg"] = torch.full(params[3].shape, 0.25)  # assigned: taken by value
        opt.state[params[4]]["exp_avg_sq"] = torch.full((), 2.0, dtype=torch.float64)  # another dtype


@pytest.mark.parametrize("mode", MODES)
def test_an_assigned_state_of_the_wrong_size_is_refused_before_anything_changes(mode):
    params = make_params(SHAPES)
    opt = fusedoff.AdamW(params, **ADAM, **modes(8)[mode])
    train(params, opt, 2, GRADS)
    before = snapshot(opt, params), [p.detach().clone() for p in params]
    # The 165-element tensor (resident in the mix) and the 300-element one (streamed in the mix).
    for index in (0, 2):
        opt.state[params[index]]["exp_avg"] = torch.zeros(params[index].numel() + 1)
        with pytest.raises(ValueError, match="elements"):
            train(params, opt, range(2, 3), GRADS)
        opt.state[params[index]]["exp_avg"] = before[0][index]["exp_avg"].clone()
    assert_same(params, snapshot(opt, params), before[1], before[0])


@pytest.mark.parametrize("scenario", [scenario_reset, scenario_edit], ids=["reset", "edit"])
def test_the_engine_follows_what_opt_state_holds(scenario):
    ref_params = make_params(SHAPES)
    ref = torch.optim.AdamW(ref_params, **ADAM, foreach=False)
    train(ref_params, ref, 6, GRADS, scenario)
    plain_params = make_params(SHAPES)
    plain = torch.optim.AdamW(plain_params, **ADAM, foreach=False)
    train(plain_params, plain, 6, GRADS)
    results = {}
    for mode, options in modes(8).items():
        params = make_params(SHAPES)
        opt = fusedoff.AdamW(params, **ADAM, **options)
        train(params, opt, 6, GRADS, scenario)
        results[mode] = params, snapshot(opt, params)
        # Measured against torch: 2.4e-7 relative at most; the scenario itself moves the weights
        # by 1e-2 (checked below), so a state the engine ignored would fail by far.
        assert_same(*results[mode], ref_params, snapshot(ref, ref_params), exact=False, rtol=2e-6, atol=1e-8)
    moved = max((a - b).abs().max().item() for a, b in zip(ref_params, plain_params))
    assert moved > 1e-3  # the scenario matters (measured: 3.8e-2 for reset, 2.6e-1 for edit)
    for mode in ("streamed", "mixed"):
        assert_same(*results[mode], *results["resident"])


@pytest.mark.parametrize("mode", MODES)
def test_apollo_state_reset_matches_the_reference(mode):
    params, ref_params = make_params(SHAPES), make_params(SHAPES)
    opt = fusedoff.Apollo(params, **APOLLO, **modes(12)[mode])
    ref = ApolloReference(ref_params, **APOLLO)
    train(params, opt, 5, GRADS, scenario_reset)
    train(ref_params, ref, 5, GRADS, scenario_reset)
    for a, b in zip(params, ref_params):
        # The fused and eager sums round differently: measured 3e-7 relative; 10x margin.
        torch.testing.assert_close(a.detach(), b.detach(), rtol=3e-6, atol=1e-7)
    for p, r in zip(params, ref_params):
        for key in ("exp_avg_grad", "approx_hessian", "update"):
            torch.testing.assert_close(opt.state[p][key], ref.state[r][key], rtol=3e-5, atol=1e-7)
        assert int(opt.state[p]["step"]) == int(ref.state[r]["step"])


# ---- copies of the optimizer ------------------------------------------------------------------

def _deepcopy(opt, params):
    return copy.deepcopy((params, opt))


def _pickle(opt, params):
    return pickle.loads(pickle.dumps((params, opt)))


def _torch_save(opt, params):
    buffer = io.BytesIO()
    torch.save((params, opt), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", [_deepcopy, _pickle, _torch_save], ids=["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("cls,kwargs,per_element", [(fusedoff.AdamW, ADAM, 8), (fusedoff.Apollo, APOLLO, 12)],
                         ids=["AdamW", "Apollo"])
@pytest.mark.parametrize("mode", MODES)
def test_a_copy_steps_exactly_as_the_original(how, cls, kwargs, per_element, mode):
    params = make_params(SHAPES)
    opt = cls(params, **kwargs, **modes(per_element)[mode], backend="cpu")
    train(params, opt, 3, GRADS)
    copied_params, copied = how(opt, params)
    assert type(copied) is cls and copied.param_groups[0]["backend"] == "cpu"
    for p, q in zip(params, copied_params):
        for key, value in copied.state[q].items():
            if key != "step":  # host tensors, not sharing memory with the original
                assert value.device.type == "cpu"
                assert value.untyped_storage().data_ptr() != opt.state[p][key].untyped_storage().data_ptr()
    train(params, opt, range(3, 6), GRADS)
    train(copied_params, copied, range(3, 6), GRADS)
    assert_same(copied_params, snapshot(copied, copied_params), params, snapshot(opt, params))
    mine, theirs = opt.memory_stats(), copied.memory_stats()
    for key in ("resident_bytes", "streamed_bytes", "device_budget", "chunk_size", "num_buffers"):
        assert mine[key] == theirs[key], key
    for p, q in zip(params, copied_params):  # each owns its own memory
        assert opt.state[p]["exp_avg" if cls is fusedoff.AdamW else "update"].untyped_storage().data_ptr() != \
            copied.state[q]["exp_avg" if cls is fusedoff.AdamW else "update"].untyped_storage().data_ptr()


def test_a_copy_of_a_model_and_optimizer_steps_the_copied_model():
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    opt = fusedoff.AdamW(model.parameters(), **ADAM, offload="stream", chunk_size=32)
    x = torch.randn(4, 5)
    model(x).square().sum().backward()
    opt.step()
    model2, opt2 = copy.deepcopy((model, opt))
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x).square().sum().backward()
        o.step()
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()


# ---- torch.compile ------------------------------------------------------------------------------

@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("mode", MODES)
def test_compiled_training_step_equals_eager(mode, compile_backend):
    torch._dynamo.reset()
    runs = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))
        opt = fusedoff.AdamW(model.parameters(), **ADAM, **modes(8)[mode])

        def train_step(x):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        step_fn = torch.compile(train_step, backend=compile_backend) if compiled else train_step
        gen = torch.Generator().manual_seed(1)
        for _ in range(6):
            step_fn(torch.randn(8, 6, generator=gen))
        runs[compiled] = [p.detach().clone() for p in model.parameters()], \
            [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    for a, b in zip(runs[True][0] + runs[True][1], runs[False][0] + runs[False][1]):
        assert torch.equal(a, b)


# ---- placement -----------------------------------------------------------------------------------

def test_set_device_budget_moves_states_and_keeps_their_values():
    params = make_params(SHAPES)
    opt = fusedoff.AdamW(params, **ADAM, offload="stream", chunk_size=32)
    ref_params = make_params(SHAPES)
    ref = fusedoff.AdamW(ref_params, **ADAM, offload="none")
    train(params, opt, 2, GRADS)
    train(ref_params, ref, 2, GRADS)
    assert opt.memory_stats()["resident_bytes"] == 0
    opt.set_device_budget(10**9)
    train(params, opt, range(2, 4), GRADS)
    train(ref_params, ref, range(2, 4), GRADS)
    stats = opt.memory_stats()
    assert stats["streamed_bytes"] == 0 and stats["resident_bytes"] == 8 * 489 and stats["device_budget"] == 10**9
    opt.set_device_budget(0)
    train(params, opt, range(4, 6), GRADS)
    train(ref_params, ref, range(4, 6), GRADS)
    assert opt.memory_stats()["resident_bytes"] == 0
    assert_same(params, snapshot(opt, params), ref_params, snapshot(ref, ref_params))


def test_auto_keeps_cpu_states_in_place_and_stream_mode_defaults_to_no_budget():
    params = make_params(SHAPES)
    opt = fusedoff.AdamW(params, offload="auto")
    train(params, opt, 1, GRADS)
    assert opt.memory_stats()["streamed_bytes"] == 0 and opt.memory_stats()["device_budget"] is None
    opt = fusedoff.AdamW(make_params(SHAPES), offload="stream")
    assert opt.memory_stats()["device_budget"] is None  # not decided before the first step
    train(opt.param_groups[0]["params"], opt, 1, GRADS)
    assert opt.memory_stats()["device_budget"] == 0 and opt.memory_stats()["resident_bytes"] == 0


@pytest.mark.parametrize("total,peak,needed,buffers,want", [
    (100_000, 10_000, 50_000, 5_000, 50_000),  # fits in 90% of total minus the peak: all resident
    (100_000, 10_000, 90_000, 5_000, 75_000),  # does not fit: 80,000 available, less the buffers
    (100_000, 95_000, 90_000, 5_000, 0),  # nothing left
])
def test_auto_budget_leaves_headroom_and_room_for_buffers(total, peak, needed, buffers, want):
    assert placement.AUTO_HEADROOM == 0.10  # the figure the README documents
    assert placement.auto_budget(total, peak, needed, buffers) == want


def test_load_state_dict_places_states_afresh_and_keeps_values():
    params = make_params(SHAPES)
    opt = fusedoff.AdamW(params, **ADAM, offload="stream", chunk_size=32, device_budget=8 * 172)
    train(params, opt, 3, GRADS)
    saved = copy.deepcopy(opt.state_dict())
    other_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    other = fusedoff.AdamW(other_params, **ADAM, offload="stream", chunk_size=32)
    other.load_state_dict(saved)
    # Loaded straight into place: streamed states are views of the host store before any step.
    assert other.memory_stats()["streamed_bytes"] == 8 * (176 + 16 + 304 + 16 + 16)
    train(params, opt, range(3, 5), GRADS)
    train(other_params, other, range(3, 5), GRADS)
    assert_same(other_params, snapshot(other, other_params), params, snapshot(opt, params))


# ---- CUDA: the mix, reads after step, and the first-step budget decision ------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("mode", MODES)
def test_cuda_states_read_right_after_step_are_that_steps(mode):
    params = [torch.nn.Parameter(p.detach().cuda()) for p in make_params(SHAPES)]
    ref_params = [torch.nn.Parameter(p.detach().cuda()) for p in make_params(SHAPES)]
    opt = fusedoff.AdamW(params, **ADAM, **modes(8)[mode])
    ref = fusedoff.AdamW(ref_params, **ADAM, offload="none")
    for step in range(4):
        GRADS(params, step)
        GRADS(ref_params, step)
        opt.step()
        ref.step()
        # No synchronisation here: the read itself must wait for the step's copies back.
        got = snapshot(opt, params)
        assert_same([p.cpu() for p in params], [{k: v.cpu() for k, v in s.items()} for s in got],
                    [p.cpu() for p in ref_params], [{k: v.cpu() for k, v in s.items()} for s in snapshot(ref, ref_params)])
    if mode != "resident":
        assert opt.memory_stats()["host_pinned"]


@pytest.mark.cuda
def test_cuda_auto_decides_the_budget_at_the_first_step_from_an_injected_figure(monkeypatch):
    params = [torch.nn.Parameter(p.detach().cuda()) for p in make_params(SHAPES)]
    needed = 8 * 489
    # A device of 10 MiB whose forward and backward peaked 1 KiB short of room for every state.
    total = 10 * 2**20
    from fusedoff.offload.cuda_runtime import CudaRuntime

    monkeypatch.setattr(CudaRuntime, "memory_info", lambda self: (total, int(total * 0.9) - needed + 1024 - 2048))
    opt = fusedoff.AdamW(params, **ADAM, chunk_size=32)  # offload="auto"
    assert opt.memory_stats()["device_budget"] is None
    GRADS(params, 0)
    opt.step()
    stats = opt.memory_stats()
    assert stats["device_budget"] == needed and stats["resident_bytes"] == needed and stats["streamed_bytes"] == 0
    monkeypatch.setattr(CudaRuntime, "memory_info", lambda self: (total, int(total * 0.9) - 8 * 200))
    opt.set_device_budget(None)  # decided again at the next step, from the new figure
    opt.step()
    stats = opt.memory_stats()
    buffers = 2 * 2 * 32 * 4
    assert stats["device_budget"] == 8 * 200 - buffers
    assert 0 < stats["resident_bytes"] <= stats["device_budget"] and stats["streamed_bytes"] > 0


@pytest.mark.cuda
def test_cuda_auto_keeps_a_model_that_fits_resident():
    model = torch.nn.Linear(256, 256).cuda()
    opt = fusedoff.AdamW(model.parameters())
    model(torch.randn(8, 256, device="cuda")).sum().backward()
    opt.step()
    stats = opt.memory_stats()
    assert stats["streamed_bytes"] == 0 and stats["resident_bytes"] == 8 * (256 * 256 + 256)
    assert stats["device_budget"] >= stats["resident_bytes"]
