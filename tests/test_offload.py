"""The offload engine: chunk plan, host store, and optimizers with offload='stream'.

On CPU the engine runs its full chunk bookkeeping with host buffers (no streams); chunk sizes are
tiny so that tensors span chunks and chunks hold several tensors. The `cuda` tests exercise the
real streams and are run by the GPU suite.
"""

from __future__ import annotations

import copy
import itertools
import time

import pytest
import torch

import fusedoff
from fusedoff.offload.contract import StateSpec
from fusedoff.offload.plan import ALIGN_ELEMENTS, ChunkPlan
from fusedoff.offload.store import HostStateStore
from tests.helpers import backend_params, drawn_grads, make_params, relative_l2_error, train

SHAPES = [(), (1,), (7,), (33, 5), (300,), (0,), (16,)]


def test_chunk_plan_knows_chunks_of_whole_tensors():
    plan = ChunkPlan([t.numel() for t in make_params(SHAPES)], 48)
    whole = [plan.whole_tensors_only(c) for c in plan.chunks]
    assert whole[0] and whole[-1] and not any(whole[1:-1])  # both kinds, as the Apollo test relies on


@pytest.mark.parametrize("segment", [None, 200], ids=["one-segment", "segments"])
def test_chunk_plan_covers_every_element_once_aligned(segment):
    numels = [0, 1, 7, 165, 300, 16, 4097]
    plan = ChunkPlan(numels, 64, segment)
    seen = [torch.zeros(n, dtype=torch.int32) for n in numels]
    for chunk in plan.chunks:
        assert chunk.numel <= 64 and chunk.begin % 64 == 0
        assert chunk.begin + chunk.numel <= plan.segment_sizes[chunk.segment]
        for piece in chunk.pieces:
            assert plan.segment_of[piece.tensor] == chunk.segment  # no chunk spans two segments
            assert plan.offsets[piece.tensor] % ALIGN_ELEMENTS == 0 and piece.chunk_offset % ALIGN_ELEMENTS == 0
            assert chunk.begin + piece.chunk_offset == plan.offsets[piece.tensor] + piece.tensor_offset
            seen[piece.tensor][piece.tensor_offset : piece.tensor_offset + piece.length] += 1
    assert all(bool((s == 1).all()) for s in seen)
    assert any(len(c.pieces) > 1 for c in plan.chunks) and len(plan.chunks) > 10
    if segment is not None:  # segments of at most 200 elements, or one tensor larger than that
        assert len(plan.segment_sizes) > 2
        for index, size in enumerate(plan.segment_sizes):
            members = [t for t, s in enumerate(plan.segment_of) if s == index and numels[t]]
            assert size <= 208 or len(members) == 1
    with pytest.raises(ValueError, match="multiple of 16"):
        ChunkPlan(numels, 100)


def test_chunk_plan_cuts_a_shard_with_a_lead_on_its_parameters_blocks():
    # A shard starting 400 elements into its parameter (144 into block 1) and one starting on a block;
    # an empty shard's lead is ignored.
    plan = ChunkPlan([300, 0, 600], 256, align=256, leads=[144, 17, 0])
    assert plan.offsets == [144, 512, 512]
    pieces = [(p.tensor, p.tensor_offset, p.chunk_offset, p.length) for c in plan.chunks for p in c.pieces]
    # The first shard's head (112 elements, the rest of block 1) fills its chunk's end; every other
    # piece starts on a chunk, hence on a block of the parameter.
    assert pieces == [(0, 0, 144, 112), (0, 112, 0, 188), (2, 0, 0, 256), (2, 256, 0, 256), (2, 512, 0, 88)]
    store = HostStateStore(plan, (StateSpec("codes", torch.uint8), StateSpec("absmax", torch.float32, 256)))
    assert [store.view("absmax", t).numel() for t in range(3)] == [2, 0, 3]  # the blocks each touches
    assert store.view("codes", 0).numel() == 300
    with pytest.raises(ValueError, match="leads"):
        ChunkPlan([300], 256, align=256, leads=[256])


