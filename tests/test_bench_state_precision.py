"""benchmarks/bench_state_precision.py at a small size: its CSV columns, and figures that agree with each
other and with the bytes counted by hand (fp32 states 8 B/param, bf16 4, 8-bit 2 + 8/256)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_state_precision as bench  # noqa: E402
import timing  # noqa: E402
from peers import PeerUnavailable  # noqa: E402

NUMEL = 1 << 18  # whole 256-element blocks
STATE_BYTES = {"fusedoff_fp32": 8.0, "fusedoff_bf16": 4.0, "fusedoff_8bit": 2 + 8 / 256,
               # bf16 params with master weights: the master among the states (fp32 4, split 2, split8 1)
               "fusedoff_fp32_bf16p_fp32_master": 12.0, "fusedoff_fp32_bf16p_split_master": 10.0,
               "fusedoff_fp32_bf16p_split8_master": 9.0, "fusedoff_8bit_bf16p_split8_master": 3 + 8 / 256,
               "torch_fused": 8.0}
# param read + write and grad read (12, fp32) or param written and grad read (2 + 2, bf16) and the
# param read beside a split master (2); every state read and written once
KERNEL_BYTES = {"fusedoff_fp32": 28.0, "fusedoff_bf16": 20.0, "fusedoff_8bit": 16.0625,
                "fusedoff_fp32_bf16p_fp32_master": 28.0, "fusedoff_fp32_bf16p_split_master": 26.0,
                "fusedoff_fp32_bf16p_split8_master": 24.0, "fusedoff_8bit_bf16p_split8_master": 12.0625,
                "torch_fused": 28.0}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_state_precision")
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_state_precision.py", "--numel", str(NUMEL), "--repeats", "3",
         "--warmup", "1", "--threads", "1", "--no-peers", "--out-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {r["contender"]: r for r in timing.read_csv(out / "bench_state_precision.csv")}
    return out, rows, result.stdout


def test_csv_rows_and_columns(run):
    out, rows, _ = run
    assert list(rows) == [*STATE_BYTES, "inplace_scale", "inplace_axpy"]
    for column in ("state_precision", "status", "numel", "ms_median", "ms_q10", "ms_q90", "ratio_to_fusedoff_fp32",
                   "ratio_paired_q10", "ratio_paired_q90", "state_bytes_per_param", "memory_stats_bytes_per_param",
                   "bytes_per_param", "bandwidth_gb_per_s", "bound_ms", "fraction_of_bound", "update_rel_err",
                   "cpu_model", "torch", "fusedoff", "torchao", "bitsandbytes", "date_utc", "load"):
        assert column in rows["fusedoff_fp32"], column
    assert all(r["numel"] == NUMEL and r["status"] == "ok" and r["torch_threads"] == 1 for r in rows.values())
    assert [rows[n]["state_precision"] for n in STATE_BYTES] == ["fp32", "bf16", "8bit", "fp32", "fp32", "fp32",
                                                                   "8bit", "fp32"]
    try:  # the plot needs matplotlib (the bench extra): without it the run says so and writes the rest
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no plot" in run[2] and not (out / "bench_state_precision.png").exists()
    else:
        assert (out / "bench_state_precision.png").stat().st_size > 0
    section = (out / "RESULTS.md").read_text()
    assert "<!-- bench_state_precision:begin -->" in section and "<!-- bench_state_precision:end -->" in section
    assert all(name in section for name in STATE_BYTES)


def test_bytes_match_the_hand_count(run):
    _, rows, _ = run
    for name, held in STATE_BYTES.items():
        assert rows[name]["state_bytes_per_param"] == pytest.approx(held, abs=1e-6), name
        assert rows[name]["bytes_per_param"] == pytest.approx(KERNEL_BYTES[name], abs=1e-6), name
    for name in (n for n in STATE_BYTES if n.startswith("fusedoff")):  # memory_stats counts the same bytes
        assert rows[name]["memory_stats_bytes_per_param"] == pytest.approx(STATE_BYTES[name], abs=1e-6), name
    assert rows["torch_fused"]["memory_stats_bytes_per_param"] is None


def test_figures_agree(run):
    _, rows, _ = run
    passes = [rows["inplace_scale"], rows["inplace_axpy"]]
    best = max(passes, key=lambda r: r["achieved_gb_per_s"])
    assert rows["fusedoff_fp32"]["ratio_to_fusedoff_fp32"] == 1.0
    assert rows[bench.MASTER_BASELINE]["ratio_to_fusedoff_fp32"] == 1.0
    for name in STATE_BYTES:
        r = rows[name]
        base = rows[bench.MASTER_BASELINE if r["master_precision"] else "fusedoff_fp32"]["ms_median"]
        assert r["ms_min"] <= r["ms_q10"] <= r["ms_median"] <= r["ms_q90"] <= r["ms_max"]
        assert r["ratio_paired_q10"] <= r["ratio_paired_q90"]
        # the CSV keeps ms to 3 decimals and the ratio to 4: compare within those roundings
        rounding = 5e-4 / base * (1 + r["ms_median"] / base) + 5e-5
        assert r["ratio_to_fusedoff_fp32"] == pytest.approx(r["ms_median"] / base, abs=rounding)
        assert (r["bandwidth_gb_per_s"], r["bandwidth_kernel"]) == (best["achieved_gb_per_s"], best["contender"])
        bound_ms = r["bytes_per_param"] * NUMEL / (r["bandwidth_gb_per_s"] * 1e9) * 1e3
        assert r["bound_ms"] == pytest.approx(bound_ms, rel=2e-3, abs=2e-3)
        # recomputed from the CSV's rounded ms (3 decimals): within what that rounding moves them
        ms_rounding = 5e-4 / r["ms_median"] + 5e-4 / max(r["bound_ms"], 5e-4)
        fraction = r["bound_ms"] / r["ms_median"]
        assert abs(r["fraction_of_bound"] - fraction) <= fraction * ms_rounding + 5e-4
        achieved = r["bytes_per_param"] * NUMEL / r["ms_median"] / 1e6
        assert abs(r["achieved_gb_per_s"] - achieved) <= achieved * 5e-4 / r["ms_median"] + 0.005


def test_update_errors_order_the_precisions(run):
    """fp32 states agree with float64 AdamW to fp32 rounding; bf16 and 8-bit cost accuracy, 8-bit more."""
    _, rows, _ = run
    err = {name: rows[name]["update_rel_err"] for name in STATE_BYTES}
    assert err["fusedoff_fp32"] < 1e-5 and err["torch_fused"] < 1e-5
    assert 1e-4 < err["fusedoff_bf16"] < 1e-2
    assert err["fusedoff_bf16"] < err["fusedoff_8bit"] < 0.1
    # Masters of bf16 params: split is fp32's bit for bit, split8 costs its rounding (relative 2^-15 a step)
    assert err["fusedoff_fp32_bf16p_fp32_master"] < 1e-5
    assert err["fusedoff_fp32_bf16p_split_master"] == err["fusedoff_fp32_bf16p_fp32_master"]
    assert err["fusedoff_fp32_bf16p_fp32_master"] < err["fusedoff_fp32_bf16p_split8_master"] < 1e-2


def test_an_unavailable_peer_is_a_skipped_row_with_its_reason(monkeypatch, capsys):
    def missing(param):
        raise PeerUnavailable("no such package here")

    def broken(param):
        raise RuntimeError("cannot run on the CPU")

    own = [bench._fusedoff("fp32"), bench._fusedoff("8bit")]
    peers = [bench.Contender("missing_8bit", "a missing peer", "8bit", missing, peer=True),
             bench.Contender("broken_8bit", "a peer that fails", "8bit", broken, peer=True)]
    monkeypatch.setattr(bench, "contenders", lambda with_peers=True: own + peers)
    args = argparse.Namespace(numel=4096, repeats=2, warmup=1, threads=1, no_peers=False)
    rows, _ = bench.measure(args)
    by_name = {r["contender"]: r for r in rows}
    assert by_name["missing_8bit"]["status"] == "skipped: no such package here"
    assert by_name["broken_8bit"]["status"] == "skipped: RuntimeError: cannot run on the CPU"
    assert "ms_median" not in by_name["missing_8bit"] and by_name["fusedoff_8bit"]["status"] == "ok"
    assert "missing_8bit: skipped (no such package here)" in capsys.readouterr().out
    verdicts = bench.format_verdicts(rows)  # the measured ones only
    assert "fusedoff_8bit:" in verdicts and "missing_8bit" not in verdicts and "broken_8bit" not in verdicts


def test_a_contender_of_fusedoff_that_fails_is_not_skipped(monkeypatch):
    def failing(param):
        raise RuntimeError("a real failure")

    own = [bench.Contender("fusedoff_fp32", "", "fp32", failing)]
    monkeypatch.setattr(bench, "contenders", lambda with_peers=True: own)
    with pytest.raises(RuntimeError, match="a real failure"):
        bench.measure(argparse.Namespace(numel=4096, repeats=1, warmup=1, threads=1, no_peers=True))
