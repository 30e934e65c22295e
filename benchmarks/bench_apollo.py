"""Question: how fast is fusedoff's fused Apollo step against the same math written the eager way in PyTorch,
and how many bytes per parameter does each move?

Contenders, timed in turn (A, B, A, B, ...) in one process, each a whole ``opt.step()``:

  fused  ``fusedoff.Apollo(params, lr, backend=...)``: its step runs ``fusedoff.ops.apollo_whole_step_``, a
         reduction pass then one apply pass (two with 'stable' decay), on the "cpu" backend for CPU
         parameters or "cuda" for CUDA parameters (``--device``).
  eager  ``fusedoff.kernels.reference.ApolloReference``: a torch.optim.Optimizer doing the reference
         implementation's whole-tensor ops one after another (the baseline the tests also use).

Two configurations, fp32 params, grads and states, ``--tensors`` parameter tensors (4 by default, so the
per-tensor sums, max and mean are real reductions): 'constant' rebound with 'L2' decay, and 'belief' rebound
with 'stable' decay (which needs mean(D) over the tensor, so the fused step takes three passes and the eager
one a host synchronisation). The Apollo hyperparameter warmup is 0: the learning rate is the same each step.

Bytes per parameter are those each implementation must read and write: the fused passes as the kernels
are written, the eager op sequence as listed in EAGER_OPS (each elementwise op reads its inputs and writes
its output; a reduction reads its input). Neither count includes write-allocate traffic or the page faults
of the eager step's fresh temporaries, which the eager step pays on top. The bound sets the bytes against
the best of two in-place passes (timing.bandwidth_kernels) over the same buffers, timed in the same
interleaved loop. Both contenders update the same tensors (see Arena), over and over: nothing is reset.

    .venv/bin/python benchmarks/bench_apollo.py                      # cpu: 16M params; cuda: 256M; results/
    .venv/bin/python benchmarks/bench_apollo.py --size 1M --repeats 3 --out-dir /tmp/bench_apollo   # smoke
"""

from __future__ import annotations

import argparse
import gc
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

if not __package__:  # run as a script: the repository root, for `benchmarks` and fusedoff
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import plotting, timing, traffic  # noqa: E402

import fusedoff  # noqa: E402
from fusedoff._ext import cpu_isa, load_extension  # noqa: E402
from fusedoff.kernels.reference import ApolloReference  # noqa: E402

LR, BETA, EPS, WEIGHT_DECAY, APOLLO_WARMUP = 1e-2, 0.9, 1e-4, 1e-2, 0
CONFIGS = traffic.APOLLO_CONFIGS
AGREEMENT_STEPS, AGREEMENT_RTOL = 3, 1e-5

# Bytes per parameter of each pass (fused) and op (eager): written once in traffic.py.
FUSED_PASSES, EAGER_OPS = traffic.APOLLO_FUSED_PASSES, traffic.APOLLO_EAGER_OPS
bytes_per_param, describe_bytes = traffic.apollo_update_bytes, traffic.describe_steps


# ---- the tensors -------------------------------------------------------------------------------------


@dataclass
class Arena:
    """One flat fp32 buffer per role, cut into ``tensors`` parameter tensors; both optimizers share them.

    NOTE: as in bench_cpu_adam, both contenders update these same tensors instead of owning copies: on this
    VM the speed of a large buffer depends on where it was allocated (10-25%), a bias that interleaving does
    not remove. The flat buffers also give the bandwidth passes the very memory the steps work on.
    """

    params: list[torch.Tensor]
    flat: dict[str, torch.Tensor]  # p g m B d

    def views(self, role: str) -> list[torch.Tensor]:
        sizes = [p.numel() for p in self.params]
        return list(self.flat[role].split(sizes))


