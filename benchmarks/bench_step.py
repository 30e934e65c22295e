"""Question: how many parameters per second does one optimizer step process, from 16M parameters up to
what the device holds, for each offload mode, precision and optimizer, beside the peers, and how close
does each configuration come to the physical bound measured in the same run?

Configurations (all on one device: ``--device cuda``, or ``cpu`` with the cpu backend):
  optimizer   adamw (fusedoff.AdamW), apollo (fusedoff.Apollo, 'constant' rebound with L2 decay)
  precision   fp32 (fp32 params, grads, states); bf16_master (bf16 params and grads, fp32 master + states)
  fusedoff    offload='none' (states beside the params) and offload='stream' (states in host memory,
              streamed through ``num_buffers`` chunk buffers; on CPU parameters, the same engine loops
              back through host buffers), one row per ``--chunk-sizes`` entry; AdamW on a GPU (and in
              the dry run) also offload='auto' (resident what fits, decided at the first step) and
              'stream' with half the state bytes as its device_budget (``fusedoff_stream_budget50``)
  peers       AdamW: torch.optim.AdamW(fused=True) resident; on a GPU also the naive hand-written offload
              (capped at ``--naive-max``), DeepSpeed's ZeRO-Offload pattern, torchao's CPUOffloadOptimizer,
              bitsandbytes' PagedAdamW. Apollo on a GPU: the eager reference. Each optional (peers.py).

The model is ``--tensor-size`` tensors (4096 x 4096 by default) and a remainder; its gradients rotate
through ``--grad-ring`` sets so no step finds the previous step's gradients in a cache. The bound comes
from traffic.py (the bytes each configuration must move) over bench_bandwidth's rates, measured at the
start of the run on a GPU, and on CPU in each group's own interleaved loop (as bench_cpu_adam does).

Timing: on CPU every contender of a (size, optimizer, precision) group is timed in turn, A, B, C, A, B, C,
after ``--warmup`` steps (timing.time_interleaved); on a GPU (and in the dry run, which rehearses it) one
contender at a time (so its peak memory is its own): warm-up, then CUDA events or synchronised clocks
(timing.time_cuda), up to ``--repeats`` samples or about ``--seconds-per-contender``. Medians and
p10-p90. On a GPU, the peak memory of each contender is torch's max_memory_allocated over its timed
steps minus what was allocated before it was built (and separately over its first step), beside its
own memory_stats().

The CSV is rewritten (whole, then renamed over the old one) after every contender measured one at a
time, and after every interleaved group, so a run killed at any moment keeps every row it measured.
Groups are ordered by priority, the targets' first; at ``--deadline-s`` everything is bounded, building
a contender (its host state) and its warm-up steps included: what has not finished by then gets a
"skipped" row, and groups past the deadline are not even allocated.

    .venv/bin/python benchmarks/bench_step.py --device cpu                    # the CPU sweep, results/
    python3 benchmarks/bench_step.py --device cuda --out-dir OUT --deadline-s 200   # the GPU suite's run
    .venv/bin/python benchmarks/bench_step.py --dry-run                       # plumbing on CPU, tiny sizes
    .venv/bin/python benchmarks/bench_step.py --from-csv OUT/bench_step_cuda.csv   # table, PNG, RESULTS again
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

if not __package__:  # run as a script: the repository root, for `benchmarks` and fusedoff
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import bench_bandwidth, bench_step_report, peers, timing, traffic  # noqa: E402

import fusedoff  # noqa: E402
from fusedoff._ext import load_extension  # noqa: E402
from fusedoff.offload.engine import OffloadEngine  # noqa: E402
from fusedoff.offload.contract import state_specs  # noqa: E402
from fusedoff.optim.adam import adam_state_specs  # noqa: E402
from fusedoff.optim.base import master_spec  # noqa: E402

OPTIMIZERS = ("adamw", "apollo")
ADAM_PEERS_GPU = ("torch_fused", "naive_offload", "zero_offload", "torchao", "bnb_paged")
DEFAULTS = {  # per device: sizes, repeats, warm-up
    "cpu": dict(sizes="16M 32M 64M 128M 256M", repeats=10, warmup=2),
    "cuda": dict(sizes="16M 64M 256M 1G", repeats=10, warmup=2),
    "dry": dict(sizes="1M 4M", repeats=2, warmup=1),
}
HEADLINE = 2**30  # the targets' "1B parameters" (1.07e9)


# ---- the model --------------------------------------------------------------------------------------


@dataclass
class Workload:
    """Parameters of one precision on one device, and a ring of gradient sets attached in turn."""

    device: torch.device
    precision: traffic.Precision
    numels: list[int]
    params: list[torch.nn.Parameter]
    grads: list[list[Tensor]]
    _next: int = 0

    @property
    def numel(self) -> int:
        return sum(self.numels)

    def rotate(self) -> None:
        """Attach the next gradient set (untimed, before every step)."""
        if not self.grads:
            return  # a workload that was never allocated (its group is past the deadline)
        for p, g in zip(self.params, self.grads[self._next % len(self.grads)]):
            p.grad = g
        self._next += 1

    def all_finite(self) -> bool:
        return all(bool(p.isfinite().all()) for p in self.params)


def split_sizes(numel: int, tensor_size: int) -> list[int]:
    """`numel` parameters as tensors of `tensor_size` elements and a remainder."""
    sizes = [tensor_size] * (numel // tensor_size)
    return sizes + [numel % tensor_size] if numel % tensor_size else sizes


def make_workload(device: torch.device, precision: traffic.Precision, numel: int, tensor_size: int,
                  ring: int, seed: int = 0, allocate: bool = True) -> Workload:
    """The parameters and gradient ring; with ``allocate=False`` only their sizes (rows of a skipped group)."""
    numels = split_sizes(numel, tensor_size)
    if not allocate:
        return Workload(device, precision, numels, [], [])
    dtype = torch.float32 if precision.param == 4 else torch.bfloat16
    grad_dtype = torch.float32 if precision.grad == 4 else torch.bfloat16
    generator = torch.Generator(device=device).manual_seed(seed)
    params = [torch.nn.Parameter((torch.randn(n, generator=generator, device=device) * 0.1).to(dtype)) for n in numels]
    grads = [[(torch.randn(n, generator=generator, device=device) * 1e-2).to(grad_dtype) for n in numels]
             for _ in range(ring)]
    workload = Workload(device, precision, numels, params, grads)
    workload.rotate()
    return workload


# ---- contenders -------------------------------------------------------------------------------------


@dataclass
class Contender:
    name: str  # fusedoff_none, fusedoff_stream[@chunk], or a peers.BUILDERS key
    kind: str  # fusedoff | peer
    offload: str  # none | stream | the peer's way (host, manual, managed)
    what: str
    traffic: traffic.Traffic
    build: Callable[[Workload], peers.Built]
    buffer_bytes: int | None = None  # fusedoff stream: num_buffers x chunk bytes, the memory target


def fusedoff_contender(optimizer: str, offload: str, workload: Workload, chunk_size: int, num_buffers: int,
                       default_chunk: int, resident_fraction: float = 0.0, state_precision: str = "fp32",
                       master_precision: str = "fp32") -> Contender:
    """fusedoff in one offload mode; with offload='stream' and `resident_fraction` > 0, a device budget of that
    fraction of the state bytes (the first tensors stay resident, the rest stream); AdamW's moments stored
    as `state_precision` says, master weights as `master_precision` says (split ones: bf16 models only)."""
    device = workload.device
    backend = device.type
    cls = fusedoff.AdamW if optimizer == "adamw" else fusedoff.Apollo
    hyper = peers.ADAM_HYPER if optimizer == "adamw" else peers.APOLLO_HYPER
    kwargs = dict(offload=offload, backend=backend)
    if state_precision != "fp32":
        kwargs["state_precision"] = state_precision
    if master_precision != "fp32":
        kwargs["master_precision"] = master_precision
    states = (2 if optimizer == "adamw" else 3) + int(workload.precision.master)
    streamed_numels = workload.numels
    if offload == "stream":
        kwargs |= dict(chunk_size=chunk_size, num_buffers=num_buffers)
    if resident_fraction:
        budget = int(resident_fraction * states * 4 * workload.numel)
        kwargs["device_budget"] = budget
        streamed_numels, left = [], budget  # the placement's greedy order (fusedoff/offload/placement.py)
        for n in workload.numels:
            if n * 4 * states <= left:
                left -= n * 4 * states
            else:
                streamed_numels.append(n)

    def build(w: Workload) -> peers.Built:
        opt = cls(w.params, **hyper, **kwargs)
        # offload='stream' on a GPU: copies and kernels on the engine's streams; time with synchronised clocks.
        return peers.Built(opt.step, events=not (offload != "none" and device.type == "cuda"),
                           memory_stats=opt.memory_stats)

    suffix = "" if offload != "stream" or chunk_size == default_chunk else f"@{timing.format_size(chunk_size)}"
    if resident_fraction:
        suffix += f"_budget{round(resident_fraction * 100)}"
    if state_precision != "fp32":
        suffix += f"_{state_precision}"
    if master_precision != "fp32":
        suffix += f"_{master_precision}"
    what = f"fusedoff.{cls.__name__}(offload='{offload}', backend='{backend}'"
    if state_precision != "fp32":
        what += f", state_precision='{state_precision}'"
    if master_precision != "fp32":
        what += f", master_precision='{master_precision}'"
    if resident_fraction:
        what += f", device_budget={resident_fraction:.0%} of the states"
    what += f", chunk_size={timing.format_size(chunk_size)}, num_buffers={num_buffers})" if offload == "stream" else ")"
    streams = offload == "stream" and bool(streamed_numels)
    state = traffic.STATE_PRECISIONS[state_precision]
    precision = dataclasses.replace(workload.precision, master_precision=master_precision)
    link = traffic.fusedoff_traffic(optimizer, precision, "stream" if streams else "none", streamed_numels,
                                    chunk_size, device.type, state=state)
    memory = traffic.fusedoff_traffic(optimizer, precision, "none", workload.numels, chunk_size, device.type,
                                      state=state)
    specs = (adam_state_specs(state_precision) if optimizer == "adamw" else ("m", "b", "d"))
    specs = state_specs(specs) + ((master_spec(master_precision),) if workload.precision.master else ())
    buffers = OffloadEngine("stream", chunk_size, num_buffers, None).buffer_bytes_for(specs)
    return Contender(
        f"fusedoff_{offload}{suffix}", "fusedoff", offload, what,
        dataclasses.replace(link, memory=memory.memory), build,
        buffer_bytes=buffers if streams else None)


PEER_INFO = {  # name: (offload, what)
    "torch_fused": ("none", "torch.optim.AdamW(fused=True), states resident"),
    "naive_offload": ("manual", "hand-written offload: per param .to(device), torch fused step, .to('cpu')"),
    "zero_offload": ("host", "DeepSpeedCPUAdam on host fp32 master, grads down / params up (ZeRO-Offload)"),
    "torchao": ("host", "torchao CPUOffloadOptimizer (fused CPU AdamW in the param dtype)"),
    "bnb_paged": ("managed", "bitsandbytes PagedAdamW, 32-bit states in managed memory"),
    "apollo_eager": ("none", "fusedoff.kernels.reference.ApolloReference (eager torch)"),
}


def peer_contender(name: str, workload: Workload) -> Contender:
    offload, what = PEER_INFO[name]
    if name == "torch_fused" and workload.precision.master:
        what += ", on fp32 masters with g.float()"

    def build(w: Workload) -> peers.Built:
        return peers.BUILDERS[name](w.params, w.precision.master, w.device)

    return Contender(name, "peer", offload, what,
                     traffic.peer_traffic(name, workload.precision, workload.numel, workload.device.type), build)


def contenders_for(optimizer: str, workload: Workload, args) -> list[Contender]:
    out = [fusedoff_contender(optimizer, "none", workload, args.chunk_sizes[0], args.num_buffers, args.chunk_sizes[0])]
    out += [fusedoff_contender(optimizer, "stream", workload, c, args.num_buffers, args.chunk_sizes[0])
            for c in args.chunk_sizes]
    gpu_peers = args.device.type == "cuda" or args.dry_run  # the dry run drives their code on the CPU
    if optimizer == "adamw" and gpu_peers:
        # offload='auto' (resident what fits: the whole model, at these sizes on a GPU) and a half budget.
        out.append(fusedoff_contender(optimizer, "auto", workload, args.chunk_sizes[0], args.num_buffers,
                                      args.chunk_sizes[0]))
        out.append(fusedoff_contender(optimizer, "stream", workload, args.chunk_sizes[0], args.num_buffers,
                                      args.chunk_sizes[0], resident_fraction=0.5))
        # Compressed states: fewer bytes over the link (issue 14's streamed 8-bit vs fp32 target).
        out.append(fusedoff_contender(optimizer, "stream", workload, args.chunk_sizes[0], args.num_buffers,
                                      args.chunk_sizes[0], state_precision="8bit"))
        if workload.precision.master:  # split masters (issue 22): 10 and 3.03 bytes each way instead of 12 and 6.03
            out.append(fusedoff_contender(optimizer, "stream", workload, args.chunk_sizes[0], args.num_buffers,
                                          args.chunk_sizes[0], master_precision="split"))
            out.append(fusedoff_contender(optimizer, "stream", workload, args.chunk_sizes[0], args.num_buffers,
                                          args.chunk_sizes[0], state_precision="8bit", master_precision="split8"))
    if optimizer == "adamw":
        names = ADAM_PEERS_GPU if gpu_peers else ("torch_fused",)
        out += [peer_contender(n, workload) for n in names
                if not (n == "naive_offload" and workload.numel > args.naive_max)]
    elif gpu_peers:
        out.append(peer_contender("apollo_eager", workload))
    return out


# ---- the plan ---------------------------------------------------------------------------------------


def plan_groups(sizes: list[int], optimizers: list[str], precisions: list[str],
                naive_max: int | None = None) -> list[tuple[int, str, str]]:
    """(size, optimizer, precision) groups, the targets' first: AdamW bf16_master and fp32 at the headline
    size (1G, or the largest below it), AdamW bf16_master at the largest size the naive offload runs at;
    then everything else, bf16_master before fp32, from the largest size down."""
    groups = [(s, o, p) for s in sizes for o in optimizers for p in precisions]
    headline = max([s for s in sizes if s <= HEADLINE] or sizes)
    naive = max([s for s in sizes if naive_max is None or s <= naive_max] or [headline])
    first = [(headline, "adamw", "bf16_master"), (headline, "adamw", "fp32"), (naive, "adamw", "bf16_master")]

    def priority(group: tuple[int, str, str]) -> tuple:
        size, optimizer, precision = group
        rank = first.index(group) if group in first else len(first)
        return (rank, precision != "bf16_master", -size, optimizer)

    return sorted(groups, key=priority)


def estimate_seconds(c: Contender, numel: int, bandwidth: traffic.Bandwidth, steps: int) -> float:
    """A pessimistic guess of building and timing `c` (to skip what cannot finish before the deadline):
    a quarter of the bound's speed (pageable copies for the naive offload: 3 GB/s), plus host state made at
    2 GB/s."""
    bound, _ = traffic.bound_seconds(c.traffic, bandwidth)
    step = (bound or 0.0) / 0.25
    if c.name == "naive_offload":
        step = max(step, c.traffic.link / 3e9)
    host_state = c.traffic.h2d if c.kind == "fusedoff" else 16 * numel  # bytes allocated (and pinned) on the host
    setup = host_state / 2e9 if c.offload != "none" else 0.0
    return 1.0 + setup + steps * step


# ---- measuring --------------------------------------------------------------------------------------


@dataclass
class Measured:
    samples: list[float] = field(default_factory=list)
    status: str = "ok"
    memory: dict = field(default_factory=dict)
    others_share: float | None = None


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def measure_alone(c: Contender, workload: Workload, args, deadline: float) -> Measured:
    """Build, warm up and time one contender by itself (on a GPU with its peak memory), all before
    `deadline`. The dry run takes the same path on the CPU, without the memory figures."""
    cuda = workload.device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        free_before = torch.cuda.mem_get_info()[0]
        torch.cuda.reset_peak_memory_stats()
    built = None
    phase, started = "building it", time.perf_counter()
    try:
        with timing.deadline_alarm(deadline):
            built = c.build(workload)
            phase = "in its first step"
            workload.rotate()
            start = time.perf_counter()
            built.step()  # the first step: lazy states, the engine's first buffers
            _sync(cuda)
            first = time.perf_counter() - start
            peak_first = torch.cuda.max_memory_allocated() - base if cuda else None
            steady = first
            phase = "warming up"
            for _ in range(max(1, args.warmup - 1)):  # warm-up; the last one sizes the repeats
                workload.rotate()
                start = time.perf_counter()
                built.step()
                _sync(cuda)
                steady = time.perf_counter() - start
            repeats = max(3, min(args.repeats, int(args.seconds_per_contender / max(steady, 1e-6))))
            left = deadline - time.perf_counter()
            if left < repeats * steady * 1.2:
                repeats = int(left / max(steady, 1e-6) / 1.2)
                if repeats < 3:
                    return Measured(status=f"skipped: a step takes {steady:.2f} s, {max(left, 0):.0f} s left before "
                                           "the deadline")
            phase = "timing it"
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            with timing.LoadMonitor() as load:
                if cuda:
                    samples = timing.time_cuda(built.step, repeats=repeats, warmup=0, events=built.events,
                                               before=workload.rotate)
                else:
                    samples = timing.time_interleaved({c.name: built.step}, repeats=repeats, warmup=0,
                                                      before=workload.rotate)[c.name]
            _sync(cuda)
            stats = built.memory_stats() if built.memory_stats is not None else {}
    except timing.DeadlineReached:
        return Measured(status=f"skipped: the deadline passed {phase} ({time.perf_counter() - started:.0f} s in)")
    finally:
        if built is not None and built.close is not None:
            built.close()
        del built
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    memory = {}
    if cuda:
        memory = {
            "gpu_peak_bytes": torch.cuda.max_memory_allocated() - base,
            "gpu_peak_first_step_bytes": peak_first,
            "gpu_used_delta_bytes": free_before - torch.cuda.mem_get_info()[0],
        }
    return Measured(samples, "ok", memory | {f"opt_{k}": v for k, v in stats.items()}, load.others_share)


def measure_one_by_one(contenders: list[Contender], workload: Workload, args, bandwidth, deadline,
                       done: Callable[[Contender, Measured], None]) -> None:
    """Each contender alone, in order; `done(contender, measured)` as soon as each is measured."""
    cuda = workload.device.type == "cuda"
    for c in contenders:
        left = deadline - time.perf_counter()
        need = estimate_seconds(c, workload.numel, bandwidth, args.warmup + 3)
        if need > left:
            done(c, Measured(status=f"skipped: needs ~{need:.0f} s, {max(left, 0):.0f} s left before the deadline"))
            continue
        print(f"  {c.name} ...", flush=True)
        try:
            measured = measure_alone(c, workload, args, deadline)
        except peers.PeerUnavailable as exc:
            measured = Measured(status=f"unavailable: {exc}")
        except Exception as exc:  # an optional peer failing must not stop the run; say what failed
            measured = Measured(status=f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            _sync(cuda)
        if not workload.all_finite():
            done(c, Measured(status="failed: non-finite parameters after its steps; the times are invalid"))
            raise SystemExit(f"FAIL {c.name}: non-finite parameters after timing; the times are invalid")
        done(c, measured)


def run_group_cpu(contenders: list[Contender], workload: Workload, args) -> tuple[dict[str, Measured], traffic.Bandwidth]:
    """Every available contender timed in turn, with the in-place bandwidth passes in the same loop."""
    out: dict[str, Measured] = {}
    steps: dict[str, Callable[[], object]] = {}
    stats: dict[str, Callable[[], dict]] = {}
    for c in contenders:
        try:
            built = c.build(workload)
        except peers.PeerUnavailable as exc:
            out[c.name] = Measured(status=f"unavailable: {exc}")
            continue
        steps[c.name] = built.step
        if built.memory_stats is not None:
            stats[c.name] = built.memory_stats
    scratch = min(workload.numel, 2**26)  # two 256 MiB buffers at most, far beyond any last-level cache
    kernels = timing.bandwidth_kernels(torch.ones(scratch), torch.ones(scratch))
    with timing.LoadMonitor() as load:
        samples = timing.time_interleaved(steps | {k.name: k.fn for k in kernels}, repeats=args.repeats,
                                          warmup=args.warmup, before=workload.rotate)
    for name in steps:
        memory = {f"opt_{k}": v for k, v in stats[name]().items()} if name in stats else {}
        out[name] = Measured(samples[name], "ok", memory, load.others_share)
    host = max(k.bytes_per_call / timing.summarize(samples[k.name]).median for k in kernels)
    return out, traffic.Bandwidth(host=host)


def result_rows(group: tuple[int, str, str], contenders: list[Contender], measured: dict[str, Measured],
                bandwidth: traffic.Bandwidth, workload: Workload, args) -> list[dict]:
    size, optimizer, precision = group
    rows = []
    for c in contenders:
        m = measured.get(c.name, Measured(status="not run"))
        bound, kind = traffic.bound_seconds(c.traffic, bandwidth)
        row = {
            "device": args.device.type, "dry_run": int(args.dry_run), "numel": size, "size": timing.format_size(size),
            "tensors": len(workload.numels), "optimizer": optimizer, "precision": precision, "contender": c.name,
            "kind": c.kind, "offload": c.offload, "what": c.what, "status": m.status,
            "h2d_bytes": c.traffic.h2d, "d2h_bytes": c.traffic.d2h, "memory_bytes": c.traffic.memory,
            "memory_where": c.traffic.where, "bound_kind": kind,
            "bound_ms": None if bound is None else round(bound * 1e3, 3),
            "buffer_bound_bytes": c.buffer_bytes,
            "bandwidth_h2d_gb_per_s": _gb(bandwidth.h2d), "bandwidth_d2h_gb_per_s": _gb(bandwidth.d2h),
            "bandwidth_bidir_gb_per_s": _gb(bandwidth.bidir), "bandwidth_device_gb_per_s": _gb(bandwidth.device),
            "bandwidth_host_gb_per_s": _gb(bandwidth.host),
        }
        if m.samples:
            s = timing.summarize(m.samples)
            bound_bytes = c.traffic.link if kind == "pinned link" else c.traffic.memory
            row |= {
                "repeats": s.n, "warmup": args.warmup, **timing.summary_columns("ms", s, 1e3),
                "mparams_per_s": round(size / s.median / 1e6, 2),
                "bytes_per_param": round(bound_bytes / size, 2),
                "gb_per_s": round(bound_bytes / s.median / 1e9, 2),
                "link_gb_per_s": round(c.traffic.link / s.median / 1e9, 2) if c.traffic.link else None,
                "fraction_of_bound": None if bound is None else round(bound / s.median, 3),
                "others_cpu_share": None if m.others_share is None else round(m.others_share, 3),
                **m.memory,
            }
        rows.append(row)
    return rows


def _gb(rate: float | None) -> float | None:
    return None if rate is None else round(rate / 1e9, 2)


# ---- main -------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", type=torch.device, default=None, help="cuda (default if available) or cpu")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU needed: the GPU run's plumbing on CPU at tiny sizes (peers too, where they can)")
    parser.add_argument("--sizes", nargs="+", type=timing.parse_size, default=None,
                        help="parameter counts (default cpu: 16M..256M; cuda: 16M 64M 256M 1G; dry run: 1M 4M)")
    parser.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    parser.add_argument("--precisions", nargs="+", choices=list(traffic.PRECISIONS), default=list(traffic.PRECISIONS))
    parser.add_argument("--tensor-size", type=timing.parse_size, default=timing.parse_size("16M"),
                        help="elements per parameter tensor (default 16M, a 4096 x 4096 matrix)")
    parser.add_argument("--chunk-sizes", nargs="+", type=timing.parse_size, default=[timing.parse_size("4M")],
                        help="offload='stream' chunk sizes, one row each (default 4M, fusedoff's default)")
    parser.add_argument("--num-buffers", type=int, default=2)
    parser.add_argument("--grad-ring", type=int, default=None, help="gradient sets in rotation (default cpu 2, cuda 3)")
    parser.add_argument("--naive-max", type=timing.parse_size, default=timing.parse_size("256M"),
                        help="largest size the (slow) naive offload runs at (default 256M)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per contender (default 10; dry run 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2; dry run 1)")
    parser.add_argument("--seconds-per-contender", type=float, default=4.0,
                        help="GPU: fewer repeats for slow contenders, to take about this long (default 4)")
    parser.add_argument("--skip", nargs="*", default=[], metavar="CONTENDER",
                        help="contenders not to run, e.g. zero_offload when its op could not be built in time")
    parser.add_argument("--deadline-s", type=float, default=None, help="skip what cannot finish within this many seconds")
    parser.add_argument("--link-bytes", type=timing.parse_size, default=timing.parse_size("1G"),
                        help="bytes per bandwidth copy (default 1G)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="CSV, PNG and RESULTS.md (default results/; dry run: a temp dir)")
    parser.add_argument("--label", default="", help="a note for the results")
    parser.add_argument("--from-csv", type=Path, default=None, help="only print and plot the rows of this CSV again")
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    if args.dry_run:
        args.device = torch.device("cpu")
    if args.device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got {args.device}")
    preset = DEFAULTS["dry" if args.dry_run else args.device.type]
    if args.sizes is None:
        args.sizes = [timing.parse_size(s) for s in preset["sizes"].split()]
    if args.dry_run:
        args.sizes = [min(s, 4 * 2**20) for s in args.sizes]
        args.tensor_size = min(args.tensor_size, 2**20)
        args.chunk_sizes = [min(c, 2**18) for c in args.chunk_sizes]
        args.naive_max = min(args.naive_max, 4 * 2**20)
        args.link_bytes = min(args.link_bytes, 2**26)
    args.repeats = preset["repeats"] if args.repeats is None else args.repeats
    args.warmup = preset["warmup"] if args.warmup is None else args.warmup
    args.grad_ring = args.grad_ring or (3 if args.device.type == "cuda" else 2)
    if args.out_dir is None:
        args.out_dir = Path(tempfile.mkdtemp(prefix="fusedoff_dry_")) if args.dry_run else timing.RESULTS_DIR
    return args


def load_native() -> str:
    """'' when fusedoff's native extension loads (finishing its JIT build if need be), else why not."""
    try:
        load_extension()
    except Exception as exc:  # the build failed: the peers and the bound are still worth measuring
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        print(f"fusedoff's native extension is unavailable, its rows are skipped: {why}", flush=True)
        return why
    return ""


