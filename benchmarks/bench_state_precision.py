"""Question: what does each state precision cost and save on the CPU? One fusedoff.AdamW step
(backend='cpu', offload='none', fp32 params and grads) with state_precision 'fp32', 'bf16' and '8bit',
beside torch.optim.AdamW(fused=True) and, where installed and able to run on the CPU, the 8-bit AdamW
of torchao and of bitsandbytes.

Every contender steps the same parameter (one fp32 tensor, its gradient attached once) with states of
its own, all timed in one interleaved loop (timing.time_interleaved: A, B, C, A, B, C, ...) together
with the in-place bandwidth passes over the parameter and the gradient. Per contender:

  state B/param   the bytes of its states (every tensor in ``opt.state[p]`` but ``step``), per parameter:
                  fp32 8, bf16 4, 8-bit 2 codes + 8/256 for one fp32 absmax per 256-element block of
                  each moment (bitsandbytes adds two 256-entry code maps per tensor). fusedoff's rows
                  also carry opt.memory_stats()'s count of the same bytes.
  kernel B/param  the bytes one step must move: param read + write (4 + 4), grad read (4), and each
                  state read and written once: 12 + 2 x state B/param (fp32 28, bf16 20, 8-bit 16.06).
                  Temporaries an implementation adds (the peers' fp32 dequantized copies) are not counted.
  bound ms        kernel B/param x params / the best in-place pass's bandwidth, timed in the same loop.
  ratio           median step / median fusedoff fp32-state step, with the p10-p90 of the per-repeat ratios.
  update rel err  ||dw - dw_ref|| / ||dw_ref|| after a few steps of a small problem with fresh random
                  gradients, against torch.optim.AdamW in float64: what the precision costs in accuracy
                  (and a check that each contender ran the same update).

The fp32-state step is memory-bound: a compressed step moves fewer bytes, so it should beat it unless
decoding and encoding the states costs more than the bytes saved.

    .venv/bin/python benchmarks/bench_state_precision.py                         # 64M params, results/
    .venv/bin/python benchmarks/bench_state_precision.py --numel 1M --repeats 3 --no-peers --out-dir /tmp/b
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

if not __package__:  # run as a script: the repository root, for `benchmarks` and fusedoff
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import peers, plotting, timing  # noqa: E402
from benchmarks.peers import ADAM_HYPER, PeerUnavailable  # noqa: E402

import fusedoff  # noqa: E402
from fusedoff._ext import cpu_isa  # noqa: E402

PRECISIONS = ("fp32", "bf16", "8bit")
PARAM_GRAD_BYTES = 4 + 4 + 4  # fp32 param read + write, fp32 grad read
BASELINE = "fusedoff_fp32"
RESULTS_KEY = "bench_state_precision"
QUALITY_NUMEL, QUALITY_STEPS = 1 << 16, 10


@dataclass
class Contender:
    name: str
    label: str  # what is timed, for the table
    state_precision: str
    build: Callable[[torch.nn.Parameter], object]  # the optimizer over one parameter
    peer: bool = False  # optional package: skipped with a reason when it cannot run
    # Master weights of bf16 parameters in this precision ("fp32", "split", "split8"): the row steps a
    # bf16 parameter and gradient instead, and is compared with the fp32-master row (MASTER_BASELINE).
    master_precision: str | None = None


def _fusedoff(precision: str, master: str | None = None) -> Contender:
    name = f"fusedoff_{precision}" + (f"_bf16p_{master}_master" if master else "")
    label = f"fusedoff.AdamW(state_precision='{precision}'" + (f", master_precision='{master}') on bf16 params"
                                                                if master else ")")
    options = dict(master_precision=master) if master else {}
    return Contender(name, label, precision,
                     lambda p: fusedoff.AdamW([p], backend="cpu", offload="none", state_precision=precision,
                                              **options, **ADAM_HYPER), master_precision=master)


MASTERS = ("fp32", "split", "split8")  # the master rows: fp32 states with each master precision
MASTER_BASELINE = "fusedoff_fp32_bf16p_fp32_master"


def _torchao(p: torch.nn.Parameter):
    try:
        from torchao.optim import AdamW8bit
    except Exception as exc:
        raise PeerUnavailable(f"torchao not importable ({type(exc).__name__}: {exc})") from exc
    return AdamW8bit([p], **ADAM_HYPER)  # block_size 256, as fusedoff's


def _bitsandbytes(p: torch.nn.Parameter):
    try:
        import bitsandbytes as bnb
    except Exception as exc:
        raise PeerUnavailable(f"bitsandbytes not importable ({type(exc).__name__}: {exc})") from exc
    return bnb.optim.AdamW8bit([p], **ADAM_HYPER)  # block-wise, 256 elements per absmax on the CPU


def contenders(with_peers: bool = True) -> list[Contender]:
    out = [_fusedoff(p) for p in PRECISIONS]
    out += [_fusedoff("fp32", m) for m in MASTERS] + [_fusedoff("8bit", "split8")]
    out.append(Contender("torch_fused", "torch.optim.AdamW(fused=True)", "fp32",
                         lambda p: torch.optim.AdamW([p], fused=True, **ADAM_HYPER)))
    if with_peers:
        out.append(Contender("torchao_8bit", "torchao.optim.AdamW8bit", "8bit", _torchao, peer=True))
        out.append(Contender("bnb_8bit", "bitsandbytes.optim.AdamW8bit", "8bit", _bitsandbytes, peer=True))
    return out


# ---- what a contender holds and moves ----------------------------------------------------------------


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor, or of the inner tensors of a tensor subclass (torchao's 8-bit states)."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def state_bytes(optimizer, param: torch.Tensor) -> int:
    """Bytes of every state tensor the optimizer keeps for `param` (not its step count)."""
    return sum(_tensor_bytes(v) for k, v in optimizer.state[param].items()
               if k != "step" and isinstance(v, torch.Tensor))


def kernel_bytes_per_param(state_bytes_per_param: float, master_precision: str | None = None) -> float:
    """Bytes one step must move per parameter: param and grad, and every state read and written once.
    With master weights (bf16 params, the master among the states): the param written and the grad
    read (2 + 2), and the param read too where it is the upper half of a split master."""
    if master_precision is None:
        return PARAM_GRAD_BYTES + 2 * state_bytes_per_param
    return 2 + 2 + (2 if master_precision != "fp32" else 0) + 2 * state_bytes_per_param


# ---- the accuracy a precision costs --------------------------------------------------------------------


def update_errors(built: dict[str, Contender], numel: int = QUALITY_NUMEL,
                  steps: int = QUALITY_STEPS) -> dict[str, float]:
    """Relative L2 error of each contender's total update after `steps` steps, against float64 torch AdamW."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(numel, generator=generator) * 0.1
    grads = [torch.randn(numel, generator=generator) * 1e-2 for _ in range(steps)]
    reference = torch.nn.Parameter(start.double())
    optimizer = torch.optim.AdamW([reference], foreach=False, **ADAM_HYPER)
    for g in grads:
        reference.grad = g.double()
        optimizer.step()
    expected = reference.detach() - start.double()
    errors = {}
    for name, contender in built.items():
        if contender.master_precision is not None:
            errors[name] = _master_update_error(contender, start, grads)
            continue
        param = torch.nn.Parameter(start.clone())
        optimizer = contender.build(param)
        for g in grads:
            param.grad = g
            optimizer.step()
        errors[name] = float((param.detach().double() - start.double() - expected).norm() / expected.norm())
    return errors