def make_arena(numel: int, tensors: int, device: torch.device, seed: int = 0) -> Arena:
    generator = torch.Generator().manual_seed(seed)
    flat = {
        "p": (torch.randn(numel, generator=generator) * 0.1).to(device),
        "g": (torch.randn(numel, generator=generator) * 1e-2).to(device),
        **{role: torch.zeros(numel, device=device) for role in ("m", "B", "d")},
    }
    sizes = [numel // tensors + (i < numel % tensors) for i in range(tensors)]
    params = list(flat["p"].split(sizes))
    for p, g in zip(params, flat["g"].split(sizes)):
        p.grad = g  # the same gradient every step
    return Arena(params, flat)


def make_optimizers(config: str, arena: Arena, backend: str) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """(fused, eager) over the arena's params, both holding the arena's m, B, d as their states."""
    hyper = dict(lr=LR, beta=BETA, eps=EPS, warmup=APOLLO_WARMUP, weight_decay=WEIGHT_DECAY, **CONFIGS[config])
    fused = fusedoff.Apollo(arena.params, backend=backend, **hyper)
    eager = ApolloReference(arena.params, **hyper)
    for p, m, b, d in zip(arena.params, arena.views("m"), arena.views("B"), arena.views("d")):
        states = {"exp_avg_grad": m, "approx_hessian": b, "update": d}
        fused.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device), **states}
        eager.state[p] = {"step": 0, **states}
    return fused, eager


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def check_agreement(config: str, args, device: torch.device) -> tuple[Arena, dict[str, float]]:
    """Step fused and eager from the same start on arenas of their own; fail loudly if they differ.

    Returns the fused arena (to time on) and the relative L2 differences of the params and of the change
    of the params (the stricter one: the update is small against the params).
    """
    arenas = [make_arena(args.size, args.tensors, device) for _ in range(2)]
    start = arenas[0].flat["p"].clone()
    fused, _ = make_optimizers(config, arenas[0], args.backend)
    _, eager = make_optimizers(config, arenas[1], args.backend)
    for _ in range(AGREEMENT_STEPS):
        fused.step()
        eager.step()
    p_fused, p_eager = arenas[0].flat["p"], arenas[1].flat["p"]
    diff = {"param_rel_l2_diff": relative_l2(p_fused, p_eager),
            "update_rel_l2_diff": relative_l2(p_fused - start, p_eager - start)}
    if not all(v < AGREEMENT_RTOL for v in diff.values()):  # NaN fails too
        raise SystemExit(f"FAIL {config}: fused and eager Apollo disagree after {AGREEMENT_STEPS} steps: relative L2 "
                         f"difference of the params {diff['param_rel_l2_diff']:.3e}, of the param change "
                         f"{diff['update_rel_l2_diff']:.3e} (must be < {AGREEMENT_RTOL:g})")
    return arenas[0], diff


