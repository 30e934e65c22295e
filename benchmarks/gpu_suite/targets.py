"""The issue's targets, computed from bench_step rows: each measured figure beside its target, with a
verdict; and the GPU suite's closing table (its stages, then the targets).

GPU targets (an H200; "1B" is the largest size measured, normally 1G = 1.07e9 parameters):
  stream_bound     AdamW, offload='stream', bf16 params + grads with fp32 master: >= 85% of the
                   measured bidirectional pinned-bandwidth bound.
  vs_naive         >= 10x the hand-written per-parameter offload, at the largest size both ran.
  vs_zero_offload  faster than the DeepSpeedCPUAdam (ZeRO-Offload) pattern, at the largest size both ran.
  none_vs_torch    offload='none' >= 0.95x torch's fused AdamW, same dtypes (fp32), at 1B.
  auto_vs_torch    offload='auto' on a model whose states fit (decided resident at the first step) >= 0.95x
                   torch's fused AdamW, fp32, at 1B, streaming nothing.
  half_budget      offload='stream' with half the state bytes as device_budget: faster than all streamed.
  stream_8bit      offload='stream' with state_precision='8bit' >= 1.8x faster than with fp32 states, at the
                   largest size both ran (the host bytes of both beside it).
  stream_memory    the optimizer's peak GPU memory during a step <= num_buffers x chunk bytes + 1%.
CPU figures (this repository's CPU machine): fusedoff vs torch's fused AdamW, and the streaming engine's
loopback overhead against offload='none', per size.

    python3 benchmarks/gpu_suite/targets.py OUTDIR     # gpu_suite.sh's verdict, from OUTDIR/stages.tsv + CSV
    python3 benchmarks/gpu_suite/targets.py OUTDIR --publish benchmarks/results
        # a GPU run's CSV, PNG and sections into results/ and its RESULTS.md
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run as a script: the repository root, for `benchmarks` and fusedoff
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import timing  # noqa: E402

ONE_BILLION = 1e9
STREAM_FRACTION, NAIVE_SPEEDUP, ZERO_OFFLOAD_SPEEDUP, NONE_VS_TORCH, MEMORY_SLACK = 0.85, 10.0, 1.0, 0.95, 0.01
STREAM_8BIT_SPEEDUP = 1.8


@dataclass
class Verdict:
    name: str
    target: str
    measured: str
    verdict: str  # "meets" | "MISSES" | "not measured"


def _ok(rows: Sequence[dict], **match) -> list[dict]:
    return [r for r in rows if r.get("status") == "ok" and r.get("ms_median") is not None
            and all(r.get(k) == v for k, v in match.items())]


def _why_missing(rows: Sequence[dict], **match) -> str:
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    if not found:
        return f"no {match.get('contender')} rows"
    return f"{match.get('contender')} {found[-1].get('size')}: {found[-1].get('status')}"


def _size(r: dict) -> str:
    below = " — below the target's 1B" if r["numel"] < ONE_BILLION else ""
    return f"{r.get('size') or timing.format_size(r['numel'])} ({r['numel'] / 1e9:.2f}e9 params{below})"


def _pair(rows: Sequence[dict], a: dict, b: dict) -> tuple[dict, dict] | None:
    """The rows matching `a` and `b` at the largest size where both were measured."""
    first = {r["numel"]: r for r in _ok(rows, **a)}
    second = {r["numel"]: r for r in _ok(rows, **b)}
    common = sorted(set(first) & set(second))
    return (first[common[-1]], second[common[-1]]) if common else None


def _verdict(ok: bool) -> str:
    return "meets" if ok else "MISSES"


ADAMW_BF16 = dict(optimizer="adamw", precision="bf16_master")
STREAM = dict(contender="fusedoff_stream", **ADAMW_BF16)


def stream_bound(rows: Sequence[dict]) -> Verdict:
    target = f">= {STREAM_FRACTION:.0%} of the bidirectional pinned bound"
    name = "AdamW stream bf16+fp32 master: share of the link bound"
    rs = _ok(rows, **STREAM)
    if not rs:
        return Verdict(name, target, _why_missing(rows, **STREAM), "not measured")
    r = max(rs, key=lambda r: r["numel"])
    linked = r.get("bound_kind") == "pinned link"
    measured = (f"{100 * r['fraction_of_bound']:.0f}% of the {r.get('bound_kind') or '?'} bound: {r['ms_median']:.1f} ms "
                f"vs {r['bound_ms']:.1f} ms ({r['h2d_bytes'] / r['numel']:.0f}+{r['d2h_bytes'] / r['numel']:.0f} "
                f"B/param at bidir {r.get('bandwidth_bidir_gb_per_s')} GB/s) at {_size(r)}")
    return Verdict(name, target, measured, _verdict(linked and r["fraction_of_bound"] >= STREAM_FRACTION))


def _speedup_verdict(rows, name, peer, factor, strict=False) -> Verdict:
    target = f"> {factor:g}x" if strict else f">= {factor:g}x"
    pair = _pair(rows, STREAM, dict(contender=peer, **ADAMW_BF16))
    if pair is None:
        return Verdict(name, target, _why_missing(rows, contender=peer, **ADAMW_BF16), "not measured")
    mine, theirs = pair
    ratio = theirs["ms_median"] / mine["ms_median"]
    measured = f"{ratio:.2f}x ({theirs['ms_median']:.1f} vs {mine['ms_median']:.1f} ms) at {_size(mine)}"
    return Verdict(name, target, measured, _verdict(ratio > factor if strict else ratio >= factor))


def vs_naive(rows: Sequence[dict]) -> Verdict:
    return _speedup_verdict(rows, "AdamW stream vs the hand-written offload", "naive_offload", NAIVE_SPEEDUP)


def vs_zero_offload(rows: Sequence[dict]) -> Verdict:
    return _speedup_verdict(rows, "AdamW stream vs DeepSpeedCPUAdam (ZeRO-Offload)", "zero_offload",
                            ZERO_OFFLOAD_SPEEDUP, strict=True)


def _fp32_vs_torch(rows: Sequence[dict], name: str, contender: str) -> tuple[Verdict, dict | None]:
    """`contender` against torch's fused AdamW in fp32 at the largest size both ran: the verdict on
    the throughput ratio, and the contender's row (None when not measured)."""
    target = f">= {NONE_VS_TORCH:g}x"
    fp32 = dict(optimizer="adamw", precision="fp32")
    pair = _pair(rows, dict(contender=contender, **fp32), dict(contender="torch_fused", **fp32))
    if pair is None:
        return Verdict(name, target, _why_missing(rows, contender=contender, **fp32), "not measured"), None
    mine, torch_row = pair
    ratio = torch_row["ms_median"] / mine["ms_median"]
    measured = f"{ratio:.3f}x ({mine['ms_median']:.2f} vs torch {torch_row['ms_median']:.2f} ms) at {_size(mine)}"
    return Verdict(name, target, measured, _verdict(ratio >= NONE_VS_TORCH)), mine