def test_host_store_hands_out_views_of_one_slab_per_tensor():
    numels = [7, 1000, 300, 0, 64]
    plan = ChunkPlan(numels, 64, 3 * 64)  # slabs of at most 3 chunks: the 1000-element tensor has its own
    store = HostStateStore(plan, ("a", "b"))
    values = [torch.randn(n) for n in numels]
    for t, v in enumerate(values):
        store.view("a", t).copy_(v)
    for t, v in enumerate(values):
        view = store.view("a", t)
        assert torch.equal(view, v) and not store.view("b", t).any()
        slab = store.slabs["a"][plan.segment_of[t]]
        assert view.untyped_storage().data_ptr() == slab.untyped_storage().data_ptr()  # a view, not a copy
    # A chunk is a view of the same slab: writing through it is seen by the tensors' views.
    for chunk in plan.chunks:
        store.chunk("b", chunk).fill_(chunk.index + 1)
    for chunk in plan.chunks:
        for piece in chunk.pieces:
            got = store.view("b", piece.tensor)[piece.tensor_offset : piece.tensor_offset + piece.length]
            assert bool((got == chunk.index + 1).all())
    # The store holds what the layout needs (padding to 16 elements per tensor) and nothing more.
    assert store.nbytes == 2 * plan.total * 4 <= 2 * 4 * (sum(numels) + ALIGN_ELEMENTS * len(numels))


def run(opt_factory, dtype, steps, seed=1, skip=None, device="cpu"):
    """Trains the tensors of SHAPES in `dtype` for `steps` steps of a run's gradients from `seed`."""
    params = make_params(SHAPES, dtype, device=device)
    opt = opt_factory(params)
    train(params, opt, steps, drawn_grads(seed, 0.1, skip))
    return params, opt


def all_states(opt):
    return {pid: {k: v.cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for pid, s in opt.state_dict()["state"].items()}


@pytest.mark.parametrize("backend,device", backend_params(("cpu", "torch")))
@pytest.mark.parametrize("cls,kwargs", [
    (fusedoff.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    (fusedoff.Adam, dict(lr=1e-2, weight_decay=0.1)),
], ids=["AdamW-amsgrad", "Adam"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-master"])
def test_adam_streamed_equals_resident(backend, device, cls, kwargs, dtype):
    """Elementwise math: chunking changes nothing, so the streamed run matches the resident one
    to the bit (same kernel, same element values)."""
    skip = lambda step, i: i == 3 and step % 3 == 0  # noqa: E731  one tensor sits out some steps
    ref_params, ref = run(lambda ps: cls(ps, backend=backend, offload="none", **kwargs), dtype, 8, skip=skip,
                          device=device)
    got_params, got = run(lambda ps: cls(ps, backend=backend, offload="stream", chunk_size=64, **kwargs),
                          dtype, 8, skip=skip, device=device)
    for a, b in zip(got_params, ref_params):
        assert torch.equal(a, b)
    want = all_states(ref)
    for pid, state in all_states(got).items():
        assert set(state) == set(want[pid])
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(want[pid][key])), (pid, key)
    assert got.state_dict()["state"][3]["step"].item() == 5


@pytest.mark.parametrize("backend,device", backend_params(("cpu", "torch")))
@pytest.mark.parametrize("rebound,decay_type", list(itertools.product(["constant", "belief"],
                                                                      ["L2", "decoupled", "stable"])))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-master"])
@pytest.mark.parametrize("chunk_size", [48, 1024], ids=["mixed-chunks", "resident-chunk"])
def test_apollo_streamed_matches_resident(backend, device, rebound, decay_type, dtype, chunk_size):
    """Whole-tensor sums gathered across chunks. With 48-element chunks the first and last hold only
    whole tensors (every phase in one visit) and the others pieces of tensors spanning chunks (a
    pass per phase); with 1024 every tensor is whole in one chunk. The partial sums of a tensor are
    added into its float64 stats in chunk order, which here gives the resident run's bits exactly
    (measured: 0 difference in every state and parameter), so equality is required."""
    kwargs = dict(lr=1e-2, warmup=2, weight_decay=0.01, rebound=rebound, weight_decay_type=decay_type)
    ref_params, ref = run(lambda ps: fusedoff.Apollo(ps, backend=backend, offload="none", **kwargs), dtype, 5,
                          device=device)
    got_params, got = run(lambda ps: fusedoff.Apollo(ps, backend=backend, offload="stream", chunk_size=chunk_size,
                                                     **kwargs), dtype, 5, device=device)
    for a, b in zip(got_params, ref_params):
        assert torch.equal(a, b)
    want = all_states(ref)
    for pid, state in all_states(got).items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(want[pid][key])), (pid, key)


def test_streamed_checkpoint_moves_to_torch_and_back():
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    params, opt = run(lambda ps: fusedoff.AdamW(ps, offload="stream", chunk_size=32, **kwargs), torch.float32, 3)
    saved = copy.deepcopy(opt.state_dict())
    torch_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    torch_opt = torch.optim.AdamW(torch_params, foreach=False, **kwargs)
    torch_opt.load_state_dict(saved)
    back = fusedoff.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], offload="stream",
                          chunk_size=32, **kwargs)
    back.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    for pid, state in back.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(value, saved["state"][pid][key])


