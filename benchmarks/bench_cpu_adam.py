"""Question: how fast is fusedoff's fused CPU AdamW step, against torch.optim.AdamW(fused=True) on CPU and
DeepSpeedCPUAdam, and how close does each come to the machine's memory-bandwidth bound?

Two configurations, each with every contender timed in turn (A, B, C, A, B, C, ...) in one process:

  fp32         fp32 params + fp32 grads + fp32 states.
               Every contender reads p, g, m, v and writes p, m, v: 28 B/param.
  bf16_master  bf16 grads with fp32 master weights.
               fusedoff: one fused call over the bf16 param, bf16 grad and fp32 master, m, v: reads
                 master 4 + grad 2 + m 4 + v 4, writes master 4 + m 4 + v 4 + bf16 param 2 = 28 B/param.
               torch: the fp32 master with its grad upcast as users do, ``master.grad = g.float()``, inside
                 the timing (a fresh 256 MiB buffer each step at 64M params, page faults included), then
                 the fused step: upcast 2 + 4, step 28 = 34 B/param. Also timed with ``copy_`` into a
                 preallocated fp32 grad, the best case for the upcast.
               DeepSpeed: ZeRO-Offload's path, an fp32 master whose fp32 grad buffer is filled with
                 ``copy_`` from the bf16 grad, then the step: 34 B/param. (DeepSpeedCPUAdam 0.19.8 has no
                 fp16/bf16 param-copy argument; its bf16 support updates bf16 params in place with no
                 fp32 master, which is another computation.)
               Neither torch nor DeepSpeed writes the bf16 model copy of the weights, which fusedoff does
               in the same pass: their rows do less work than fusedoff's.

Bytes are those the algorithm must read and write per parameter. The bound sets them against the
best of two in-place passes (scale, 1:1 read:write; axpy, 2:1) over the same buffers, timed in the
same interleaved loop with the same thread count (see timing.bandwidth_kernels). Every contender
updates the same tensors in turn (see Arena).

    .venv/bin/python benchmarks/bench_cpu_adam.py                        # 64M params, results/
    .venv/bin/python benchmarks/bench_cpu_adam.py --size 1M --repeats 3 --out-dir /tmp/bench   # smoke
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

if not __package__:  # run as a script: the repository root, for `benchmarks` and fusedoff
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import plotting, timing  # noqa: E402
from benchmarks.peers import load_deepspeed_cpu_adam  # noqa: E402

import fusedoff  # noqa: E402
from fusedoff import ops  # noqa: E402
from fusedoff._ext import cpu_isa, load_extension  # noqa: E402

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 1e-2
CONFIGS = ("fp32", "bf16_master")
TARGETS = {"torch": 1.2, "deepspeed": 1.0}  # fusedoff speedup wanted over each peer (ratio of medians)


@dataclass
class Contender:
    name: str  # fusedoff | torch | torch_copy | deepspeed
    label: str  # what is timed, for the table and the plot
    step: Callable[[], object]
    bytes_per_param: int


@dataclass
class Arena:
    """The tensors of one configuration, shared by every contender.

    NOTE: each contender updates these same tensors in turn instead of owning a copy. Under this VM
    the speed of a 256 MiB buffer depends on where it landed: with one copy per contender, the same
    kernel ran 10-25% slower or faster depending on which allocation it got, and that bias survives
    interleaving (measured with 1 thread, CPU time, 32M params: fusedoff 54 vs 60 ms on two
    allocations, deepspeed 41 vs 54 ms across runs). On shared tensors that bias is gone.
    """

    weights: torch.Tensor  # fp32: the param (fp32) or the master weights (bf16_master)
    grad: torch.Tensor  # fp32 or bf16
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    param_bf16: torch.Tensor | None = None  # bf16_master: the model copy fusedoff writes
    grad_fp32: torch.Tensor | None = None  # bf16_master: the preallocated buffer of the copy_ upcast


def make_arena(config: str, numel: int, seed: int = 0) -> Arena:
    generator = torch.Generator().manual_seed(seed)
    weights = torch.randn(numel, generator=generator) * 0.1
    grad = torch.randn(numel, generator=generator) * 1e-2
    arena = Arena(weights, grad, torch.zeros(numel), torch.zeros(numel))
    if config == "bf16_master":
        arena.grad = grad.to(torch.bfloat16)
        arena.param_bf16 = weights.to(torch.bfloat16)
        arena.grad_fp32 = torch.empty(numel)
    return arena

# ---- contenders --------------------------------------------------------------------------------------


def fusedoff_contender(config: str, arena: Arena) -> Contender:
    steps = [torch.zeros((), dtype=torch.float32)]
    hyper = dict(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY,
                 decoupled_weight_decay=True, amsgrad=False, maximize=False, backend="cpu")
    if config == "fp32":
        params, masters, label = [arena.weights], [], "fusedoff.ops.adam_step_ (fp32)"
    else:
        params, masters, label = [arena.param_bf16], [arena.weights], "fusedoff.ops.adam_step_ (bf16 p+g, fp32 master)"
    grads, exp_avgs, exp_avg_sqs = [arena.grad], [arena.exp_avg], [arena.exp_avg_sq]

    def step() -> None:
        ops.increment_steps_(steps)
        ops.adam_step_(params, grads, exp_avgs, exp_avg_sqs, [], masters, steps, **hyper)

    return Contender("fusedoff", label, step, 28)


def _step_with_grad(config: str, arena: Arena, optimizer, upcast: str) -> Callable[[], None]:
    """The timed step: attach the grad (several optimizers share the weights), upcasting bf16 inside."""
    weights, grad = arena.weights, arena.grad
    if config == "fp32":

        def step() -> None:
            weights.grad = grad
            optimizer.step()

    elif upcast == "float":

        def step() -> None:
            weights.grad = grad.float()  # a new fp32 tensor each step, as user code does
            optimizer.step()

    else:
        buffer = arena.grad_fp32

        def step() -> None:
            buffer.copy_(grad)  # into a preallocated fp32 buffer (ZeRO-Offload style)
            weights.grad = buffer
            optimizer.step()

    return step


def torch_contender(config: str, arena: Arena, upcast: str = "float") -> Contender:
    optimizer = torch.optim.AdamW([arena.weights], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                  fused=True)
    # The arena's moments become its state (what load_state_dict would do); fused wants a float32 step.
    optimizer.state[arena.weights] = {"step": torch.zeros((), dtype=torch.float32), "exp_avg": arena.exp_avg,
                                      "exp_avg_sq": arena.exp_avg_sq}
    step = _step_with_grad(config, arena, optimizer, upcast)
    if config == "fp32":
        return Contender("torch", "torch AdamW(fused=True)", step, 28)
    name = "torch" if upcast == "float" else "torch_copy"
    how = "g.float()" if upcast == "float" else "copy_ into fp32 buffer"
    return Contender(name, f"torch AdamW(fused=True) + {how}", step, 34)


def deepspeed_contender(cls, config: str, arena: Arena) -> Contender:
    optimizer = cls([arena.weights], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, adamw_mode=True)
    optimizer.state[arena.weights] = {"step": 0, "exp_avg": arena.exp_avg, "exp_avg_sq": arena.exp_avg_sq}
    step = _step_with_grad(config, arena, optimizer, "copy")
    label = "DeepSpeedCPUAdam" + ("" if config == "fp32" else " + copy_ into fp32 buffer")
    return Contender("deepspeed", label, step, 28 if config == "fp32" else 34)


def make_contenders(config: str, arena: Arena, deepspeed_cls) -> list[Contender]:
    contenders = [fusedoff_contender(config, arena), torch_contender(config, arena, "float")]
    if config == "bf16_master":
        contenders.append(torch_contender(config, arena, "copy"))
    if deepspeed_cls is not None:
        contenders.append(deepspeed_contender(deepspeed_cls, config, arena))
    return contenders


def weight_agreement(config: str, deepspeed_cls, numel: int = 1 << 16, steps: int = 3) -> dict[str, float]:
    """max |w - w_torch| after ``steps`` steps from the same start, each contender on an arena of its own."""
    names = [c.name for c in make_contenders(config, make_arena(config, 1), deepspeed_cls)]
    weights = {}
    for name in names:
        arena = make_arena(config, numel)
        contender = next(c for c in make_contenders(config, arena, deepspeed_cls) if c.name == name)
        for _ in range(steps):
            contender.step()
        weights[name] = arena.weights
    return {name: float((w - weights["torch"]).abs().max()) for name, w in weights.items()}


# ---- one configuration -------------------------------------------------------------------------------


def run_config(config: str, args, deepspeed_cls) -> list[dict]:
    arena = make_arena(config, args.size)
    contenders = make_contenders(config, arena, deepspeed_cls)
    kernels = timing.bandwidth_kernels(arena.exp_avg_sq, arena.weights)
    callables = {c.name: c.step for c in contenders} | {k.name: k.fn for k in kernels}
    with timing.LoadMonitor() as load:
        samples = timing.time_interleaved(callables, repeats=args.repeats, warmup=args.warmup)

    bandwidth = {k.name: k.bytes_per_call / timing.summarize(samples[k.name]).median for k in kernels}
    best_kernel = max(bandwidth, key=bandwidth.get)
    agreement = weight_agreement(config, deepspeed_cls)
    fused_times = samples["fusedoff"]
    rows = []
    for c in contenders:
        s = timing.summarize(samples[c.name])
        moved = c.bytes_per_param * args.size
        speedup = timing.paired_ratio(samples[c.name], fused_times)  # t_peer / t_fusedoff, per repeat
        rows.append({
            "config": config,
            "contender": c.name,
            "what": c.label,
            "numel": args.size,
            "threads": args.threads,
            "repeats": args.repeats,
            **timing.summary_columns("ms", s, 1e3),
            "bytes_per_param": c.bytes_per_param,
            "achieved_gb_per_s": round(moved / s.median / 1e9, 2),
            "bandwidth_gb_per_s": round(bandwidth[best_kernel] / 1e9, 2),
            "bandwidth_kernel": best_kernel,
            "bound_ms": round(moved / bandwidth[best_kernel] * 1e3, 3),
            "fraction_of_bandwidth": round(moved / s.median / bandwidth[best_kernel], 3),
            "fusedoff_speedup": round(s.median / timing.summarize(fused_times).median, 3),
            "fusedoff_speedup_paired_q10": round(speedup.q10, 3),
            "fusedoff_speedup_paired_q90": round(speedup.q90, 3),
            "max_abs_weight_diff_vs_torch": agreement[c.name],
            "others_cpu_share": None if load.others_share is None else round(load.others_share, 3),
        })
    for k in kernels:
        s = timing.summarize(samples[k.name])
        rows.append({
            "config": config, "contender": k.name, "what": k.description, "numel": args.size,
            "threads": args.threads, "repeats": args.repeats, **timing.summary_columns("ms", s, 1e3),
            "achieved_gb_per_s": round(k.bytes_per_call / s.median / 1e9, 2),
            "others_cpu_share": None if load.others_share is None else round(load.others_share, 3),
        })
    del arena, contenders, kernels, callables
    gc.collect()
    return rows


# ---- output ------------------------------------------------------------------------------------------


TABLE_COLUMNS = timing.paired_step_columns("fusedoff", "fusedoff") + [
    ("max|dw| vs torch", lambda r: f"{r['max_abs_weight_diff_vs_torch']:.1e}"),
]


def format_table(rows: list[dict]) -> str:
    return timing.markdown_table(rows, TABLE_COLUMNS)


def format_verdicts(rows: list[dict], deepspeed_status: str) -> str:
    """One line per (config, peer): the speedup against its target, and the most any kernel could get."""
    lines = []
    for config in [c for c in CONFIGS if any(r["config"] == c for r in rows)]:
        fused = next(r for r in rows if r["config"] == config and r["contender"] == "fusedoff")
        for peer, target in TARGETS.items():
            row = next((r for r in rows if r["config"] == config and r["contender"] == peer), None)
            if row is None:
                lines.append(f"- {config}: fusedoff vs {peer}: not measured ({deepspeed_status})")
                continue
            verdict = "meets" if row["fusedoff_speedup"] >= target else "MISSES"
            ceiling = row["ms_median"] / fused["bound_ms"]  # a fusedoff step at the bandwidth bound
            lines.append(f"- {config}: fusedoff vs {peer} ({row['what']}): {row['fusedoff_speedup']:.2f}x "
                         f"(target >= {target}x: {verdict}; at the bandwidth bound fusedoff would be {ceiling:.2f}x)")
    return "\n".join(lines)


def _short_label(row: dict) -> str:
    upcast = {"torch": "\n+ g.float()", "torch_copy": "\n+ copy_", "deepspeed": "\n+ copy_"}
    name = {"fusedoff": "fusedoff", "torch": "torch fused", "torch_copy": "torch fused", "deepspeed": "DeepSpeed"}
    return name[row["contender"]] + (upcast.get(row["contender"], "") if row["config"] == "bf16_master" else "")


def plot(rows: list[dict], path: Path, title: str) -> None:
    groups = {c: [r for r in rows if r["config"] == c and r.get("bytes_per_param")] for c in CONFIGS}
    plotting.step_bars({c: rs for c, rs in groups.items() if rs}, path, title, _short_label,
                          lambda r: r["contender"] == "fusedoff")


def results_markdown(rows, meta, args, deepspeed_status, load_note) -> str:
    bw = {r["config"]: r for r in rows if r.get("bandwidth_gb_per_s")}
    bound_lines = "\n".join(
        f"- {c}: best in-place pass = {bw[c]['bandwidth_gb_per_s']:.1f} GB/s ({bw[c]['bandwidth_kernel']}); "
        f"at 28 B/param the bound is {28 * args.size / bw[c]['bandwidth_gb_per_s'] / 1e6:.1f} ms, at 34 B/param "
        f"{34 * args.size / bw[c]['bandwidth_gb_per_s'] / 1e6:.1f} ms" for c in CONFIGS if c in bw)
    return f"""## bench_cpu_adam: fused CPU AdamW step, fusedoff vs torch fused vs DeepSpeedCPUAdam