def none_vs_torch(rows: Sequence[dict]) -> Verdict:
    return _fp32_vs_torch(rows, "AdamW none fp32 vs torch fused AdamW (throughput ratio)", "fusedoff_none")[0]


def auto_vs_torch(rows: Sequence[dict]) -> Verdict:
    verdict, mine = _fp32_vs_torch(rows, "AdamW auto fp32 (a model that fits) vs torch fused AdamW", "fusedoff_auto")
    if mine is None:
        return verdict
    streamed = mine.get("opt_streamed_bytes")  # 'auto' must keep a model that fits resident
    return Verdict(verdict.name, verdict.target, f"{verdict.measured}; streamed bytes {streamed}",
                   verdict.verdict if not streamed else "MISSES")


def half_budget(rows: Sequence[dict]) -> Verdict:
    name, target = "AdamW stream with half the states resident vs all streamed", "step time falls (< 1x)"
    pair = _pair(rows, dict(contender="fusedoff_stream_budget50", **ADAMW_BF16), STREAM)
    if pair is None:
        return Verdict(name, target, _why_missing(rows, contender="fusedoff_stream_budget50", **ADAMW_BF16),
                       "not measured")
    half, whole = pair
    ratio = half["ms_median"] / whole["ms_median"]
    measured = (f"{ratio:.3f}x ({half['ms_median']:.2f} vs {whole['ms_median']:.2f} ms; the link bytes alone "
                f"would give {half['h2d_bytes'] / max(whole['h2d_bytes'], 1):.2f}x) at {_size(half)}")
    return Verdict(name, target, measured, _verdict(ratio < 1.0))