def test_streamed_grad_scaler_overflow_changes_nothing():
    params, opt = run(lambda ps: fusedoff.AdamW(ps, offload="stream", chunk_size=32), torch.float32, 2)
    before = all_states(opt), [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.full_like(p, float("inf"))
    opt.grad_scale, opt.found_inf = torch.full((), 4.0), torch.ones(1)
    opt.step()
    del opt.grad_scale, opt.found_inf
    for p, b in zip(params, before[1]):
        assert torch.equal(p, b)
    for pid, state in all_states(opt).items():
        for key, value in state.items():
            assert torch.equal(value, before[0][pid][key])


def test_memory_stats_report_the_host_store():
    params, opt = run(lambda ps: fusedoff.AdamW(ps, offload="stream", chunk_size=64, amsgrad=True), torch.float32, 1)
    stats = opt.memory_stats()
    # By hand: SHAPES hold 1, 1, 7, 165, 300, 0 and 16 elements, each padded to a multiple of 16.
    padded = 16 + 16 + 16 + 176 + 304 + 0 + 16
    assert stats["host_bytes"] == stats["streamed_bytes"] == 3 * 4 * padded  # exp_avg, exp_avg_sq, max_exp_avg_sq
    assert stats["host_pinned"] is False  # CPU parameters: nothing to pin for
    # On the parameters' device (here the host): two buffer sets of three 64-element fp32 chunks.
    assert stats["resident_bytes"] == 0 and stats["device_bytes"] == 2 * 3 * 64 * 4
    assert stats["device_budget"] == 0 and stats["chunk_size"] == 64 and stats["num_buffers"] == 2


@pytest.mark.parametrize("kwargs,match", [
    (dict(offload="disk"), "offload"),
    (dict(offload="stream", chunk_size=0), "chunk_size"),
    (dict(offload="stream", num_buffers=1), "num_buffers"),
    (dict(offload="none", device_budget=2**20), "device_budget"),
    (dict(offload="stream", device_budget=-1), "device_budget"),
])
def test_invalid_offload_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fusedoff.AdamW(make_params(SHAPES), **kwargs)


def test_chunk_size_is_rounded_up_to_the_alignment():
    _, opt = run(lambda ps: fusedoff.AdamW(ps, offload="stream", chunk_size=1000), torch.float32, 1)
    assert opt.memory_stats()["chunk_size"] == 1008  # the next multiple of 16


# ---- the real streaming path (GPU suite) --------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("cls,kwargs", [(fusedoff.AdamW, dict(lr=1e-2, weight_decay=0.1)),
                                        (fusedoff.Apollo, dict(lr=1e-2, warmup=2, rebound="belief",
                                                               weight_decay=0.01, weight_decay_type="stable"))],
                         ids=["AdamW", "Apollo"])
