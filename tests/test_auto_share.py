"""``host_share="auto"``: the share chosen from what the steps measure (fusedoff/offload/auto_share.py).

The controller is held against a brute-force oracle: a model of the two paths of a step (the
device's: copies down and streamed chunks; the host's: copies down and host kernels), its best
share found by evaluating the step at every share of a fine grid, in float64. The engine is held to
what the controller decides, on the stream simulator with clocks: the device's from the bytes the
link moved, the host worker's from the elements its kernels touched; every result is the bits of
share 0, whatever the share moved to.
"""

from __future__ import annotations

import os
import random
import threading
from types import SimpleNamespace

import pytest
import torch

import fusedoff
from fusedoff.offload import auto_share, host_share, runtimes
from fusedoff.offload.auto_share import MEASURED_STEPS, MIN_GAIN, PROBE_SHARE, AutoShare, AutoShares, StepTimes
from fusedoff.offload.cuda_runtime import _start_worker
from fusedoff.offload.runtime import HostRuntime
from fusedoff.testing.simulator import SimulatedRuntime
from tests import test_host_share
from tests.helpers import assert_bitwise_equal, make_params

GRID = [i / 10000 for i in range(10001)]


class TwoPaths:
    """A step's two paths, linear in the share except for a contention term: the host's kernels
    slow down with the share of host memory the streamed copies take, (1 + contention * (1 - x))."""

    def __init__(self, device: float, host: float, down: float, contention: float = 0.0, noise: float = 0.0,
                 seed: int = 0) -> None:
        self.device, self.host, self.down, self.contention, self.noise = device, host, down, contention, noise
        self.random = random.Random(seed)

    def times(self, x: float, elements: int = 10**6) -> StepTimes:
        jitter = lambda: 1.0 + self.noise * (2.0 * self.random.random() - 1.0)  # noqa: E731
        hosted = round(x * elements)
        x = hosted / elements
        host_s = self.host * x * (1.0 + self.contention * (1.0 - x)) * jitter()
        down_s = self.down * x
        return StepTimes(hosted, elements - hosted, device_s=down_s + self.device * (1.0 - x) * jitter(),
                         down_s=down_s, host_s=host_s)

    def step_s(self, x: float) -> float:
        host_s = self.host * x * (1.0 + self.contention * (1.0 - x))
        return max(self.down * x + self.device * (1.0 - x), self.down * x + host_s if x else 0.0)

    def best(self) -> tuple[float, float]:
        """(share, step) of the shortest step on the grid."""
        return min(((x, self.step_s(x)) for x in GRID), key=lambda t: t[1])


def run(controller: AutoShare, paths: TwoPaths, steps: int) -> list[float]:
    shares = []
    for _ in range(steps):
        controller.observe(paths.times(controller.share))
        shares.append(controller.share)
    return shares


@pytest.mark.parametrize("device, host, down", [(1.0, 3.0, 0.1), (1.0, 0.5, 0.2), (2.0, 2.0, 0.0)])
def test_the_share_moves_to_the_oracles_best_and_stays(device, host, down):
    """Streaming only first (the step to beat), then the probe, then the model's balance: measured,
    kept."""
    paths = TwoPaths(device, host, down)
    controller = AutoShare()
    assert controller.share == 0.0
    shares = run(controller, paths, 40)
    best_share, best_step = paths.best()
    assert controller.share == pytest.approx(best_share, abs=1e-3)
    assert paths.step_s(controller.share) <= best_step * (1 + 1e-3)
    assert controller.replans == 2  # linear paths: the probe, then the balance
    assert shares[:2 * MEASURED_STEPS] == [0.0] * (MEASURED_STEPS - 1) + [PROBE_SHARE] * MEASURED_STEPS + [shares[-1]]


def test_a_host_too_slow_to_pay_goes_back_to_streaming_only():
    """The probe measured slower than share 0, and the balance predicted less than MIN_GAIN better:
    back to 0, and not again."""
    paths = TwoPaths(1.0, 30.0, 0.05)
    controller = AutoShare()
    shares = run(controller, paths, 60)
    assert controller.share == 0.0 and controller.replans == 2
    assert shares.count(PROBE_SHARE) == MEASURED_STEPS
    assert paths.step_s(0.0) <= paths.best()[1] * (1 + MIN_GAIN)