def run_group(group: tuple[int, str, str], args, bandwidth: traffic.Bandwidth, deadline: float, native: str,
              emit: Callable[[list[dict]], None]) -> None:
    """Every contender of one (size, optimizer, precision): `emit(rows)` as soon as rows are measured, one
    contender at a time on a GPU and in the dry run, the whole group at once when interleaved on CPU."""
    size, optimizer, precision = group
    past = time.perf_counter() > deadline
    workload = make_workload(args.device, traffic.PRECISIONS[precision], size, args.tensor_size, args.grad_ring,
                             allocate=not past)
    contenders = contenders_for(optimizer, workload, args)
    decided = {c.name: Measured(status="skipped: --skip") for c in contenders if c.name in args.skip}
    if native:
        decided |= {c.name: Measured(status=f"unavailable: {native}") for c in contenders if c.kind == "fusedoff"}
    if past:
        decided |= {c.name: Measured(status="skipped: past the deadline") for c in contenders if c.name not in decided}

    def rows(cs: list[Contender], measured: dict[str, Measured], bw: traffic.Bandwidth = bandwidth) -> list[dict]:
        return result_rows(group, cs, measured, bw, workload, args)

    if args.device.type == "cuda" or args.dry_run or past:
        def done(c: Contender, m: Measured) -> None:
            emit(rows([c], {c.name: m}))

        for c in contenders:  # the decided ones in their place, in contender order
            if c.name in decided:
                done(c, decided[c.name])
            else:
                measure_one_by_one([c], workload, args, bandwidth, deadline, done)
        return
    to_run = [c for c in contenders if c.name not in decided]
    measured, host = run_group_cpu(to_run, workload, args)
    if not workload.all_finite():
        raise SystemExit(f"FAIL {group}: non-finite parameters after timing; the times are invalid")
    emit(rows(contenders, decided | measured, dataclasses.replace(bandwidth, host=host.host)))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    name = f"bench_step_{'dry' if args.dry_run else args.device.type}"
    if args.from_csv is not None:
        name = args.from_csv.stem
        rows = timing.read_csv(args.from_csv)
        bench_step_report.write_outputs(rows, rows[0] if rows else {}, args.out_dir / f"{name}.png", name, note="")
        return
    csv_path = args.out_dir / f"{name}.csv"
    start = time.perf_counter()
    deadline = start + (args.deadline_s if args.deadline_s is not None else float("inf"))
    torch.set_num_threads(args.threads)
    peer_versions = peers.versions()
    extra = {"fusedoff": fusedoff.__version__, "label": args.label, "dry_run": int(args.dry_run),
             "command": timing.command_line(), "tensor_size": args.tensor_size, "grad_ring": args.grad_ring,
             "warmup": args.warmup, "repeats_max": args.repeats,
             **{f"peer_{k}": v for k, v in peer_versions.items()}, **timing.gpu_metadata()}
    print(f"{name}: sizes {' '.join(timing.format_size(s) for s in args.sizes)}, peers "
          f"{', '.join(f'{k} {v}' for k, v in peer_versions.items())}", flush=True)

    results = timing.RowsFile(csv_path, timing.hardware_metadata(args.threads, extra | {"load": "in progress"}))
    emit = results.add  # rows into the CSV at once: a run killed after this keeps them

    bandwidth = traffic.Bandwidth()
    with timing.LoadMonitor() as load:
        if args.device.type == "cuda" or args.dry_run:  # the bound first: measured even if the rest runs out of time
            bound_rows = bench_bandwidth.measure(args.device.type, link_bytes=args.link_bytes,
                                                 host_bytes=min(args.link_bytes, 2**30), repeats=10,
                                                 dry_run=args.dry_run)
            bandwidth = bench_bandwidth.bandwidth_from_rows(bound_rows)
            print(timing.markdown_table(bound_rows, bench_bandwidth.TABLE_COLUMNS), flush=True)
            emit([{"device": args.device.type, "dry_run": int(args.dry_run), **r} for r in bound_rows])
        native = load_native()
        for group in plan_groups(args.sizes, args.optimizers, args.precisions, args.naive_max):
            print(f"{timing.format_size(group[0])} {group[1]} {group[2]} ({time.perf_counter() - start:.0f} s)",
                  flush=True)
            run_group(group, args, bandwidth, deadline, native, emit)
            gc.collect()
            if args.device.type == "cuda":
                torch.cuda.empty_cache()
    note = timing.load_note(load)
    meta = timing.hardware_metadata(args.threads, extra | {"load": note, "wall_s": round(time.perf_counter() - start)})
    results.finish(meta)
    bench_step_report.write_outputs(results.rows, meta, args.out_dir / f"{name}.png", name, note)


if __name__ == "__main__":
    main()