def test_cuda_streamed_matches_resident(cls, kwargs):
    """Real streams: two groups, a tensor sitting out a step, chunks of whole and of spanning tensors."""
    runs = {}
    for offload in ("none", "stream"):
        params = [torch.nn.Parameter(p.detach().cuda().to(torch.bfloat16)) for p in make_params(SHAPES)]
        opt = cls([{"params": params[:4]}, {"params": params[4:]}], offload=offload, chunk_size=48, **kwargs)
        gen = torch.Generator().manual_seed(1)
        for step in range(6):
            for i, p in enumerate(params):
                p.grad = None if (i == 3 and step == 2) else (torch.randn(p.shape, generator=gen) * 0.1).to(
                    "cuda", torch.bfloat16)
            opt.step()
        runs[offload] = (params, opt)
    (got, got_opt), (ref, ref_opt) = runs["stream"], runs["none"]
    want = ref_opt.state_dict()["state"]
    for pid, state in got_opt.state_dict()["state"].items():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or not value.numel():
                continue
            if cls is fusedoff.AdamW:  # elementwise: the same kernel on the same values, bit for bit
                assert torch.equal(value.cpu(), want[pid][key].cpu()), (pid, key)
            else:  # only the order of the partial sums differs
                assert relative_l2_error([value.cpu()], [want[pid][key].cpu()]) <= 1e-5, (pid, key)
    for a, b in zip(got, ref):  # params are the masters rounded to bf16
        assert torch.equal(a, b) if cls is fusedoff.AdamW else \
            relative_l2_error([a.float().cpu()], [b.float().cpu()]) <= torch.finfo(torch.bfloat16).eps
    assert got_opt.memory_stats()["host_pinned"]


@pytest.mark.cuda
def test_cuda_device_memory_is_bounded_by_the_buffers():
    torch.cuda.synchronize()
    params = [torch.nn.Parameter(torch.randn(2**20, device="cuda", dtype=torch.bfloat16)) for _ in range(16)]
    for p in params:
        p.grad = torch.randn_like(p)
    chunk = 2**16
    opt = fusedoff.AdamW(params, offload="stream", chunk_size=chunk, num_buffers=2)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        opt.step()
    torch.cuda.synchronize()
    used = torch.cuda.max_memory_allocated() - base
    bound = 2 * 3 * chunk * 4  # two buffer sets of exp_avg, exp_avg_sq, master
    stats = opt.memory_stats()
    assert stats["device_peak_bytes"] == bound
    assert used <= bound * 1.01 + 64 * 1024, f"{used} bytes used on the GPU, buffers {bound}"


def _cuda_time(fn, repeats=3) -> float:
    """Median milliseconds of `fn` until the device is idle (after one warm-up): a host clock
    around device-wide syncs, so work on side streams (the last copy-out) is counted too."""
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


@pytest.mark.cuda
def test_cuda_stream_overlaps_copies_and_kernels():
    """The streamed step takes less than its copies in, kernels and copies out done one after another."""
    n, chunk = 2**26, 2**22  # 64M bf16 params, 16 chunks
    param = torch.nn.Parameter(torch.randn(n, device="cuda", dtype=torch.bfloat16))
    param.grad = torch.randn_like(param)
    streamed = fusedoff.AdamW([param], offload="stream", chunk_size=chunk)
    step_ms = _cuda_time(streamed.step)

    host = torch.empty(3 * n, dtype=torch.float32, pin_memory=True)  # exp_avg, exp_avg_sq, master
    device = torch.empty(3 * n, dtype=torch.float32, device="cuda")
    copy_in_ms = _cuda_time(lambda: device.copy_(host, non_blocking=True))
    copy_out_ms = _cuda_time(lambda: host.copy_(device, non_blocking=True))
    resident_param = torch.nn.Parameter(param.detach().clone())
    resident_param.grad = param.grad
    resident = fusedoff.AdamW([resident_param], offload="none")
    kernel_ms = _cuda_time(resident.step)
    serial_ms = copy_in_ms + kernel_ms + copy_out_ms
    assert step_ms < 0.9 * serial_ms, f"step {step_ms:.2f} ms vs serial {serial_ms:.2f} ms: no overlap"


# ---- regressions ---------------------------------------------------------------------------------

def test_two_param_groups_of_equal_size_stream():
    a, b = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(5))
    ra, rb = (torch.nn.Parameter(t.detach().clone()) for t in (a, b))
    got = fusedoff.AdamW([{"params": [a]}, {"params": [b], "lr": 0.1}], offload="stream", chunk_size=16)
    ref = fusedoff.AdamW([{"params": [ra]}, {"params": [rb], "lr": 0.1}], offload="none")
    for _ in range(3):
        for p in (a, b, ra, rb):
            p.grad = torch.ones(5)
        got.step()
        ref.step()
    assert torch.equal(a, ra) and torch.equal(b, rb)


