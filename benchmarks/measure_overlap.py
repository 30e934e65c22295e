"""Question: how much of a streamed step does the next forward see on this GPU, plain and overlapped,
and what did the timed simulator predict for the same case with this machine's link rates?

The first GPU run calibrates the timed model (fusedoff/testing/timed.py): this script measures what
benchmarks/predict_step.py predicts, one case, beside its prediction. fusedoff.AdamW over `--layers`
x `--per-layer` bf16 tensors of `--tensor-size` elements (fp32 masters, `--state-precision` states,
offload='stream', default chunks, 2 buffer sets); the next forward is one main-stream operation per
layer that takes `--forward-ms` / layers (``torch.cuda._sleep``, calibrated), preceded, when
overlapped, by fusedoff's forward pre-hook (``opt.overlap_with(model)``). Timed with CUDA events:

  step ms      ``opt.step()`` until every chunk is computed and copied back (the device synchronised)
  exposed ms   (step + forward) - forward alone: how much later the forward ends because of the step

The prediction runs the same configuration scaled down on the timed device (as predict_step.py does)
with `Rates` taking h2d, d2h and both-at-once from pinned copies measured here first.

    python3 benchmarks/measure_overlap.py                       # on a GPU: 1B parameters, 8-bit states
    python3 benchmarks/measure_overlap.py --dry-run             # anywhere: the plumbing at tiny sizes
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

if not __package__:  # run as a script: the repository root, for `benchmarks` and fusedoff
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import predict_step, timing  # noqa: E402
from benchmarks.bench_bandwidth import bandwidth_from_rows, measure_link  # noqa: E402

import fusedoff  # noqa: E402
from fusedoff.offload.engine import DEFAULT_CHUNK_SIZE  # noqa: E402
from fusedoff.testing.timed import Rates, predict  # noqa: E402


class SleepLayer(torch.nn.Module):
    """A layer whose forward keeps the current stream busy for a set time (its parameters unused)."""

    def __init__(self, params, cycles: int) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(params)
        self.cycles = cycles

    def forward(self, x=None):
        if self.cycles:
            torch.cuda._sleep(self.cycles)
        return x


def cycles_per_second() -> float:
    torch.cuda._sleep(1_000_000)  # warm
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / (start.elapsed_time(end) * 1e-3)


def measure(args, overlap: bool) -> dict:
    device = "cpu" if args.dry_run else "cuda"
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(args.tensor_size, generator=gen).to(device, torch.bfloat16))
              for _ in range(args.layers * args.per_layer)]
    for p in params:
        p.grad = (torch.randn(args.tensor_size, generator=gen) * 1e-2).to(device, torch.bfloat16)
    cycles = 0 if args.dry_run else int(args.forward_ms * 1e-3 / args.layers * cycles_per_second())
    model = torch.nn.Sequential(*(SleepLayer(params[k * args.per_layer:(k + 1) * args.per_layer], cycles)
                                  for k in range(args.layers)))
    # (host_share=0: the timed prediction beside it is of streaming only; measure_host_share.py measures "auto")
    opt = fusedoff.AdamW(params, lr=1e-3, weight_decay=0.01, offload="stream", state_precision=args.state_precision,
                         chunk_size=args.chunk_size, host_share=0.0)
    if overlap:
        opt.overlap_with(model)

    def clock(fn) -> float:
        if args.dry_run:
            begin = time.perf_counter()
            fn()
            return time.perf_counter() - begin
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()  # the step's copies back included
        return start.elapsed_time(end) * 1e-3

    def step_then_forward() -> None:
        opt.step()
        model(None)

    for _ in range(args.warmup):
        step_then_forward()
    samples = {"step": [], "forward": [], "step_forward": []}
    for _ in range(args.repeats):  # interleaved, so that drifts hit the three alike
        samples["step"].append(clock(opt.step))
        samples["forward"].append(clock(lambda: model(None)))
        samples["step_forward"].append(clock(step_then_forward))
    exposed = [sf - f for sf, f in zip(samples["step_forward"], samples["forward"])]
    return {"mode": "overlapped" if overlap else "plain",
            "step_ms": round(timing.summarize(samples["step"]).median * 1e3, 2),
            "forward_ms": round(timing.summarize(samples["forward"]).median * 1e3, 2),
            "exposed_ms": round(timing.summarize(exposed).median * 1e3, 2),
            "host_pinned": opt.memory_stats()["host_pinned"]}


def predicted(args, rates: Rates, overlap: bool) -> dict:
    scale = max(1, args.chunk_size // predict_step.SCALED_CHUNK)
    numels = [args.tensor_size] * (args.layers * args.per_layer)
    params = predict_step.scaled_params(numels, scale)
    layer_seconds = [args.forward_ms * 1e-3 / args.layers] * args.layers
    recorded = predict_step.record(params, args.state_precision, args.chunk_size // scale, scale, layer_seconds, numels,
                                   overlap=overlap)
    p = predict(recorded.runtime, rates, recorded.step, recorded.forward)
    return {"predicted_step_ms": round(p.step_s * 1e3, 2), "predicted_exposed_ms": round(p.exposed_s * 1e3, 2),
            "link_bound_ms": round(p.link_bound_s * 1e3, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--per-layer", type=int, default=4)
    parser.add_argument("--tensor-size", type=timing.parse_size, default=16 * 2**20)
    parser.add_argument("--chunk-size", type=timing.parse_size, default=DEFAULT_CHUNK_SIZE)
    parser.add_argument("--state-precision", default="8bit", choices=("fp32", "bf16", "8bit"))
    parser.add_argument("--forward-ms", type=float, default=100.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dry-run", action="store_true", help="CPU parameters at tiny sizes: the plumbing only")
    args = parser.parse_args()
    if args.dry_run:
        args.layers, args.per_layer, args.tensor_size, args.chunk_size = 4, 2, 4096, 1024
        args.repeats, args.warmup = 1, 1
        rates = Rates()
        link = "the default Rates (dry run: no link measured)"
    else:
        bandwidth = bandwidth_from_rows(measure_link(256 * 2**20, repeats=5))
        rates = Rates(h2d=bandwidth.h2d, d2h=bandwidth.d2h, both=bandwidth.bidir)
        link = f"measured here: h2d {bandwidth.h2d / 1e9:.1f} GB/s, d2h {bandwidth.d2h / 1e9:.1f} GB/s, both " \
               f"{bandwidth.bidir / 1e9:.1f} GB/s"
    rows = []
    for overlap in (False, True):
        rows.append({**measure(args, overlap), **predicted(args, rates, overlap)})
    print(f"{args.layers} x {args.per_layer} x {args.tensor_size} bf16 parameters, {args.state_precision} states, "
          f"forward {args.forward_ms} ms; rates {link}" + (" — DRY RUN, CPU: figures are meaningless" if args.dry_run
                                                            else ""))
    print(timing.markdown_table(rows, [
        ("mode", lambda r: r["mode"]), ("step ms", lambda r: r["step_ms"]),
        ("predicted step ms", lambda r: r["predicted_step_ms"]), ("link-bound ms", lambda r: r["link_bound_ms"]),
        ("forward ms", lambda r: r["forward_ms"]), ("exposed ms", lambda r: r["exposed_ms"]),
        ("predicted exposed ms", lambda r: r["predicted_exposed_ms"]), ("host pinned", lambda r: r["host_pinned"]),
    ]))


if __name__ == "__main__":
    main()
