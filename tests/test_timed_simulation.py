"""The timed simulator (fusedoff/testing/timed.py): its arithmetic against schedules worked out by hand,
the real engine on it against the host loopback (results bit for bit, link bytes as
benchmarks/traffic.py counts them), and the scale factor."""

from __future__ import annotations


import pytest
import torch

import fusedoff
from benchmarks import predict_step, traffic
from fusedoff.testing.timed import D2H, H2D, HOST, KERNEL, Rates, TimedRuntime, link_rates, predict

MS = 1e-3
# 1 byte per ns each way, 1.5 bytes per ns both at once; 4 bytes per ns of device memory; no host cost
HAND = Rates(h2d=1e9, d2h=1e9, both=1.5e9, device_memory=4e9, device_memory_fraction=1.0, host_call=0.0)


def test_link_sharing_by_hand():
    assert link_rates(1, 0, HAND) == (1e9, 0.0)
    assert link_rates(1, 1, HAND) == (0.75e9, 0.75e9)  # the cap split in halves
    assert link_rates(2, 0, HAND) == (0.5e9, 0.0)  # two copies one way share its rate
    slow_d2h = Rates(h2d=1e9, d2h=0.4e9, both=1.2e9)
    assert link_rates(1, 1, slow_d2h) == pytest.approx((0.8e9, 0.4e9))  # d2h under its half: h2d gets the rest
    assert link_rates(1, 1, Rates(h2d=1e9, d2h=1e9, both=3e9)) == (1e9, 1e9)  # the cap does not bind


def two_chunks(rates: Rates, forward_wait: bool = True):
    """Two chunks through three streams, each: copy-in 2 MB, a kernel over 4 MB (zero_ on a 2 MB
    buffer: read and written), copy-out 2 MB; then two forward layers on the main stream, the second
    after an event of the compute stream."""
    rt = TimedRuntime(torch.device("cpu"))
    cin, comp, cout = rt.new_stream(), rt.new_stream(), rt.new_stream()
    host = [torch.zeros(500_000) for _ in range(2)]  # 2 MB each
    bufs = [rt.empty(500_000) for _ in range(2)]
    rt.main_work(1 * MS, "forward layer 0")  # nothing to wait for
    rt.step_begins = rt.mark()
    for k in range(2):
        rt.copy(cin, bufs[k], host[k])
        rt.wait_event(comp, rt.record(cin))
        rt.launch(comp, bufs[k].zero_)
        rt.wait_event(cout, rt.record(comp))
        rt.copy(cout, host[k], bufs[k])
    rt.forward_begins = rt.mark()
    if forward_wait:
        rt.wait_event(rt.current_stream(), rt.record(comp))
    rt.main_work(0.5 * MS, "forward layer 1")
    return rt


def ends(rt, rates, kind):
    timed = rt.schedule(rates)
    return [timed.end[op.index] for op in rt.ops if op.kind == kind], timed


def test_two_chunks_by_hand():
    rt = two_chunks(HAND)
    assert [op.amount for op in rt.ops if op.kind == KERNEL] == [4e6, 4e6]  # zero_: 2 MB read, 2 MB written
    (in0, in1), timed = ends(rt, HAND, H2D)
    (out0, out1), _ = ends(rt, HAND, D2H)
    (k0, k1), _ = ends(rt, HAND, KERNEL)
    # copy-in 0 alone: 0-2 ms; copy-in 1 from 2 ms; kernel 0 2-3 ms; at 3 ms copy-out 0 starts and the
    # link is shared (0.75 B/ns each): copy-in 1's last 1 MB ends at 3 + 1/0.75; copy-out 0 has moved
    # 1 MB by then, its last 1 MB alone takes 1 ms more; kernel 1 after copy-in 1; copy-out 1 (2 ms alone)
    # after kernel 1 and copy-out 0.
    in1_end = 3 * MS + 1 * MS / 0.75
    assert (in0, k0) == pytest.approx((2 * MS, 3 * MS))
    assert in1 == pytest.approx(in1_end)
    assert out0 == pytest.approx(in1_end + 1 * MS)
    assert k1 == pytest.approx(in1_end + 1 * MS)
    assert out1 == pytest.approx(in1_end + 3 * MS)
    work = [timed.end[op.index] for op in rt.ops if op.kind == "work"]
    assert work == pytest.approx([1 * MS, in1_end + 1.5 * MS])  # layer 1 waited for kernel 1
    # without the wait, layer 1 follows layer 0 on the main stream
    rt = two_chunks(HAND, forward_wait=False)
    work, _ = ends(rt, HAND, "work")
    assert work == pytest.approx([1 * MS, 1.5 * MS])


