"""The benchmarks' pure logic: sizes, bytes moved per step, bounds, verdicts. Nothing here is timed.

Every expected figure is computed by hand in the test (or by the engine itself, for the streamed layout
and the passes it asks for), never by the function under test.
"""

import dataclasses
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_step  # noqa: E402
import timing  # noqa: E402
import traffic  # noqa: E402
from gpu_suite import targets  # noqa: E402

import fusedoff  # noqa: E402
from fusedoff import ops  # noqa: E402
from fusedoff.offload.plan import ChunkPlan  # noqa: E402

FP32, BF16 = traffic.PRECISIONS["fp32"], traffic.PRECISIONS["bf16_master"]
STATES = traffic.STATE_PRECISIONS
G = 2**30


# ---- sizes -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,value", [("64M", 64 * 2**20), ("1G", 2**30), ("1.5G", 3 * 2**29), ("16k", 16384),
                                        ("4096", 4096), (" 256M ", 256 * 2**20)])
def test_parse_size(text, value):
    assert timing.parse_size(text) == value


@pytest.mark.parametrize("text", ["", "12X", "M"])
def test_parse_size_rejects_garbage(text):
    with pytest.raises((ValueError, KeyError)):
        timing.parse_size(text)


@pytest.mark.parametrize("value,text", [(64 * 2**20, "64M"), (2**30, "1G"), (3 * 2**29, "1.5G"), (4096, "4K"),
                                        (1000, "1000"), (2**20 + 1, "1048577")])
def test_format_size(value, text):
    assert timing.format_size(value) == text


def test_split_sizes():
    assert bench_step.split_sizes(40, 16) == [16, 16, 8]
    assert bench_step.split_sizes(32, 16) == [16, 16]
    assert bench_step.split_sizes(5, 16) == [5]


# ---- bytes moved -------------------------------------------------------------------------------------


def test_adam_update_bytes_by_hand():
    # fp32: read p g m v (16), write p m v (12); bf16 + master: read master 4, g 2, m 4, v 4; write master,
    # m, v (12) and the bf16 param (2); amsgrad adds max_exp_avg_sq read and written
    assert traffic.adam_update_bytes(FP32) == 28
    assert traffic.adam_update_bytes(BF16) == 14 + 14
    assert traffic.adam_update_bytes(FP32, amsgrad=True) == 28 + 8


def test_adam_update_bytes_with_compressed_states_by_hand():
    # bf16 moments: 2 B each. fp32 params: read p g (8) m v (4), write p (4) m v (4); bf16 + master: read
    # master 4, g 2, m v 4; write master 4, m v 4, the bf16 param 2
    assert traffic.adam_update_bytes(FP32, state=STATES["bf16"]) == 12 + 8
    assert traffic.adam_update_bytes(BF16, state=STATES["bf16"]) == 10 + 10
    # 8-bit moments: 1 B each, and per 256 elements each moment's fp32 scale read and written (16 B)
    assert traffic.adam_update_bytes(FP32, state=STATES["8bit"]) == 10 + 6 + 16 / 256
    assert traffic.adam_update_bytes(BF16, state=STATES["8bit"]) == 8 + 8 + 16 / 256
    assert traffic.adam_update_bytes(FP32, state=STATES["fp32"]) == 28  # the default
    # Whole tensors: a last, partial block has a whole scale (7 elements: one block; 300: two)
    assert traffic.adam_tensors_update_bytes([7, 300], FP32, state=STATES["8bit"]) == 16 * 307 + 16 * 3
    assert traffic.adam_tensors_update_bytes([7, 300], BF16, state=STATES["bf16"]) == 20 * 307
    with pytest.raises(ValueError, match="amsgrad"):  # fusedoff.AdamW refuses it too
        traffic.adam_update_bytes(FP32, amsgrad=True, state=STATES["8bit"])


