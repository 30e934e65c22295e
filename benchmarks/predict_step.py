"""Question: how long should a streamed AdamW step take on an H200, and how much of it will the next
forward see? A prediction by the timed simulator (fusedoff/testing/timed.py), not a measurement.

fusedoff.AdamW with bf16 parameters and gradients, fp32 master weights, moments stored as fp32, bf16 or
8-bit (``state_precision``), offload='stream' with the default chunk (4M elements) and 2 buffer sets, at
bench_step.py's shapes: 16M-element tensors (4096 x 4096), 64 of them for "1B" (2^30 parameters, 16
layers of 4) and 448 for "7B" (32 layers of 14). Each case runs the real engine on `TimedRuntime` with
the model scaled down [note: timed scale]: tensors of 1024 elements, chunks of 256, each byte counted
16384 times, so the schedule has the large model's chunks, copies and calls. One step is taken (states
are created), the device drained, then the step is recorded, then the next forward as one main-stream
operation per layer (``--forward-ms`` over the layers), and the schedule is computed at `Rates`.

  step ms        the step's first host call to its last copy back to host memory.
  link-bound ms  the step's bytes over the link at its rates: max(h2d / h2d rate, d2h / d2h rate,
                 (h2d + d2h) / both-directions cap). A step can take no less.
  exposed ms     how much later the forward ends than after an instant step: the step's cost to
                 training, where the forward runs on the main stream after ``opt.step()``.
  exposed ms, overlapped   the same with ``opt.overlap_with(model)``: each layer's forward waits only
                 for the chunks of its own parameters, updated in forward order.
  link-bound - forward     what no schedule can hide: the link time the forward does not cover.
  host us/call   the engine's Python per runtime call, measured here: the recorded step's wall time,
                 less the time the CPU copies and kernels themselves took, over its runtime calls.

The step's link bytes are held to benchmarks/traffic.py's count for the full-size configuration.

    .venv/bin/python benchmarks/predict_step.py                    # results/predict_step.csv, RESULTS.md
    .venv/bin/python benchmarks/predict_step.py --models 1B --forward-ms 50 --out-dir /tmp/p
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

if not __package__:  # run as a script: the repository root, for `benchmarks` and fusedoff
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import timing, traffic  # noqa: E402

import fusedoff  # noqa: E402
from fusedoff.offload import runtimes  # noqa: E402
from fusedoff.offload.engine import DEFAULT_CHUNK_SIZE  # noqa: E402
from fusedoff.testing.timed import Prediction, Rates, TimedRuntime, predict  # noqa: E402

RESULTS_KEY = "predict_step"
TENSOR = 16 * 2**20  # bench_step.py's --tensor-size: a 4096 x 4096 matrix
MODELS = {"1B": (16, 4), "7B": (32, 14)}  # layers, 16M-element tensors per layer
STATE_PRECISIONS = ("fp32", "bf16", "8bit")
SCALED_CHUNK = 256  # elements standing for one 4M chunk: whole 8-bit scale blocks (256 elements)
HYPER = dict(lr=1e-3, weight_decay=0.01)


@dataclass
class Recorded:
    """A step recorded on a TimedRuntime, with the forward after it."""

    runtime: TimedRuntime
    optimizer: fusedoff.AdamW
    step: range
    forward: range
    numels: list[int]  # the full-size tensors the scaled ones stand for
    host_call_s: float  # measured: the step's wall time less its copies' and kernels', per runtime call


def scaled_params(numels: list[int], scale: int, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n // scale, generator=gen).bfloat16()) for n in numels]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).bfloat16()
    return params


class TimedLayer(torch.nn.Module):
    """A layer of the model: its parameters, and a forward that is main-stream work of a given length
    on the timed device (after fusedoff's forward pre-hook, when the step overlaps the forward)."""

    def __init__(self, params: list[torch.nn.Parameter], seconds: float, runtime, what: str) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(params)
        self.seconds, self.runtime, self.what = seconds, runtime, what

    def forward(self, x=None):
        self.runtime().main_work(self.seconds, self.what)
        return x


def record(params: list[torch.nn.Parameter], state_precision: str, chunk_size: int, scale: float,
           layer_seconds: list[float], numels: list[int], overlap: bool = False, num_buffers: int = 2) -> Recorded:
    """One streamed AdamW step of `params` recorded on a TimedRuntime (after a first step that creates
    the states), then the next forward: one main-stream operation per layer (the parameters split
    evenly over the layers, in order). `overlap`: the step overlaps that forward (``opt.overlap_with``)."""
    made: list[TimedRuntime] = []
    per_layer = len(params) // max(1, len(layer_seconds))
    model = torch.nn.Sequential(*(
        TimedLayer(params[k * per_layer:(k + 1) * per_layer], seconds, lambda: made[-1], f"forward layer {k}")
        for k, seconds in enumerate(layer_seconds)))
    with runtimes.simulate(lambda device: made.append(TimedRuntime(device, scale=scale)) or made[-1]):
        opt = fusedoff.AdamW(params, **HYPER, offload="stream", chunk_size=chunk_size, num_buffers=num_buffers,
                             state_precision=state_precision, backend="cpu")
        if overlap:
            opt.overlap_with(model)
        opt.step()
        (rt,) = made
        opt._engine.join()
        rt.drain()
        first, ran = rt.mark(), rt.device_seconds
        began = time.perf_counter()
        opt.step()
        wall = time.perf_counter() - began
        between = rt.mark()
        model(None)
    step = range(first, between)
    host_calls = sum(rt.ops[i].kind == "host" for i in step)
    return Recorded(rt, opt, step, range(between, rt.mark()), numels, (wall - (rt.device_seconds - ran)) / host_calls)


def link_bytes(numels: list[int], state_precision: str) -> tuple[int, int]:
    """traffic.py's (h2d, d2h) for the full-size configuration."""
    return traffic.adam_stream_link(numels, DEFAULT_CHUNK_SIZE, traffic.PRECISIONS["bf16_master"],
                                    state=traffic.STATE_PRECISIONS[state_precision])


def row(model: str, state_precision: str, recorded: Recorded, p: Prediction, rates: Rates) -> dict:
    h2d, d2h = link_bytes(recorded.numels, state_precision)
    if (p.h2d_bytes, p.d2h_bytes) != (h2d, d2h):
        raise AssertionError(f"{model} {state_precision}: recorded link bytes {p.h2d_bytes:.0f}/{p.d2h_bytes:.0f} "
                             f"but traffic.py counts {h2d}/{d2h}")
    return {
        "model": model, "state_precision": state_precision, "params": sum(recorded.numels),
        "chunks": -(-sum(recorded.numels) // DEFAULT_CHUNK_SIZE), "h2d_gb": round(h2d / 1e9, 3),
        "d2h_gb": round(d2h / 1e9, 3), "kernel_gb": round(p.kernel_bytes / 1e9, 3),
        "step_ms": round(p.step_s * 1e3, 2), "link_bound_ms": round(p.link_bound_s * 1e3, 2),
        "step_over_bound": round(p.step_s / p.link_bound_s, 3), "forward_ms": round(p.forward_s * 1e3, 2),
        "exposed_ms": round(p.exposed_s * 1e3, 2), "host_calls": p.host_calls,
        "host_us_per_call_measured": round(recorded.host_call_s * 1e6, 2),
        **{f"path_{kind}_ms": round(s * 1e3, 2) for kind, s in sorted(p.path_seconds.items())},
        **{f"rate_{k}": v for k, v in dataclasses.asdict(rates).items()},
    }


COLUMNS = [
    ("model", lambda r: r["model"]), ("states", lambda r: r["state_precision"]), ("chunks", lambda r: r["chunks"]),
    ("h2d GB", lambda r: r["h2d_gb"]), ("d2h GB", lambda r: r["d2h_gb"]),
    ("step ms", lambda r: f"{r['step_ms']:.1f}"), ("link-bound ms", lambda r: f"{r['link_bound_ms']:.1f}"),
    ("step / bound", lambda r: f"{r['step_over_bound']:.3f}"),
    ("exposed ms", lambda r: f"{r['exposed_ms']:.1f}"),
    ("exposed ms, overlapped", lambda r: f"{r['exposed_overlapped_ms']:.1f}"),
    ("link-bound - forward", lambda r: f"{r['hidden_bound_ms']:.1f}"), ("host calls", lambda r: r["host_calls"]),
]


def results_markdown(rows: list[dict], rates: Rates, host_calls_us: list[float], path: list[str], path_case: str,
                     meta: dict, args) -> str:
    return "\n".join([
        "## predict_step: the streamed AdamW step on an H200, predicted (not measured)",
        "",
        f"- command: `{timing.command_line()}`",
        f"- date: {meta['date_utc']}; torch {meta['torch']}; the host time per call measured on:",
        timing.hardware_lines(meta),
        f"- rates: h2d {rates.h2d / 1e9:g} GB/s, d2h {rates.d2h / 1e9:g} GB/s, both at once {rates.both / 1e9:g} GB/s, "
        f"device memory {rates.device_memory / 1e12:g} TB/s x {rates.device_memory_fraction:g}, "
        f"host {rates.host_call * 1e6:.2f} us per runtime call",
        f"- host time per runtime call measured here (engine Python, CPU copies and kernels subtracted), per case: "
        f"{', '.join(f'{v:.2f}' for v in host_calls_us)} us (median {statistics.median(host_calls_us):.2f})"
        + ("" if args.host_call_us is None else f"; the rates use --host-call-us {args.host_call_us}"),
        f"- forward after the step: {args.forward_ms:g} ms over the model's layers, on the main stream",
        "- link bytes equal benchmarks/traffic.py's count for each configuration",
        "",
        timing.markdown_table(rows, COLUMNS),
        "",
        f"Critical path of {path_case} (start, duration, timeline, operations; runs merged), its last lines:",
        "",
        "```",
        *path,
        "```",
    ])


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--states", nargs="+", choices=STATE_PRECISIONS, default=list(STATE_PRECISIONS))
    parser.add_argument("--forward-ms", type=float, default=100.0, help="the next forward, over the layers (100)")
    parser.add_argument("--host-call-us", type=float, default=None,
                        help="host time per runtime call (default: the median measured by this run)")
    parser.add_argument("--num-buffers", type=int, default=2, help="buffer sets of the pipeline (2)")
    parser.add_argument("--path-lines", type=int, default=16, help="critical-path lines shown (last ones)")
    parser.add_argument("--out-dir", type=Path, default=timing.RESULTS_DIR)
    parser.add_argument("--label", default="")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    scale = DEFAULT_CHUNK_SIZE // SCALED_CHUNK
    cases = []
    for model in args.models:
        layers, per_layer = MODELS[model]
        numels = [TENSOR] * (layers * per_layer)
        for state_precision in args.states:
            params = scaled_params(numels, scale)
            layer_seconds = [args.forward_ms * 1e-3 / layers] * layers
            cases.append((model, state_precision,
                          record(params, state_precision, SCALED_CHUNK, scale, layer_seconds, numels,
                                 num_buffers=args.num_buffers),
                          record(params, state_precision, SCALED_CHUNK, scale, layer_seconds, numels, overlap=True,
                                 num_buffers=args.num_buffers)))
    measured = [c[2].host_call_s * 1e6 for c in cases]
    host_call = statistics.median(measured) if args.host_call_us is None else args.host_call_us
    rates = Rates(host_call=host_call * 1e-6)
    rows, paths = [], {}
    for model, state_precision, recorded, overlapped in cases:
        p = predict(recorded.runtime, rates, recorded.step, recorded.forward)
        o = predict(overlapped.runtime, rates, overlapped.step, overlapped.forward)
        rows.append({**row(model, state_precision, recorded, p, rates), "exposed_overlapped_ms": round(o.exposed_s * 1e3, 2),
                     "hidden_bound_ms": round(max(0.0, p.link_bound_s - p.forward_s) * 1e3, 2)})
        paths[f"{model} {state_precision}"] = p
        paths[f"{model} {state_precision} overlapped"] = o
    print(timing.markdown_table(rows, COLUMNS))
    path_case = next(iter(paths))
    shown = paths[path_case]
    share = ", ".join(f"{kind} {s * 1e3:.1f} ms" for kind, s in sorted(shown.path_seconds.items()))
    path = [f"time on the path by kind: {share}", *shown.critical_path[-args.path_lines:]]
    print(f"\ncritical path of {path_case} (the step, then the forward):\n" + "\n".join(path))
    meta = timing.hardware_metadata(torch.get_num_threads(), {"label": args.label, "command": timing.command_line()})
    timing.write_csv(args.out_dir / f"{RESULTS_KEY}.csv", rows, meta)
    timing.update_results_section(args.out_dir / "RESULTS.md", RESULTS_KEY,
                                  results_markdown(rows, rates, measured, path, path_case, meta, args))


if __name__ == "__main__":
    main()
