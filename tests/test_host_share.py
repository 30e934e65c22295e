"""The host's share of a step (``host_share``): host-computed tensors give every bit a streamed or
resident step gives.

A host-computed tensor's states stay in host memory and the host kernels step them there, on the
host worker, between the copy of its gradient and parameter down and the copy of its parameter
back up (fusedoff/offload/host_share.py). Each case trains the same run with shares 0, 0.3 and 1,
through the host loopback and the stream simulator (whose race checker holds the worker as one
more ordered agent), with what training does between steps: an overflow that GradScaler skips,
clipping, a parameter written outside the step, the states read right after each step, a share
changed between steps and a checkpoint loaded into an optimizer with another share; parameters
and every state are compared, bit for bit, with the share-0 run.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import fusedoff
from fusedoff.offload import runtimes
from fusedoff.offload import host_share
from fusedoff.offload.host_share import HostShare
from fusedoff.offload.runtime import HostRuntime
from fusedoff.offload.transaction import StepIncompleteError
from fusedoff.testing.simulator import RaceError, SimulatedRuntime
from tests import test_adam_optimizer, test_overlap
from tests.helpers import ParameterListModel, assert_bitwise_equal, make_params, train, train_model

# The first tensors small: a share of 0.3 takes the first one or two streamed tensors, whatever the budget holds.
SHAPES = [(7,), (40,), (33, 5), (16,), (300,), ()]
ADAM = dict(lr=1e-2, weight_decay=0.1)
APOLLO = dict(lr=1e-2, warmup=2, weight_decay=0.01)
CASES = {
    "AdamW-fp32-amsgrad": (fusedoff.AdamW, dict(ADAM, amsgrad=True), torch.float32),
    "Adam-bf16-states": (fusedoff.Adam, dict(ADAM, state_precision="bf16", seed=7), torch.float32),
    "AdamW-8bit-states-bf16-master": (fusedoff.AdamW, dict(ADAM, state_precision="8bit"), torch.bfloat16),
    "AdamW-split-master": (fusedoff.AdamW, dict(ADAM, master_precision="split"), torch.bfloat16),
    "Adam-split8-master": (fusedoff.Adam, dict(ADAM, master_precision="split8"), torch.bfloat16),
    "Apollo-constant-L2": (fusedoff.Apollo, dict(APOLLO, rebound="constant", weight_decay_type="L2"), torch.float32),
    "Apollo-belief-stable-bf16": (fusedoff.Apollo, dict(APOLLO, rebound="belief", weight_decay_type="stable"),
                                  torch.bfloat16),
    "Apollo-belief-decoupled": (fusedoff.Apollo, dict(APOLLO, rebound="belief", weight_decay_type="decoupled"),
                                torch.float32),
}
PLACEMENTS = {
    # a budget that holds every state: the share moves no resident state
    "resident": dict(offload="stream", chunk_size=32, device_budget=10**9),
    "streamed": dict(offload="stream", chunk_size=32),
    "mixed": dict(offload="stream", chunk_size=32, device_budget=168),  # the 7-element tensor's states, and more
}
SHARES = (0.3, 1.0)
OTHER_SHARE = {0.0: 0.0, 0.3: 1.0, 1.0: 0.3}
STEPS = 6
OVERFLOW_AT, CLIP_AT, WRITE_AT, CHANGE_AT, LOAD_AT = 1, 2, 2, 3, 4


def training_run(make_opt, dtype, share, *, sim=None):
    """Trains the tensors of SHAPES (two param groups, two buckets sharing a pipeline) through a
    GradScaler; returns the parameters and every state read right after each step, and the
    memory_stats of the first step."""
    params = make_params(SHAPES, dtype)
    groups = [{"params": params[:3]}, {"params": params[3:], "lr": 3e-3}]
    opt = make_opt(groups, share)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    scaler.scale(torch.zeros(()))  # (its scale is made at its first use)
    generator = torch.Generator().manual_seed(1)
    seen, stats = [], None
    for step in range(STEPS):
        scale = scaler.get_scale()
        for p in params:
            p.grad = (torch.randn(p.shape, generator=generator) * 0.1 * scale).to(dtype)
            if sim:
                sim[-1].main_access([p.grad], write=True, what="backward writes a gradient")
        if step == OVERFLOW_AT:  # GradScaler finds it and the step changes nothing
            params[0].grad.view(-1)[3] = float("inf")
        if step == CLIP_AT:
            scaler.unscale_(opt)
            opt.clip_grad_norm_(0.05)
        scaler.step(opt)
        scaler.update()
        if sim:  # the next forward reads the parameters
            sim[-1].main_access([p.detach() for p in params], write=False, what="the forward reads a parameter")
        seen.append([{k: v.clone() for k, v in opt.state[p].items()} for p in params])
        stats = stats or opt.memory_stats()
        if step == WRITE_AT:  # written outside the step, on the main stream
            for p in params[:2] + params[4:5]:
                p.detach().mul_(0.75)
                if sim:
                    sim[-1].main_access([p.detach()], write=True, what="a write to a parameter")
        if step == CHANGE_AT:
            for group in opt.param_groups:
                group["host_share"] = OTHER_SHARE[share]
        if step == LOAD_AT:  # into an optimizer whose share is another
            saved = copy.deepcopy(opt.state_dict())
            opt = make_opt(groups, share)
            opt.load_state_dict(saved)  # (saved with the other share: each optimizer keeps its own)
            assert [group["host_share"] for group in opt.param_groups] == [share] * len(opt.param_groups)
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in params], seen, stats


def simulated(make_opt, dtype, share, seed=0):
    sims = []

    def factory(device):
        sims.append(SimulatedRuntime(device, seed=seed + 1000 * len(sims)))
        return sims[-1]

    with runtimes.simulate(factory):
        result = training_run(make_opt, dtype, share, sim=sims)
    assert any(sim.checked > 0 for sim in sims)  # (the race checker saw the run)
    return result, sims


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("case", list(CASES))
def test_every_share_gives_the_bits_of_share_0(case, placement):
    cls, kwargs, dtype = CASES[case]

    def make(groups, share):
        return cls(groups, **kwargs, **PLACEMENTS[placement], backend="cpu", host_share=share)

    params, seen, stats = training_run(make, dtype, 0.0)
    assert stats["host_computed_params"] == 0 and stats["host_share_buffer_bytes"] == 0
    want = params, seen
    for share in SHARES:
        got, got_seen, stats = training_run(make, dtype, share)
        assert_bitwise_equal((got, got_seen), want, f"share {share}")
        hosted = stats["host_computed_params"]
        if placement == "resident":
            assert hosted == 0 and stats["resident_bytes"] > 0
        else:
            assert 0 < hosted <= sum(p.numel() for p in params), stats
            assert stats["host_share_buffer_bytes"] > 0 and stats["host_computed_bytes"] > 0
            assert (hosted == sum(p.numel() for p in params)) == (share == 1.0 and placement == "streamed")
        (got, got_seen, sim_stats), sims = simulated(make, dtype, share, seed=int(share * 10))
        assert_bitwise_equal((got, got_seen), want, f"share {share}, simulated")
        if placement != "resident":  # (page-locked on an asynchronous device: the host share's buffers too)
            assert sim_stats["host_pinned"] and not stats["host_pinned"]
        assert (sum(sim.host_tasks for sim in sims) > 0) == (placement != "resident")


@pytest.mark.emulated
@pytest.mark.parametrize("case", [case for case in CASES if not case.startswith("Apollo")])
def test_the_host_kernels_give_the_cuda_kernels_bits(case, monkeypatch):
    """On a GPU, streamed and resident tensors run the CUDA kernels and host-computed ones the host
    kernels: here the CUDA kernels compiled for the host (backend 'cuda_emulated') beside the host
    kernels, as on a GPU, give the same bits in the elementwise updates. (Apollo's whole-tensor sums
    are summed in each backend's own order: on a GPU its host share is not bit for bit, as its
    streamed and resident steps are not either; see tests/test_stream_simulation.py.)"""
    monkeypatch.setattr(host_share, "host_backend", lambda backend: "cpu")
    cls, kwargs, dtype = CASES[case]

    def make(groups, share):
        return cls(groups, **kwargs, **PLACEMENTS["streamed"], backend="cuda_emulated", host_share=share)

    want = training_run(make, dtype, 0.0)[:2]
    for share in SHARES:
        assert_bitwise_equal(training_run(make, dtype, share)[:2], want, f"share {share}")


@pytest.mark.parametrize("optimizer", ["AdamW", "Apollo"])
@pytest.mark.parametrize("placement", ["streamed", "mixed"])
def test_an_overlapped_step_with_a_host_share_equals_the_plain_one_without_a_race(placement, optimizer):
    """overlap_with(model): a module's forward waits for its host-computed parameters' copies back
    (the host first waits for its worker); the states read once the run is over."""
    plain = test_overlap.training_run(torch.bfloat16, "8bit", placement, overlap=False, optimizer=optimizer)
    for share in SHARES:
        got = test_overlap.training_run(torch.bfloat16, "8bit", placement, overlap=True, optimizer=optimizer,
                                        options=dict(host_share=share), read_state=share == 1.0)
        if share == 1.0:
            got = got[0], got[1][-1:]
        assert_bitwise_equal(got, plain, f"share {share}")


def host_share_run(seed=0):
    """A streamed AdamW run with every tensor host-computed, on the simulated device."""
    cls, kwargs, dtype = CASES["AdamW-8bit-states-bf16-master"]
    return simulated(lambda groups, share: cls(groups, **kwargs, **PLACEMENTS["streamed"], backend="cpu",
                                               host_share=share), dtype, 1.0, seed)


def test_the_race_checker_holds_the_host_worker_to_its_waits(monkeypatch):
    _, sims = host_share_run()
    assert sum(sim.host_tasks for sim in sims) > 0  # (clean: the run raised no race)
    with monkeypatch.context() as patched:  # the worker does not wait for the copies down
        patched.setattr(HostShare, "_copied_down", lambda self, rt, down: None)
        with pytest.raises((RaceError, StepIncompleteError), match="RaceError.*host worker|host worker"):
            host_share_run()
    with monkeypatch.context() as patched:  # the copies back do not wait for the worker
        patched.setattr(HostShare, "_wait_for_worker", lambda self, rt: None)
        with pytest.raises((RaceError, StepIncompleteError), match="RaceError.*host worker|host worker"):
            host_share_run()


# Each drops a bucket right after a step, the copies back of its host-computed parameters still queued.
RELEASES = {
    "share changed": lambda opt: [g.update(host_share=OTHER_SHARE[g["host_share"]]) for g in opt.param_groups],
    "checkpoint loaded": lambda opt: opt.load_state_dict(copy.deepcopy(opt.state_dict())),
    "budget set": lambda opt: opt.set_device_budget(None),
    "group removed": lambda opt: opt.param_groups.pop(),
}


def released_run(release, share, sims=None):
    """Three steps of a streamed AdamW over two param groups, `RELEASES[release]` after the first;
    the parameters and every state at the end."""
    params = make_params(SHAPES)
    opt = fusedoff.AdamW([{"params": params[:3]}, {"params": params[3:], "lr": 3e-3}], **ADAM,
                         **PLACEMENTS["streamed"], backend="cpu", host_share=share)
    generator = torch.Generator().manual_seed(2)
    for step in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
            if sims:
                sims[-1].main_access([p.grad], write=True, what="backward writes a gradient")
        opt.step()
        if step == 0:
            RELEASES[release](opt)
    return [p.detach().clone() for p in params], [{k: v.clone() for k, v in opt.state[p].items()} for p in params]


@pytest.mark.parametrize("release", list(RELEASES))
def test_a_bucket_s_host_memory_is_released_once_its_copies_back_are_done(release):
    """A bucket dropped (placed afresh, or its group gone) gives its host memory back to the host:
    the host share's parameter buffer, which the step's copies back read, its states and other
    buffers. The simulator records the release as the host's write of each (see its docstring), so
    a release not after `wait_host`'s wait for those copies is a race; the bits are those of share 0."""
    want = released_run(release, 0.0)
    sims = []

    def factory(device):
        sims.append(SimulatedRuntime(device, seed=len(sims)))
        return sims[-1]

    with runtimes.simulate(factory):
        got = released_run(release, 1.0, sims)
    assert_bitwise_equal(got, want, release)
    assert sims[0].host_tasks > 0  # (the released bucket was host-computed, and released:)
    assert any("host share's parameter buffer released" in access.what
               for accesses in sims[0]._history.values() for access in accesses)


