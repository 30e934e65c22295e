"""The memory report: where every byte of a training step goes, predicted and measured.

Two halves that meet in one table:

- :func:`predict` gives the bytes of each component of a training step (parameters, gradients,
  optimizer states on the device, master weights, fp32 gradient copies, streaming buffers, and
  what lives in host memory) for fusedoff and for the alternatives: ``setup="plain"`` (the
  optimizer run on the parameters as they are, states on the device in the parameters' dtype, as
  ``torch.optim.AdamW`` does) and ``setup="upcast"`` (the usual mixed precision: fp32 master
  copies of the parameters, every gradient upcast with ``.float()`` into its master's ``.grad``,
  fp32 states on the device). It needs only the parameters' shapes and dtypes, so meta tensors
  predict a model that does not fit anywhere.
- :class:`MemoryReport` measures each phase of a training step, ``with report.phase("forward"):``.
  On CUDA it resets torch's peak counter at entry and reads it at exit; on CPU it reads the
  process's resident memory (and its peak where Linux lets the peak be reset).

:func:`format_report` prints them side by side; what a phase measured beyond the predicted
components present in it is the activations (and temporaries) of that phase.

Step counters (one 4-byte scalar per tensor) are left out of every prediction. fusedoff's state
bytes come from the classes' own stored forms (fusedoff/formats.py: fp32, bf16 or 8-bit moments)
and the offload engine's own rules (host alignment, buffer sets), so the prediction is the bytes
``memory_stats()`` reports.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from fusedoff.offload.placement import Placement
from fusedoff.offload.plan import round_up
from fusedoff.offload.runtime import LinkBytes
from fusedoff.formats import check_master_options, check_master_param
from fusedoff.offload.contract import Phase, StateSpec
from fusedoff.optim.adam import Adam, AdamW
from fusedoff.optim.apollo import Apollo
from fusedoff.optim.base import keeps_master, master_spec

PARAMETERS = "parameters"
GRADIENTS = "gradients"
STATES = "optimizer states on the device"
MASTERS = "master weights on the device"
FP32_GRADS = "fp32 gradient copies"
BUFFERS = "streaming buffers"
HOST_STATES = "optimizer states in host memory"
HOST_MASTERS = "master weights in host memory"
DEVICE_COMPONENTS = (PARAMETERS, GRADIENTS, STATES, MASTERS, FP32_GRADS, BUFFERS)
HOST_COMPONENTS = (HOST_STATES, HOST_MASTERS)

PHASES = ("forward", "backward", "step")
# The device components alive in each phase of a step that begins with zero_grad(set_to_none=True)
# (torch's default): no gradient exists during the forward pass, the backward pass creates them,
# and the fp32 copies of the upcast recipe exist from the step until the next zero_grad.
PRESENT = {
    "forward": (PARAMETERS, STATES, MASTERS, BUFFERS),
    "backward": (PARAMETERS, GRADIENTS, STATES, MASTERS, BUFFERS),
    "step": DEVICE_COMPONENTS,
}

SETUPS = ("fusedoff", "plain", "upcast")
_CLASSES = {"adamw": AdamW, "adam": Adam, "apollo": Apollo}
OPTIMIZERS = tuple(_CLASSES)
MIB = 2**20


@dataclass(frozen=True)
class MemoryPrediction:
    """Bytes by component: `device` on the parameters' device, `host` in host memory (offloaded)."""

    label: str
    device_type: str
    device: dict[str, int]
    host: dict[str, int]
    state_precision: str | None = None  # how fusedoff stores the moments (None: another setup)
    # fusedoff streamed: the parameter elements whose states live in host memory, and the bytes a
    # step in which every parameter has a gradient copies each way ({"to_device": ..., "to_host": ...}).
    streamed_params: int = 0
    link: dict[str, int] = field(default_factory=lambda: {"to_device": 0, "to_host": 0})

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def host_bytes_per_param(self) -> float | None:
        """Host bytes per streamed parameter element, as memory_stats() says (None where nothing streams)."""
        return self.host_total / self.streamed_params if self.streamed_params else None

    @property
    def link_bytes_per_param(self) -> dict[str, float] | None:
        """Bytes a step copies each way per streamed parameter element (None where nothing streams)."""
        if not self.streamed_params:
            return None
        return {way: nbytes / self.streamed_params for way, nbytes in self.link.items()}

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    def present(self, phase: str) -> int:
        """The predicted device bytes alive during `phase` (one of PHASES)."""
        if phase not in PRESENT:
            raise ValueError(f"no prediction for phase {phase!r}; phases are {PHASES}")
        return sum(self.device[name] for name in PRESENT[phase])