def _master_update_error(contender: Contender, start: torch.Tensor, grads: list[torch.Tensor]) -> float:
    """The same for a master row: bf16 parameters from the bf16 rounding of `start`, bf16 gradients; the
    master's total update against float64 torch AdamW's from the same start and gradients."""
    from fusedoff.kernels import master as masters

    start = start.to(torch.bfloat16)
    reference = torch.nn.Parameter(start.double())
    optimizer = torch.optim.AdamW([reference], foreach=False, **ADAM_HYPER)
    param = torch.nn.Parameter(start.clone())
    fused = contender.build(param)
    for g in grads:
        reference.grad = g.to(torch.bfloat16).double()
        optimizer.step()
        param.grad = g.to(torch.bfloat16)
        fused.step()
    state = fused.state[param]
    low = state.get("master_low_bits", state.get("master_low_byte"))
    master = state["master_param"] if "master_param" in state else masters.join(param.detach(), low)
    expected = reference.detach() - start.double()
    return float((master.double() - start.double() - expected).norm() / expected.norm())


# ---- the run -------------------------------------------------------------------------------------------


def measure(args) -> tuple[list[dict], timing.LoadMonitor]:
    generator = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(args.numel, generator=generator) * 0.1)
    param.grad = torch.randn(args.numel, generator=generator) * 1e-2
    low = torch.nn.Parameter(param.detach().to(torch.bfloat16))  # the master rows' bf16 parameter
    low.grad = param.grad.to(torch.bfloat16)

    def param_of(c: Contender) -> torch.nn.Parameter:
        return param if c.master_precision is None else low

    running: dict[str, Contender] = {}
    optimizers: dict[str, object] = {}
    skipped: dict[str, str] = {}
    candidates = contenders(not args.no_peers)
    for c in candidates:
        try:
            optimizers[c.name] = c.build(param_of(c))
            optimizers[c.name].step()  # the first step: states created, kernels compiled (torchao)
            running[c.name] = c
        except Exception as exc:  # a missing package, or a peer that cannot run on the CPU
            if not c.peer:
                raise
            skipped[c.name] = str(exc) if isinstance(exc, PeerUnavailable) else f"{type(exc).__name__}: {exc}"
            optimizers.pop(c.name, None)
            print(f"{c.name}: skipped ({skipped[c.name]})", flush=True)

    kernels = timing.bandwidth_kernels(param.detach(), param.grad)
    callables = {name: optimizers[name].step for name in running} | {k.name: k.fn for k in kernels}
    print(f"timing {', '.join(callables)}: {args.numel} params, {args.repeats} repeats, {args.threads} threads ...",
          flush=True)
    with timing.LoadMonitor() as load:
        samples = timing.time_interleaved(callables, repeats=args.repeats, warmup=max(0, args.warmup - 1))
    bandwidth = {k.name: k.bytes_per_call / timing.summarize(samples[k.name]).median for k in kernels}
    best = max(bandwidth, key=bandwidth.get)
    errors = update_errors(running)
    others = None if load.others_share is None else round(load.others_share, 3)
    common = {"numel": args.numel, "threads": args.threads, "repeats": args.repeats}

    rows = []
    for c in candidates:
        row = {"contender": c.name, "what": c.label, "state_precision": c.state_precision,
               "master_precision": c.master_precision or "", **common}
        if c.name in skipped:
            rows.append({**row, "status": f"skipped: {skipped[c.name]}"})
            continue
        s = timing.summarize(samples[c.name])
        baseline = samples[BASELINE if c.master_precision is None else MASTER_BASELINE]
        baseline_median = timing.summarize(baseline).median
        ratio = timing.paired_ratio(samples[c.name], baseline)
        held = state_bytes(optimizers[c.name], param_of(c)) / args.numel
        moved = kernel_bytes_per_param(held, c.master_precision)
        bound = moved * args.numel / bandwidth[best]
        stats = optimizers[c.name].memory_stats() if c.name.startswith("fusedoff") else None
        rows.append({
            **row, "status": "ok", **timing.summary_columns("ms", s, 1e3),
            "ratio_to_fusedoff_fp32": round(s.median / baseline_median, 4),
            "ratio_paired_q10": round(ratio.q10, 4), "ratio_paired_q90": round(ratio.q90, 4),
            "state_bytes_per_param": round(held, 6),
            "memory_stats_bytes_per_param": None if stats is None else round(stats["resident_bytes"] / args.numel, 6),
            "bytes_per_param": round(moved, 6),
            "achieved_gb_per_s": round(moved * args.numel / s.median / 1e9, 2),
            "bandwidth_gb_per_s": round(bandwidth[best] / 1e9, 2), "bandwidth_kernel": best,
            "bound_ms": round(bound * 1e3, 3), "fraction_of_bound": round(bound / s.median, 3),
            "update_rel_err": float(f"{errors[c.name]:.3e}"), "others_cpu_share": others,
        })
    for k in kernels:
        s = timing.summarize(samples[k.name])
        rows.append({"contender": k.name, "what": k.description, **common, "status": "ok",
                     **timing.summary_columns("ms", s, 1e3),
                     "achieved_gb_per_s": round(k.bytes_per_call / s.median / 1e9, 2), "others_cpu_share": others})
    return rows, load