def stream_8bit(rows: Sequence[dict]) -> Verdict:
    name, target = "AdamW stream with 8-bit states vs fp32 states", f">= {STREAM_8BIT_SPEEDUP:g}x"
    pair = _pair(rows, dict(contender="fusedoff_stream_8bit", **ADAMW_BF16), STREAM)
    if pair is None:
        return Verdict(name, target, _why_missing(rows, contender="fusedoff_stream_8bit", **ADAMW_BF16), "not measured")
    compressed, fp32 = pair
    ratio = fp32["ms_median"] / compressed["ms_median"]
    host = "".join(f"; host {label} {r['opt_host_bytes'] / 2**30:.2f} GiB" for label, r in (("8-bit", compressed),
                                                                                          ("fp32", fp32))
                   if r.get("opt_host_bytes") is not None)
    measured = (f"{ratio:.2f}x ({compressed['ms_median']:.1f} vs {fp32['ms_median']:.1f} ms; the link bytes alone "
                f"would give {fp32['h2d_bytes'] / max(compressed['h2d_bytes'], 1):.2f}x){host} at {_size(compressed)}")
    return Verdict(name, target, measured, _verdict(ratio >= STREAM_8BIT_SPEEDUP))


def stream_memory(rows: Sequence[dict]) -> Verdict:
    name, target = "AdamW stream: optimizer's peak GPU memory in a step", "<= num_buffers x chunk bytes + 1%"
    rs = [r for r in _ok(rows, **STREAM) if r.get("gpu_peak_bytes") is not None]
    if not rs:
        return Verdict(name, target, "no GPU peak measured" + ("" if _ok(rows, **STREAM) else
                                                                f" ({_why_missing(rows, **STREAM)})"), "not measured")
    r = max(rs, key=lambda r: r["numel"])
    bound = r["buffer_bound_bytes"]
    measured = (f"{r['gpu_peak_bytes'] / 2**20:.1f} MiB vs buffers {bound / 2**20:.1f} MiB "
                f"(first step {r['gpu_peak_first_step_bytes'] / 2**20:.1f} MiB; memory_stats device_peak "
                f"{(r.get('opt_device_peak_bytes') or 0) / 2**20:.1f} MiB) at {_size(r)}")
    return Verdict(name, target, measured, _verdict(r["gpu_peak_bytes"] <= bound * (1 + MEMORY_SLACK)))


GPU_TARGETS = (stream_bound, vs_naive, vs_zero_offload, none_vs_torch, auto_vs_torch, half_budget, stream_8bit,
               stream_memory)


def gpu_verdicts(rows: Sequence[dict]) -> list[Verdict]:
    return [target(rows) for target in GPU_TARGETS]


# ---- CPU figures ----------------------------------------------------------------------------------------


def loopback_overhead(rows: Sequence[dict]) -> list[dict]:
    """Per (size, optimizer, precision, stream row): stream median / none median (1.0 = no overhead), and
    what that ratio would be if both ran at the memory bound with the loopback copies' buffers missing the
    cache: each copy reads and writes its bytes, so (update + 2 x (h2d + d2h)) / update."""
    out = []
    for r in _ok(rows, contender="fusedoff_none"):
        for s in _ok(rows, numel=r["numel"], optimizer=r["optimizer"], precision=r["precision"], offload="stream",
                     kind="fusedoff"):
            out.append({"size": r["size"], "numel": r["numel"], "optimizer": r["optimizer"], "precision": r["precision"],
                        "contender": s["contender"], "ratio": s["ms_median"] / r["ms_median"],
                        "none_ms": r["ms_median"], "stream_ms": s["ms_median"],
                        "loaded": (r.get("others_cpu_share") or 0) > timing.LOAD_THRESHOLD,
                        "bound_ratio": (s["memory_bytes"] + 2 * (s["h2d_bytes"] + s["d2h_bytes"])) / s["memory_bytes"]
                        if s.get("memory_bytes") else None})
    return out


def vs_torch(rows: Sequence[dict]) -> list[dict]:
    """Per (size, precision): torch fused median / fusedoff none median (AdamW)."""
    out = []
    for r in _ok(rows, contender="fusedoff_none", optimizer="adamw"):
        for t in _ok(rows, contender="torch_fused", numel=r["numel"], precision=r["precision"]):
            out.append({"size": r["size"], "numel": r["numel"], "precision": r["precision"],
                        "ratio": t["ms_median"] / r["ms_median"], "fusedoff_ms": r["ms_median"],
                        "torch_ms": t["ms_median"], "fusedoff_fraction": r.get("fraction_of_bound"),
                        "torch_fraction": t.get("fraction_of_bound"),
                        "loaded": (r.get("others_cpu_share") or 0) > timing.LOAD_THRESHOLD})
    return out