def test_a_stream_cannot_wait_for_the_host_worker():
    sim = SimulatedRuntime(torch.device("cpu"))
    task = sim.host_compute(lambda: None, after=None)
    with pytest.raises(TypeError, match="cannot wait for the host worker"):
        sim.wait_event(sim.new_stream(), task)
    sim.wait_host_compute(task)
    assert sim.host_tasks == 1


@pytest.mark.parametrize("share", [-0.1, 1.5, float("nan"), "0.5", None, True, "Auto", "automatic"])
def test_a_share_outside_0_to_1_is_refused_before_anything_changes(share):
    params = make_params(SHAPES)
    with pytest.raises(ValueError, match="host_share must be 'auto' or a number in"):
        fusedoff.AdamW(params, offload="stream", host_share=share)
    opt = fusedoff.AdamW(params, offload="stream", chunk_size=32, backend="cpu")
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    before = [p.detach().clone() for p in params], [dict(opt.state[p]) for p in params]
    before = copy.deepcopy(before)
    opt.param_groups[0]["host_share"] = share
    with pytest.raises(ValueError, match="host_share must be 'auto' or a number in"):
        opt.step()
    assert_bitwise_equal(([p.detach() for p in params], [dict(opt.state[p]) for p in params]), before)
    with pytest.raises(ValueError, match="host_share must be 'auto' or a number in"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))], "host_share": share})
    assert len(opt.param_groups) == 1