- date: {meta['date_utc']}{' — ' + args.label if args.label else ''}
- load: {load_note}
{timing.hardware_lines(meta)}
- versions: python {meta['python']}, torch {meta['torch']}, fusedoff {meta['fusedoff']}
  (cpu ISA {meta['fusedoff_cpu_isa']}), deepspeed {deepspeed_status}; {meta['torch_threads']} threads for all
  (OpenMP runtime: {meta['openmp_runtimes']})
- deepspeed: {meta['deepspeed_build'] or deepspeed_status}
- command: `{timing.command_line()}`
- {args.size} params ({args.size / 2**20:g}M), {args.warmup} warm-up steps, then {args.repeats} interleaved repeats;
  AdamW lr={LR}, betas={BETAS}, eps={EPS}, weight_decay={WEIGHT_DECAY}

{format_table(rows)}

Speedup = median(peer) / median(fusedoff); the bracket is the p10-p90 of the per-repeat paired ratios.
B/param counts the bytes each implementation must read + write per parameter (no write-allocate);
`torch`/`deepspeed` in bf16_master include the bf16 -> fp32 grad upcast (`torch`: `g.float()`, a new tensor
each step; `torch_copy`/`deepspeed`: `copy_` into a preallocated fp32 buffer) and do not write a bf16
model copy, which fusedoff does in its one pass. max|dw| is the largest difference of the fp32 weights
from torch's after the same steps (a check that all contenders computed the same update).