def test_host_cost_by_hand():
    """Host calls one after another, 0.1 ms each; a device operation starts after the call that queued it;
    synchronize ends one call after its event."""
    rates = Rates(h2d=1e9, d2h=1e9, both=2e9, device_memory=1e9, device_memory_fraction=1.0, host_call=0.1 * MS)
    rt = TimedRuntime(torch.device("cpu"))
    cin, comp = rt.new_stream(), rt.new_stream()
    buf = rt.empty(250_000)  # 1 MB
    rt.copy(cin, buf, torch.zeros(250_000))  # host 0-0.1, copy 0.1-1.1
    rt.wait_event(comp, rt.record(cin))  # host 0.1-0.2 (record), 0.2-0.3 (wait)
    rt.launch(comp, buf[:125_000].zero_)  # host 0.3-0.4, kernel over 1 MB: 1.1-2.1
    rt.synchronize(rt.record(comp))  # host 0.4-0.5 (record), synchronize 2.1-2.2
    for _ in range(10):
        rt.main_work(0.0)  # ten calls issued from 2.2 on
    timed = rt.schedule(rates)
    host_ends = [timed.end[op.index] for op in rt.ops if op.kind == HOST]
    assert host_ends[:6] == pytest.approx([0.1 * MS, 0.2 * MS, 0.3 * MS, 0.4 * MS, 0.5 * MS, 2.2 * MS])
    assert [timed.end[op.index] for op in rt.ops if op.kind in (H2D, KERNEL)] == pytest.approx([1.1 * MS, 2.1 * MS])
    assert max(timed.end) == pytest.approx(3.2 * MS)


def test_prediction_of_the_two_chunks():
    rt = two_chunks(HAND)
    p = predict(rt, HAND, step=range(rt.step_begins, rt.forward_begins), forward=range(rt.forward_begins, rt.mark()))
    in1_end = 3 * MS + 1 * MS / 0.75
    assert p.step_s == pytest.approx(in1_end + 3 * MS)
    assert (p.h2d_bytes, p.d2h_bytes, p.kernel_bytes) == (4e6, 4e6, 8e6)
    assert p.link_bound_s == pytest.approx(8e6 / 1.5e9)
    # layer 1 (0.5 ms) ends at in1_end + 1.5 ms; after an instant step it would end at 1.5 ms
    assert p.exposed_s == pytest.approx(in1_end)
    assert p.critical_path[-1].split()[4:6] == ["main", "stream"]
    assert p.path_seconds["work"] == pytest.approx(0.5 * MS)


@pytest.mark.parametrize("state_precision", ["fp32", "bf16", "8bit"])
def test_engine_on_the_timed_runtime_equals_the_host_loopback(state_precision):
    numels, chunk = [1000, 700, 3000, 37], 256  # tensors spanning chunks and sharing them
    params = predict_step.scaled_params(numels, 1, seed=3)
    recorded = predict_step.record(params, state_precision, chunk, 1.0, [1 * MS], numels)
    loopback = predict_step.scaled_params(numels, 1, seed=3)
    opt = fusedoff.AdamW(loopback, **predict_step.HYPER, offload="stream", chunk_size=chunk, num_buffers=2,
                         state_precision=state_precision, backend="cpu")
    for _ in range(2):  # record() takes two steps
        opt.step()
    for got, want in zip(params, loopback):
        assert torch.equal(got, want)
        got_states, want_states = recorded.optimizer.state[got], opt.state[want]
        assert got_states.keys() == want_states.keys() and len(want_states) >= 3
        for name in want_states:
            assert torch.equal(got_states[name], want_states[name]), name
    p = predict(recorded.runtime, HAND, recorded.step, recorded.forward)
    h2d, d2h = traffic.adam_stream_link(numels, chunk, traffic.PRECISIONS["bf16_master"],
                                        state=traffic.STATE_PRECISIONS[state_precision])
    assert (p.h2d_bytes, p.d2h_bytes) == (h2d, d2h)
    # the kernels' bytes: the update's own, and the bf16 parameter read too (2 bytes, see the note);
    # at most a few step counts (4 bytes each, one per piece of a tensor in a chunk) besides
    update = traffic.adam_tensors_update_bytes(numels, traffic.PRECISIONS["bf16_master"],
                                               state=traffic.STATE_PRECISIONS[state_precision])
    pieces = 30
    assert update + 2 * sum(numels) <= p.kernel_bytes <= update + 2 * sum(numels) + 4 * pieces