def _unique_params(params: nn.Module | Iterable[Tensor]) -> list[Tensor]:
    params = params.parameters() if isinstance(params, nn.Module) else params
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:  # tied weights count once
            seen.add(id(p))
            out.append(p)
    return out


def _bytes(params: Iterable[Tensor], dtype: torch.dtype | None = None) -> int:
    return sum(p.numel() * (p.element_size() if dtype is None else dtype.itemsize) for p in params)


def predict(params: nn.Module | Iterable[Tensor], *, setup: str = "fusedoff", optimizer: str = "adamw",
            amsgrad: bool = False, grad_dtype: torch.dtype | None = None, master_weights: bool | None = None,
            offload: str = "auto", chunk_size: int | None = None, num_buffers: int = 2,
            device_budget: int | None = None, device: torch.device | str | None = None,
            state_precision: str = "fp32", master_precision: str = "fp32", options: dict | None = None,
            label: str | None = None) -> MemoryPrediction:
    """Predicted bytes by component for training `params` with `optimizer` in `setup`.

    Args:
        setup: ``"fusedoff"`` (fusedoff.AdamW/Adam/Apollo with `master_weights`, `offload`,
            `chunk_size`, `num_buffers`, `device_budget` as passed to the optimizer; the states that
            fit in the budget stay on the device, in the optimizer's order, the rest stream; offload
            "auto" on CUDA with no budget predicts a model whose states fit: pass the budget the
            optimizer decided, ``opt.memory_stats()["device_budget"]``, for its split), ``"plain"``
            (torch's optimizer or the eager reference on the parameters as they are: states on the
            device in the parameters' dtype) or ``"upcast"`` (fp32 master copies, fp32 gradient
            copies and fp32 states, all on the device).
        state_precision: fusedoff's storage of the moments, as passed to fusedoff.AdamW/Adam
            (``"fp32"``, ``"bf16"``, ``"8bit"``: one byte each and an fp32 scale per block of 256);
            fusedoff only (the other setups keep theirs as said above), and Apollo keeps fp32 states
            only.
        master_precision: fusedoff's storage of master weights (``"fp32"`` 4 bytes, ``"split"`` 2,
            ``"split8"`` 1; bf16 parameters only, as the optimizer refuses fp16 ones).
        options: the optimizer's other arguments that decide which states a streamed step moves
            (Apollo's ``weight_decay``, ``rebound``, ``weight_decay_type``; default: the class's
            defaults).
        grad_dtype: the gradients' dtype; None means each parameter's own.
        device: where the parameters train (default: where they are), so that meta tensors can stand
            for them.
    """
    if setup not in SETUPS:
        raise ValueError(f"setup must be one of {SETUPS}, got {setup!r}")
    _class_of(optimizer)
    if optimizer == "apollo" and amsgrad:
        raise ValueError("amsgrad is an Adam option")
    if offload not in ("auto", "none", "stream"):
        raise ValueError(f"offload must be 'auto', 'none' or 'stream', got {offload!r}")
    specs = state_specs_of(optimizer, state_precision, amsgrad=amsgrad, setup=setup)
    check_master_options(master_precision, master_weights)
    if setup != "fusedoff" and master_precision != "fp32":
        raise ValueError(f"master_precision={master_precision!r} is a fusedoff option: setup={setup!r} keeps fp32 masters")
    params = _unique_params(params)
    if device is not None:
        device_type = torch.device(device).type
    else:
        device_types = {p.device.type for p in params}
        if len(device_types) > 1:
            raise ValueError(f"parameters on several device types: {sorted(device_types)}")
        device_type = device_types.pop() if device_types else "cpu"
    num_states = len(specs)
    fp32 = torch.float32
    on_device = dict.fromkeys(DEVICE_COMPONENTS, 0)
    host = dict.fromkeys(HOST_COMPONENTS, 0)
    on_device[PARAMETERS] = _bytes(params)
    on_device[GRADIENTS] = _bytes(params, grad_dtype)

    streams, streamed, link = False, 0, LinkBytes()
    if setup == "plain":
        on_device[STATES] = num_states * _bytes(params)
    elif setup == "upcast":
        on_device[STATES] = num_states * _bytes(params, fp32)
        on_device[MASTERS] = _bytes(params, fp32)
        on_device[FP32_GRADS] = _bytes(params, fp32)
    else:
        phases = phases_of(optimizer, state_precision, amsgrad=amsgrad, options=options)
        streams, streamed, link = _predict_fusedoff(params, on_device, host, specs, master_weights, master_precision,
                                                    offload, device_type, chunk_size, num_buffers, device_budget,
                                                    phases)
    if label is None:
        label = {"fusedoff": "fusedoff " + ("stream" if streams else "none"), "plain": "plain",
                 "upcast": "fp32 upcast"}[setup]
        if state_precision != "fp32":
            label += f" {state_precision}"
        if master_precision != "fp32":
            label += f" {master_precision} master"
    return MemoryPrediction(label, device_type, on_device, host, state_precision if setup == "fusedoff" else None,
                            streamed, link.as_dict())