def synchronized(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """timing.time_interleaved times synchronous calls: on CUDA, wait for the queued kernels."""
    if device.type != "cuda":
        return fn

    def call() -> None:
        fn()
        torch.cuda.synchronize(device)

    return call


# ---- one configuration -------------------------------------------------------------------------------


def run_config(config: str, args, device: torch.device) -> list[dict]:
    arena, agreement = check_agreement(config, args, device)
    fused, eager = make_optimizers(config, arena, args.backend)
    kernels = timing.bandwidth_kernels(arena.flat["B"], arena.flat["p"])
    callables = {"fused": fused.step, "eager": eager.step} | {k.name: k.fn for k in kernels}
    with timing.LoadMonitor() as load:
        samples = timing.time_interleaved({name: synchronized(fn, device) for name, fn in callables.items()},
                                          repeats=args.repeats, warmup=args.warmup)
    if not all(bool(t.isfinite().all()) for t in arena.flat.values()):
        raise SystemExit(f"FAIL {config}: non-finite values in the params or states after timing; times are invalid")

    bandwidth = {k.name: k.bytes_per_call / timing.summarize(samples[k.name]).median for k in kernels}
    best_kernel = max(bandwidth, key=bandwidth.get)
    fused_median = timing.summarize(samples["fused"]).median
    others = None if load.others_share is None else round(load.others_share, 3)
    common = {"config": config, "device": str(device), "numel": args.size, "tensors": args.tensors,
              "threads": args.threads, "repeats": args.repeats}
    contenders = {
        "fused": (f"fusedoff.Apollo(backend='{args.backend}') -> ops.apollo_whole_step_", FUSED_PASSES[config]),
        "eager": ("fusedoff.kernels.reference.ApolloReference (eager torch)", EAGER_OPS[config]),
    }
    rows = []
    for name, (label, steps) in contenders.items():
        s = timing.summarize(samples[name])
        nbytes = bytes_per_param(steps)
        moved = nbytes * args.size
        speedup = timing.paired_ratio(samples[name], samples["fused"])  # t / t_fused, per repeat
        rows.append({
            **common, "contender": name, "what": label,
            **timing.summary_columns("ms", s, 1e3),
            "bytes_per_param": nbytes,
            "achieved_gb_per_s": round(moved / s.median / 1e9, 2),
            "bandwidth_gb_per_s": round(bandwidth[best_kernel] / 1e9, 2),
            "bandwidth_kernel": best_kernel,
            "bound_ms": round(moved / bandwidth[best_kernel] * 1e3, 3),
            "fraction_of_bandwidth": round(moved / s.median / bandwidth[best_kernel], 3),
            "fused_speedup": round(s.median / fused_median, 3),
            "fused_speedup_paired_q10": round(speedup.q10, 3),
            "fused_speedup_paired_q90": round(speedup.q90, 3),
            **{k: float(f"{v:.3e}") for k, v in agreement.items()},
            "bytes_breakdown": describe_bytes(steps),
            "others_cpu_share": others,
        })
    for k in kernels:
        s = timing.summarize(samples[k.name])
        rows.append({**common, "contender": k.name, "what": k.description, **timing.summary_columns("ms", s, 1e3),
                     "achieved_gb_per_s": round(k.bytes_per_call / s.median / 1e9, 2), "others_cpu_share": others})
    del arena, fused, eager, kernels, callables
    gc.collect()
    return rows


# ---- output ------------------------------------------------------------------------------------------


TABLE_COLUMNS = timing.paired_step_columns("fused", "fused") + [
    ("rel. L2 diff p / dp", lambda r: f"{r['param_rel_l2_diff']:.1e} / {r['update_rel_l2_diff']:.1e}"),
]


def format_table(rows: list[dict]) -> str:
    return timing.markdown_table(rows, TABLE_COLUMNS)


def format_verdicts(rows: list[dict]) -> str:
    """Per config: the speedup, the byte ratio (the speedup at equal GB/s), and the fused step's ceiling."""
    lines = []
    for config in [c for c in CONFIGS if any(r["config"] == c for r in rows)]:
        fused, eager = (next(r for r in rows if r["config"] == config and r["contender"] == name)
                        for name in ("fused", "eager"))
        lines.append(
            f"- {config}: fused {fused['ms_median']:.2f} ms vs eager {eager['ms_median']:.2f} ms: "
            f"{eager['fused_speedup']:.2f}x faster; bytes {fused['bytes_per_param']} vs {eager['bytes_per_param']} "
            f"B/param: eager moves {eager['bytes_per_param'] / fused['bytes_per_param']:.2f}x as much; "
            f"fused at {100 * fused['fraction_of_bandwidth']:.0f}% of the bandwidth bound, eager at "
            f"{100 * eager['fraction_of_bandwidth']:.0f}%; at the bound the fused step would be "
            f"{eager['ms_median'] / fused['bound_ms']:.2f}x faster than eager")
    return "\n".join(lines)


def byte_accounting() -> str:
    lines = []
    for config in CONFIGS:
        for name, table in (("fused", FUSED_PASSES), ("eager", EAGER_OPS)):
            steps = table[config]
            lines.append(f"- {config}, {name} ({len(steps)} {'passes' if name == 'fused' else 'ops'}, "
                         f"{bytes_per_param(steps)} B/param): {describe_bytes(steps)}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    groups = {c: [r for r in rows if r["config"] == c and r.get("bytes_per_param")] for c in CONFIGS}
    plotting.step_bars({c: rs for c, rs in groups.items() if rs}, path, title,
                          lambda r: "fusedoff fused" if r["contender"] == "fused" else "eager torch\n(ApolloReference)",
                          lambda r: r["contender"] == "fused")


def cache_note(meta: dict, args) -> str:
    """On CPU, whether one tensor's buffers fit in the L3, where the eager step's temporaries would stay."""
    match = re.match(r"([\d.]+)\s*([KMG])i?B", str(meta.get("l3_cache", "")))
    if args.device.type != "cpu" or not match:
        return ""
    l3 = float(match.group(1)) * {"K": 2**10, "M": 2**20, "G": 2**30}[match.group(2)]
    tensor_bytes = 4 * args.size / args.tensors
    if tensor_bytes >= 2 * l3:
        return ""
    return (f"\nNOTE: one tensor's fp32 buffer is {tensor_bytes / 2**20:.0f} MiB against an L3 of "
            f"{l3 / 2**20:.0f} MiB: "
            f"an eager op's output may still be in cache when the next op reads it, so the eager step's memory "
            f"traffic can be below its byte count (use a larger --size for a DRAM-bound comparison).")


def results_markdown(rows, meta, args, load_note) -> str:
    bw = {r["config"]: r for r in rows if r.get("bandwidth_gb_per_s")}
    bound_lines = "\n".join(f"- {c}: best in-place pass = {bw[c]['bandwidth_gb_per_s']:.1f} GB/s "
                            f"({bw[c]['bandwidth_kernel']})" for c in CONFIGS if c in bw)
    return f"""## bench_apollo ({args.device.type}): fused Apollo step, fusedoff vs the eager PyTorch reference

- date: {meta['date_utc']}{' — ' + args.label if args.label else ''}
- load: {load_note}
{timing.hardware_lines(meta)}
- versions: python {meta['python']}, torch {meta['torch']}, fusedoff {meta['fusedoff']}
  (cpu ISA {meta['fusedoff_cpu_isa']}); {meta['torch_threads']} threads (OpenMP runtime: {meta['openmp_runtimes']})
- command: `{timing.command_line()}`
- {args.size} fp32 params ({args.size / 2**20:g}M) as {args.tensors} tensors on {args.device}, backend
  '{args.backend}'; {args.warmup} warm-up steps, then {args.repeats} interleaved repeats of the whole `opt.step()`;
  Apollo lr={LR}, beta={BETA}, eps={EPS}, weight_decay={WEIGHT_DECAY}, warmup={APOLLO_WARMUP}

{format_table(rows)}

Speedup = median(eager) / median(fused); the bracket is the p10-p90 of the per-repeat paired ratios.
B/param counts the fp32 bytes each implementation must read + write per parameter (no write-allocate, no
page faults of the eager step's fresh temporaries). The last column is the relative L2 difference of the
params, and of their change, after {AGREEMENT_STEPS} steps of each from the same start (checked < {AGREEMENT_RTOL:g}
before timing).{cache_note(meta, args)}

{format_verdicts(rows)}

Bytes per parameter, pass by pass (fused) and op by op (eager), as r(ead) / w(rite) fp32 tensors of 4 B:
{byte_accounting()}

Bandwidth bound (measured in the same interleaved loop on the same buffers; on a loaded machine the
in-place passes are slowed like everything else, and a "% of BW" above 100 means the bound came out low):
{bound_lines}

Files: `bench_apollo_{args.device.type}.csv` (one row per contender, hardware and version columns),
`bench_apollo_{args.device.type}.png`.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", type=torch.device, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu (backend 'cpu') or cuda (backend 'cuda'); default cuda if available")
    parser.add_argument("--size", type=timing.parse_size, default=None,
                        help="parameters, e.g. 1M (default 16M on cpu, 256M on cuda)")
    parser.add_argument("--tensors", type=int, default=4, help="parameter tensors the params are cut into (default 4)")
    parser.add_argument("--repeats", type=int, default=30, help="interleaved repeats per contender (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per contender first (default 3)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads for all")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--out-dir", type=Path, default=timing.RESULTS_DIR, help="CSV, PNG and RESULTS.md go here")
    parser.add_argument("--label", default="", help="a note for the results, e.g. 'preliminary, machine under load'")
    args = parser.parse_args()
    if args.device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got {args.device}")
    if args.device.type == "cuda" and args.device.index is None:
        args.device = torch.device("cuda", torch.cuda.current_device())
    args.backend = args.device.type
    if args.size is None:
        args.size = (16 if args.device.type == "cpu" else 256) * 2**20
    if not 1 <= args.tensors <= args.size:
        parser.error("--tensors must be between 1 and --size")
    torch.set_num_threads(args.threads)
    load_extension()

    rows: list[dict] = []
    with timing.LoadMonitor() as load:
        for config in args.configs:
            print(f"timing {config}: {args.size} params in {args.tensors} tensors on {args.device}, {args.repeats} "
                  f"repeats, {args.threads} threads ...", flush=True)
            rows += run_config(config, args, args.device)
    load_note = timing.load_note(load)

    extra = {"fusedoff": fusedoff.__version__, "fusedoff_cpu_isa": cpu_isa(),
             "device": str(args.device), "label": args.label, "load": load_note}
    if args.device.type == "cuda":
        extra |= timing.gpu_metadata()
    meta = timing.hardware_metadata(args.threads, extra)
    print()
    print(format_table(rows))
    print()
    print(format_verdicts(rows))
    print("\nbytes per parameter:")
    print(byte_accounting())
    print(f"\nload: {load_note}{cache_note(meta, args)}")

    name = f"bench_apollo_{args.device.type}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    timing.write_csv(args.out_dir / f"{name}.csv", rows, meta)
    gpu = f", {meta['gpu']}" if args.device.type == "cuda" else ""
    title = (f"Apollo step, {args.size / 2**20:g}M fp32 params in {args.tensors} tensors on {args.device}{gpu}, "
             f"{args.threads} threads, {meta['cpu_model']}; torch {meta['torch']}; {meta['date_utc']}"
             + (f"\n{args.label}" if args.label else ""))
    plot(rows, args.out_dir / f"{name}.png", title)
    timing.update_results_section(args.out_dir / "RESULTS.md", name, results_markdown(rows, meta, args, load_note))
    print(f"wrote {args.out_dir}/{name}.csv, {name}.png, RESULTS.md")


if __name__ == "__main__":
    main()