def test_streamed_adamw_bf16_master_moves_12_bytes_each_way():
    n = G  # 1G params in 4096 x 4096 tensors: every tensor 16-aligned, so no padding
    numels = [2**24] * (n // 2**24)
    t = traffic.fusedoff_traffic("adamw", BF16, "stream", numels, 4 * 2**20, "cuda")
    assert (t.h2d, t.d2h) == (12 * n, 12 * n)  # master + exp_avg + exp_avg_sq, in and out
    assert t.memory == 28 * n and t.where == "device"
    fp32 = traffic.fusedoff_traffic("adamw", FP32, "stream", numels, 4 * 2**20, "cuda")
    assert (fp32.h2d, fp32.d2h) == (8 * n, 8 * n)
    assert traffic.fusedoff_traffic("adamw", BF16, "none", numels, 4 * 2**20, "cuda").link == 0


def test_streamed_adamw_with_compressed_states_moves_their_bytes():
    n = G  # 2**24-element tensors: multiples of 256, so no padding
    numels = [2**24] * (n // 2**24)
    eight = traffic.fusedoff_traffic("adamw", BF16, "stream", numels, 4 * 2**20, "cuda", state=STATES["8bit"])
    # the master (4), one byte of each moment, each moment's fp32 scale per 256 elements: each way
    assert (eight.h2d, eight.d2h) == ((4 + 1 + 1) * n + 2 * 4 * n // 256,) * 2
    assert eight.memory == 16 * n + 16 * n // 256
    bf16 = traffic.fusedoff_traffic("adamw", BF16, "stream", numels, 4 * 2**20, "cuda", state=STATES["bf16"])
    assert (bf16.h2d, bf16.d2h, bf16.memory) == ((4 + 2 + 2) * n, (4 + 2 + 2) * n, 20 * n)
    fp32 = traffic.fusedoff_traffic("adamw", FP32, "stream", numels, 4 * 2**20, "cuda", state=STATES["8bit"])
    assert (fp32.h2d, fp32.d2h) == (2 * n + 2 * 4 * n // 256,) * 2  # no master: the moments alone
    with pytest.raises(ValueError, match="fp32 states only"):
        traffic.fusedoff_traffic("apollo", FP32, "stream", numels, 4 * 2**20, "cuda", state=STATES["bf16"])


def test_streamed_bytes_count_the_alignment_padding():
    # tensors of 5 and 7 elements: the second starts at 16, the flat space ends at 32
    t = traffic.fusedoff_traffic("adamw", BF16, "stream", [5, 7], 16, "cpu")
    assert (t.h2d, t.d2h) == (3 * 4 * 32, 3 * 4 * 32)
    # 8-bit states: tensors start on multiples of 256 (the second at 256, the space ends at 512) and the
    # chunk of 16 becomes 256; master 4 B and codes 1 + 1 B per element, two scales of 4 B per block
    t = traffic.fusedoff_traffic("adamw", BF16, "stream", [5, 7], 16, "cpu", state=STATES["8bit"])
    assert (t.h2d, t.d2h) == ((4 + 1 + 1) * 512 + 2 * 4 * 2,) * 2


@pytest.mark.parametrize("align", [16, 256])  # fp32 and bf16 states; 8-bit ones (whole scale blocks)
def test_chunk_layout_matches_the_engine(align):
    rng = random.Random(0)
    for _ in range(200):
        numels = [rng.choice([0, 1, 7, 16, 33, 100, 257, 1000]) for _ in range(rng.randint(1, 8))]
        chunk = align * rng.randint(1, 20)
        plan = ChunkPlan(numels, chunk, align=align)
        want = [(c.numel, plan.whole_tensors_only(c)) for c in plan.chunks]
        assert traffic.chunk_layout(numels, chunk, align) == want, (numels, chunk)


def test_streamed_apollo_by_hand():
    chunk = 1024
    spanning = [4 * chunk]  # one tensor over four chunks: a pass per phase
    n = 4 * chunk
    # constant + L2: reduce copies m B d in (L2 reads the master too), nothing out; full: all in and out
    assert traffic.apollo_stream_link(spanning, chunk, FP32, "constant_L2") == (24 * n, 12 * n)
    assert traffic.apollo_stream_link(spanning, chunk, BF16, "constant_L2") == (32 * n, 16 * n)
    # belief + stable: reduce m B d in; moments m B d in, m B out; finish m B (+ master) in with d, d (+ master) out
    assert traffic.apollo_stream_link(spanning, chunk, FP32, "belief_stable") == ((12 + 12 + 12) * n, (8 + 4) * n)
    assert traffic.apollo_stream_link(spanning, chunk, BF16, "belief_stable") == ((12 + 12 + 16) * n, (8 + 8) * n)
    whole = [chunk // 2] * 4  # two whole tensors per chunk: every phase while resident, once in and out
    assert traffic.apollo_stream_link(whole, chunk, FP32, "constant_L2") == (12 * n // 2, 12 * n // 2)
    assert traffic.apollo_stream_link(whole, chunk, BF16, "belief_stable") == (16 * n // 2, 16 * n // 2)


OPTIMIZER_STATES = [("adamw", None, "fp32"), ("adamw", None, "bf16"), ("adamw", None, "8bit"),
                    ("apollo", "constant_L2", "fp32"), ("apollo", "belief_stable", "fp32")]


@pytest.mark.parametrize("precision", ["fp32", "bf16_master"])
@pytest.mark.parametrize("optimizer,config,state", OPTIMIZER_STATES, ids=lambda v: str(v))
def test_counted_streamed_bytes_match_traffic_py(optimizer, config, state, precision):
    """The bytes the engine's copies moved (counted by the runtime as they are issued: each chunk of each
    state as it lies in host memory, padding and scale blocks included) are traffic.py's: a check that
    the phase tables follow fusedoff/optim/apollo.py and that the layout follows the engine's alignment
    and chunk rounding (tests/test_link_bytes.py runs every combination on the stream simulator)."""
    numels, chunk = [40, 300, 7, 64], 64  # whole-tensor chunks and a tensor spanning chunks (8-bit: 256)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    params = [torch.nn.Parameter(torch.randn(n).to(dtype)) for n in numels]
    for p in params:
        p.grad = torch.randn_like(p)
    if optimizer == "adamw":
        opt = fusedoff.AdamW(params, offload="stream", chunk_size=chunk, backend="torch", state_precision=state)
        want = traffic.adam_stream_link(numels, chunk, traffic.PRECISIONS[precision], state=STATES[state])
    else:
        opt = fusedoff.Apollo(params, lr=1e-2, warmup=0, weight_decay=1e-2, offload="stream", chunk_size=chunk,
                              backend="torch", **traffic.APOLLO_CONFIGS[config])
        want = traffic.apollo_stream_link(numels, chunk, traffic.PRECISIONS[precision], config)
    opt.step()
    moved = opt.memory_stats()["link_bytes_last_step"]
    assert (moved["to_device"], moved["to_host"]) == want


@pytest.mark.parametrize("offload", ["none", "stream"])
@pytest.mark.parametrize("precision, master", [("fp32", "fp32"), ("bf16_master", "fp32"), ("bf16_master", "split"),
                                               ("bf16_master", "split8")])
@pytest.mark.parametrize("state", list(STATES))
def test_adam_update_bytes_match_the_tensors_the_fused_call_gets(monkeypatch, state, precision, master, offload):
    """The kernel's bytes counted over the tensors the optimizer hands its fused op (whole tensors, or
    pieces of chunk buffers): the grad read; every state, scale and master read and written; the param
    written, and read too where it is the fp32 weight or the upper half of a split master."""
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
    assert counted["bytes"] == traffic.adam_tensors_update_bytes(numels, model, state=STATES[state])
    t = traffic.fusedoff_traffic("adamw", model, offload, numels, 256, "cpu", state=STATES[state])
    assert t.memory == counted["bytes"]


def test_apollo_update_bytes_by_hand():
    # fp32, 4 B a tensor: constant_L2 reduce r p g m B d (20) + full r 20 w p m B d (16) = 56
    assert traffic.apollo_update_bytes(traffic.APOLLO_FUSED_PASSES["constant_L2"]) == 56
    # belief_stable: reduce r g m B d (16); moments r 16 w m B (8); finish r p m B (12) w d p (8) = 60
    assert traffic.apollo_update_bytes(traffic.APOLLO_FUSED_PASSES["belief_stable"]) == 60
    # bf16 + master: the grad is 2 B, and writing p writes the master (4) and the bf16 param (2)
    assert traffic.apollo_update_bytes(traffic.APOLLO_FUSED_PASSES["constant_L2"], BF16) == (4 + 2 + 12) * 2 + 4 + 12 + 2
    assert traffic.apollo_update_bytes(traffic.APOLLO_EAGER_OPS["constant_L2"]) == 156
    assert traffic.apollo_update_bytes(traffic.APOLLO_EAGER_OPS["belief_stable"]) == 172


def test_peer_traffic_by_hand():
    n = 1000
    naive = traffic.peer_traffic("naive_offload", BF16, n, "cuda")
    assert (naive.h2d, naive.d2h) == (12 * n, 12 * n)  # master, exp_avg, exp_avg_sq each way
    assert naive.memory == (6 + 28 + 6) * n  # upcast g, the step, p.copy_(master)
    assert traffic.peer_traffic("naive_offload", FP32, n, "cuda").link == 2 * 8 * n
    zero = traffic.peer_traffic("zero_offload", BF16, n, "cuda")
    assert (zero.h2d, zero.d2h, zero.memory, zero.where) == (2 * n, 2 * n, 40 * n, "host")
    zero32 = traffic.peer_traffic("zero_offload", FP32, n, "cuda")
    assert (zero32.h2d, zero32.d2h, zero32.memory) == (4 * n, 4 * n, 28 * n)
    assert traffic.peer_traffic("torch_fused", BF16, n, "cuda").memory == 34 * n
    assert traffic.peer_traffic("torch_fused", FP32, n, "cpu").where == "host"
    assert traffic.peer_traffic("torchao", BF16, n, "cuda").memory == 14 * n  # bf16 p g m v read, p m v written
    assert traffic.peer_traffic("bnb_paged", BF16, n, "cuda").memory == 22 * n  # bf16 p g, fp32 m v
    with pytest.raises(ValueError):
        traffic.peer_traffic("nope", FP32, n, "cuda")


def test_bound_seconds_by_hand():
    gb = 1e9
    t = traffic.Traffic(h2d=12 * gb, d2h=12 * gb, memory=28 * gb)
    bw = traffic.Bandwidth(h2d=50 * gb, d2h=50 * gb, bidir=80 * gb, device=4000 * gb, host=100 * gb)
    seconds, kind = traffic.bound_seconds(t, bw)
    assert kind == "pinned link" and seconds == pytest.approx(24 / 80)  # both together bind, not 12/50
    asym = traffic.Traffic(h2d=24 * gb, d2h=0, memory=gb)
    assert traffic.bound_seconds(asym, bw)[0] == pytest.approx(24 / 50)  # h2d alone binds
    resident = traffic.Traffic(memory=28 * gb)
    assert traffic.bound_seconds(resident, bw) == (pytest.approx(28 / 4000), "device memory")
    # on CPU: no link measured, the loopback copies are not counted, host memory binds
    loop = traffic.Traffic(h2d=12 * gb, d2h=12 * gb, memory=28 * gb, where="host")
    assert traffic.bound_seconds(loop, traffic.Bandwidth(host=20 * gb)) == (pytest.approx(28 / 20), "host memory")
    assert traffic.bound_seconds(loop, traffic.Bandwidth()) == (None, "")


# ---- the plan ----------------------------------------------------------------------------------------


def test_plan_puts_the_targets_first():
    sizes = [16 * 2**20, 256 * 2**20, G, 2 * G]
    groups = bench_step.plan_groups(sizes, ["adamw", "apollo"], ["fp32", "bf16_master"])
    assert groups[:2] == [(G, "adamw", "bf16_master"), (G, "adamw", "fp32")]
    naive = bench_step.plan_groups(sizes, ["adamw", "apollo"], ["fp32", "bf16_master"], naive_max=256 * 2**20)
    assert naive[:3] == [(G, "adamw", "bf16_master"), (G, "adamw", "fp32"), (256 * 2**20, "adamw", "bf16_master")]
    assert naive[3] == (2 * G, "adamw", "bf16_master")  # then the rest, bf16 first, largest first
    assert sorted(groups) == sorted((s, o, p) for s in sizes for o in ("adamw", "apollo")
                                    for p in ("fp32", "bf16_master"))
    # without a size at 1G, the largest below it stands in
    assert bench_step.plan_groups([2**20, 2**22], ["adamw"], ["fp32"])[0] == (2**22, "adamw", "fp32")


# ---- verdicts ----------------------------------------------------------------------------------------


def _row(contender, numel, ms, optimizer="adamw", precision="bf16_master", **extra):
    return {"contender": contender, "numel": numel, "size": timing.format_size(numel), "ms_median": ms,
            "optimizer": optimizer, "precision": precision, "status": "ok", **extra}


def _stream(numel, ms, fraction, kind="pinned link", **extra):
    return _row("fusedoff_stream", numel, ms, fraction_of_bound=fraction, bound_kind=kind,
                bound_ms=ms * fraction, h2d_bytes=12 * numel, d2h_bytes=12 * numel, offload="stream",
                kind="fusedoff", **extra)


def test_stream_bound_verdict():
    assert targets.stream_bound([_stream(G, 100.0, 0.85)]).verdict == "meets"
    assert targets.stream_bound([_stream(G, 100.0, 0.84)]).verdict == "MISSES"
    assert targets.stream_bound([_stream(G, 100.0, 0.95, kind="host memory")]).verdict == "MISSES"
    # the largest size measured is the one judged
    v = targets.stream_bound([_stream(G, 100.0, 0.5), _stream(2**28, 30.0, 0.9)])
    assert v.verdict == "MISSES" and "1G" in v.measured
    skipped = {**_stream(G, 1.0, 0.9), "status": "skipped: needs ~50 s"}
    assert targets.stream_bound([skipped]).verdict == "not measured"


def test_speedup_verdicts_compare_at_the_largest_common_size():
    rows = [_stream(G, 250.0, 0.9), _stream(2**28, 62.0, 0.9), _row("naive_offload", 2**28, 650.0)]
    v = targets.vs_naive(rows)  # naive ran at 256M only: compared there, 650 / 62 = 10.48
    assert v.verdict == "meets" and "256M" in v.measured and "10.48x" in v.measured
    rows[-1]["ms_median"] = 610.0  # 9.84x
    assert targets.vs_naive(rows).verdict == "MISSES"
    assert targets.vs_zero_offload(rows).verdict == "not measured"
    even = [_stream(G, 250.0, 0.9), _row("zero_offload", G, 250.0)]
    assert targets.vs_zero_offload(even).verdict == "MISSES"  # faster means strictly faster
    even[1]["ms_median"] = 251.0
    assert targets.vs_zero_offload(even).verdict == "meets"


def test_none_vs_torch_verdict():
    rows = [_row("fusedoff_none", G, 100.0, precision="fp32"), _row("torch_fused", G, 95.0, precision="fp32")]
    assert targets.none_vs_torch(rows).verdict == "meets"  # 95 / 100 = 0.95
    rows[1]["ms_median"] = 94.0
    assert targets.none_vs_torch(rows).verdict == "MISSES"
    bf16_only = [_row("fusedoff_none", G, 100.0), _row("torch_fused", G, 200.0)]  # other dtypes don't count
    assert targets.none_vs_torch(bf16_only).verdict == "not measured"


def test_auto_vs_torch_verdict():
    rows = [_row("fusedoff_auto", G, 100.0, precision="fp32", opt_streamed_bytes=0),
            _row("torch_fused", G, 95.0, precision="fp32")]
    assert targets.auto_vs_torch(rows).verdict == "meets"
    rows[0]["opt_streamed_bytes"] = 4096  # as fast, but it streamed: 'auto' did not keep a model that fits
    assert targets.auto_vs_torch(rows).verdict == "MISSES"
    assert targets.auto_vs_torch(rows[1:]).verdict == "not measured"


def test_half_budget_verdict():
    half = _row("fusedoff_stream_budget50", G, 60.0, h2d_bytes=6 * G)
    rows = [_stream(G, 100.0, 0.9), half]
    v = targets.half_budget(rows)
    assert v.verdict == "meets" and "0.600x" in v.measured and "0.50x" in v.measured
    half["ms_median"] = 100.0
    assert targets.half_budget(rows).verdict == "MISSES"


def test_stream_8bit_verdict():
    fp32 = _stream(G, 180.0, 0.9, opt_host_bytes=16 * G)  # 12 bytes a parameter each way
    compressed = _row("fusedoff_stream_8bit", G, 100.0, h2d_bytes=6 * G, opt_host_bytes=int(6.03 * G))
    v = targets.stream_8bit([fp32, compressed])
    assert v.verdict == "meets" and "1.80x" in v.measured and "2.00x" in v.measured and "host 8-bit 6.03 GiB" in v.measured
    compressed["ms_median"] = 101.0  # 1.78x
    assert targets.stream_8bit([fp32, compressed]).verdict == "MISSES"
    assert targets.stream_8bit([fp32]).verdict == "not measured"


def test_stream_memory_verdict():
    bound = 96 * 2**20
    row = _stream(G, 1.0, 0.9, gpu_peak_bytes=int(bound * 1.009), gpu_peak_first_step_bytes=bound * 2,
                  buffer_bound_bytes=bound, opt_device_peak_bytes=bound)
    assert targets.stream_memory([row]).verdict == "meets"
    row["gpu_peak_bytes"] = int(bound * 1.011)
    assert targets.stream_memory([row]).verdict == "MISSES"
    assert targets.stream_memory([_stream(G, 1.0, 0.9)]).verdict == "not measured"  # no GPU figure (CPU run)


def test_cpu_figures():
    rows = [_row("fusedoff_none", 2**24, 10.0, offload="none", kind="fusedoff", others_cpu_share=0.2),
            _row("fusedoff_stream", 2**24, 12.5, offload="stream", kind="fusedoff", memory_bytes=28, h2d_bytes=12,
                 d2h_bytes=12),
            _row("torch_fused", 2**24, 15.0, offload="none", kind="peer")]
    (loop,) = targets.loopback_overhead(rows)
    assert loop["ratio"] == pytest.approx(1.25) and loop["contender"] == "fusedoff_stream"
    assert loop["bound_ratio"] == pytest.approx((28 + 2 * 24) / 28)  # each loopback copy reads and writes
    assert loop["loaded"]  # 20% of the CPUs used by others
    (vs,) = targets.vs_torch(rows)
    assert vs["ratio"] == pytest.approx(1.5)


# ---- files and tables --------------------------------------------------------------------------------


def test_csv_round_trip(tmp_path):
    rows = [{"a": 1, "b": 2.5, "c": "x"}, {"a": 3, "d": None}]
    timing.write_csv(tmp_path / "r.csv", rows, {"meta": "m"})
    back = timing.read_csv(tmp_path / "r.csv")
    assert back == [{"a": 1, "b": 2.5, "c": "x", "d": None, "meta": "m"},
                    {"a": 3, "b": None, "c": None, "d": None, "meta": "m"}]


def test_markdown_table_leaves_missing_cells_blank():
    table = timing.markdown_table([{"x": 1.0}, {}], [("x", lambda r: f"{r['x']:.1f}"), ("y", lambda r: r["y"])])
    assert table.splitlines() == ["| x | y |", "|---|---|", "| 1.0 |  |", "|  |  |"]


def test_suite_stages(tmp_path):
    (tmp_path / "stages.tsv").write_text("build\t0\t120\t270\tbuilt\ntests\t124\t120\t120\t\nbench\t200\t0\t0\tno\n")
    stages = targets.read_stages(tmp_path / "stages.tsv")
    assert [targets.stage_status(s) for s in stages] == ["ok", "TIMED OUT at 120 s", "skipped"]
    report = targets.suite_report(tmp_path)
    assert "no benchmark CSV" in report and "TIMED OUT" in report


@pytest.mark.parametrize("script, args", [
    ("measure_overlap.py", ["--dry-run"]),
    ("bench_host_cost.py", ["--shapes", "20x64", "--repeats", "2", "--warmup", "1"]),
])
def test_the_gpu_suites_newer_stages_run_their_plumbing_on_the_cpu(tmp_path, script, args):
    """The GPU suite's host-cost and overlap stages (run dry in its rehearsal too) exit 0 and print
    their table, with every contender and mode measured."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    extra = ["--out-dir", str(tmp_path)] if script == "bench_host_cost.py" else []
    done = subprocess.run([sys.executable, str(root / "benchmarks" / script), *args, *extra], capture_output=True,
                          text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and not line.startswith("| shape")
            and not line.startswith("| mode")]
    names = {line.split("|")[1 if script == "measure_overlap.py" else 2].strip() for line in rows}
    assert names >= ({"plain", "overlapped"} if script == "measure_overlap.py" else {"torch", "resident", "stream"})
