"""bench_step.py's outputs, from its rows: the tables it prints, its figures beside the GPU targets, its
PNG and its RESULTS.md section (``bench_step.py --from-csv`` draws them again from a CSV)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from benchmarks import bench_bandwidth, plotting, timing
from benchmarks.gpu_suite import targets


MiB = 2**20


def _mib(value) -> str:
    return f"{value / MiB:.0f}" if value is not None else ""


def _loaded(r: dict) -> bool:
    """Whether other processes used more than timing.LOAD_THRESHOLD of the CPUs while this row was timed."""
    return (r.get("others_cpu_share") or 0) > timing.LOAD_THRESHOLD


LOAD_MARK = (f"† timed while other processes used more than {timing.LOAD_THRESHOLD:.0%} of the CPUs (each group's "
             "share is the CSV's `others_cpu_share` and the detail table's last column)")


def _status(r: dict) -> str:
    return "" if r.get("status") == "ok" else str(r.get("status"))


DETAIL_COLUMNS = [
    ("size", lambda r: r["size"]),
    ("optimizer", lambda r: r["optimizer"]),
    ("precision", lambda r: r["precision"]),
    ("contender", lambda r: r["contender"]),
    ("median ms [p10-p90]", lambda r: f"{r['ms_median']:.2f} [{r['ms_q10']:.2f}-{r['ms_q90']:.2f}]"),
    ("Mparam/s", lambda r: f"{r['mparams_per_s']:.0f}"),
    ("B/param", lambda r: f"{r['bytes_per_param']:g}"),
    ("GB/s", lambda r: f"{r['gb_per_s']:.1f}"),
    ("bound ms (what binds)", lambda r: f"{r['bound_ms']:.2f} ({r['bound_kind']})"),
    ("% of bound", lambda r: f"{100 * r['fraction_of_bound']:.0f}%"),
    ("peak GPU MiB steady / 1st step", lambda r: f"{_mib(r['gpu_peak_bytes'])} / {_mib(r['gpu_peak_first_step_bytes'])}"),
    ("memory_stats device / host MiB", lambda r: f"{_mib(r['opt_device_peak_bytes'])} / {_mib(r['opt_host_bytes'])}"
     if r.get("opt_host_bytes") is not None else None),
    ("status", _status),
    ("others' CPU", lambda r: f"{100 * r['others_cpu_share']:.0f}%"),
]
PIVOT_KEYS = ("optimizer", "precision", "contender")
LOOPBACK_NOTE = """
offload='stream' with CPU parameters runs the same engine looped back through host buffers (what CI tests;
offload='auto' does not stream CPU parameters): each chunk's states are copied into a buffer set and back,
so a step moves 2 x (h2d + d2h) bytes more through host memory than offload='none' (the ratio that gives at
the bound stands beside each measured ratio). At the default chunk of 4M elements a buffer set (32-64 MiB)
exceeds this machine's 32 MiB L3, so the copies reach DRAM. A looped-back step is many short OpenMP regions
(copies and a kernel per chunk): when another process takes a core, each region waits for a descheduled
thread, which costs it far more than one long region (the rows marked † above).
"""


def detail_table(rows: Sequence[dict]) -> str:
    """Every row; without GPU figures (a CPU run), without the peak GPU memory column."""
    gpu = any(r.get("gpu_peak_bytes") is not None for r in rows)
    return timing.markdown_table(rows, [c for c in DETAIL_COLUMNS if gpu or not c[0].startswith("peak GPU")])


def step_rows(rows: Sequence[dict]) -> list[dict]:
    return [r for r in rows if r.get("kind") in ("fusedoff", "peer")]


def pivot_table(rows: Sequence[dict]) -> str:
    """Mparam/s (% of bound) per configuration and size."""
    sizes = sorted({r["numel"] for r in rows})
    by_config: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for r in rows:
        by_config[tuple(r[k] for k in PIVOT_KEYS)][r["numel"]] = r

    def cell(size):
        def fn(item):
            r = item[1].get(size)
            if r is None or r.get("status") != "ok":
                return "" if r is None else "-"
            text = f"{r['mparams_per_s']:.0f} ({100 * r['fraction_of_bound']:.0f}%)" \
                if r.get("fraction_of_bound") is not None else f"{r['mparams_per_s']:.0f}"
            return text + (" †" if _loaded(r) else "")
        return fn

    columns = [(k, lambda item, i=i: item[0][i]) for i, k in enumerate(PIVOT_KEYS)]
    columns += [(timing.format_size(s), cell(s)) for s in sizes]
    return timing.markdown_table(sorted(by_config.items()), columns)


def figures(rows: Sequence[dict]) -> str:
    """The CPU figures (fusedoff vs torch, loopback overhead) or the GPU targets, as markdown lines."""
    gpu = any(r.get("device") == "cuda" for r in rows) or any(r.get("dry_run") for r in rows)
    lines = []
    if gpu:
        lines.append(targets.verdict_table(targets.gpu_verdicts(rows)))
    for v in targets.vs_torch(rows):
        lines.append(f"- {v['size']} AdamW {v['precision']}: fusedoff offload='none' {v['ratio']:.2f}x torch fused "
                     f"({v['fusedoff_ms']:.1f} vs {v['torch_ms']:.1f} ms; "
                     f"{100 * (v['fusedoff_fraction'] or 0):.0f}% vs {100 * (v['torch_fraction'] or 0):.0f}% of the bound)"
                     + (" †" if v["loaded"] else ""))
    for v in targets.loopback_overhead(rows):
        lines.append(f"- {v['size']} {v['optimizer']} {v['precision']}: {v['contender']} / offload='none' = "
                     f"{v['ratio']:.2f} ({v['stream_ms']:.1f} vs {v['none_ms']:.1f} ms; "
                     f"{v['bound_ratio']:.2f} if both ran at the bound with the copies in memory)"
                     + (" †" if v["loaded"] else ""))
    return "\n".join(lines)


PRECISION_STYLE = {"bf16_master": "-", "fp32": "--"}
CONTENDER_COLORS = {"fusedoff_none": "tab:green", "fusedoff_stream": "tab:blue", "torch_fused": "tab:orange",
                    "naive_offload": "tab:red", "zero_offload": "tab:purple", "torchao": "tab:brown",
                    "bnb_paged": "tab:pink", "apollo_eager": "tab:gray"}


def _color(contender: str) -> str:
    base = contender.split("@")[0]
    return CONTENDER_COLORS.get(base, "tab:cyan") if base == contender else "tab:olive"  # other chunk sizes


def _mark_loaded(ax, rows: Sequence[dict], y: str) -> None:
    plotting.mark_loaded(ax, rows, "numel", y, _loaded, f"† others used > {timing.LOAD_THRESHOLD:.0%} of the CPUs")


def plot(rows: Sequence[dict], path: Path, title: str) -> None:
    """Throughput vs size per configuration (one panel per optimizer), and per configuration at the
    largest size: peak GPU memory (GPU) or the streaming loopback overhead (CPU)."""
    measured = [r for r in rows if r.get("status") == "ok"]
    optimizers = sorted({r["optimizer"] for r in measured}) or ["adamw"]
    with plotting.figure(path, title, len(optimizers) + 1, panel_size=(6.5, 5.5), dpi=110) as (fig, axes):
        for ax, optimizer in zip(axes, optimizers):
            lines: dict[tuple, list[dict]] = defaultdict(list)
            for r in measured:
                if r["optimizer"] == optimizer:
                    lines[(r["precision"], r["contender"])].append(r)
            for (precision, contender), rs in sorted(lines.items(), key=lambda kv: (kv[0][1], kv[0][0])):
                rs.sort(key=lambda r: r["numel"])
                ax.plot([r["numel"] for r in rs], [r["mparams_per_s"] for r in rs],
                        PRECISION_STYLE.get(precision, ":"), color=_color(contender), marker="o", markersize=3,
                        lw=2 if contender.startswith("fusedoff") else 1, label=f"{contender} {precision}")
            _mark_loaded(ax, [r for r in measured if r["optimizer"] == optimizer], "mparams_per_s")
            plotting.size_axis(ax)
            ax.set_yscale("log")
            ax.set_xlabel("parameters")
            ax.set_ylabel("Mparams / s (median step)")
            ax.set_title(f"{optimizer}: step throughput")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        ax = axes[-1]
        gpu = [r for r in measured if r.get("gpu_peak_bytes") is not None]
        if gpu:
            largest = {}
            for r in gpu:
                key = f"{r['optimizer']} {r['precision']} {r['contender']}"
                if key not in largest or r["numel"] > largest[key]["numel"]:
                    largest[key] = r
            keys = sorted(largest)
            ax.barh(keys, [largest[k]["gpu_peak_bytes"] / MiB for k in keys], color="tab:blue",
                    label="peak GPU memory in a timed step, MiB")
            bounds = [(i, largest[k]["buffer_bound_bytes"] / MiB) for i, k in enumerate(keys)
                      if largest[k].get("buffer_bound_bytes")]
            if bounds:
                ax.scatter([b for _, b in bounds], [i for i, _ in bounds], marker="|", s=300, color="tab:red",
                           zorder=3, label="num_buffers x chunk bytes")
            ax.set_xscale("log")
            ax.set_xlabel("MiB (each at its largest size measured)")
            ax.set_title("optimizer's peak GPU memory")
            ax.tick_params(axis="y", labelsize=7)
            ax.legend(fontsize=7)
        else:
            overhead = targets.loopback_overhead(measured)
            series: dict[tuple, list[dict]] = defaultdict(list)
            for v in overhead:
                series[(v["optimizer"], v["precision"], v["contender"])].append(v)
            for key, vs in sorted(series.items()):
                vs.sort(key=lambda v: v["numel"])
                ax.plot([v["numel"] for v in vs], [v["ratio"] for v in vs], marker="o", label=" ".join(key))
            _mark_loaded(ax, [{**v, "others_cpu_share": 1.0 if v["loaded"] else 0.0} for v in overhead], "ratio")
            ax.axhline(1.0, color="gray", lw=0.8)
            plotting.size_axis(ax)
            ax.set_xlabel("parameters")
            ax.set_ylabel("stream step time / none step time")
            ax.set_title("offload='stream' loopback overhead (CPU)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)


def results_markdown(rows: Sequence[dict], meta: dict, name: str, note: str) -> str:
    bound_rows = [r for r in rows if r.get("kind") == "bandwidth"]
    steps = step_rows(rows)
    largest = max((r["numel"] for r in steps), default=0)
    device = "cuda" if any(r.get("device") == "cuda" for r in rows) else "cpu"
    dry = " — DRY RUN (plumbing on CPU, not a measurement)" if any(r.get("dry_run") for r in rows) else ""
    peer_versions = ", ".join(f"{k[5:]} {v}" for k, v in meta.items() if k.startswith("peer_"))
    bound = (f"Bound measured at the start of the run:\n\n{timing.markdown_table(bound_rows, bench_bandwidth.TABLE_COLUMNS)}\n"
             if bound_rows else
             "Bound: the best in-place pass over two 256 MiB buffers, timed in each group's interleaved loop "
             "(`bandwidth_host_gb_per_s` in the CSV); loopback copies are not counted in it (traffic.bound_seconds).\n")
    return f"""## {name}: step throughput against the peers and the bound ({device}){dry}

