"""Question: what is the physical bound here? Pinned host->device, device->host and both at once
(bidirectional), device memory (a large device-to-device copy) and host memory (the best in-place pass,
all threads), measured with large copies. bench_step.py measures the same in its own run and sets every
configuration's bytes against it (traffic.bound_seconds).

    python3 benchmarks/bench_bandwidth.py --out-dir OUT          # GPU; on CPU only the host figure
    python3 benchmarks/bench_bandwidth.py --dry-run              # no GPU: host copies stand in for the link

Timing: warm-up, then CUDA events (one stream) or synchronised clocks (both directions at once on two
streams), medians of ``--repeats`` samples. Pinned memory comes from torch's pinned allocator; fusedoff's
store registers ordinary allocations instead (cudaHostRegister), which the DMA engines serve alike.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

if not __package__:  # run as a script: the repository root, for `benchmarks` and fusedoff
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import timing, traffic  # noqa: E402


def _row(what: str, description: str, samples: list[float], nbytes: int) -> dict:
    s = timing.summarize(samples)
    return {"contender": what, "kind": "bandwidth", "what": description, "status": "ok", "repeats": s.n,
            "bytes": nbytes, **timing.summary_columns("ms", s, 1e3), "gb_per_s": round(nbytes / s.median / 1e9, 2)}


def measure_link(nbytes: int, repeats: int, warmup: int = 2) -> list[dict]:
    """h2d, d2h, bidirectional (pinned <-> device) and device-to-device rows."""
    n = nbytes // 4
    host_in = torch.empty(n, dtype=torch.float32, pin_memory=True).fill_(1.0)
    host_out = torch.empty(n, dtype=torch.float32, pin_memory=True).fill_(1.0)
    dev_in = torch.empty(n, dtype=torch.float32, device="cuda").fill_(1.0)
    dev_out = torch.empty(n, dtype=torch.float32, device="cuda").fill_(1.0)
    up, down = torch.cuda.Stream(), torch.cuda.Stream()

    def both() -> None:
        with torch.cuda.stream(up):
            dev_in.copy_(host_in, non_blocking=True)
        with torch.cuda.stream(down):
            host_out.copy_(dev_out, non_blocking=True)

    rows = [
        _row("h2d", "pinned host -> device copy", timing.time_cuda(
            lambda: dev_in.copy_(host_in, non_blocking=True), repeats=repeats, warmup=warmup, events=True), 4 * n),
        _row("d2h", "device -> pinned host copy", timing.time_cuda(
            lambda: host_out.copy_(dev_out, non_blocking=True), repeats=repeats, warmup=warmup, events=True), 4 * n),
        _row("bidir", "both at once on two streams (bytes of both)", timing.time_cuda(
            both, repeats=repeats, warmup=warmup, events=False), 8 * n),
        _row("device", "device-to-device copy (bytes read + written)", timing.time_cuda(
            lambda: dev_out.copy_(dev_in), repeats=repeats, warmup=warmup, events=True), 8 * n),
    ]
    return rows


def measure_host(nbytes: int, repeats: int, warmup: int = 2) -> list[dict]:
    """Host memory: the in-place passes of timing.bandwidth_kernels over two large fp32 buffers."""
    n = nbytes // 4
    x, y = torch.ones(n), torch.ones(n)
    kernels = timing.bandwidth_kernels(x, y)
    samples = timing.time_interleaved({k.name: k.fn for k in kernels}, repeats=repeats, warmup=warmup)
    return [_row(f"host_{k.name}", k.description, samples[k.name], k.bytes_per_call) for k in kernels]


def measure_host_copies(nbytes: int, repeats: int, warmup: int = 2) -> list[dict]:
    """Dry run without a GPU: host-to-host copies stand in for the link (plumbing only, not a bound)."""
    n = nbytes // 4
    a, b = torch.ones(n), torch.ones(n)
    samples = timing.time_interleaved({"copy": lambda: b.copy_(a)}, repeats=repeats, warmup=warmup)["copy"]
    return [_row(name, f"DRY RUN: host copy standing in for {name}", samples, 4 * n)
            for name in ("h2d", "d2h", "bidir")] + [_row("device", "DRY RUN: host copy standing in for device memory",
                                                         samples, 8 * n)]


def measure(device: str, *, link_bytes: int, host_bytes: int, repeats: int, dry_run: bool = False) -> list[dict]:
    """All bound rows for `device` ("cuda" or "cpu"); with dry_run, host copies stand in for the link."""
    rows = measure_host(host_bytes, repeats)
    if device == "cuda" and not dry_run:
        rows = measure_link(link_bytes, repeats) + rows
    elif dry_run:
        rows = measure_host_copies(link_bytes, repeats) + rows
    return rows


def bandwidth_from_rows(rows: list[dict]) -> traffic.Bandwidth:
    """The rates (bytes/s) of measure()'s rows; host memory is the best in-place pass."""
    rate = {r["contender"]: r["bytes"] / (r["ms_median"] * 1e-3) for r in rows if r.get("kind") == "bandwidth"}
    host = [v for k, v in rate.items() if k.startswith("host_")]
    return traffic.Bandwidth(h2d=rate.get("h2d"), d2h=rate.get("d2h"), bidir=rate.get("bidir"),
                             device=rate.get("device"), host=max(host) if host else None)


TABLE_COLUMNS = [
    ("what", lambda r: r["contender"]),
    ("how", lambda r: r["what"]),
    ("MiB per copy", lambda r: f"{r['bytes'] / 2**20:.0f}"),
    ("median ms", lambda r: f"{r['ms_median']:.3f}"),
    ("p10-p90 ms", lambda r: f"{r['ms_q10']:.3f}-{r['ms_q90']:.3f}"),
    ("GB/s", lambda r: f"{r['gb_per_s']:.1f}"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--link-bytes", type=timing.parse_size, default=timing.parse_size("1G"),
                        help="bytes per pinned/device copy (default 1G)")
    parser.add_argument("--host-bytes", type=timing.parse_size, default=timing.parse_size("1G"),
                        help="bytes per host buffer of the in-place passes (default 1G)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dry-run", action="store_true", help="no GPU needed: host copies stand in for the link")
    parser.add_argument("--out-dir", type=Path, default=None, help="CSV goes here (default results/; dry run: a temp dir)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if args.dry_run:
        args.link_bytes, args.host_bytes = min(args.link_bytes, 2**26), min(args.host_bytes, 2**26)
    out_dir = args.out_dir or (Path(tempfile.mkdtemp(prefix="fusedoff_dry_")) if args.dry_run else timing.RESULTS_DIR)
    with timing.LoadMonitor() as load:
        rows = measure(device, link_bytes=args.link_bytes, host_bytes=args.host_bytes, repeats=args.repeats,
                       dry_run=args.dry_run)
    meta = timing.hardware_metadata(torch.get_num_threads(), {**timing.gpu_metadata(), "load": timing.load_note(load),
                                                              "dry_run": int(args.dry_run)})
    print(timing.markdown_table(rows, TABLE_COLUMNS))
    print(f"\nload: {meta['load']}")
    path = out_dir / f"bench_bandwidth_{device}.csv"
    timing.write_csv(path, rows, meta)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
