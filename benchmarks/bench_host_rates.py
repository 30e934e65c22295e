"""Question: how fast is this machine's host side for the step's cost model (fusedoff/costs.py)? The
calibration `fusedoff.calibrate.measure` takes: the host kernel's step (backend='cpu', bf16 parameters)
in elements per second for each optimizer, state and master precision, on each thread count asked for;
the host memory's bandwidth (a copy between two tensors, an in-place pass); and with a GPU the pinned
link each way and both at once, and the device kernel.

Per row: the elements per second, the bytes per element the model counts for that setup's kernel
(costs.element_bytes) and what they make in GB/s, beside the in-place pass's bandwidth: a kernel
near it is bound by host memory, one far below by its arithmetic (the codecs of 8-bit states, the
split masters' rounding).

    .venv/bin/python benchmarks/bench_host_rates.py                         # results/host_rates.csv
    .venv/bin/python benchmarks/bench_host_rates.py --threads 1 2 --numel 1M --repeats 3 --out-dir /tmp/r
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if not __package__:  # run as a script: the repository root, for `benchmarks` and fusedoff
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import timing  # noqa: E402

from fusedoff import calibrate, costs  # noqa: E402

RESULTS_KEY = "bench_host_rates"


def _cpuinfo_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def rows_of(calibration: calibrate.Calibration) -> list[dict]:
    rows = []
    for (optimizer, state, master), rate in calibration.host_kernel.items():
        kernel = costs.element_bytes(costs.Setup(optimizer, torch.bfloat16, None, state, master)).kernel
        rows.append({"what": "host kernel", "optimizer": optimizer, "state_precision": state,
                     "master_precision": master,
                     "threads": calibration.threads, "numel": calibration.numel,
                     "elements_per_s": round(rate), "kernel_bytes_per_element": kernel,
                     "gb_per_s": round(rate * kernel / 1e9, 2)})
    for what, value in (("host copy (read + written)", calibration.host_copy),
                        ("host in-place pass (read + written)", calibration.host_inplace),
                        ("h2d pinned copy", calibration.h2d), ("d2h pinned copy", calibration.d2h),
                        ("both directions at once", calibration.both),
                        ("device kernel (fused AdamW, read + written)", calibration.device_kernel)):
        if value is not None:
            rows.append({"what": what, "threads": calibration.threads, "gb_per_s": round(value / 1e9, 2)})
    return rows


def format_table(rows: list[dict]) -> str:
    return timing.markdown_table(rows, [
        ("what", lambda r: r["what"]),
        ("optimizer", lambda r: r.get("optimizer")),
        ("states", lambda r: r.get("state_precision")),
        ("master", lambda r: r.get("master_precision")),
        ("threads", lambda r: r["threads"]),
        ("M elements/s", lambda r: f"{r['elements_per_s'] / 1e6:.0f}" if r.get("elements_per_s") else None),
        ("B/element", lambda r: f"{r['kernel_bytes_per_element']:g}" if r.get("kernel_bytes_per_element") else None),
        ("GB/s", lambda r: f"{r['gb_per_s']:.1f}"),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    parser.add_argument("--numel", type=timing.parse_size, default=calibrate.NUMEL,
                        help=f"elements per host kernel step (default {timing.format_size(calibrate.NUMEL)})")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out-dir", type=Path, default=timing.RESULTS_DIR)
    args = parser.parse_args()
    rows = []
    with timing.LoadMonitor() as load:
        for threads in args.threads:
            calibration = calibrate.measure(threads, numel=args.numel, repeats=args.repeats)
            rows += rows_of(calibration)
            print(format_table(rows_of(calibration)), flush=True)
    meta = timing.hardware_metadata(torch.get_num_threads(), {**timing.gpu_metadata(),
                                                              "cpuinfo_model": _cpuinfo_model(),
                                                              "load": timing.load_note(load)})
    timing.write_csv(args.out_dir / "host_rates.csv", rows, meta)
    markdown = (f"{timing.hardware_lines(meta)}\n- /proc/cpuinfo: {meta['cpuinfo_model']}\n- torch {meta['torch']}, "
                f"{meta['date_utc']}\n- load: {meta['load']}\n\n`{timing.command_line()}`\n\n{format_table(rows)}\n\n"
                "What `python -m fusedoff.plan --rates measured` uses for the host side; on a machine without a GPU "
                "the link and device rates come from a preset.\n")
    timing.update_results_section(args.out_dir / "RESULTS.md", RESULTS_KEY, markdown)
    print(markdown)
    print(f"wrote {args.out_dir / 'host_rates.csv'}")


if __name__ == "__main__":
    main()