def test_contention_converges_without_flip_flop():
    """The host kernels slow down while the copies stream: each move's prediction is off, and the
    next steps correct it; the moves end within a few, at a step close to the oracle's best."""
    paths = TwoPaths(1.0, 1.5, 0.1, contention=1.0, noise=0.02, seed=3)
    controller = AutoShare()
    shares = run(controller, paths, 200)
    best_share, best_step = paths.best()
    assert controller.replans <= 4
    assert len(set(shares[-100:])) == 1  # settled
    assert paths.step_s(controller.share) <= best_step * (1 + MIN_GAIN)


def test_noise_and_a_small_gain_do_not_replace():
    """A balance within MIN_GAIN of the best is kept, however the measurements scatter."""
    paths = TwoPaths(1.0, 1.0, 0.0, noise=0.03, seed=5)
    controller = AutoShare(share=0.49, _probed=True)  # the best is 0.5: at most a 2% gain
    shares = run(controller, paths, 100)
    assert controller.replans == 0 and set(shares) == {0.49}


def test_a_balance_that_moves_is_followed():
    paths = TwoPaths(1.0, 1.0, 0.1)
    controller = AutoShare()
    run(controller, paths, 20)
    assert controller.share == pytest.approx(paths.best()[0], abs=1e-3)
    paths.host = 4.0  # the host got busier (another job, another rank's data loader)
    run(controller, paths, 20)
    assert controller.share == pytest.approx(paths.best()[0], abs=1e-3)
    assert controller.replans == 3


def test_a_probe_that_hosts_nothing_is_doubled_up_to_its_limit():
    """A share whose tensors all exceed it hosts nothing (every tensor larger): the probe doubles
    (a share that hosts the same tensors re-places nothing) until one is hosted, or MAX_PROBE."""
    controller = AutoShare()
    moved = [controller.observe(StepTimes(0, 1000, device_s=1.0, down_s=0.0, host_s=0.0)) for _ in range(40)]
    assert moved.count(True) == 4  # 0.1, 0.2, 0.4, 0.5
    assert controller.share == auto_share.MAX_PROBE and controller.report()["seconds_per_share"]["host"] is None


# ---- the engine -------------------------------------------------------------------------------------
LINK_SECONDS_PER_BYTE = 1e-9


class ClockedRuntime(SimulatedRuntime):
    """The stream simulator with clocks: the device's time is the bytes copied over the link so far
    (at LINK_SECONDS_PER_BYTE); a host worker's task starts when the event it waits for was recorded
    and takes `host_seconds_per_element` times the elements it touches; once the host has waited for
    a task, nothing the device does next is earlier than its end. The worker's own clock (`now`)
    advances by the task's seconds while it runs."""

    measures_time = True

    def __init__(self, device, *, seed: int, host_seconds_per_element: float) -> None:
        super().__init__(device, seed=seed)
        self.host_seconds_per_element = host_seconds_per_element
        self._at: dict[int, tuple[object, float]] = {}
        self._task_end: dict[int, tuple[object, float]] = {}
        self._floor = 0.0
        self._clock = 0.0
        self._task_cost = 0.0

    def _device_time(self) -> float:
        return max(self._floor, (self.link.to_device + self.link.to_host) * LINK_SECONDS_PER_BYTE)

    def timer(self, stream):
        event = self.record(stream)
        self._at[id(event)] = (event, self._device_time())
        return event

    def seconds(self, start, end):
        return self._at[id(end)][1] - self._at[id(start)][1]

    def host_compute(self, fn, *, after, reads=(), writes=()):
        writes = list(writes)
        cost = sum(t.numel() for t in writes) * self.host_seconds_per_element
        began = self._at[id(after)][1] if after is not None else self._device_time()

        def timed():
            self._task_cost = cost
            fn()

        task = super().host_compute(timed, after=after, reads=reads, writes=writes)
        self._task_end[id(task)] = (task, began + cost)
        return task

    def wait_host_compute(self, task) -> None:
        super().wait_host_compute(task)
        if task is not None:
            self._floor = max(self._floor, self._task_end[id(task)][1])

    def now(self) -> float:
        began, self._clock = self._clock, self._clock + self._task_cost
        self._task_cost = 0.0
        return began


SHAPES = [(64,)] * 16 + [(8, 8)] * 4  # twenty tensors of 64: a share moves in steps of 5%
STEPS = 3 * MEASURED_STEPS + 2  # share 0, the probe, then the balance


