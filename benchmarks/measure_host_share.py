"""Question: on this GPU, how long is a streamed step with host_share="auto" beside streaming only, and
what did the timed simulator predict for both with this machine's measured rates?

fusedoff.AdamW over `--layers` x `--per-layer` bf16 tensors of `--tensor-size` elements (1B by default),
fp32 states and fp32 master weights, offload='stream' (default chunks). Two optimizers, one after the
other: host_share=0, then "auto", whose steps are taken until its placement has not moved for
`--settled` steps; each takes `--max-steps` steps, then `--repeats` more of each are timed with CUDA events,
from ``opt.step()`` until its copies back are done (the device synchronised). Both optimizers step the
same gradients from the same values: their parameters are compared, bit for bit, at the end.

The prediction is benchmarks/predict_host_share.py's (the timed simulator with its host resource, the
real engine's controller choosing the share), with h2d, d2h and both-at-once from pinned copies measured
here and host memory from an in-place pass over 1 GiB (fusedoff/calibrate.py).

    python3 benchmarks/measure_host_share.py                 # on a GPU
    python3 benchmarks/measure_host_share.py --dry-run       # anywhere: the plumbing at tiny sizes (CPU)
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

if not __package__:  # run as a script: the repository root, for `benchmarks` and fusedoff
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import predict_host_share, timing  # noqa: E402
from benchmarks.bench_bandwidth import bandwidth_from_rows, measure_link  # noqa: E402

import fusedoff  # noqa: E402
from fusedoff.calibrate import measure_host_memory  # noqa: E402
from fusedoff.testing.timed import Rates  # noqa: E402


def measure(args, share) -> tuple[dict, list[torch.Tensor]]:
    device = "cpu" if args.dry_run else "cuda"
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(args.tensor_size, generator=gen).to(device, torch.bfloat16))
              for _ in range(args.layers * args.per_layer)]
    grads = [(torch.randn(args.tensor_size, generator=gen) * 1e-2).to(device, torch.bfloat16) for _ in params]
    for p, g in zip(params, grads):
        p.grad = g
    opt = fusedoff.AdamW(params, lr=1e-3, weight_decay=0.01, offload="stream", host_share=share)

    def clock() -> float:
        if args.dry_run:
            begin = time.perf_counter()
            opt.step()
            return time.perf_counter() - begin
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        opt.step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e-3

    placed, still, settled_at = None, 0, None
    for k in range(args.max_steps):  # both optimizers alike: their parameters are compared
        opt.step()
        hosted = opt.memory_stats()["host_computed_params"]
        still = still + 1 if hosted == placed else 0
        placed = hosted
        if still >= args.settled and settled_at is None:
            settled_at = k + 1 - still  # the first step of the placement that stayed
    samples = [clock() for _ in range(args.repeats)]
    stats = opt.memory_stats()
    auto = (stats["host_share_auto"] or {}).get(str(params[0].device), {})
    row = {"host_share": share, "step_ms": round(timing.summarize(samples).median * 1e3, 2),
           "share_placed": round(stats["host_computed_params"] / sum(p.numel() for p in params), 3),
           "replans": auto.get("replans", 0), "settled_at_step": settled_at,
           "link_gb_last_step": round(sum(stats["link_bytes_last_step"].values()) / 1e9, 2),
           "host_pinned": stats["host_pinned"]}
    values = [p.detach().cpu() for p in params]
    del opt, params, grads
    gc.collect()
    return row, values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--per-layer", type=int, default=4)
    parser.add_argument("--tensor-size", type=timing.parse_size, default=16 * 2**20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--settled", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=24)  # "auto": 5 steps at 0, 5 at the probe, then its choice
    parser.add_argument("--dry-run", action="store_true", help="CPU parameters at tiny sizes: the plumbing only")
    args = parser.parse_args()
    if args.dry_run:
        args.layers, args.per_layer, args.tensor_size, args.repeats, args.max_steps = 4, 2, 4096, 1, 4
        rates, how = Rates(host_memory=50e9), "the timed model's default link, 50 GB/s of host memory (dry run)"
    else:
        bandwidth = bandwidth_from_rows(measure_link(256 * 2**20, repeats=5))
        _, host_memory = measure_host_memory(torch.get_num_threads(), repeats=3)
        rates = Rates(h2d=bandwidth.h2d, d2h=bandwidth.d2h, both=bandwidth.bidir, host_memory=host_memory)
        how = (f"measured here: h2d {bandwidth.h2d / 1e9:.1f} GB/s, d2h {bandwidth.d2h / 1e9:.1f} GB/s, both "
               f"{bandwidth.bidir / 1e9:.1f} GB/s, host memory {host_memory / 1e9:.1f} GB/s (in place)")
    rows, values = [], []
    for share in (0.0, "auto"):
        row, vals = measure(args, share)
        rows.append(row)
        values.append(vals)
    same = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(*values))
    numels = [args.tensor_size] * (args.layers * args.per_layer)
    for row, share in zip(rows, (0.0, "auto")):
        step_s, placed, _ = predict_host_share.run(numels, rates, share)
        row.update(predicted_step_ms=round(step_s * 1e3, 2), predicted_share=round(placed, 3))
    print(f"{len(numels)} x {args.tensor_size} bf16 parameters, AdamW fp32 states and master, streamed; rates {how}"
          + (" — DRY RUN, CPU: figures are meaningless ('auto' is 0 on CPU parameters)" if args.dry_run else ""))
    print(timing.markdown_table(rows, [
        ("host_share", lambda r: r["host_share"]), ("step ms", lambda r: r["step_ms"]),
        ("predicted step ms", lambda r: r["predicted_step_ms"]), ("share placed", lambda r: r["share_placed"]),
        ("predicted share", lambda r: r["predicted_share"]), ("replans", lambda r: r["replans"]),
        ("placement kept from step", lambda r: r["settled_at_step"]), ("link GB", lambda r: r["link_gb_last_step"]),
        ("host pinned", lambda r: r["host_pinned"]),
    ]))
    print(f"auto / streamed: {rows[1]['step_ms'] / rows[0]['step_ms']:.3f} (predicted "
          f"{rows[1]['predicted_step_ms'] / rows[0]['predicted_step_ms']:.3f}); parameters bit for bit alike: {same}")
    if not same:
        raise SystemExit("host_share='auto' changed the parameters' bits")


if __name__ == "__main__":
    main()