@pytest.mark.parametrize("decay_type", ["L2", "decoupled", "stable"])
def test_apollo_streamed_tensor_sitting_out_keeps_its_states(decay_type):
    kwargs = dict(lr=1e-2, warmup=0, weight_decay=0.01, rebound="belief", weight_decay_type=decay_type)
    skip = lambda step, i: i != 0 and step == 2  # noqa: E731  only the first tensor steps at step 2
    _, ref = run(lambda ps: fusedoff.Apollo(ps, offload="none", **kwargs), torch.float32, 4, skip=skip)
    _, got = run(lambda ps: fusedoff.Apollo(ps, offload="stream", chunk_size=16, **kwargs), torch.float32, 4,
                 skip=skip)
    want = all_states(ref)
    for pid, state in all_states(got).items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.numel():
                assert relative_l2_error([value], [want[pid][key]]) <= 1e-5, (pid, key)


def test_load_state_dict_into_a_stepped_streamed_optimizer_starts_fresh_states():
    params, opt = run(lambda ps: fusedoff.AdamW(ps, offload="stream", chunk_size=16), torch.float32, 2)
    fresh = fusedoff.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params[:1]] + params[1:],
                           offload="stream", chunk_size=16)
    saved = fresh.state_dict()  # no state at all
    opt.load_state_dict(saved)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for state in opt.state_dict()["state"].values():
        assert not state["exp_avg"].any() and state["step"].item() == 1


def test_load_state_dict_rejects_wrong_sizes_before_changing_anything():
    params, opt = run(lambda ps: fusedoff.AdamW(ps, offload="stream", chunk_size=16), torch.float32, 2)
    saved = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(saved)
    bad["state"][4]["exp_avg"] = torch.zeros(params[4].numel() + 1)
    with pytest.raises(ValueError, match="elements"):
        opt.load_state_dict(bad)
    for pid, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(value, saved["state"][pid][key])


def test_user_state_dict_hooks_see_complete_dicts():
    params, opt = run(lambda ps: fusedoff.AdamW(ps, offload="stream", chunk_size=16), torch.float32, 2)
    seen = {}
    opt.register_state_dict_post_hook(lambda o, sd: seen.update(post=set(sd["state"][4])))
    opt.register_load_state_dict_pre_hook(lambda o, sd: seen.update(pre=set(sd["state"][4])))
    saved = opt.state_dict()
    opt.load_state_dict(saved)
    assert seen["post"] == seen["pre"] == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.cuda
def test_cuda_failed_pinning_leaves_no_error_behind():
    """A failed cudaHostRegister (here: memory already registered) returns False, and the CUDA
    error it leaves is cleared: the next launch check must not report it as its own."""
    from fusedoff.offload.cuda_runtime import pin_in_place, unpin_slabs

    slab = torch.zeros(1024)
    assert pin_in_place(slab, torch.device("cuda"))
    assert not pin_in_place(slab, torch.device("cuda"))  # cudaErrorHostMemoryAlreadyRegistered
    x = torch.ones(8, device="cuda") * 2  # a kernel launch, checked by torch
    torch.cuda.synchronize()
    assert x.sum().item() == 16
    unpin_slabs([slab], torch.cuda.current_device())


@pytest.mark.cuda
def test_cuda_a_store_freed_during_graph_capture_keeps_its_memory_until_unpinned():
    """A store freed while a graph is captured must not synchronise (that would break the
    capture) nor hand its memory back while copies queued before the capture may use it."""
    from fusedoff.offload import cuda_runtime

    params = [torch.nn.Parameter(torch.randn(4096, device="cuda"))]
    opt = fusedoff.AdamW(params, offload="stream", chunk_size=1024)
    params[0].grad = torch.randn_like(params[0])
    opt.step()
    layout = next(iter(opt._engine.buckets.values()))
    slab_pointer = layout.store.slabs["exp_avg"][0].data_ptr()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        del opt, layout  # the store (and its finalizer) go now, inside the capture
        import gc

        gc.collect()
        x = params[0] * 2  # something to capture
    deferred = [s for slabs, _ in cuda_runtime._deferred_unpins for s in slabs]
    assert any(s.data_ptr() == slab_pointer for s in deferred)  # kept alive, not yet unpinned
    probe = torch.zeros(16)
    assert cuda_runtime.pin_in_place(probe, torch.device("cuda"))  # the next pinning unpins them
    assert not cuda_runtime._deferred_unpins
    cuda_runtime.unpin_slabs([probe], torch.cuda.current_device())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(x, params[0] * 2)