def clocked_run(share, host_seconds_per_element: float, *, dtype=torch.bfloat16, **kwargs):
    """Trains SHAPES for STEPS steps on the clocked simulator; the parameters and states after each
    step, the memory_stats at the end and the runtimes."""
    sims = []

    def factory(device):
        sims.append(ClockedRuntime(device, seed=len(sims), host_seconds_per_element=host_seconds_per_element))
        return sims[-1]

    with runtimes.simulate(factory):
        params = make_params(SHAPES, dtype)
        opt = fusedoff.AdamW(params, lr=1e-2, weight_decay=0.1, offload="stream", chunk_size=128, backend="cpu",
                             host_share=share, **kwargs)
        generator = torch.Generator().manual_seed(2)
        seen, shares = [], []
        for _ in range(STEPS):
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator).to(dtype)
                if sims:  # (made at the first step)
                    sims[-1].main_access([p.grad], write=True, what="backward writes a gradient")
            opt.step()
            seen.append([p.detach().clone() for p in params]
                        + [{k: v.clone() for k, v in opt.state[p].items()} for p in params])
            shares.append(opt.memory_stats()["host_computed_params"] / sum(p.numel() for p in params))
    return seen, opt.memory_stats(), shares


@pytest.mark.parametrize("host_seconds_per_element, direction", [(1e-10, 1), (1e-6, -1)])
def test_auto_moves_the_share_toward_the_faster_path_and_keeps_every_bit(host_seconds_per_element, direction):
    reference, _, _ = clocked_run(0.0, host_seconds_per_element)
    seen, stats, shares = clocked_run("auto", host_seconds_per_element)
    assert_bitwise_equal(seen, reference)
    auto = stats["host_share_auto"]["cpu"]
    assert auto["replans"] == 2  # the probe, then where the two paths balance (or back to 0)
    assert shares[:MEASURED_STEPS] == [0.0] * MEASURED_STEPS  # streaming only, measured first
    assert shares[MEASURED_STEPS] == pytest.approx(PROBE_SHARE)  # two of the twenty tensors
    assert (shares[-1] - shares[MEASURED_STEPS]) * direction > 0  # the placement followed
    assert auto["last_step"]["measured_step_s"] > 0
    assert len(auto["measured_step_s"]) == 3 if direction > 0 else 2  # (a slow host: the probe, then back to 0)


def test_auto_is_0_where_nothing_is_measured():
    """The host loopback (CPU parameters: the host is the device) and the plain simulator have no
    timers: "auto" hosts nothing and reports no automatic share."""
    params = make_params(SHAPES)
    opt = fusedoff.AdamW(params, offload="stream", chunk_size=128, backend="cpu")
    assert opt.param_groups[0]["host_share"] == "auto"
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    stats = opt.memory_stats()
    assert stats["host_computed_params"] == 0 and stats["streamed_params"] > 0
    assert stats["host_share_auto"] is None
    with runtimes.simulate(lambda device: SimulatedRuntime(device, seed=0)):
        opt = fusedoff.AdamW(params, offload="stream", chunk_size=128, backend="cpu")
        opt.step()
        assert opt.memory_stats()["host_computed_params"] == 0


class _TimedCuda(HostRuntime):
    measures_time = True


@pytest.mark.parametrize("backend, sums, expected", [("cuda", False, True), ("triton", False, False),
                                                      ("cuda", True, False)])
def test_auto_hosts_only_where_every_bit_is_kept(backend, sums, expected, monkeypatch):
    """On a GPU, "auto" hosts a bucket only where the host kernels give the device's bits: the CUDA
    backend's, for updates without whole-tensor sums (where a fraction raises, "auto" is 0)."""
    monkeypatch.setattr(host_share, "backend_named", lambda name: SimpleNamespace(device_type=None, require=lambda: None))
    device = torch.device("cuda", 0)
    assert host_share.auto_host_computable(device, backend, sums, _TimedCuda(device)) is expected
    assert not host_share.auto_host_computable(device, backend, sums, HostRuntime(device))
    if not expected:
        with pytest.raises(ValueError, match="host_share > 0"):
            host_share.check_host_computable(device, backend, sums)


def test_a_missing_host_kernel_makes_auto_0(monkeypatch):
    def missing():
        raise RuntimeError("fusedoff._C is not built")

    monkeypatch.setattr(host_share, "backend_named", lambda name: SimpleNamespace(device_type=None, require=missing))
    device = torch.device("cuda", 0)
    assert not host_share.auto_host_computable(device, "cuda", False, _TimedCuda(device))


# ---- the worker's threads ----------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_host_threads_are_checked_before_anything(value):
    with pytest.raises(ValueError, match="host_threads must be"):
        fusedoff.AdamW(make_params(SHAPES), host_threads=value)