def test_a_share_with_offload_none_is_refused():
    with pytest.raises(ValueError, match="offload='none'"):
        fusedoff.AdamW(make_params(SHAPES), offload="none", host_share=0.5)
    opt = fusedoff.AdamW(make_params(SHAPES), offload="none", host_share=0)
    with pytest.raises(ValueError, match="offload='none'"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))], "host_share": 1.0})


def test_share_0_places_as_before_and_a_share_moves_only_streamed_tensors():
    """The rule of [note: the host share]: the longest prefix of the streamed tensors within the share."""
    from fusedoff.offload.host_share import host_computed

    assert host_computed([7, 40, 165, 16], [True] * 4, 0.0) == [False] * 4
    assert host_computed([7, 40, 165, 16], [True] * 4, 1.0) == [True] * 4
    # 0.3 of 228 is 68.4: 7 and 40 fit (47), 165 does not, 16 does (63)
    assert host_computed([7, 40, 165, 16], [True] * 4, 0.3) == [True, True, False, True]
    # a resident tensor counts for nothing: 0.3 of 221 is 66.3: 40, then 16 (56)
    assert host_computed([7, 40, 165, 16], [False, True, True, True], 0.3) == [False, True, False, True]
    assert host_computed([300, 7], [True, True], 0.5) == [False, True]  # a tensor too large does not end it


