"""Timing utilities shared by the benchmark scripts.

What every benchmark here needs, written once:
  * ``time_interleaved``: warm each contender up, then run them in turn (A, B, C, A, B, C, ...) so that
    a burst of load from other processes hits all of them alike; medians and quantiles, not means.
    Let the contenders work on the same buffers where they can: on a VM the speed of a large buffer
    depends on where it was allocated (10-25% here), a bias that interleaving does not remove.
  * ``Summary``/``summarize`` and ``paired_ratio``: median and quantiles of the per-repeat times, and of
    the per-repeat ratio of two contenders (paired because they ran back to back).
  * ``bandwidth_kernels``: in-place scale and axpy passes (STREAM-like, no write-allocate traffic) to
    time in the same interleaved loop, so the bandwidth bound is measured under the same conditions.
  * ``LoadMonitor``: the share of the CPUs that *other* processes used during a run (from /proc), so a
    result taken on a busy machine says so.
  * ``time_cuda``: the same for one contender on a GPU: warm-up, then CUDA events (single-stream work) or
    synchronised clocks (work on several streams or on the host), one sample per call.
  * ``hardware_metadata``, ``gpu_metadata``, ``write_csv``/``read_csv``, ``update_results_section``: CSV rows
    with hardware and version columns, and one replaceable section per script in results/RESULTS.md.
  * ``RowsFile``: a CSV rewritten whole after every row measured, so a run killed at any moment keeps
    every row it measured; ``read_csv`` gives them back (a script's ``--from-csv`` redraws its outputs).
  * ``deadline_alarm``: a run's deadline enforced wherever the main thread is (building a contender,
    its first step, its warm-up), raising ``DeadlineReached``.
  * ``markdown_table``, ``load_note``, ``hardware_lines``: the table, load label and hardware summary
    every script prints, written once. (The figures: plotting.py.)
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
QUANTILES = (0.1, 0.25, 0.75, 0.9)
SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "neon", "asimd")


# ---- timing ---------------------------------------------------------------------------------------


def time_interleaved(
    contenders: Mapping[str, Callable[[], object]], *, repeats: int, warmup: int,
    before: Callable[[], object] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of each contender, ``repeats`` samples each, taken in turn.

    Every contender is first called ``warmup`` times (page faults, lazy initialisation, JIT
    loading, the CPU clock settling). Then each repeat calls every contender once, in the given
    order; a contender is a synchronous callable (CPU work: nothing to synchronise). ``before`` runs
    untimed before every call (e.g. attaching the next gradients of a rotation).
    """
    for fn in contenders.values():
        for _ in range(warmup):
            if before is not None:
                before()
            fn()
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, fn in contenders.items():
            if before is not None:
                before()
            start = time.perf_counter_ns()
            fn()
            samples[name].append((time.perf_counter_ns() - start) * 1e-9)
    return samples


def time_cuda(fn: Callable[[], object], *, repeats: int, warmup: int, events: bool,
              before: Callable[[], object] | None = None) -> list[float]:
    """Seconds per call of ``fn`` on the current GPU, one sample per call after ``warmup`` calls.

    ``events=True``: CUDA events recorded on the current stream around the call (right for work that
    runs on that stream alone: no host-side timer overhead). ``events=False``: the device is
    synchronised before and after, and the host clock read between (right for work on several
    streams, or on the host: it covers everything the call started). ``before`` runs untimed.
    """
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        if before is not None:
            before()
        if events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e-3)
        else:
            torch.cuda.synchronize()
            begin = time.perf_counter_ns()
            fn()
            torch.cuda.synchronize()
            samples.append((time.perf_counter_ns() - begin) * 1e-9)
    return samples


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default), without needing numpy."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class Summary:
    """Median and spread of samples (in the samples' unit)."""

    n: int
    median: float
    q10: float
    q25: float
    q75: float
    q90: float
    min: float
    max: float


def summarize(values: Sequence[float]) -> Summary:
    q10, q25, q75, q90 = (quantile(values, q) for q in QUANTILES)
    return Summary(len(values), statistics.median(values), q10, q25, q75, q90, min(values), max(values))


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> Summary:
    """Per-repeat ratios of two interleaved contenders: robust to slow drifts in machine load."""
    return summarize([a / b for a, b in zip(numerator, denominator)])