def test_the_default_threads_leave_a_core_per_rank(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert host_share.default_host_threads() == 63
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert host_share.default_host_threads() == 7
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)  # pinned per rank
    assert host_share.default_host_threads() == 7
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert host_share.default_host_threads() == 1


def test_the_workers_threads_are_its_own():
    """The worker's OpenMP threads (what the host kernels ask torch for) are set on its thread only:
    the Python thread's and a thread started later keep torch's."""
    before = torch.get_num_threads()
    wanted = 1 if before > 1 else 2
    seen = {}

    def worker():
        _start_worker(torch.device("cpu"), wanted)
        seen["worker"] = torch.get_num_threads()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    other = threading.Thread(target=lambda: seen.setdefault("other", torch.get_num_threads()))
    other.start()
    other.join()
    assert seen == {"worker": wanted, "other": before}
    assert torch.get_num_threads() == before


def test_report_before_and_after_a_step():
    controller = AutoShare(share=0.1)
    assert controller.report()["last_step"] is None
    controller.observe(StepTimes(10, 90, device_s=1.0, down_s=0.1, host_s=0.2, measured_s=1.05))
    report = controller.report()
    assert report["last_step"] == {"share": 0.1, "device_s": 1.0, "host_s": pytest.approx(0.3),
                                   "measured_step_s": 1.05}
    assert report["seconds_per_share"]["host"] == pytest.approx(2.0)
    assert report["seconds_per_share"]["device"] == pytest.approx(0.9 / 0.9)


def test_the_model_the_controller_predicts_with():
    assert auto_share.predicted_step(0.0, 1.0, 3.0, 0.1) == 1.0
    assert auto_share.predicted_step(0.25, 1.0, 3.0, 0.1) == pytest.approx(max(0.025 + 0.75, 0.025 + 0.75))


def test_a_share_the_placement_cannot_reach_is_not_placed_again_and_again():
    """Whole tensors: with two tensors the placed share is 0, 0.5 or 1, whatever the target; once
    the target is where the measurements put it, nothing re-places (each re-placement copies every
    state once in host memory)."""
    paths = TwoPaths(1.0, 0.35, 0.05, noise=0.01, seed=11)
    controller = AutoShare(share=0.5, _probed=True)  # the best is 0.74: placed as 0.5
    for _ in range(100):
        placed = round(controller.share * 2) / 2
        controller.observe(paths.times(placed, elements=2))
    assert controller.replans == 1 and controller.share == pytest.approx(1 / 1.35, abs=0.01)


def test_a_container_narrower_than_the_machine_is_split_among_its_ranks(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)  # a cpuset of 32
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert host_share.default_host_threads() == 3  # 32 / 8 - 1, not 31 for each of 8 ranks


# ---- what the engine feeds the controller ----------------------------------------------------------------
class _FakeTimers:
    """A runtime whose timers are numbers (seconds), complete after `ready_after` looks."""

    device = torch.device("cpu")

    def __init__(self, ready_after: int = 0, capturing: bool = False) -> None:
        self.looks, self.ready_after, self._capturing = 0, ready_after, capturing

    def capturing(self) -> bool:
        return self._capturing

    def seconds(self, start, end):
        self.looks += 1
        return None if self.looks <= self.ready_after else end - start

    def task_seconds(self, task, measured):
        return measured


def _timing(rt, *, skipped=False):
    host = SimpleNamespace(copied_down=0.1, copied_up=1.2, last_task=None, compute_s=0.8, skipped=skipped)
    return auto_share._Timing(rt, 0.0, [], hosted=10, streamed=90, ends=[1.0, 0.9], hosts=[host])


def test_the_step_measured_is_from_its_start_to_the_last_copy_back():
    shares = AutoShares()
    rt = _FakeTimers()
    shares.by_device[rt.device] = AutoShare(share=0.1)
    shares._pending = [_timing(rt)]
    shares.observe()
    last = shares.by_device[rt.device].last
    assert (last.device_s, last.down_s, last.host_s, last.measured_s) == (1.0, 0.1, 0.8, 1.2)


def test_steps_gradscaler_skipped_are_not_measured():
    """A skipped step's host kernels return at once: its host time would say the host is free."""
    shares = AutoShares()
    rt = _FakeTimers()
    shares.by_device[rt.device] = AutoShare(share=0.1)
    shares._pending = [_timing(rt, skipped=True)]
    shares.observe()
    assert shares.by_device[rt.device].last is None and shares.report() is None