def test_the_cuda_runtime_s_worker_runs_its_tasks_in_order_off_the_calling_thread():
    """The CUDA runtime's host worker (no GPU needed without events): a thread of its own, tasks in
    the order given, the caller going on meanwhile, a task's error raised by the wait for it."""
    import threading

    from fusedoff.offload.cuda_runtime import CudaRuntime

    rt = CudaRuntime(torch.device("cuda", 0))
    seen, gate = [], threading.Event()
    rt.host_compute(lambda: (gate.wait(10), seen.append(threading.current_thread().name)), after=None)
    second = rt.host_compute(lambda: seen.append("second"), after=None)
    seen.append("the caller went on")
    gate.set()
    rt.wait_host_compute(second)
    assert seen[0] == "the caller went on" and seen[1].startswith("fusedoff-host") and seen[2] == "second"
    failing = rt.host_compute(lambda: 1 / 0, after=None)
    with pytest.raises(ZeroDivisionError):
        rt.wait_host_compute(failing)
    rt.wait_host_compute(failing)  # (raised once: the task is done)


class _DeferredWorker(HostRuntime):
    """The host loopback with a worker that runs a task when the host first waits for it (as a
    thread that has not finished before the wait), its error raised by that wait."""

    def host_compute(self, fn, *, after, reads=(), writes=()):
        return [fn, None]

    def wait_host_compute(self, task) -> None:
        if task is None:
            return
        if task[0] is not None:
            fn, task[0] = task[0], None
            try:
                fn()
            except Exception as error:
                task[1] = error
        error, task[1] = task[1], None
        if error is not None:
            raise error