# ---- output ----------------------------------------------------------------------------------------------


def _ratio(r: dict) -> str:
    if r["contender"] in (BASELINE, MASTER_BASELINE):
        return "1 (itself)"
    return f"{r['ratio_to_fusedoff_fp32']:.2f} [{r['ratio_paired_q10']:.2f}-{r['ratio_paired_q90']:.2f}]"


TABLE_COLUMNS = [
    ("contender", lambda r: r["contender"]),
    ("states", lambda r: r.get("state_precision")),
    ("params, master", lambda r: f"bf16, {r['master_precision']}" if r.get("master_precision") else "fp32, none"),
    ("median ms", lambda r: f"{r['ms_median']:.2f}"),
    ("p10-p90 ms", lambda r: f"{r['ms_q10']:.2f}-{r['ms_q90']:.2f}"),
    ("vs its baseline [p10-p90]", _ratio),
    ("state B/param", lambda r: f"{r['state_bytes_per_param']:.4g}"),
    ("kernel B/param", lambda r: f"{r['bytes_per_param']:.4g}"),
    ("GB/s", lambda r: f"{r['achieved_gb_per_s']:.1f}"),
    ("bound ms", lambda r: f"{r['bound_ms']:.2f}"),
    ("% of bound", lambda r: f"{100 * r['fraction_of_bound']:.0f}%"),
    ("update rel. err", lambda r: f"{r['update_rel_err']:.1e}"),
    ("status", lambda r: r["status"] if r["status"] != "ok" else ""),
]