# ---- the physical bound -----------------------------------------------------------------------------


@dataclass
class BandwidthKernel:
    """A memory-bound torch kernel and the bytes it reads and writes per call."""

    name: str
    fn: Callable[[], object]
    bytes_per_call: int
    description: str


def bandwidth_kernels(x: torch.Tensor, y: torch.Tensor) -> list[BandwidthKernel]:
    """Two in-place passes over fp32 tensors, numerically no-ops so they can run on live buffers.

    In place, like an optimizer step: every line written was read first, so the hardware moves
    exactly the bytes counted (a STREAM copy or triad into a fresh array also reads each destination
    line before writing it, traffic that STREAM's count leaves out). Read:write is 1:1 for the scale
    and 2:1 for the axpy; an Adam step (4:3) lies between. They run on torch's intra-op pool, so
    ``torch.set_num_threads`` gives them the thread count of the kernels under test. Size the
    tensors far beyond the last-level cache.
    """
    n = x.numel()
    return [
        BandwidthKernel("inplace_scale", lambda: x.mul_(1.0), 8 * n, "x.mul_(1.0): read 4 B + write 4 B in place"),
        BandwidthKernel("inplace_axpy", lambda: x.add_(y, alpha=0.0), 12 * n,
                        "x.add_(y, alpha=0): read 8 B + write 4 B in place"),
    ]


# ---- how busy the machine was -----------------------------------------------------------------------


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return total - idle, total