@pytest.mark.parametrize("placement", ["loopback", "simulated", "overlapped"])
def test_a_worker_task_that_failed_leaves_the_step_incomplete(placement, monkeypatch):
    """Found when the host waits for it (the end of the step, or under overlap_with the wait for
    the step, here a checkpoint's): every later step and checkpoint refuses, as after any failure
    among a step's changes."""
    model = ParameterListModel(SHAPES, torch.float32)
    params = list(model.parameters())
    if placement != "loopback":
        factory = _DeferredWorker if placement == "overlapped" else lambda device: SimulatedRuntime(device, seed=3)
        monkeypatch.setattr(runtimes, "_simulated", factory)
    opt = fusedoff.AdamW(params, offload="stream", chunk_size=32, backend="cpu", host_share=1.0)
    if placement == "overlapped":
        opt.overlap_with(model)

    def fail(update, phase, args):
        raise RuntimeError("a host kernel failed")

    train(params, opt, 1)
    saved = copy.deepcopy(opt.state_dict())
    want = [p.detach().clone() for p in params]
    train(params, opt, range(1, 3))  # the failed step's parameters are not the checkpoint's
    failing = monkeypatch.context()
    with failing as patched:
        patched.setattr(host_share, "ops", type("FailingOps", (), {"run_update": staticmethod(fail)}))
        for p in params:
            p.grad = torch.ones_like(p)
        with pytest.raises((StepIncompleteError, RuntimeError), match="a host kernel failed"):
            opt.step()
            opt.state_dict()  # (a worker that runs the task later: found here)
    with pytest.raises(StepIncompleteError):
        opt.step()
    with pytest.raises(StepIncompleteError):
        opt.state_dict()
    with torch.no_grad():  # the checkpoint before the failed step: the run goes on from it
        for p, value in zip(params, want):
            p.copy_(value)
    opt.load_state_dict(saved)
    opt.state_dict()  # (the host waited for everything: nothing of the failed step is copied up)
    assert all(torch.equal(p.detach(), value) for p, value in zip(params, want))
    train(params, opt, range(1, 3))
    assert opt.state_dict()["state"][0]["step"] == 3


@pytest.mark.parametrize("backend,sums,refused", [("triton", False, "needs backend='cuda'"),
                                                  ("torch", False, "needs backend='cuda'"),
                                                  ("cuda", True, "sums over whole tensors"),
                                                  ("cuda", False, None)])
def test_on_a_gpu_a_share_is_refused_where_the_host_would_not_give_the_device_s_bits(backend, sums, refused):
    """The host kernels give the CUDA kernels' bits (test_the_host_kernels_give_the_cuda_kernels_bits),
    not a Triton kernel's or torch's, and they sum whole tensors (Apollo) in another order: those
    buckets refuse a share (HostShare.prepare, before the step changes anything). No GPU needed: the
    check reads the device's type."""
    check = functools.partial(host_share.check_host_computable, torch.device("cuda", 0), backend, sums)
    if refused is None:
        check()
    else:
        with pytest.raises(ValueError, match=refused):
            check()
    host_share.check_host_computable(torch.device("cpu"), backend if backend != "cuda" else "cpu", sums)  # one kernel


def test_a_checkpoint_saved_with_a_share_loads_into_an_optimizer_that_keeps_every_state_on_the_device(tmp_path):
    """Where a tensor is stepped is the loading run's choice, as its device budget is: a checkpoint of
    an optimizer with a share, saved to a file, loads into one with offload='none', which goes on as
    the saving one does."""
    params = make_params(SHAPES)
    sharing = fusedoff.AdamW(params, offload="stream", chunk_size=32, backend="cpu", host_share=0.5)
    train(params, sharing, 2)
    torch.save(sharing.state_dict(), tmp_path / "opt.pt")
    saved = torch.load(tmp_path / "opt.pt", weights_only=True)
    assert saved["param_groups"][0]["host_share"] == 0.5
    copies = [p.detach().clone().requires_grad_() for p in params]
    resident = fusedoff.AdamW(copies, offload="none", backend="cpu")
    resident.load_state_dict(saved)
    assert resident.param_groups[0]["host_share"] == "auto"  # (its own: the default)
    train(params, sharing, range(2, 4))
    train(copies, resident, range(2, 4))
    for p, q in zip(params, copies):
        assert_bitwise_equal(p.detach(), q.detach())


@pytest.mark.parametrize("fused_cls,torch_cls", test_adam_optimizer.PAIRS, ids=["AdamW", "Adam"])
def test_every_tensor_host_computed_is_as_close_to_float64_as_torch_optim(fused_cls, torch_cls):
    """A peer on the same inputs: every tensor stepped by the host (share 1) against torch.optim in
    float64, within test_adam_optimizer's bound (twice torch's own fp32 error, plus an ulp)."""
    kwargs = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, amsgrad=True)
    model = test_adam_optimizer.make_model("cpu")
    opt = fused_cls(model.parameters(), backend="cpu", offload="stream", chunk_size=64, host_share=1.0, **kwargs)
    train_model(model, opt, 20, test_adam_optimizer.batches(model, "cpu"), loss_in_fp32=True)
    assert opt.memory_stats()["host_computed_params"] == sum(p.numel() for p in model.parameters())
    test_adam_optimizer.assert_close_to_float64(model, opt, torch_cls, kwargs, 20, "cpu")