def format_table(rows: list[dict]) -> str:
    return timing.markdown_table([r for r in rows if r.get("state_precision")], TABLE_COLUMNS)


def format_verdicts(rows: list[dict]) -> str:
    """Each compressed contender against the fp32-state step: measured, and what the bytes alone would give."""
    by_name = {r["contender"]: r for r in rows}
    lines = []
    for r in rows:
        compressed = r.get("master_precision") not in ("", None, "fp32") or r.get("state_precision") not in (None, "fp32")
        if not compressed or r["status"] != "ok":
            continue
        base = by_name[MASTER_BASELINE if r.get("master_precision") else BASELINE]
        verdict = "beats" if r["ratio_to_fusedoff_fp32"] < 1 else "DOES NOT BEAT"
        lines.append(f"- {r['contender']}: {r['ms_median']:.2f} vs {base['ms_median']:.2f} ms = "
                     f"{r['ratio_to_fusedoff_fp32']:.2f}x {base['contender']} ({verdict} it); its bytes alone "
                     f"({r['bytes_per_param']:.4g} vs {base['bytes_per_param']:.4g} B/param) would give "
                     f"{r['bytes_per_param'] / base['bytes_per_param']:.2f}x; {100 * r['fraction_of_bound']:.0f}% "
                     f"of its bound")
        eight = by_name.get("fusedoff_8bit", {})
        if not r["contender"].startswith("fusedoff") and eight.get("status") == "ok":
            lines[-1] += f"; fusedoff_8bit is {r['ms_median'] / eight['ms_median']:.2f}x faster than it"
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Left: median step (whiskers p10-p90, log scale: the peers are slower by an order of magnitude) with
    each contender's bound; right: the bytes each holds and moves per parameter."""
    shown = [r for r in rows if r.get("state_precision") and r["status"] == "ok"]
    x = list(range(len(shown)))
    labels = [r["contender"] for r in shown]
    colors = ["tab:green" if r["contender"].startswith("fusedoff") else "tab:gray" for r in shown]
    with plotting.figure(path, title, 2, panel_size=(7.5, 5.5)) as (fig, (left, right)):
        err = [[r["ms_median"] - r["ms_q10"] for r in shown], [r["ms_q90"] - r["ms_median"] for r in shown]]
        left.bar(x, [r["ms_median"] for r in shown], yerr=err, capsize=4, color=colors, label="median step (p10-p90)")
        left.scatter(x, [r["bound_ms"] for r in shown], marker="_", s=400, color="tab:red", zorder=3,
                     label="bound: kernel bytes / best in-place pass")
        for i, r in enumerate(shown):  # staggered: neighbouring labels of equal bars do not overlap
            left.annotate(f"{r['ms_median']:.1f} ms\n{r['ratio_to_fusedoff_fp32']:.2f}x", (i, r["ms_q90"]),
                          ha="center", va="bottom", xytext=(0, 3 + 22 * (i % 2)), textcoords="offset points",
                          fontsize=7)
        left.set_yscale("log")
        left.set_ylim(top=8 * max(r["ms_q90"] for r in shown))  # room for the labels above the tallest whisker
        left.set_ylabel("step time, ms (log)")
        left.set_title("step time; ratio to fusedoff fp32 states", fontsize=10)
        left.legend(fontsize=8, loc="upper left")
        width = 0.4
        right.bar([i - width / 2 for i in x], [r["state_bytes_per_param"] for r in shown], width, color="tab:blue",
                  label="state bytes held")
        right.bar([i + width / 2 for i in x], [r["bytes_per_param"] for r in shown], width, color="tab:orange",
                  label="bytes a step moves (12 + 2 x states)")
        right.set_ylim(top=1.3 * max(r["bytes_per_param"] for r in shown))  # the legend above the bars
        right.set_ylabel("bytes per parameter")
        right.set_title("bytes per parameter", fontsize=10)
        right.legend(fontsize=8, loc="upper left", ncol=2)
        for ax in (left, right):
            plotting.category_axis(ax, labels, width=10, fontsize=7)