Ratios against the targets:
{format_verdicts(rows, deepspeed_status)}

Bandwidth bound (measured in the same interleaved loop, same thread count; on a loaded machine the
in-place passes are slowed like everything else, and a "% of BW" above 100 means the bound came out low):
{bound_lines}

Files: `bench_cpu_adam.csv` (one row per contender, hardware and version columns), `bench_cpu_adam.png`.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=timing.parse_size, default=64 * 2**20, help="parameters, e.g. 64M (default) or 1M")
    parser.add_argument("--repeats", type=int, default=30, help="interleaved repeats per contender (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per contender (default 3)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="threads for all contenders")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam")
    parser.add_argument("--out-dir", type=Path, default=timing.RESULTS_DIR, help="CSV, PNG and RESULTS.md go here")
    parser.add_argument("--label", default="", help="a note for the results, e.g. 'preliminary, machine under load'")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    load_extension()
    if args.no_deepspeed:
        deepspeed_cls, deepspeed_status, deepspeed_build = None, "not run (--no-deepspeed)", ""
    else:
        deepspeed_cls, deepspeed_status, deepspeed_build = load_deepspeed_cpu_adam()
        if deepspeed_cls is None:
            deepspeed_status = f"unavailable, skipped ({deepspeed_status})"
            print(f"DeepSpeedCPUAdam: {deepspeed_status}", flush=True)

    rows: list[dict] = []
    with timing.LoadMonitor() as load:
        for config in args.configs:
            print(f"timing {config}: {args.size} params, {args.repeats} repeats, {args.threads} threads ...",
                  flush=True)
            rows += run_config(config, args, deepspeed_cls)
    load_note = timing.load_note(load)

    meta = timing.hardware_metadata(args.threads, {
        "fusedoff": fusedoff.__version__,
        "fusedoff_cpu_isa": cpu_isa(),
        "deepspeed": deepspeed_status,
        "deepspeed_build": deepspeed_build,
        "label": args.label,
        "load": load_note,
    })
    print()
    print(format_table(rows))
    print()
    print(format_verdicts(rows, deepspeed_status))
    print(f"\nload: {load_note}")

    args.out_dir.mkdir(parents=True, exist_ok=True)
    timing.write_csv(args.out_dir / "bench_cpu_adam.csv", rows, meta)
    title = (f"fused CPU AdamW, {args.size / 2**20:g}M params, {args.threads} threads, {meta['cpu_model']}; "
             f"torch {meta['torch']}, deepspeed {deepspeed_status.split(' (')[0]}; {meta['date_utc']}"
             + (f"\n{args.label}" if args.label else ""))
    plot(rows, args.out_dir / "bench_cpu_adam.png", title)
    timing.update_results_section(args.out_dir / "RESULTS.md", "bench_cpu_adam",
                                  results_markdown(rows, meta, args, deepspeed_status, load_note))
    print(f"wrote {args.out_dir}/bench_cpu_adam.csv, bench_cpu_adam.png, RESULTS.md")


if __name__ == "__main__":
    main()