def _self_jiffies() -> int:
    """utime + stime of this process (all threads), from /proc/self/stat."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


class LoadMonitor:
    """``with LoadMonitor() as load:`` ... ``load.others_share``: the CPU share other processes used.

    0.0 is a quiet machine; 0.5 on 2 cores means one whole core was busy with something else.
    Linux only; elsewhere ``others_share`` stays None.
    """

    def __init__(self) -> None:
        self.others_share: float | None = None
        self.loadavg_before: float | None = None
        self._start: tuple[int, int, int] | None = None

    def __enter__(self) -> "LoadMonitor":
        try:
            self.loadavg_before = os.getloadavg()[0]
            busy, total = _cpu_jiffies()
            self._start = (busy, total, _self_jiffies())
        except (OSError, ValueError, IndexError):
            self._start = None
        return self

    def __exit__(self, *exc) -> None:
        if self._start is None:
            return
        busy, total = _cpu_jiffies()
        mine = _self_jiffies()
        d_busy, d_total, d_mine = busy - self._start[0], total - self._start[1], mine - self._start[2]
        if d_total > 0:
            self.others_share = max(0.0, (d_busy - d_mine) / d_total)


LOAD_THRESHOLD = 0.05  # above this share of the CPUs used by others, a result is labelled as taken under load


def load_note(load: LoadMonitor) -> str:
    """The load label every result carries: what other processes used, and 'TAKEN UNDER LOAD' above the threshold."""
    if load.others_share is None:
        return "unknown"
    note = (f"other processes used {100 * load.others_share:.0f}% of the CPUs during the run "
            f"(1-min load average before it: {load.loadavg_before:.2f})")
    if load.others_share > LOAD_THRESHOLD:
        note += " — TAKEN UNDER LOAD, preliminary"
    return note


# ---- metadata, CSV, RESULTS.md ----------------------------------------------------------------------


def _lscpu() -> dict[str, str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines()) if v}


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _openmp_runtimes() -> str:
    """The OpenMP runtimes mapped into this process: one path means every extension shares one pool."""
    maps = _read("/proc/self/maps")
    libs = sorted({line.split()[-1] for line in maps.splitlines() if re.search(r"lib(g|i)?omp[^/]*\.so", line)})
    return ";".join(libs)


def hardware_metadata(threads: int, extra: Mapping[str, object] | None = None) -> dict[str, object]:
    """Hardware and version columns for every CSV row (strings and numbers only)."""
    cpu = _lscpu()
    flags = set(cpu.get("Flags", "").split())
    thp = re.search(r"\[(\w+)\]", _read("/sys/kernel/mm/transparent_hugepage/enabled"))
    meminfo = re.search(r"MemTotal:\s+(\d+)", _read("/proc/meminfo"))
    meta: dict[str, object] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu_model": cpu.get("Model name", platform.processor()),
        "cpu_family_model": f"{cpu.get('CPU family', '?')}/{cpu.get('Model', '?')}",
        "cpus": os.cpu_count(),
        "sockets": cpu.get("Socket(s)", ""),
        "threads_per_core": cpu.get("Thread(s) per core", ""),
        "l3_cache": cpu.get("L3 cache", ""),
        "simd_flags": " ".join(f for f in SIMD_FLAGS if f in flags),
        "hypervisor": cpu.get("Hypervisor vendor", "none"),
        "mem_total_gib": round(int(meminfo.group(1)) / 2**20, 1) if meminfo else "",
        "transparent_hugepages": thp.group(1) if thp else "",
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": threads,
        "openmp_runtimes": _openmp_runtimes(),
    }
    meta.update(extra or {})
    return meta


def gpu_metadata() -> dict[str, object]:
    """GPU columns (empty without a GPU): name, memory, capability, CUDA and driver versions."""
    if not torch.cuda.is_available():
        return {"gpu": ""}
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        driver = ""
    return {
        "gpu": props.name,
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "gpu_capability": f"{props.major}.{props.minor}",
        "gpu_multiprocessors": props.multi_processor_count,
        "torch_cuda": torch.version.cuda,
        "nvidia_driver": driver,
    }


def hardware_lines(meta: Mapping[str, object]) -> str:
    """The hardware and version lines of a RESULTS.md section."""
    gpu = (f"\n- GPU: {meta['gpu']} ({meta.get('gpu_memory_gib')} GiB, compute capability {meta.get('gpu_capability')}), "
           f"CUDA {meta.get('torch_cuda')}, driver {meta.get('nvidia_driver')}" if meta.get("gpu") else "")
    return (f"- hardware (lscpu): {meta['cpu_model']} (family/model {meta['cpu_family_model']}), {meta['cpus']} CPUs,\n"
            f"  {meta['sockets']} socket(s), L3 {meta['l3_cache']}, SIMD {meta['simd_flags']}, hypervisor "
            f"{meta['hypervisor']},\n  {meta['mem_total_gib']} GiB, THP {meta['transparent_hugepages']}{gpu}")


def write_csv(path: Path, rows: Sequence[Mapping[str, object]], metadata: Mapping[str, object]) -> None:
    """One row per measurement, each followed by the metadata columns. Written beside `path`, then
    renamed over it: a run killed while writing leaves the previous complete file, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    full = [{**row, **metadata} for row in rows]
    fieldnames: list[str] = []
    for row in full:
        fieldnames += [k for k in row if k not in fieldnames]
    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fieldnames)
        writer.writeheader()
        writer.writerows(full)
    os.replace(partial, path)


def read_csv(path: Path) -> list[dict[str, object]]:
    """Rows as written by write_csv, numbers parsed back (ints, then floats), empty cells as None."""

    def parse(value: str) -> object:
        if value == "":
            return None
        for kind in (int, float):
            try:
                return kind(value)
            except ValueError:
                pass
        return value

    with open(path, newline="") as f:
        return [{k: parse(v) for k, v in row.items()} for row in csv.DictReader(f)]


class RowsFile:
    """A CSV of rows that come one measurement at a time: each ``add`` rewrites it whole (write_csv
    renames a complete file over the old one), so a run killed at any moment keeps every row it
    measured, with the metadata known when it was written."""

    def __init__(self, path: Path, metadata: Mapping[str, object]):
        self.path, self.metadata, self.rows = path, metadata, []

    def add(self, rows: Sequence[Mapping[str, object]]) -> None:
        self.rows.extend(rows)
        write_csv(self.path, self.rows, self.metadata)

    def finish(self, metadata: Mapping[str, object]) -> None:
        """The final metadata (the load, the wall time) on every row."""
        self.metadata = metadata
        write_csv(self.path, self.rows, metadata)


class DeadlineReached(Exception):
    """The run's deadline passed inside a measurement."""