def results_markdown(rows: list[dict], meta: dict, args, load_note: str) -> str:
    skipped = "".join(f"\n- {r['contender']}: {r['status']}" for r in rows if r["status"].startswith("skipped"))
    bw = next(r for r in rows if r["contender"] == BASELINE)
    counted = ", ".join(f"{r['contender']} {r['memory_stats_bytes_per_param']:.4g}" for r in rows
                        if r.get("memory_stats_bytes_per_param"))
    return f"""## bench_state_precision: what each state precision costs and saves on the CPU

- date: {meta['date_utc']}{' — ' + args.label if args.label else ''}
- load: {load_note}
{timing.hardware_lines(meta)}
- versions: python {meta['python']}, torch {meta['torch']}, fusedoff {meta['fusedoff']} (cpu ISA
  {meta['fusedoff_cpu_isa']}); torchao {meta['torchao']}, bitsandbytes {meta['bitsandbytes']};
  {meta['torch_threads']} threads
- command: `{timing.command_line()}`
- {args.numel} fp32 params ({args.numel / 2**20:g}M) in one tensor, its fp32 gradient fixed; every contender steps
  it with states of its own; one first step each, {max(0, args.warmup - 1)} more warm-up steps, then
  {args.repeats} interleaved repeats; AdamW lr={ADAM_HYPER['lr']}, betas={ADAM_HYPER['betas']},
  eps={ADAM_HYPER['eps']}, weight_decay={ADAM_HYPER['weight_decay']}{skipped}

{format_table(rows)}

"vs its baseline" = median / median of the fp32-state step (fusedoff_fp32; for the rows on bf16 params with
master weights, fusedoff_fp32_bf16p_fp32_master: fp32 states and masters), and the p10-p90 of the per-repeat
paired ratios. The rows on bf16 params step a bf16 copy of the parameter and gradient; their state B/param
include the master (fp32 4, split 2, split8 1) and their kernel B/param are 2 + 2 (param written, grad read)
+ 2 more where a split master reads its parameter + 2 x state B/param; their update rel. err is the master's
update from the bf16 start against float64 torch.optim.AdamW from the same start.
State B/param: the bytes of the states held (fusedoff's memory_stats() counts the same:
{counted}).
Kernel B/param = 12 (param read + write, grad read) + 2 x state B/param: what a step must move; the peers
move more (their fp32 temporaries are not counted). Bound = kernel bytes / {bw['bandwidth_gb_per_s']:.1f} GB/s, the best
in-place pass ({bw['bandwidth_kernel']}) timed in the same loop. Update rel. err: ||dw - dw_ref|| / ||dw_ref||
after {QUALITY_STEPS} steps of {QUALITY_NUMEL} params with fresh random gradients, against float64 torch.optim.AdamW.

The target: a compressed step (states or master) beats its baseline.
{format_verdicts(rows)}

Files: `{RESULTS_KEY}.csv` (one row per contender and bandwidth pass, hardware and version columns),
`{RESULTS_KEY}.png`.
"""


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=timing.parse_size, default=64 * 2**20,
                        help="parameters, e.g. 64M (default) or 1M")
    parser.add_argument("--repeats", type=int, default=20, help="interleaved repeats per contender (default 20)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="warm-up steps per contender, the first included (default 3)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="threads for all contenders")
    parser.add_argument("--no-peers", action="store_true", help="skip torchao and bitsandbytes")
    parser.add_argument("--out-dir", type=Path, default=timing.RESULTS_DIR, help="CSV, PNG and RESULTS.md go here")
    parser.add_argument("--label", default="", help="a note for the results, e.g. 'machine shared'")
    parser.add_argument("--from-csv", type=Path, default=None,
                        help="only print the tables of this CSV and draw its PNG again (into --out-dir)")
    return parser.parse_args(argv)