def _class_of(optimizer: str) -> type:
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    return _CLASSES[optimizer]


def state_specs_of(optimizer: str, state_precision: str = "fp32", *, amsgrad: bool = False,
                   setup: str = "fusedoff") -> tuple[StateSpec, ...]:
    """The states one parameter keeps besides its master weights, as the optimizer class (one of
    `OPTIMIZERS`) stores them in `setup` (refusing what the class refuses)."""
    if setup not in SETUPS:
        raise ValueError(f"setup must be one of {SETUPS}, got {setup!r}")
    if setup != "fusedoff" and state_precision != "fp32":
        kept = "in the parameters' dtype" if setup == "plain" else "in fp32"
        raise ValueError(f"state_precision={state_precision!r} is a fusedoff option: setup={setup!r} keeps its "
                         f"states {kept} (state_precision='fp32')")
    cls = _class_of(optimizer)
    group = {"state_precision": state_precision, "amsgrad": amsgrad}
    cls._check_state_options(group)
    return cls._state_specs(group)


def phases_of(optimizer: str, state_precision: str = "fp32", *, amsgrad: bool = False,
              options: dict | None = None) -> Callable[[tuple[str, ...]], tuple[Phase, ...]]:
    """names -> the phases the optimizer class declares for a bucket keeping the states (and master)
    named; `options` are the class's other arguments (Apollo's ``weight_decay``, ``rebound``, ...),
    checked now as the class checks them."""
    cls = _class_of(optimizer)
    options = dict(options or {})
    if optimizer != "apollo":
        options.update(amsgrad=amsgrad, state_precision=state_precision)
    group = cls._default_options(**{"lr": 1e-3, **options})  # (refusing what the class refuses)
    return lambda names: cls._phases(group, names)


