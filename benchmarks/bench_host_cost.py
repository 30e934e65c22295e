"""Question: what does a step cost per tensor on the host, against torch.optim.AdamW(fused=True)?

Many small tensors (norm weights, biases, experts) make an optimizer step host-bound: the kernels
are short and the Python and dispatch work per tensor decides the step time. Each shape is
`count` fp32 tensors of `numel` elements with gradients attached once (the step does not consume
them); every contender updates its own copy of the same tensors, timed in turn (A, B, C, A, B, C,
...) in one process, so that drifts in machine load hit all alike:

  torch     torch.optim.AdamW(fused=True) (on CPU: its fused CPU kernel)
  resident  fusedoff.AdamW(offload="none")
  stream    fusedoff.AdamW(offload="stream") (on CPU parameters: the engine looped back through host
            buffers, every chunk copied in and out; on a GPU: streamed over the link)

The figure is the median step time and its ratio to torch's (paired per repeat); `per tensor` is
the step time over the tensor count. The bytes a step must move are printed beside it (28 B per
element for fp32 AdamW) with the time they take at the bound measured in the same loop
(timing.bandwidth_kernels): where the step is far above that time, the cost is per tensor.

    .venv/bin/python benchmarks/bench_host_cost.py                      # the issue's shapes, results/
    .venv/bin/python benchmarks/bench_host_cost.py --before OLD.csv     # and an older build's rows beside them
    .venv/bin/python benchmarks/bench_host_cost.py --shapes 20x64 --repeats 3 --out-dir /tmp/b   # smoke
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if not __package__:  # run as a script: the repository root, for `benchmarks` and fusedoff
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import plotting, timing  # noqa: E402

import fusedoff  # noqa: E402

DEFAULT_SHAPES = ("2000x64", "2000x4096", "300x65536")
BYTES_PER_ELEMENT = 28  # fp32 AdamW: reads p, g, m, v (16), writes p, m, v (12)
CONTENDERS = ("torch", "resident", "stream")


def parse_shape(text: str) -> tuple[int, int]:
    count, numel = text.lower().split("x")
    return int(count), timing.parse_size(numel)


def make_step(name: str, count: int, numel: int, device: str, seed: int = 0):
    """A step callable over fresh copies of the shape's tensors (same values for every contender)."""
    generator = torch.Generator().manual_seed(seed)
    params = []
    for _ in range(count):
        p = torch.nn.Parameter(torch.randn(numel, generator=generator).to(device))
        p.grad = torch.randn(numel, generator=generator).to(device)
        params.append(p)
    if name == "torch":
        opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    else:
        opt = fusedoff.AdamW(params, lr=1e-3, offload="none" if name == "resident" else "stream")
    return opt.step


def run_shape(count: int, numel: int, args) -> list[dict]:
    steps = {name: make_step(name, count, numel, args.device) for name in CONTENDERS}
    x = torch.randn(count * numel, device=args.device)
    y = torch.randn(count * numel, device=args.device)
    kernels = timing.bandwidth_kernels(x, y)
    contenders = {**steps, **{f"bound:{k.name}": k.fn for k in kernels}}
    if args.device == "cuda":
        samples = {name: timing.time_cuda(fn, repeats=args.repeats, warmup=args.warmup, events=False)
                   for name, fn in contenders.items()}
    else:
        samples = timing.time_interleaved(contenders, repeats=args.repeats, warmup=args.warmup)
    bandwidth = max(k.bytes_per_call / timing.summarize(samples[f"bound:{k.name}"]).median for k in kernels)
    moved = BYTES_PER_ELEMENT * count * numel
    rows = []
    for name in CONTENDERS:
        s = timing.summarize(samples[name])
        ratio = timing.paired_ratio(samples[name], samples["torch"])
        rows.append({
            "shape": f"{count}x{numel}", "count": count, "numel": numel, "contender": name,
            **timing.summary_columns("step_ms", s, 1e3),
            "per_tensor_us": round(s.median / count * 1e6, 2),
            "vs_torch": round(ratio.median, 3), "vs_torch_q25": round(ratio.q25, 3), "vs_torch_q75": round(ratio.q75, 3),
            "bytes_moved": moved, "bound_ms": round(moved / bandwidth * 1e3, 3),
        })
    return rows


def format_table(rows: list[dict]) -> str:
    return timing.markdown_table(rows, [
        ("shape", lambda r: r["shape"]), ("contender", lambda r: r["contender"]),
        ("step ms (median)", lambda r: f"{r['step_ms_median']:.2f}"),
        ("per tensor us", lambda r: f"{r['per_tensor_us']:.1f}"),
        ("vs torch fused (q25-q75)", lambda r: f"{r['vs_torch']:.2f}x ({r['vs_torch_q25']:.2f}-{r['vs_torch_q75']:.2f})"),
        ("bound ms", lambda r: f"{r['bound_ms']:.2f}"),
    ])


def plot(rows: list[dict], before: list[dict], path: Path, title: str) -> None:
    """One panel per shape: median step time per contender, this build's and `before`'s fusedoff rows."""
    shown = []
    for r in rows + [{**b, "contender": f"{b['contender']} (before)"} for b in before if b["contender"] != "torch"]:
        shown.append({**r, "ms_median": r["step_ms_median"], "ms_q10": r["step_ms_q10"], "ms_q90": r["step_ms_q90"],
                      "bytes_per_param": BYTES_PER_ELEMENT})
    groups: dict[str, list[dict]] = {}
    for r in shown:
        groups.setdefault(str(r["shape"]), []).append(r)
    plotting.step_bars(groups, path, title, label=lambda r: str(r["contender"]).replace(" (", "\n("),
                          highlight=lambda r: r["contender"] in ("resident", "stream"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="COUNTxNUMEL, e.g. 2000x64")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=timing.RESULTS_DIR)
    parser.add_argument("--before", type=Path, help="a CSV of this script from an older build, plotted beside")
    parser.add_argument("--label", default="", help="appended to the results section's title (e.g. 'before')")
    args = parser.parse_args()
    rows = []
    with timing.LoadMonitor() as load:
        for text in args.shapes:
            count, numel = parse_shape(text)
            rows += run_shape(count, numel, args)
            print(format_table([r for r in rows if r["shape"] == f"{count}x{numel}"]), flush=True)
    meta = timing.hardware_metadata(torch.get_num_threads(), {"device": args.device, "load": timing.load_note(load)})
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"bench_host_cost_{args.device}" + (f"_{args.label}" if args.label else "")
    timing.write_csv(args.out_dir / f"{stem}.csv", rows, meta)
    before = timing.read_csv(args.before) if args.before else []
    try:
        plot(rows, before, args.out_dir / f"{stem}.png", f"optimizer step per tensor count x size, {args.device}, "
             f"{meta['cpu_model']}, {torch.get_num_threads()} threads")
    except ImportError:
        print("(no matplotlib: no plot)")
    markdown = (f"{timing.hardware_lines(meta)}\n- load: {meta['load']}\n\n`{timing.command_line()}`\n\n"
                f"{format_table(rows)}\n")
    if before:
        markdown += f"\nThe older build's rows (`{args.before.name}`):\n\n{format_table(before)}\n"
    timing.update_results_section(args.out_dir / "RESULTS.md", f"bench_host_cost {args.device} {args.label}".strip(),
                                  markdown)
    print(markdown)


if __name__ == "__main__":
    main()