def title_of(meta: dict) -> str:
    return (f"AdamW step by state precision, {meta['numel'] / 2**20:g}M fp32 params, {meta['threads']} threads, "
            f"{meta['cpu_model']}; torch {meta['torch']}; {meta['date_utc']}"
            + (f"\n{meta['label']}" if meta.get("label") else ""))


def draw(rows: list[dict], meta: dict, out_dir: Path) -> str:
    """The PNG of `rows`; what was written, for the closing line."""
    try:
        plot(rows, out_dir / f"{RESULTS_KEY}.png", title_of(meta))
        return f", {RESULTS_KEY}.png"
    except ImportError as e:  # matplotlib is the bench extra's, not the test suite's
        return f" (no plot: {e})"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.from_csv is not None:
        rows = timing.read_csv(args.from_csv)
        print(format_table(rows), format_verdicts(rows), sep="\n\n")
        print(f"wrote {args.out_dir}/{draw(rows, rows[0], args.out_dir).removeprefix(', ')}")
        return
    torch.set_num_threads(args.threads)
    rows, load = measure(args)
    load_note = timing.load_note(load)
    versions = peers.versions()
    meta = timing.hardware_metadata(args.threads, {
        "fusedoff": fusedoff.__version__, "fusedoff_cpu_isa": cpu_isa(),
        "torchao": versions["torchao"], "bitsandbytes": versions["bitsandbytes"],
        "label": args.label, "load": load_note,
    })
    print()
    print(format_table(rows))
    print()
    print(format_verdicts(rows))
    print(f"\nload: {load_note}")

    args.out_dir.mkdir(parents=True, exist_ok=True)
    timing.write_csv(args.out_dir / f"{RESULTS_KEY}.csv", rows, meta)
    plotted = draw(rows, {**rows[0], **meta}, args.out_dir)
    timing.update_results_section(args.out_dir / "RESULTS.md", RESULTS_KEY,
                                  results_markdown(rows, meta, args, load_note))
    print(f"wrote {args.out_dir}/{RESULTS_KEY}.csv{plotted}, RESULTS.md")


if __name__ == "__main__":
    main()