def _predict_fusedoff(params, on_device, host, specs, master_weights, master_precision, offload, device_type,
                      chunk_size, num_buffers, device_budget, phases_of) -> tuple[bool, int, LinkBytes]:
    """Fills `on_device` and `host` as the engine places states (Placement.predict_placement):
    buckets of one dtype and master setting in the order they first appear, each tensor's states
    and master resident while they fit in the budget. Returns whether anything streams, the
    parameter elements that do, and the bytes a step copies (Placement.predict_link)."""
    placement = Placement(offload, chunk_size, num_buffers, device_budget)  # constructing one allocates nothing
    # offload='auto' on a GPU without a budget decides one from the device's memory at the first
    # step: predicted as if everything fits.
    budget = None if offload == "auto" and device_budget is None else placement.default_budget(device_type == "cuda")
    buckets: dict[tuple, list[Tensor]] = {}
    for p in params:
        master = keeps_master(p.dtype, master_weights)
        if master:
            check_master_param(master_precision, p.dtype)
        buckets.setdefault((p.dtype, master), []).append(p)
    kept = [specs + ((master_spec(master_precision),) if master else ()) for _, master in buckets]
    flags, buffers = placement.predict_placement([(k, [p.numel() for p in members])
                                                  for k, members in zip(kept, buckets.values())], budget)
    streamed, link = 0, LinkBytes()
    for bucket_specs, members, resident in zip(kept, buckets.values(), flags):
        numels = [0 if fits else p.numel() for p, fits in zip(members, resident)]
        streamed += sum(numels)
        if any(numels):
            link = link + placement.predict_link(bucket_specs, phases_of(tuple(s.name for s in bucket_specs)), numels)
        masters = bucket_specs[len(specs):]
        _, align = placement.plan_chunk_size(bucket_specs)
        for p, fits in zip(members, resident):
            n = p.numel()
            if fits:
                on_device[STATES] += sum(s.nbytes(n) for s in specs)
                on_device[MASTERS] += sum(s.nbytes(n) for s in masters)
            elif n:
                # The host store lays each tensor out from a multiple of the plan's alignment (ChunkPlan).
                padded = round_up(n, align)
                host[HOST_STATES] += sum(s.nbytes(padded) for s in specs)
                host[HOST_MASTERS] += sum(s.nbytes(padded) for s in masters)
    on_device[BUFFERS] = buffers
    return bool(buffers), streamed, link


def check_memory_stats(prediction: MemoryPrediction, stats: dict) -> list[str]:
    """Where a fusedoff optimizer's own ``memory_stats()`` disagrees with `prediction` (empty: none).

    ``host_bytes`` must equal the predicted host bytes, ``resident_bytes`` the predicted states and
    masters on the device, and ``device_bytes`` (what the optimizer holds on the parameters'
    device: resident states and masters, and its streaming buffers) those plus the buffers;
    ``streamed_params`` the predicted parameter elements in host memory; and after a step in which
    every streamed parameter had a gradient, ``link_bytes_last_step`` (the bytes the step's copies
    moved, counted) the predicted bytes each way (a step that first reads back parameters written
    from outside, or whose masters were loaded, moves those bytes more to the host). Call it after
    the first step (states are lazy).
    """
    problems = []
    if stats["host_bytes"] != prediction.host_total:
        problems.append(f"host_bytes {stats['host_bytes']} != predicted {prediction.host_total}")
    resident = prediction.device[STATES] + prediction.device[MASTERS]
    if stats["resident_bytes"] != resident:
        problems.append(f"resident_bytes {stats['resident_bytes']} != predicted {resident}")
    expected = resident + prediction.device[BUFFERS]
    if stats["device_bytes"] != expected:
        problems.append(f"device_bytes {stats['device_bytes']} != predicted {expected}")
    if stats["streamed_params"] != prediction.streamed_params:
        problems.append(f"streamed_params {stats['streamed_params']} != predicted {prediction.streamed_params}")
    elif (stats["streamed_params_last_step"] == stats["streamed_params"]
          and stats["link_bytes_last_step"] != prediction.link):
        problems.append(f"link_bytes_last_step {stats['link_bytes_last_step']} != predicted {prediction.link}")
    return problems


# ---- measuring ------------------------------------------------------------------------------

def host_rss_bytes() -> int:
    """The process's resident memory now (Linux /proc/self/statm; else its lifetime peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return host_peak_rss_bytes()


def host_peak_rss_bytes() -> int:
    """The process's peak resident memory: since the last reset_host_peak() where that works, else
    over its lifetime (getrusage)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return lifetime_peak_rss_bytes()


