"""Question: how much shorter does host_share="auto" make a streamed step, on an H100 node and on a
workstation? A prediction by the timed simulator with its host resource (fusedoff/testing/timed.py,
[note: timed host resource]), not a measurement; the analytic cost model (fusedoff/costs.py) beside it.

fusedoff.AdamW with bf16 parameters and gradients, fp32 states and fp32 master weights, every state
streamed (offload='stream', 4M-element chunks), at predict_step.py's shapes (1B: 64 tensors of 16M
elements, 7B: 448), scaled down as there ([note: timed scale]). The rates are `fusedoff.costs` presets,
ASSUMED (h100-pcie5: PCIe Gen5 ~55 GB/s each way, 100 both, 75 GB/s of host DRAM per GPU;
workstation-pcie4: ~25 each way, 45 both, 80 GB/s), the host kernels bound by host memory alone.

  streamed ms   share 0: the step recorded on the TimedRuntime after a first step, then scheduled.
  auto ms       host_share="auto": the real engine's controller (fusedoff/offload/auto_share.py) reads
                its timers from the schedule of each step; steps are taken (each drained) until the
                share has not moved for 11 steps (at most 60), then one more is recorded and scheduled.
  auto share    the share the controller placed (whole tensors: multiples of 1/64 or 1/448).
  model ms      fusedoff.costs.predict_step at that preset: streamed only, and at its own best share.

    .venv/bin/python benchmarks/predict_host_share.py                 # results/predict_host_share.{csv,png}
    .venv/bin/python benchmarks/predict_host_share.py --models 1B --out-dir /tmp/p
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch

if not __package__:  # run as a script: the repository root, for `benchmarks` and fusedoff
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.predict_step import MODELS, SCALED_CHUNK, TENSOR, scaled_params  # noqa: E402

import fusedoff  # noqa: E402
from fusedoff import costs  # noqa: E402
from fusedoff.offload import runtimes  # noqa: E402
from fusedoff.offload.auto_share import MEASURED_STEPS  # noqa: E402
from fusedoff.offload.engine import DEFAULT_CHUNK_SIZE  # noqa: E402
from fusedoff.testing.timed import Rates, TimedRuntime, predict  # noqa: E402

PRESETS = ("h100-pcie5", "workstation-pcie4")
# "auto" is stepped until its share has not moved for SETTLED_STEPS steps (the controller decides after
# MEASURED_STEPS at a placement: twice that and one), at most MAX_STEPS
SETTLED_STEPS, MAX_STEPS = 2 * MEASURED_STEPS + 1, 60
HYPER = dict(lr=1e-3, weight_decay=0.01)


def timed_rates(preset: costs.Rates) -> Rates:
    return Rates(h2d=preset.h2d, d2h=preset.d2h, both=preset.both, device_memory=preset.device_memory,
                 device_memory_fraction=1.0, host_memory=preset.host_memory)


def run(numels: list[int], rates: Rates, share) -> tuple[float, float, dict]:
    """(step seconds, share placed, the controller's report) of a streamed step with `share`."""
    # (tensors of 1024 elements and chunks of 256 standing for 4M: smaller tensors are scaled less)
    scale = max(1, min(DEFAULT_CHUNK_SIZE // SCALED_CHUNK, min(numels) // 1024))
    params = scaled_params(numels, scale)
    made: list[TimedRuntime] = []
    with runtimes.simulate(lambda device: made.append(TimedRuntime(device, scale=scale, rates=rates)) or made[-1]):
        opt = fusedoff.AdamW(params, **HYPER, offload="stream", chunk_size=SCALED_CHUNK, backend="cpu",
                             host_share=share)
        replans, since = 0, 0
        for _ in range(MAX_STEPS if share == "auto" else 1):
            opt.step()
            opt._engine.join()
            made[-1].drain()
            now = (opt.memory_stats()["host_share_auto"] or {}).get("cpu", {}).get("replans", 0)
            since = 0 if now != replans else since + 1
            replans = now
            if since >= SETTLED_STEPS:
                break
        while True:  # the step recorded: one that placed nothing afresh (a new placement has a new runtime)
            count = len(made)
            rt = made[-1]
            first = rt.mark()
            opt.step()
            opt._engine.join()
            rt.drain()
            if len(made) == count:
                break
        stats = opt.memory_stats()
    prediction = predict(rt, rates, range(first, rt.mark()))
    report = (stats["host_share_auto"] or {}).get("cpu", {})
    return prediction.step_s, stats["host_computed_params"] / sum(p.numel() for p in params), report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    setup = costs.Setup()  # AdamW, bf16 parameters and gradients, fp32 states and master
    rows = []
    for name in PRESETS:
        preset = costs.preset(name)
        rates = timed_rates(preset)
        for model in args.models:
            layers, per_layer = MODELS[model]
            numels = [TENSOR] * (layers * per_layer)
            streamed_s, _, _ = run(numels, rates, 0.0)
            auto_s, share, report = run(numels, rates, "auto")
            model_streamed = costs.predict_step(setup, preset, sum(numels))
            model_best = costs.best_host_share(setup, preset, sum(numels))
            rows.append({
                "rates": name, "model": model, "params": sum(numels),
                "streamed_ms": round(streamed_s * 1e3, 1), "auto_ms": round(auto_s * 1e3, 1),
                "auto_over_streamed": round(auto_s / streamed_s, 3), "auto_share": round(share, 3),
                "auto_replans": report.get("replans", 0),
                "model_streamed_ms": round(model_streamed.step_s * 1e3, 1),
                "model_best_share": round(model_best.host_share, 3),
                "model_best_ms": round(model_best.step_s * 1e3, 1),
                "model_ratio": round(model_best.step_s / model_streamed.step_s, 3),
            })
            print(rows[-1], flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with open(args.out_dir / "predict_host_share.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args.out_dir / "predict_host_share.png")
    print(markdown(rows))


def markdown(rows: list[dict]) -> str:
    lines = ["| rates (assumed) | model | streamed ms | auto ms | auto / streamed | auto share | "
             "cost model: streamed ms | best share | ms | ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rates']} | {r['model']} | {r['streamed_ms']} | {r['auto_ms']} | {r['auto_over_streamed']} | "
                     f"{r['auto_share']} | {r['model_streamed_ms']} | {r['model_best_share']} | {r['model_best_ms']} | "
                     f"{r['model_ratio']} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']}\n{r['rates']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([i - 0.2 for i in x], [r["streamed_ms"] for r in rows], 0.4, label="streamed only")
    ax.bar([i + 0.2 for i in x], [r["auto_ms"] for r in rows], 0.4, label='host_share="auto"')
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("predicted step (ms)")
    ax.set_title("AdamW, fp32 states and master, bf16 params: PREDICTED (timed simulator, assumed rates)", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