@contextlib.contextmanager
def deadline_alarm(deadline: float):
    """Raises DeadlineReached wherever the main thread is when `deadline` (perf_counter) passes: a
    contender's construction, its first step (which allocates and pins its host state) and its warm-up
    steps are bounded like its timed steps. (A call into C finishes first: the alarm lands after it.)"""
    left = deadline - time.perf_counter()
    if left == float("inf") or threading.current_thread() is not threading.main_thread():
        yield
        return
    if left <= 0:
        raise DeadlineReached

    def on_alarm(signum, frame):
        raise DeadlineReached

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, left)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def update_results_section(path: Path, key: str, markdown: str) -> None:
    """Replace (or append) the section between ``<!-- key:begin -->`` and ``<!-- key:end -->``."""
    begin, end = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
    block = f"{begin}\n{markdown.rstrip()}\n{end}\n"
    header = "# Benchmark results\n\nOne section per benchmark script, rewritten by its last run.\n\n"
    text = path.read_text() if path.exists() else header
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end) + r"\n?", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def summary_columns(prefix: str, s: Summary, scale: float = 1.0, digits: int = 3) -> dict[str, float]:
    """``{prefix}_median``, ``{prefix}_q10``, ... columns, scaled (e.g. 1e3 for ms)."""
    return {f"{prefix}_{k}": round(v * scale, digits) for k, v in asdict(s).items() if k != "n"}


SIZE_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    """'64M' -> 64 * 2**20; K, M, G are binary; plain integers as they are."""
    text = text.strip().upper()
    if not text:
        raise ValueError("empty size")
    return int(float(text[:-1]) * SIZE_UNITS[text[-1]]) if text[-1] in SIZE_UNITS else int(text)


def format_size(n: int) -> str:
    """The inverse of parse_size where it is exact (64M, 1G, 1.5G), else the plain number."""
    for unit in ("G", "M", "K"):
        value = n / SIZE_UNITS[unit]
        if value >= 1 and value * 4 == int(value * 4):
            return f"{value:g}{unit}"
    return str(n)


def command_line() -> str:
    """The command that ran this script, with the interpreter relative to the working directory."""
    exe = Path(sys.executable)
    try:
        exe = exe.relative_to(Path.cwd())
    except ValueError:
        pass
    return shlex.join([str(exe), *sys.argv])



# ---- tables and plots ---------------------------------------------------------------------------------


def paired_step_columns(subject: str, key: str) -> list[tuple[str, Callable[[Mapping[str, object]], object]]]:
    """The columns of a side-by-side step table (config, contender, timing, bytes, the bound) and
    `subject`'s speedup over each peer from the row's `{key}_speedup*` fields."""
    def speedup(r):
        if r["contender"] == subject:
            return "1 (itself)"
        return f"{r[key + '_speedup']:.2f}x [{r[key + '_speedup_paired_q10']:.2f}-{r[key + '_speedup_paired_q90']:.2f}]"

    return [
        ("config", lambda r: r["config"]),
        ("contender", lambda r: r["contender"]),
        ("median ms", lambda r: f"{r['ms_median']:.2f}"),
        ("p10-p90 ms", lambda r: f"{r['ms_q10']:.2f}-{r['ms_q90']:.2f}"),
        ("B/param", lambda r: r["bytes_per_param"]),
        ("GB/s", lambda r: f"{r['achieved_gb_per_s']:.1f}"),
        ("% of BW", lambda r: f"{100 * r['fraction_of_bandwidth']:.0f}%"),
        ("bound ms", lambda r: f"{r['bound_ms']:.2f}"),
        (f"{subject} speedup [p10-p90]", speedup),
    ]


def markdown_table(rows: Sequence[Mapping[str, object]],
                   columns: Sequence[tuple[str, Callable[[Mapping[str, object]], object]]]) -> str:
    """A markdown table: one column per (header, cell function); a cell that raises or gives None is blank."""

    def cell(fn, row) -> str:
        try:
            value = fn(row)
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            return ""
        return "" if value is None else str(value)

    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(fn, r) for _, fn in columns) + " |" for r in rows]
    return "\n".join(lines)
