"""The cost model of one optimizer step: bytes and seconds, for states resident, streamed or stepped on the host.

A step of N parameter elements splits them three ways:

  resident       states on the device; the device kernel steps them (no link traffic);
  streamed       states in host memory, copied to the device chunk by chunk, stepped there, copied back
                 (the pipeline double-buffers, so copies and kernels overlap);
  host-computed  states in host memory, stepped there by the host kernel: the gradient and the
                 parameter go down to the host, and the parameter back up. The parameter goes down
                 too because anything may have written it on the device since the last step (see
                 [note: the host share of a step] in fusedoff/offload/host_share.py).

Bytes per element come from the optimizer classes' own state specs and phases (the stored forms of
fusedoff/formats.py, as `fusedoff.memory.state_specs_of` and `phases_of` give them) and the engine's own
rule for the bytes a streamed pass copies (`Placement.predict_link`), never from constants written here.

[note: the step's cost model] Four resources run concurrently, and the step takes as long as the
busiest one (a documented simple model, not a schedule):

  link         h2d bytes / h2d rate, d2h bytes / d2h rate, and both together / the rate when both
               directions run at once: the largest of the three (the streamed chunks' copies, and the
               host-computed elements' gradients and parameters down and parameters up, share it);
  device       the bytes the device kernel reads and writes (resident and streamed elements) / the
               device memory bandwidth it reaches;
  host memory  every byte that crosses host memory / its bandwidth: the host kernel's reads and writes
               over the host-computed elements, and every byte the link moves, both ways. Pinned-memory
               copies are DMA over PCIe from and into host DRAM: a streamed chunk is read from it on the
               way up and written into it on the way down, a host-computed element's gradient and
               parameter land in it and its parameter leaves from it. On a node of several GPUs every
               rank streams at once, so the bandwidth is one GPU's share of the node's;
  host kernel  the host-computed elements / the host kernel's measured elements per second, where the
               rates have one for the setup: what it reaches alone on its threads (arithmetic such as
               codecs and rounding can hold it below host memory's rate); the copies' traffic that
               competes with it is in host memory's term.

A host-computed element crosses host memory with more bytes than a streamed one does (its kernel
reads and writes the states the stream would copy, and the link's copies bring its gradient and
parameter down and take its parameter up besides), so a host share shortens the step only where
the link, not host memory, bounds the streamed step.

Left out: the pipeline's fill and drain (one chunk each way), per-call host costs, the forward that
overlapped steps hide under, and the copies' and kernels' contention for device memory. The timed
simulator (fusedoff/testing/timed.py) schedules the real engine's operations for the streamed case.

The kernel's bytes per element ([note: kernel bytes per element]): every phase reads the gradient and
the states it declares and writes the states it declares; the parameter is written once and read once
unless a whole fp32 master stands for it. This is fusedoff's fused kernels' count for Adam (28 bytes
for bf16 parameters with fp32 states and masters); for Apollo with L2 decay it is 4 bytes short of
the kernel's (which reads the parameter in two phases).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from fusedoff import formats, memory
from fusedoff.offload.contract import Phase, StateSpec
from fusedoff.offload.gradients import LOW_PRECISION
from fusedoff.offload.placement import Placement, auto_budget
from fusedoff.optim.base import master_spec

OPTIMIZERS = memory.OPTIMIZERS
NO_MASTER = "none"
MASTER_PRECISIONS = (*formats.MASTER_FORMS, NO_MASTER)
STATE_PRECISIONS = tuple(formats.MOMENT_FORMS)
# A tensor this many chunks long stands for the model's tensors when counting a streamed pass's bytes
# per element: weight matrices of large models span chunks (Apollo then copies once per phase).
_SPANNING_CHUNKS = 4


@dataclass(frozen=True)
class Setup:
    """What one step updates and how the optimizer stores it."""

    optimizer: str = "adamw"
    param_dtype: torch.dtype = torch.bfloat16
    grad_dtype: torch.dtype | None = None  # None: the parameter's
    state_precision: str = "fp32"
    master_precision: str = "fp32"  # "none": no master weights (always none for fp32 parameters)

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        formats.moment_form(self.state_precision)
        if self.master_precision not in MASTER_PRECISIONS:
            raise ValueError(f"master_precision must be one of {MASTER_PRECISIONS}, got {self.master_precision!r}")
        if self.param_dtype not in LOW_PRECISION and self.master_precision != NO_MASTER:
            raise ValueError(f"{self.param_dtype} parameters keep no master weights: master_precision='none'")
        if self.master_precision != NO_MASTER:
            formats.check_master_param(self.master_precision, self.param_dtype)
        _specs_and_phases(self)  # what the optimizer class refuses (Apollo's compressed states)

    @property
    def grad(self) -> torch.dtype:
        return self.param_dtype if self.grad_dtype is None else self.grad_dtype

    @property
    def label(self) -> str:
        return f"{self.state_precision} states, {self.master_precision} master"


@dataclass(frozen=True)
class ElementBytes:
    """Bytes per parameter element of one `Setup` (see [note: the step's cost model])."""

    param: float
    grad: float
    states: float  # the optimizer's states, stored (where they live)
    master: float  # the stored master weight (0: none)
    stream_h2d: float  # a streamed step's copies, per streamed element
    stream_d2h: float
    kernel: float  # what the fused update reads and writes ([note: kernel bytes per element])
    buffers: int  # the streaming buffers on the device (bytes, whole), when anything streams

    @property
    def stored(self) -> float:
        return self.states + self.master

    @property
    def host_h2d(self) -> float:
        """A host-computed element's parameter, back up to the device after the host stepped it."""
        return self.param

    @property
    def host_d2h(self) -> float:
        """A host-computed element's gradient (in its own dtype) and its parameter, down to the host:
        the engine copies the parameter down every step, as anything may have written it on the
        device since the last one ([note: the host share of a step] in fusedoff/offload/host_share.py)."""
        return self.grad + self.param

    @property
    def host_staging(self) -> float:
        """A host-computed element's page-locked staging in host memory: `HostShare`'s parameter
        buffer and its gradient buffer (one per gradient dtype: one here), each whole. Left out: each
        bucket's few scalars (step counts, scale, found_inf) and the buffers' alignment padding."""
        return self.param + self.grad


def _specs_and_phases(setup: Setup) -> tuple[tuple[StateSpec, ...], tuple[StateSpec, ...], tuple[Phase, ...]]:
    """The states, the master and the phases the optimizer class declares (refusing what it refuses),
    asked as the memory report asks them."""
    states = memory.state_specs_of(setup.optimizer, setup.state_precision)
    master = () if setup.master_precision == NO_MASTER else (master_spec(setup.master_precision),)
    names = tuple(s.name for s in states + master)
    return states, master, memory.phases_of(setup.optimizer, setup.state_precision)(names)


def _per_element(specs: Iterable[StateSpec]) -> float:
    return sum(s.dtype.itemsize / s.block for s in specs)


def element_bytes(setup: Setup, *, chunk_size: int | None = None, num_buffers: int = 2) -> ElementBytes:
    """Bytes per element of `setup` (the engine's chunk size and buffer sets, as passed to the optimizer)."""
    states, master, phases = _specs_and_phases(setup)
    specs = states + master
    placement = Placement("stream", chunk_size, num_buffers, None)
    numel = _SPANNING_CHUNKS * placement.plan_chunk_size(specs)[0]
    link = placement.predict_link(specs, phases, [numel])
    by_name = {s.name: s for s in specs}
    param, grad = setup.param_dtype.itemsize, setup.grad.itemsize
    whole_master = bool(master) and master[0].follows_param
    kernel = sum(grad + _per_element(by_name[n] for n in phase.reads) + _per_element(by_name[n] for n in phase.writes)
                 for phase in phases) + param * (1 if whole_master else 2)
    return ElementBytes(param=param, grad=grad, states=_per_element(states), master=_per_element(master),
                        stream_h2d=link.to_device / numel, stream_d2h=link.to_host / numel, kernel=kernel,
                        buffers=placement.buffer_bytes_for(specs))


@dataclass(frozen=True)
class Rates:
    """How fast each resource runs, in bytes (or elements) per second. Presets: `PRESETS`; measured:
    ``fusedoff.calibrate.measure(threads).rates(base)``."""

    name: str
    h2d: float  # bytes/s host -> device, large pinned copies
    d2h: float  # bytes/s device -> host
    both: float  # bytes/s of both directions together while both are busy
    device_memory: float  # bytes/s (read + written) a streaming device kernel reaches
    host_memory: float  # bytes/s (read + written) of host memory: this GPU's share of it, for kernel and copies
    # Elements per second of the host kernel by (optimizer, state precision, master precision), measured
    # on `host_threads` threads; setups missing here are timed by their bytes at `host_memory` alone.
    host_kernel: dict[tuple[str, str, str], float] = field(default_factory=dict)
    host_threads: int | None = None
    source: str = ""  # where the numbers come from

    def host_elements_per_s(self, setup: Setup) -> float | None:
        optimizer = "adamw" if setup.optimizer == "adam" else setup.optimizer  # one kernel, one cost
        return self.host_kernel.get((optimizer, setup.state_precision, setup.master_precision))


# Presets: ASSUMED figures for planning, not measurements (`--rates measured` measures the host here).
PRESETS = {
    "h100-pcie5": Rates(
        "h100-pcie5",
        # PCIe Gen5 x16: 64 GB/s raw per direction; ~55 GB/s is what large pinned copies are assumed to
        # reach each way, and 100 GB/s both ways at once (the assumptions of fusedoff/testing/timed.py).
        h2d=55e9, d2h=55e9, both=100e9,
        # H100 SXM HBM3: 3.35 TB/s published; a streaming kernel assumed to reach 80% of it.
        device_memory=3.35e12 * 0.8,
        # One GPU's share of a two-socket, 112-core DDR5-4800 server with 8 GPUs: 14 cores, and of
        # 2 sockets x 8 channels x 38.4 GB/s = 614 GB/s peak, ~77 GB/s: 75 GB/s assumed reached.
        host_memory=75e9,
        source="assumed: PCIe Gen5 x16 ~55 GB/s each way (100 both), H100 HBM3 3.35 TB/s x 0.8, "
               "14 cores and 75 GB/s of DDR5 per GPU"),
    "workstation-pcie4": Rates(
        "workstation-pcie4",
        # PCIe Gen4 x16: 32 GB/s raw per direction; ~25 GB/s assumed reached each way, 45 GB/s both ways.
        h2d=25e9, d2h=25e9, both=45e9,
        # A workstation GPU with ~1 TB/s of GDDR6X (an RTX 4090's 1008 GB/s published), 80% assumed reached.
        device_memory=1.0e12 * 0.8,
        # A 16-core desktop CPU with dual-channel DDR5-6000 (96 GB/s peak): 80 GB/s assumed reached.
        host_memory=80e9,
        source="assumed: PCIe Gen4 x16 ~25 GB/s each way (45 both), a ~1 TB/s GPU x 0.8, "
               "16 cores and 80 GB/s of DDR5"),
}


def preset(name: str) -> Rates:
    if name not in PRESETS:
        raise ValueError(f"rates must be one of {tuple(PRESETS)}, got {name!r}")
    return PRESETS[name]


@dataclass(frozen=True)
class StepPrediction:
    """One step of `setup` for `resident` + `streamed` + `host` elements at `rates`: bytes and seconds."""

    setup: Setup
    rates: str
    resident: int
    streamed: int
    host: int
    h2d_bytes: float
    d2h_bytes: float
    device_bytes: float  # on the GPU: parameters, gradients, resident states and masters, buffers
    host_bytes: float  # in host memory: streamed and host-computed states and masters, host staging
    # Seconds of each term of the step (each linear in the elements it counts): "h2d", "d2h", "both"
    # (the link), "device", "host memory" (the kernel's and the link's bytes / bandwidth), "host kernel"
    # (elements / measured rate; 0 where none).
    terms: dict[str, float]

    @property
    def params(self) -> int:
        return self.resident + self.streamed + self.host

    @property
    def host_share(self) -> float:
        """The share of the elements not resident that the host steps."""
        outside = self.streamed + self.host
        return self.host / outside if outside else 0.0

    @property
    def link_s(self) -> float:
        """The least time the link moves the bytes in: each direction at its rate, both under `both`."""
        return max(self.terms["h2d"], self.terms["d2h"], self.terms["both"])

    @property
    def device_s(self) -> float:
        return self.terms["device"]

    @property
    def step_s(self) -> float:
        return max(self.terms.values())

    @property
    def bound(self) -> str:
        """The resource the step waits on: "link", "device", "host memory" or "host kernel"."""
        resources = (("link", self.link_s), ("device", self.device_s), ("host memory", self.terms["host memory"]),
                     ("host kernel", self.terms["host kernel"]))
        return max(resources, key=lambda t: t[1])[0]


def predict_step(setup: Setup, rates: Rates, params: int, *, resident: int = 0, host_share: float = 0.0,
                 chunk_size: int | None = None, num_buffers: int = 2) -> StepPrediction:
    """The step of `params` elements of which `resident` keep their states on the device and a share
    `host_share` of the rest are stepped by the host (see [note: the step's cost model]).

    Host-computed elements keep in host memory their states and master, and their staging
    (`ElementBytes.host_staging`: the page-locked parameter and gradient buffers the engine's
    `HostShare` allocates, whole)."""
    params, resident = int(params), int(resident)
    if params < 0 or not 0 <= resident <= params:
        raise ValueError(f"need 0 <= resident <= params, got resident={resident}, params={params}")
    if not 0.0 <= host_share <= 1.0:  # (NaN fails too)
        raise ValueError(f"host_share must be in [0, 1], got {host_share}")
    b = element_bytes(setup, chunk_size=chunk_size, num_buffers=num_buffers)
    host = round(host_share * (params - resident))
    streamed = params - resident - host
    h2d = streamed * b.stream_h2d + host * b.host_h2d
    d2h = streamed * b.stream_d2h + host * b.host_d2h
    rate = rates.host_elements_per_s(setup)
    terms = {"h2d": h2d / rates.h2d, "d2h": d2h / rates.d2h, "both": (h2d + d2h) / rates.both,
             "device": (resident + streamed) * b.kernel / rates.device_memory,
             "host memory": (host * b.kernel + h2d + d2h) / rates.host_memory,
             "host kernel": host / rate if rate else 0.0}
    device = params * (b.param + b.grad) + resident * b.stored + (b.buffers if streamed else 0)
    host_bytes = (streamed + host) * b.stored + host * b.host_staging
    return StepPrediction(setup, rates.name, resident, streamed, host, h2d_bytes=h2d, d2h_bytes=d2h,
                          device_bytes=device, host_bytes=host_bytes, terms=terms)


def auto_resident(setup: Setup, params: int, gpu_memory: int, *, reserve: int = 0, chunk_size: int | None = None,
                  num_buffers: int = 2) -> int:
    """The elements whose states offload='auto' keeps on a GPU of `gpu_memory` bytes holding the
    parameters, the gradients and `reserve` bytes more: the engine's automatic budget (placement.py's
    `auto_budget`: 10% headroom, and room for the buffers when not everything fits), counted in
    elements rather than whole tensors."""
    b = element_bytes(setup, chunk_size=chunk_size, num_buffers=num_buffers)
    in_use = params * (b.param + b.grad) + reserve
    budget = auto_budget(int(gpu_memory), int(in_use), math.ceil(params * b.stored), b.buffers)
    return min(params, int(budget // b.stored))


def best_host_share(setup: Setup, rates: Rates, params: int, *, resident: int = 0, chunk_size: int | None = None,
                    num_buffers: int = 2) -> StepPrediction:
    """The prediction at the host share (of the elements not resident: never a resident one) with the
    shortest step, exactly: each term of the step is linear in the share, so the step (their maximum)
    is convex and piecewise linear, and its least value lies at 0, at 1 or where two terms cross."""

    def at(share: float) -> StepPrediction:
        return predict_step(setup, rates, params, resident=resident, host_share=share, chunk_size=chunk_size,
                            num_buffers=num_buffers)

    none, every = at(0.0), at(1.0)
    candidates = {0.0, 1.0}
    for a, b in itertools.combinations(none.terms, 2):
        slope = (every.terms[a] - none.terms[a]) - (every.terms[b] - none.terms[b])
        if slope:
            share = (none.terms[b] - none.terms[a]) / slope
            if 0.0 < share < 1.0:
                candidates.add(share)
    return min((at(share) for share in sorted(candidates)), key=lambda p: (p.step_s, p.host))


__all__ = ["ElementBytes", "PRESETS", "Rates", "Setup", "StepPrediction", "auto_resident", "best_host_share",
           "element_bytes", "predict_step", "preset"]