def test_timers_not_complete_are_looked_at_again_then_dropped():
    shares = AutoShares()
    late = _FakeTimers(ready_after=4)  # the first look reads 4 timers: none complete
    shares.by_device[late.device] = AutoShare(share=0.1)
    shares._pending = [_timing(late)]
    shares.observe()
    assert shares.by_device[late.device].last is None and len(shares._pending) == 1
    shares.observe()
    assert shares.by_device[late.device].last is not None and not shares._pending
    never = _FakeTimers(ready_after=10**9)
    shares._pending = [_timing(never)]
    for _ in range(auto_share.PENDING):
        shares.observe()
    assert not shares._pending  # (dropped, never waited for)


def test_nothing_is_looked_at_during_a_graph_capture_and_a_failed_step_is_discarded():
    shares = AutoShares()
    rt = _FakeTimers(capturing=True)
    shares.by_device[rt.device] = AutoShare(share=0.1)
    shares._pending = [_timing(rt)]
    shares.observe()
    assert rt.looks == 0 and len(shares._pending) == 1
    shares.discard()
    assert not shares._pending


def test_a_share_that_hosts_the_same_tensors_places_nothing_afresh():
    """Whole tensors: a share that would host the tensors already hosted is recorded, and the states
    stay where they are (each re-placement copies every state once in host memory)."""
    params = make_params([(64,)] * 10)
    opt = fusedoff.AdamW(params, offload="stream", chunk_size=128, backend="cpu", host_share=0.3)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    placement = opt._engine.placement
    opt.param_groups[0]["host_share"] = 0.35  # still three of the ten tensors
    opt.step()
    assert opt._engine.placement is placement and opt.memory_stats()["host_computed_params"] == 3 * 64
    opt.param_groups[0]["host_share"] = 0.45  # four
    opt.step()
    assert opt._engine.placement is not placement and opt.memory_stats()["host_computed_params"] == 4 * 64


def test_auto_is_0_under_overlap_with():
    """The next forward waits for a module's host-computed parameters until the host stepped the
    whole bucket, which the step's timers do not see: "auto" hosts nothing while the step overlaps."""
    sims = []

    def factory(device):
        sims.append(ClockedRuntime(device, seed=0, host_seconds_per_element=1e-10))
        return sims[-1]

    with runtimes.simulate(factory):
        model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(10)))
        opt = fusedoff.AdamW(model.parameters(), offload="stream", chunk_size=128, backend="cpu")

        def step():
            model(torch.ones(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            return opt.memory_stats()["host_computed_params"]

        hosted = [step() for _ in range(3 * MEASURED_STEPS + 2)]
        assert hosted[-1] > 0  # (a fast host: "auto" hosts tensors)
        opt.overlap_with(model)
        assert [step() for _ in range(3 * MEASURED_STEPS + 2)] == [0] * (3 * MEASURED_STEPS + 2)


@pytest.mark.parametrize("placement", ["resident", "streamed", "mixed"])
@pytest.mark.parametrize("case", list(test_host_share.CASES))
def test_a_moving_automatic_share_keeps_every_bit(case, placement, monkeypatch):
    """test_host_share's run (two groups, GradScaler with an overflow, clipping, a write outside the
    step, states read after each step, a share set by hand, a checkpoint loaded into a new optimizer)
    with host_share="auto" deciding after every step (MEASURED_STEPS 1) on the clocked simulator,
    whose race checker sees it: the bits of share 0."""
    monkeypatch.setattr(auto_share, "MEASURED_STEPS", 1)
    monkeypatch.setitem(test_host_share.OTHER_SHARE, "auto", 0.3)  # the share set by hand at CHANGE_AT
    cls, kwargs, dtype = test_host_share.CASES[case]

    def make(groups, share):
        return cls(groups, **kwargs, **test_host_share.PLACEMENTS[placement], backend="cpu", host_share=share)

    want = test_host_share.training_run(make, dtype, 0.0)[:2]
    sims = []

    def factory(device):
        sims.append(ClockedRuntime(device, seed=len(sims), host_seconds_per_element=1e-11))
        return sims[-1]

    with runtimes.simulate(factory):
        got = test_host_share.training_run(make, dtype, "auto", sim=sims)[:2]
    assert_bitwise_equal(got, want)
    # (every state resident: nothing streams, and "auto" hosts nothing)
    assert (sum(sim.host_tasks for sim in sims) > 0) == (placement != "resident") and any(sim.checked for sim in sims)