# ---- the suite's table ----------------------------------------------------------------------------------


def verdict_table(verdicts: Sequence[Verdict]) -> str:
    return timing.markdown_table([v.__dict__ for v in verdicts], [
        ("target", lambda v: v["name"]), ("wanted", lambda v: v["target"]), ("measured", lambda v: v["measured"]),
        ("verdict", lambda v: v["verdict"])])


def read_stages(path: Path) -> list[dict]:
    """gpu_suite.sh's stages.tsv: name, exit status, seconds, limit, detail (tab-separated)."""
    stages = []
    if path.exists():
        for line in path.read_text().splitlines():
            name, rc, seconds, limit, *detail = line.split("\t") + [""]
            stages.append({"stage": name, "rc": int(rc), "seconds": int(seconds), "limit": limit,
                           "detail": detail[0]})
    return stages


def stage_status(stage: dict) -> str:
    rc = stage["rc"]
    if rc == 0:
        return "ok"
    if rc in (124, 137):
        return f"TIMED OUT at {stage['limit']} s"
    return "skipped" if rc == 200 else f"FAILED (exit {rc})"


def suite_report(out_dir: Path) -> str:
    stages = read_stages(out_dir / "stages.tsv")
    lines = [timing.markdown_table(stages, [
        ("stage", lambda s: s["stage"]), ("status", stage_status), ("seconds", lambda s: f"{s['seconds']} of {s['limit']}"),
        ("detail", lambda s: s["detail"])])]
    csvs = sorted(out_dir.glob("bench_step_*.csv"))
    if not csvs:
        lines.append("\nno benchmark CSV: no target measured")
        return "\n".join(lines)
    rows = timing.read_csv(csvs[0])
    meta = rows[0] if rows else {}
    dry = any(r.get("dry_run") for r in rows)
    lines.append(f"\n{csvs[0].name}: {sum(1 for r in rows if r.get('status') == 'ok')} rows measured, "
                 f"{sum(1 for r in rows if str(r.get('status', '')).startswith('skipped'))} skipped; "
                 f"{meta.get('gpu') or meta.get('cpu_model')}, torch {meta.get('torch')}, {meta.get('date_utc')}")
    if dry:
        lines.append("DRY RUN on the CPU, tiny sizes: the plumbing ran; these are not measurements of any target")
    lines.append("\n" + verdict_table(gpu_verdicts(rows)))
    return "\n".join(lines)


def publish(out_dir: Path, results_dir: Path) -> None:
    """A GPU suite's results into `results_dir`: its bench_step CSV and PNG, that script's RESULTS.md section,
    and a gpu_suite section (the machine, the command, the stages and every target beside its figure)."""
    results = results_dir / "RESULTS.md"
    for f in sorted(out_dir.glob("bench_step_cuda.*")):
        shutil.copy(f, results_dir / f.name)
    suite_results = out_dir / "RESULTS.md"
    if suite_results.exists():
        found = re.search(r"<!-- bench_step_cuda:begin -->\n(.*?)\n<!-- bench_step_cuda:end -->", suite_results.read_text(),
                          re.S)
        if found:
            timing.update_results_section(results, "bench_step_cuda", found.group(1))
    log = (out_dir / "suite.log").read_text().splitlines() if (out_dir / "suite.log").exists() else []
    keep = ("== fusedoff", "python ", "nvcc:", "cpus ", "NO GPU")
    machine = "\n".join(f"    {line.strip()}" for line in log if line.startswith(keep) or "Driver Version" in line
                        or "H200" in line or "H100" in line)
    timing.update_results_section(results, "gpu_suite", f"""## gpu_suite: the one-shot GPU check, every target beside its figure

- command: `bash benchmarks/gpu_suite.sh OUTDIR`, then `python3 benchmarks/gpu_suite/targets.py OUTDIR --publish benchmarks/results`
- machine (from suite.log):

{machine}

{suite_report(out_dir)}
""")
    print(f"published {out_dir} into {results}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="the GPU suite's verdict (stages, then the targets)")
    parser.add_argument("out_dir", type=Path, help="gpu_suite.sh's output folder")
    parser.add_argument("--publish", type=Path, default=None, metavar="RESULTS_DIR",
                        help="also copy the run's CSV, PNG and sections into RESULTS_DIR (benchmarks/results)")
    args = parser.parse_args(argv)
    print(suite_report(args.out_dir))
    if args.publish is not None:
        publish(args.out_dir, args.publish)


if __name__ == "__main__":
    main()
