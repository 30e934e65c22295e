"""A quick GPU timing of the fused steps (the GPU suite's first look; the full benchmark set is the
benchmarks issue's): AdamW with bf16 params + grads and fp32 master weights at --size parameters,
offload='none' and offload='stream' against torch.optim.AdamW(fused=True) on fp32 master weights,
with the pinned host<->device bandwidth measured in the same run for the streaming bound.

    python3 benchmarks/gpu_quick_timing.py --size 256M --out-dir OUT
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import timing  # noqa: E402

import fusedoff  # noqa: E402


def cuda_ms(fn, repeats: int) -> list[float]:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=timing.parse_size, default=timing.parse_size("256M"))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out-dir", type=Path, default=Path("gpu_suite_out"))
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    n = args.size
    rows = []

    pinned = torch.empty(n, dtype=torch.float32, pin_memory=True)
    device_copy = torch.empty(n, dtype=torch.float32, device="cuda")
    for name, dst, src in [("h2d", device_copy, pinned), ("d2h", pinned, device_copy)]:
        s = timing.summarize(cuda_ms(lambda dst=dst, src=src: dst.copy_(src, non_blocking=True), args.repeats))
        rows.append({"what": name, "median_ms": s.median, "GB/s": 4 * n / s.median / 1e6})
    del pinned, device_copy

    param = torch.nn.Parameter(torch.randn(n, device="cuda", dtype=torch.bfloat16))
    param.grad = torch.randn_like(param)
    for offload in ("none", "stream"):
        opt = fusedoff.AdamW([param], offload=offload)
        s = timing.summarize(cuda_ms(opt.step, args.repeats))
        stats = opt.memory_stats()
        # streamed bytes per param: 12 B of fp32 state in and out over PCIe (exp_avg, exp_avg_sq, master)
        rows.append({"what": f"fusedoff AdamW offload={offload}", "median_ms": s.median,
                     "GB/s": (24 * n / s.median / 1e6) if offload == "stream" else "",
                     "device_peak_bytes": stats["device_peak_bytes"], "host_bytes": stats["host_bytes"]})
        del opt
    master = torch.nn.Parameter(param.detach().float())
    master.grad = param.grad.float()
    ref = torch.optim.AdamW([master], fused=True)
    s = timing.summarize(cuda_ms(ref.step, args.repeats))
    rows.append({"what": "torch AdamW(fused=True), fp32 master + fp32 grad", "median_ms": s.median, "GB/s": ""})

    fields = sorted({k for r in rows for k in r}, key=lambda k: ["what", "median_ms", "GB/s"].index(k)
                    if k in ("what", "median_ms", "GB/s") else 9)
    with open(args.out_dir / "gpu_quick_timing.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    print(f"{n} params, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for r in rows:
        print(" | ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