- date: {meta.get('date_utc')}{' — ' + meta['label'] if meta.get('label') else ''}
- load: {note or meta.get('load')}
{timing.hardware_lines(meta)}
- versions: python {meta.get('python')}, torch {meta.get('torch')}, fusedoff {meta.get('fusedoff')}; peers: {peer_versions};
  {meta.get('torch_threads')} threads
- command: `{meta.get('command') or timing.command_line()}`
- model: tensors of {timing.format_size(int(meta.get('tensor_size') or 0))} elements, gradients rotating through \
{meta.get('grad_ring')} sets; {meta.get('warmup')} warm-up steps, then up to {meta.get('repeats_max')} timed steps \
({'every contender of a group in turn' if device == 'cpu' else 'one contender at a time'})

Throughput, Mparams/s (and % of the bound) by size:

{pivot_table(steps)}

{LOAD_MARK}

{figures(steps)}
{LOOPBACK_NOTE if device == "cpu" else ""}
{bound}
Every row at {timing.format_size(largest) if largest else '-'}:

{detail_table([r for r in steps if r['numel'] == largest])}

B/param and GB/s count the bytes of what binds the bound (traffic.py): the pinned link (h2d + d2h) for
streamed and host-side configurations on a GPU, else the update's memory traffic. Files: `{name}.csv` (every
row, hardware and version columns), `{name}.png`.
"""


def write_outputs(rows: Sequence[dict], meta: dict, png: Path, name: str, note: str) -> None:
    steps = step_rows(rows)
    print()
    print(pivot_table(steps))
    print()
    print(detail_table(steps))
    print()
    print(figures(steps))
    print(f"\nload: {note or meta.get('load')}")
    title = (f"{name}: {meta.get('gpu') or meta.get('cpu_model')}, torch {meta.get('torch')}, "
             f"fusedoff {meta.get('fusedoff')}; {meta.get('date_utc')}"
             + (" — DRY RUN" if any(r.get("dry_run") for r in rows) else "")
             + (f"\n{note or meta.get('load')}" if "UNDER LOAD" in (note or meta.get("load") or "") else ""))
    plot(steps, png, title)
    timing.update_results_section(png.parent / "RESULTS.md", name, results_markdown(rows, meta, name, note))
    print(f"wrote {png} and its section of {png.parent}/RESULTS.md (rows: {name}.csv)")