def lifetime_peak_rss_bytes() -> int:
    """The process's peak resident memory over its life (getrusage: never reset; 0 on Windows)."""
    try:
        import resource
    except ImportError:
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def reset_host_peak() -> bool:
    """Resets the peak resident memory to the current (Linux >= 4.0, /proc/self/clear_refs); False
    where that is not allowed, and the peak is then the process's lifetime peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def release_freed_host_memory() -> None:
    """Gives the memory that malloc keeps after frees back to the system (glibc's malloc_trim), so
    that what an earlier run freed does not hide what a new one uses; nothing where that is absent."""
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc; Windows has no CDLL(None)
        return
    malloc_trim(0)


@dataclass
class PhaseMemory:
    """What one phase measured, over every time it ran, in bytes above the report's baseline."""

    name: str
    calls: int = 0
    entry_bytes: int = 0  # the most in use at entry (the steady state, once states exist)
    peak_bytes: int = 0  # the most in use during the phase
    counter_reset_seen: bool = False  # someone else reset torch's peak counter during a phase


class MemoryReport:
    """Peak memory per training phase on `device`, in bytes above what was in use when created.

    On CUDA, ``phase()`` resets torch's peak counter of the device at entry
    (``reset_peak_memory_stats``) and reads it at exit, taking the larger of it and the readings of
    ``memory_allocated`` at entry and exit. That counter is one per process and device: code that
    resets it during a phase (another library, another thread) hides the part of the peak before
    its reset; a peak reading below the entry reading shows such a reset and is flagged, a reset at
    a higher level cannot be seen. Code reading the counter across a phase sees this phase's peak
    only. No call synchronises with the device: the allocator counts on the host, in program order.

    On CPU, memory is the process's resident set (RSS): at entry and as the peak (VmHWM, reset at
    entry through /proc/self/clear_refs where allowed, otherwise the larger of entry and exit).
    RSS includes everything the process maps, and what malloc keeps after frees for reuse, so it
    is a coarse measure beside the GPU's: a new report first hands that kept memory back
    (malloc_trim), so that what an earlier run freed does not hide what this one uses.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if not self.cuda:
            release_freed_host_memory()
        self.host_peak_resettable = not self.cuda and reset_host_peak()
        self.phases: dict[str, PhaseMemory] = {}
        self.baseline_bytes = self._in_use()

    def _in_use(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.cuda else host_rss_bytes()

    @contextmanager
    def phase(self, name: str) -> Iterator[PhaseMemory]:
        record = self.phases.setdefault(name, PhaseMemory(name))
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.host_peak_resettable:
            reset_host_peak()
        entry = self._in_use()
        try:
            yield record
        finally:
            leaving = self._in_use()
            if self.cuda:
                counter = torch.cuda.max_memory_allocated(self.device)
                record.counter_reset_seen |= counter < entry
            else:
                counter = host_peak_rss_bytes() if self.host_peak_resettable else 0
            record.calls += 1
            record.entry_bytes = max(record.entry_bytes, entry - self.baseline_bytes)
            record.peak_bytes = max(record.peak_bytes, max(counter, entry, leaving) - self.baseline_bytes)


# ---- showing --------------------------------------------------------------------------------

@dataclass
class MeasuredRun:
    """One training run: its name, the prediction of its setup and what it measured."""

    name: str
    prediction: MemoryPrediction
    report: MemoryReport
    notes: list[str] = field(default_factory=list)


def _mib(value: int) -> str:
    return f"{value / MIB:.2f}"


def format_report(predictions: Sequence[MemoryPrediction], runs: Sequence[MeasuredRun] = ()) -> str:
    """The prediction table (one column per setup) and, for each measured run, its phases: the
    predicted components present, the measured peak and the remainder (activations)."""
    title = "predicted bytes by component (MiB" + (f", {predictions[0].device_type})" if predictions else ")")
    width = max(len(name) for name in (*DEVICE_COMPONENTS, *HOST_COMPONENTS, "device total at the step", title))
    columns = [max(10, len(p.label)) for p in predictions]
    lines = [title.ljust(width + 2) + "".join("  " + p.label.rjust(c) for p, c in zip(predictions, columns))]

    def row(name: str, values: Iterable[int]) -> str:
        return f"  {name.ljust(width)}" + "".join("  " + _mib(v).rjust(c) for v, c in zip(values, columns))

    if any(p.state_precision not in (None, "fp32") for p in predictions):  # compressed states: say which
        lines.append(f"  {'fusedoff state precision'.ljust(width)}"
                     + "".join("  " + (p.state_precision or "-").rjust(c) for p, c in zip(predictions, columns)))
    for name in DEVICE_COMPONENTS:
        lines.append(row(name, (p.device[name] for p in predictions)))
    lines.append(row("device total at the step", (p.device_total for p in predictions)))
    for name in HOST_COMPONENTS:
        lines.append(row(name, (p.host[name] for p in predictions)))
    if runs:
        cuda = runs[0].report.cuda
        measure = "device memory allocated" if cuda else "process RSS"
        lines += ["", f"measured per phase (MiB; {measure} above the run's start, the most over all steps)"]
        name_width = max(len(r.name) for r in runs)
        lines.append(f"  {'run'.ljust(name_width)}  {'phase':<9} {'predicted':>10} {'at entry':>10} {'peak':>10} "
                     f"{'activations (peak - predicted)':>31}")
        for run in runs:
            for k, phase in enumerate(run.report.phases.values()):
                predicted = run.prediction.present(phase.name) if phase.name in PRESENT else None
                remainder = "-" if predicted is None else _mib(phase.peak_bytes - predicted)
                flag = "  (peak counter reset elsewhere: a lower bound)" if phase.counter_reset_seen else ""
                lines.append(f"  {(run.name if k == 0 else '').ljust(name_width)}  {phase.name:<9} "
                             f"{'-' if predicted is None else _mib(predicted):>10} {_mib(phase.entry_bytes):>10} "
                             f"{_mib(phase.peak_bytes):>10} {remainder:>31}{flag}")
            lines += [f"  {note}" for note in run.notes]
        if not cuda:
            lines.append("  (on CPU: resident memory counts what malloc keeps after frees, "
                         "so the remainder bounds the activations from above)")
    now = host_rss_bytes()  # the kernel updates the lifetime peak lazily: it may lag the present
    lines.append(f"host: process resident memory {_mib(now)} MiB now, "
                 f"{_mib(max(now, lifetime_peak_rss_bytes()))} MiB at most over the process's life")
    return "\n".join(lines)


def plot_report(runs: Sequence[MeasuredRun], path: str) -> None:
    """A PNG of each run's phases: the predicted components stacked beside the measured peak."""
    # Optional, and through Figure rather than pyplot: no global backend or state is touched.
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5 * len(runs), 4))
    axes = fig.subplots(1, len(runs), sharey=True, squeeze=False)[0]
    colors = dict(zip(DEVICE_COMPONENTS, colormaps["tab10"].colors))
    legend = {}
    for ax, run in zip(axes, runs):
        phases = [p for p in run.report.phases.values() if p.name in PRESENT]
        for x, phase in enumerate(phases):
            bottom = 0.0
            for name in PRESENT[phase.name]:
                height = run.prediction.device[name] / MIB
                if height:
                    legend[name] = ax.bar(x - 0.2, height, 0.4, bottom=bottom, color=colors[name])
                    bottom += height
            legend["measured peak"] = ax.bar(x + 0.2, phase.peak_bytes / MIB, 0.4, color="0.3")
        ax.set_xticks(range(len(phases)), [p.name for p in phases])
        ax.set_title(run.name)
    measure = "device memory allocated" if runs[0].report.cuda else "process RSS"
    axes[0].set_ylabel(f"MiB ({measure} above the run's start)")
    order = [name for name in (*DEVICE_COMPONENTS, "measured peak") if name in legend]
    fig.legend([legend[name] for name in order], order, loc="upper center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.88))
    fig.savefig(path, dpi=120)