def test_scale_multiplies_device_time_and_leaves_host_cost():
    numels = [2048, 2048, 1024]
    recorded = predict_step.record(predict_step.scaled_params(numels, 1), "fp32", 256, 1.0, [], numels)
    rt = recorded.runtime
    no_host = Rates(host_call=0.0)
    base = rt.schedule(no_host)
    rt.scale = 1000.0
    scaled = rt.schedule(no_host)
    # without host costs every time is a sum of byte counts over rates: the whole schedule scales
    assert scaled.end == pytest.approx([e * 1000 for e in base.end], rel=1e-9)
    with_host = Rates(host_call=5e-6)
    timed = rt.schedule(with_host)
    for op in rt.ops:
        if op.kind == HOST:
            assert timed.end[op.index] - timed.start[op.index] == pytest.approx(5e-6)
    p1 = predict(rt, with_host, recorded.step)
    rt.scale = 2000.0
    p2 = predict(rt, with_host, recorded.step)
    assert (p2.h2d_bytes, p2.d2h_bytes, p2.link_bound_s) == pytest.approx((2 * p1.h2d_bytes, 2 * p1.d2h_bytes,
                                                                           2 * p1.link_bound_s))
    assert p2.host_calls == p1.host_calls
    assert p1.h2d_bytes == 1000 * 12 * sum(numels)  # fp32 master and moments, each chunk in whole


# ---- the host resource ([note: timed host resource]) ---------------------------------------------------
def test_host_memory_sharing_by_hand():
    from fusedoff.testing.timed import host_rates

    tight = Rates(host_memory=1.5e9)
    assert host_rates(1e9, 1e9, 0, tight) == (0.75e9, 0.75e9, 0.0)  # the copies slowed alike
    assert host_rates(1e9, 0.0, 1, tight) == (1e9, 0.0, 0.5e9)  # the kernels get what the copies leave
    roomy = Rates(host_memory=200e9, host_kernel=60e9)
    assert host_rates(50e9, 50e9, 2, roomy) == (50e9, 50e9, 30e9)  # the kernels' own rate, split
    assert host_rates(50e9, 50e9, 1, Rates()) == (50e9, 50e9, float("inf"))  # unbounded by default


def test_a_host_task_schedule_by_hand():
    """A d2h copy of 1 GB, then a host task over 1.5 GB that waits for it; an h2d copy of 2 GB from
    the start. Host memory 1.5 GB/s: the two copies get 0.75 GB/s each until the d2h copy ends
    (4/3 s); then the h2d copy runs at 1 GB/s for its last 1 GB and the task gets the 0.5 GB/s left
    (0.5 GB by 7/3 s); then the task alone at 1.5 GB/s, its last 1 GB in 2/3 s: it ends at 3 s."""
    scale = 250_000  # a byte recorded stands for this many
    rates = Rates(h2d=1e9, d2h=1e9, both=3e9, host_call=0.0, host_memory=1.5e9)
    rt = TimedRuntime(torch.device("cpu"), scale=scale, rates=rates)
    down, up = rt.new_stream(), rt.new_stream()
    rt.copy_to_host(down, torch.empty(1000), rt.empty(1000))  # 4000 bytes: 1 GB
    rt.copy_to_device(up, rt.empty(2000), torch.empty(2000))  # 2 GB
    values = torch.ones(750)
    task = rt.host_compute(lambda: values.mul_(2.0), after=rt.timer(down))  # read and written: 1.5 GB
    start = rt.timer(rt.current_stream())
    timed = rt.schedule(rates)
    assert timed.end[task.op] == pytest.approx(3.0)
    assert timed.start[task.op] == pytest.approx(4 / 3)
    assert rt.task_seconds(task, measured=0.0) == pytest.approx(3.0 - 4 / 3)
    assert rt.seconds(start, rt.timer(down)) == pytest.approx(4 / 3)
    rt.wait_host_compute(task)
    assert rt.ops[-1].kind == HOST and rt.ops[-1].deps[-1] == task.op
    rt.drain()
    assert rt.seconds(start, rt.timer(down)) is None  # (a drain between them)


def test_auto_on_the_timed_model_lands_within_min_gain_of_the_best_placement():
    """host_share="auto" on the timed simulator, with the workstation preset's rates (link-bound): its
    step is within MIN_GAIN of the best of every placement it could choose (k of the 16 tensors hosted),
    each scheduled alike, and shorter than streaming only."""
    from benchmarks import predict_host_share
    from fusedoff import costs
    from fusedoff.offload.auto_share import MIN_GAIN

    rates = predict_host_share.timed_rates(costs.preset("workstation-pcie4"))
    numels = [predict_step.TENSOR] * 16
    auto_s, share, _ = predict_host_share.run(numels, rates, "auto")
    every = [predict_host_share.run(numels, rates, k / 16)[0] for k in range(17)]
    assert auto_s <= min(every) * (1 + MIN_GAIN)
    assert auto_s < every[0] * (1 - MIN_GAIN) and share > 0
