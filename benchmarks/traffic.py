"""Bytes one optimizer step must move, per configuration: the figures every bound is computed from.

Written once here and used by every benchmark and by the verdict; tests/test_benchmarks.py checks each
formula against a hand computation. Counts are the bytes an implementation must read and write (each
input read once, each output written once, no write-allocate), per step.

A configuration's ``Traffic`` has two parts:
  * the link: bytes host -> device (``h2d``) and device -> host (``d2h``) over the pinned PCIe/NVLink
    path (for offload='stream' on CPU parameters: the loopback copies through host buffers);
  * ``memory``: bytes the update itself reads and writes in the memory it runs in (``where``: the
    device's or the host's).

Precisions (``PRECISIONS``):
  fp32         fp32 params, fp32 grads, fp32 states.
  bf16_master  bf16 params and grads; the optimizer keeps fp32 master weights and fp32 states.

Master precisions (``MASTER_BYTES_PER_ELEMENT``, a Precision's ``master_precision``): the bytes per
element the optimizer stores (and streams) for a master weight. The one place they are written: the
link model, the README's table of bytes per parameter and the tests that count the engine's copies
all take them from `master_bytes_per_element`.
  fp32         the fp32 master, 4 bytes.
  split        its low 16 bits beside the bf16 parameter (exact), 2 bytes.
  split8       bits 8-15 of its stochastic rounding to 24 bits, 1 byte.

State precisions of fusedoff.AdamW (``STATE_PRECISIONS``, its ``state_precision``): how the two moments
are stored; the master weights stay fp32.
  fp32         4 bytes each.
  bf16         2 bytes each.
  8bit         1 byte each, and one fp32 absmax scale per moment per block of 256 elements.

The streamed layout is re-derived here from the rule in fusedoff/offload/plan.py (each tensor starts at
a multiple of the plan's alignment: 16 elements, or 256 with 8-bit states so that no scale block spans
two chunks; chunks of ``chunk_size`` elements, rounded up to that alignment, over that flat space),
independently of the engine's own ChunkPlan, and the tests compare the two.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fusedoff import formats
from fusedoff.offload.plan import ALIGN_ELEMENTS  # every tensor starts on a 64-byte boundary

FP32 = 4
# Bytes per element of a stored master weight, by master precision (see the module docstring), read
# from the forms themselves (fusedoff/formats.py): a new form is picked up by every table and test
# built on this module.
MASTER_BYTES_PER_ELEMENT = {precision: int(form.bytes_per_element()) for precision, form in formats.MASTER_FORMS.items()}
QUANT_BLOCK = formats.EIGHT_BIT.block  # elements per fp32 scale of an 8-bit moment


@dataclass(frozen=True)
class Precision:
    name: str
    param: int  # bytes per element of the model's parameter
    grad: int  # bytes per element of its gradient
    master: bool  # master weights kept by the optimizer
    master_precision: str = "fp32"  # how they are stored (MASTER_BYTES_PER_ELEMENT)

    @property
    def master_bytes(self) -> int:
        """Bytes per element of the stored master weight (0 without one)."""
        return master_bytes_per_element(self.master_precision) if self.master else 0


def master_bytes_per_element(master_precision: str) -> int:
    """Bytes per element of a master weight stored in `master_precision` (MASTER_BYTES_PER_ELEMENT)."""
    if master_precision not in MASTER_BYTES_PER_ELEMENT:
        raise ValueError(f"master precision must be one of {tuple(MASTER_BYTES_PER_ELEMENT)}, got {master_precision!r}")
    return MASTER_BYTES_PER_ELEMENT[master_precision]


PRECISIONS = {
    "fp32": Precision("fp32", param=4, grad=4, master=False),
    "bf16_master": Precision("bf16_master", param=2, grad=2, master=True),
}


@dataclass(frozen=True)
class StatePrecision:
    name: str
    moment: int  # bytes per element of exp_avg and of exp_avg_sq
    block: int = 0  # one fp32 scale per moment per block of this many elements (0: none)

    def moment_states(self) -> dict[str, tuple[int, int]]:
        """The stored moments (and their scales) as name: (bytes per value, elements per value)."""
        states = {"exp_avg": (self.moment, 1), "exp_avg_sq": (self.moment, 1)}
        if self.block:
            states.update({"exp_avg_absmax": (FP32, self.block), "exp_avg_sq_absmax": (FP32, self.block)})
        return states


def _state_precision(form: formats.StoredForm) -> StatePrecision:
    values, *scales = form.specs("exp_avg")
    return StatePrecision(form.precision, moment=values.dtype.itemsize, block=scales[0].block if scales else 0)


STATE_PRECISIONS = {precision: _state_precision(form) for precision, form in formats.MOMENT_FORMS.items()}
FP32_STATES = STATE_PRECISIONS["fp32"]


@dataclass(frozen=True)
class Traffic:
    """Bytes per step (see the module docstring)."""

    h2d: int = 0
    d2h: int = 0
    memory: int = 0
    where: str = "device"  # "device" | "host": the memory `memory` is counted in

    @property
    def link(self) -> int:
        return self.h2d + self.d2h


@dataclass(frozen=True)
class Bandwidth:
    """Measured bytes/s; None where not measured (no GPU: no link)."""

    h2d: float | None = None
    d2h: float | None = None
    bidir: float | None = None  # both directions at once: total bytes / time
    device: float | None = None  # device memory, bytes read + written per second
    host: float | None = None  # host memory, bytes read + written per second (best in-place pass)


def bound_seconds(traffic: Traffic, bandwidth: Bandwidth) -> tuple[float | None, str]:
    """The least time a step can take at the measured bandwidths, and what binds it.

    The link term is the slowest of: h2d alone at the h2d rate, d2h alone at the d2h rate, and both
    together at the bidirectional rate (copies in and out overlap in a pipelined step). The memory term
    is the update's bytes at its memory's rate. Both can overlap, so the bound is their maximum. Without
    a measured link (CPU), loopback copies are not counted: they are not needed work, and the overhead
    they add is what the benchmark reports against offload='none'.
    """
    terms: dict[str, float] = {}
    if traffic.link and None not in (bandwidth.h2d, bandwidth.d2h, bandwidth.bidir):
        terms["pinned link"] = max(traffic.h2d / bandwidth.h2d, traffic.d2h / bandwidth.d2h,
                                   traffic.link / bandwidth.bidir)
    rate = bandwidth.device if traffic.where == "device" else bandwidth.host
    if traffic.memory and rate:
        terms[f"{traffic.where} memory"] = traffic.memory / rate
    if not terms:
        return None, ""
    kind = max(terms, key=terms.get)
    return terms[kind], kind


# ---- the fused update's own bytes ----------------------------------------------------------------------


def _check_adam_states(amsgrad: bool, state: StatePrecision) -> None:
    if amsgrad and state.name != "fp32":  # as fusedoff.AdamW refuses it
        raise ValueError(f"amsgrad keeps fp32 states only, got state precision {state.name!r}")


def _adam_update_terms(precision: Precision, amsgrad: bool, state: StatePrecision) -> tuple[int, int]:
    """(bytes per element, bytes per scale block) of one fused Adam update."""
    _check_adam_states(amsgrad, state)
    moments = 2 * state.moment + FP32 * int(amsgrad)  # max_exp_avg_sq is fp32
    # The fp32 weights: the param or the whole master; a split master is read beside its parameter.
    split = precision.master and precision.master_precision != "fp32"
    weights = precision.param + precision.master_bytes if split else FP32
    reads = weights + precision.grad + moments
    writes = (precision.master_bytes if precision.master else FP32) + moments + (precision.param if precision.master else 0)
    return reads + writes, 2 * 2 * FP32 if state.block else 0  # each moment's scale read and written


def adam_update_bytes(precision: Precision, amsgrad: bool = False, state: StatePrecision = FP32_STATES) -> float:
    """Per element, one fused Adam/AdamW update where its states are (fusedoff's kernel).

    Reads the fp32 weights (the param, or the master), the grad, exp_avg, exp_avg_sq (and
    max_exp_avg_sq); writes the fp32 weights and the states, and with master weights the rounded
    low-precision param too. fp32: 16 + 12 = 28; bf16_master: 14 + 14 = 28. Compressed moments (`state`)
    are read and written at their size; 8-bit ones also read and write each moment's fp32 scale once per
    block, 16 / 256 bytes per element here (an int for fp32 and bf16 states, a float for 8-bit ones;
    `adam_tensors_update_bytes` counts each tensor's last, partial block whole).
    """
    per_element, per_block = _adam_update_terms(precision, amsgrad, state)
    return per_element + per_block / state.block if state.block else per_element


def adam_tensors_update_bytes(numels: Sequence[int], precision: Precision, amsgrad: bool = False,
                              state: StatePrecision = FP32_STATES) -> int:
    """One fused Adam/AdamW update of tensors of `numels` elements (8-bit scales: each tensor's blocks)."""
    per_element, per_block = _adam_update_terms(precision, amsgrad, state)
    return sum(per_element * n + (per_block * -(-n // state.block) if state.block else 0) for n in numels)


# Apollo, per pass (fusedoff) or op (eager reference), as (what, tensors read, tensors written). p g m B d
# are the param, grad and the three states (exp_avg_grad, approx_hessian, update); gw y v t D q are the
# eager step's whole-tensor temporaries. Fused: the passes of apollo_whole_step_ (csrc/cpu/apollo_cpu.cpp,
# csrc/cuda/apollo_cuda.cu); the reduce and 'moments' passes read p only for L2 decay.
APOLLO_CONFIGS = {
    "constant_L2": dict(rebound="constant", weight_decay_type="L2"),
    "belief_stable": dict(rebound="belief", weight_decay_type="stable"),
}
APOLLO_FUSED_PASSES = {
    "constant_L2": [("reduce: sums of d^4, y*d, B*d^2, max|y|", "p g m B d", ""),
                    ("full: m, B, d, p", "p g m B d", "p m B d")],
    "belief_stable": [("reduce: sums of d^4, y*d, B*d^2, max|y|", "g m B d", ""),
                      ("moments: m, B, sum D", "g m B d", "m B"),
                      ("finish: d, p with wd / mean(D)", "p m B", "d p")],
}
# Eager: ApolloReference.step, op by op (an op that reads one tensor twice, d.mul(d), reads it once).
_EAGER_MOMENTS = [
    ("m.add_(y, alpha)", "m y", "m"),
    ("d.norm(p=4)", "d", ""),
    ("d.div_(den)", "d", "d"),
    ("v = d.mul(d)", "d", "v"),
    ("y.div_(den)", "y", "y"),
    ("y.mul_(d)", "y d", "y"),
    ("y.sum()", "y", ""),
    ("t = B.mul(v)", "B v", "t"),
    ("t.sum()", "t", ""),
    ("B.addcmul_(v, delta)", "B v", "B"),
    ("D = B.abs()", "B", "D"),
]
APOLLO_EAGER_OPS = {
    "constant_L2": [("gw = g.add(p, alpha=wd)", "g p", "gw"), ("y = gw - m", "gw m", "y"), *_EAGER_MOMENTS,
                    ("D.clamp_(min=0.01)", "D", "D"),
                    ("q = m.div(D)", "m D", "q"),
                    ("d.copy_(q)", "q", "d"),
                    ("p.add_(d, alpha=-lr)", "p d", "p")],
    "belief_stable": [("y = g - m", "g m", "y"), ("R = y.norm(p=inf)", "y", ""), *_EAGER_MOMENTS,
                      ("D = torch.max(D, R)", "D", "D"),
                      ("D.add_(eps / alpha)", "D", "D"),
                      ("q = m.div(D)", "m D", "q"),
                      ("d.copy_(q)", "q", "d"),
                      ("D.mean().item()", "D", ""),
                      ("d.add_(p, alpha=wd / mean)", "d p", "d"),
                      ("p.add_(d, alpha=-lr)", "p d", "p")],
}


def apollo_update_bytes(steps: Sequence[tuple[str, str, str]], precision: Precision = PRECISIONS["fp32"]) -> int:
    """Per element, bytes of a list of Apollo passes or ops. Every tensor is fp32 except the grad (its
    precision's) and, with master weights, `p` is the fp32 master plus a rounded param written with it."""
    size = {"g": precision.grad}
    total = 0
    for _, reads, writes in steps:
        total += sum(size.get(t, FP32) for t in reads.split()) + sum(size.get(t, FP32) for t in writes.split())
        if precision.master and "p" in writes.split():
            total += precision.param
    return total


def describe_steps(steps: Sequence[tuple[str, str, str]]) -> str:
    return "; ".join(f"{what} [r {reads or '-'} / w {writes or '-'}]" for what, reads, writes in steps)


# ---- the streamed layout -------------------------------------------------------------------------------


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _flat_offsets(numels: Sequence[int], align: int) -> tuple[list[int], int]:
    """Each tensor's first element in the streamed flat layout (each on a multiple of `align`
    elements), and the layout's length."""
    offsets, flat = [], 0
    for n in numels:
        offsets.append(flat)
        flat = _round_up(flat + n, align)
    return offsets, flat


def chunk_layout(numels: Sequence[int], chunk_size: int, align: int = ALIGN_ELEMENTS) -> list[tuple[int, bool]]:
    """(elements, holds whole tensors only) per chunk of the streamed flat layout, each tensor starting
    on a multiple of `align` elements (`chunk_size` a multiple of it)."""
    offsets, flat = _flat_offsets(numels, align)
    chunks = []
    for begin in range(0, flat, chunk_size):
        end = min(begin + chunk_size, flat)
        whole = True
        for offset, n in zip(offsets, numels):
            if n and offset < end and offset + n > begin:  # the tensor has elements in this chunk
                whole = whole and begin <= offset and offset + n <= end
        chunks.append((end - begin, whole))
    return chunks


def _streamed(chunks: Sequence[int], read: Sequence[str], write: Sequence[str],
              sizes: dict[str, tuple[int, int]] | None = None) -> tuple[int, int]:
    """(h2d, d2h) bytes of one pipeline pass over `chunks`: every written state is also copied in, a chunk
    of a state whole. `sizes`: name: (bytes per value, elements per value) where not fp32 per element."""
    elements = sum(chunks)

    def moved(names) -> int:
        total = 0
        for name in set(names):
            size, block = (sizes or {}).get(name, (FP32, 1))
            total += size * elements // block  # chunks hold whole blocks (the plan is aligned to them)
        return total

    return moved(set(read) | set(write)), moved(write)


def _adam_stored(precision: Precision, amsgrad: bool, state: StatePrecision) -> dict[str, tuple[int, int]]:
    """What a streamed Adam/AdamW tensor keeps in host memory: name: (bytes per value, elements per value)."""
    _check_adam_states(amsgrad, state)
    stored = state.moment_states()
    if amsgrad:
        stored["max_exp_avg_sq"] = (FP32, 1)
    if precision.master:
        stored["master_param"] = (precision.master_bytes, 1)
    return stored


def stored_states(optimizer: str, precision: Precision, amsgrad: bool = False,
                  state: StatePrecision = FP32_STATES) -> dict[str, tuple[int, int]]:
    """What one tensor keeps (`optimizer`: "adamw", "adam" or "apollo"): name: (bytes per value,
    elements per value), its master included."""
    if optimizer != "apollo":
        return _adam_stored(precision, amsgrad, state)
    if state.name != "fp32" or amsgrad:
        raise ValueError("fusedoff.Apollo keeps fp32 states only, and has no amsgrad")
    stored = dict.fromkeys(("exp_avg_grad", "approx_hessian", "update"), (FP32, 1))
    if precision.master:
        stored["master_param"] = (precision.master_bytes, 1)
    return stored


def stream_host_bytes(optimizer: str, numels: Sequence[int], precision: Precision, amsgrad: bool = False,
                      state: StatePrecision = FP32_STATES) -> int:
    """Bytes of host memory the streamed states (and masters) of tensors of `numels` elements take: each
    state over the flat layout, each tensor starting on a multiple of the alignment (16 elements, 256
    with 8-bit states)."""
    stored = stored_states(optimizer, precision, amsgrad, state)
    align = max(ALIGN_ELEMENTS, state.block)
    _, flat = _flat_offsets(numels, align)
    return sum(size * flat // block for size, block in stored.values())


def adam_stream_link(numels: Sequence[int], chunk_size: int, precision: Precision,
                     amsgrad: bool = False, state: StatePrecision = FP32_STATES) -> tuple[int, int]:
    """(h2d, d2h) of a streamed Adam/AdamW step: one pass, every state (and the master) in and out.
    The plan is aligned to the largest block of a state (8-bit scales: 256 elements), and the chunk size
    rounded up to a multiple of it, as the engine does (OffloadEngine.plan_chunk_size)."""
    sizes = _adam_stored(precision, amsgrad, state)
    states = list(sizes)
    align = max(ALIGN_ELEMENTS, state.block)
    layout = chunk_layout(numels, _round_up(chunk_size, align), align)
    return _streamed([n for n, _ in layout], states, states, sizes)


def apollo_stream_link(numels: Sequence[int], chunk_size: int, precision: Precision, config: str) -> tuple[int, int]:
    """(h2d, d2h) of a streamed Apollo step (fusedoff/optim/apollo.py's `_streamed_step`).

    Chunks holding whole tensors only run every phase while resident: the moments and the master in and
    out once. Chunks of tensors that span chunks take one pipeline pass per phase, each copying in what it
    reads or writes and copying out what it writes. The reduce and 'moments' phases read the master
    only with L2 decay."""
    moments = ["exp_avg_grad", "approx_hessian", "update"]
    master = ["master_param"] if precision.master else []
    l2 = APOLLO_CONFIGS[config]["weight_decay_type"] == "L2"  # the benchmarks use weight_decay > 0
    passes = {
        "reduce": (moments + (master if l2 else []), []),
        "full": (moments + master, moments + master),
        "moments": (moments + (master if l2 else []), moments[:2]),
        "finish": (moments[:2] + master, moments[2:] + master),
    }
    phases = ("reduce", "moments", "finish") if APOLLO_CONFIGS[config]["weight_decay_type"] == "stable" \
        else ("reduce", "full")
    sizes = {"master_param": (precision.master_bytes, 1)}
    layout = chunk_layout(numels, chunk_size)
    whole = [n for n, w in layout if w]
    spanning = [n for n, w in layout if not w]
    h2d, d2h = _streamed(whole, moments + master, moments + master, sizes)
    for phase in phases if spanning else ():
        a, b = _streamed(spanning, *passes[phase], sizes)
        h2d, d2h = h2d + a, d2h + b
    return h2d, d2h


# ---- each configuration's traffic ---------------------------------------------------------------------


def fusedoff_traffic(optimizer: str, precision: Precision, offload: str, numels: Sequence[int], chunk_size: int,
                     device: str, apollo_config: str = "constant_L2", state: StatePrecision = FP32_STATES) -> Traffic:
    """fusedoff.AdamW / fusedoff.Apollo with offload 'none' or 'stream' (params and grads on `device`),
    AdamW's moments stored as `state` says (Apollo keeps fp32 states only)."""
    n = sum(numels)
    if optimizer == "adamw":
        memory = adam_tensors_update_bytes(numels, precision, state=state)
    elif state.name != "fp32":
        raise ValueError(f"fusedoff.Apollo keeps fp32 states only, got state precision {state.name!r}")
    else:
        memory = apollo_update_bytes(APOLLO_FUSED_PASSES[apollo_config], precision) * n
    where = "device" if device == "cuda" else "host"
    if offload == "none":
        return Traffic(memory=memory, where=where)
    if optimizer == "adamw":
        h2d, d2h = adam_stream_link(numels, chunk_size, precision, state=state)
    else:
        h2d, d2h = apollo_stream_link(numels, chunk_size, precision, apollo_config)
    return Traffic(h2d=h2d, d2h=d2h, memory=memory, where=where)


def peer_traffic(peer: str, precision: Precision, numel: int, device: str) -> Traffic:
    """The peers of bench_step.py (see peers.py for what each does), per step over `numel` params.

    torch_fused    torch.optim.AdamW(fused=True), states resident. bf16_master: the fp32 master's grad is
                   the bf16 grad upcast (`g.float()`: read 2, write 4) before the 28-byte step; no bf16
                   param is written back.
    naive_offload  a user's loop: the states (and the fp32 master) on the CPU, per parameter `.to(device)`,
                   a torch fused step there, `.to('cpu')`; the param stays on the device. Link: the states
                   both ways. Device memory: the step, plus for bf16_master the upcast (6) and the
                   param write-back `p.copy_(master)` (6).
    zero_offload   DeepSpeed's pattern: the grad to pinned host memory, DeepSpeedCPUAdam on an fp32 master
                   in host memory, the param back. Link: grad down, param up. Host memory: the step, plus
                   for bf16_master the upcast into the fp32 grad buffer (6) and the rounding into the
                   pinned bf16 param (6).
    torchao        torchao's CPUOffloadOptimizer: grad down, torch's fused CPU AdamW on a host copy of the
                   param *in the param's dtype* (bf16 states for bf16 params: 7 elements of 2 B), param up.
    bnb_paged      bitsandbytes' PagedAdamW (32-bit states in CUDA managed memory, resident while they
                   fit), updating the param directly: fp32 28; bf16 params with fp32 states 22.
    apollo_eager   fusedoff.kernels.reference.ApolloReference (fp32 only): the eager op sequence.
    """
    p = precision
    if peer == "torch_fused":
        upcast = (p.grad + FP32) if p.master else 0
        return Traffic(memory=(adam_update_bytes(PRECISIONS["fp32"]) + upcast) * numel,
                       where="device" if device == "cuda" else "host")
    if peer == "naive_offload":
        moved = FP32 * (2 + int(p.master)) * numel
        extra = (p.grad + FP32 + FP32 + p.param) if p.master else 0
        return Traffic(h2d=moved, d2h=moved, memory=(adam_update_bytes(PRECISIONS["fp32"]) + extra) * numel)
    if peer == "zero_offload":
        extra = (p.grad + FP32 + FP32 + p.param) if p.master else 0
        return Traffic(h2d=p.param * numel, d2h=p.grad * numel,
                       memory=(adam_update_bytes(PRECISIONS["fp32"]) + extra) * numel, where="host")
    if peer == "torchao":
        return Traffic(h2d=p.param * numel, d2h=p.grad * numel, memory=7 * p.param * numel, where="host")
    if peer == "bnb_paged":
        return Traffic(memory=(2 * p.param + p.grad + 4 * FP32) * numel)
    if peer == "apollo_eager":
        return Traffic(memory=apollo_update_bytes(APOLLO_EAGER_OPS["constant_L2"]) * numel,
                       where="device" if device == "cuda" else "host")
    raise ValueError(f"unknown peer {peer!r}")


# ---- bytes per parameter: the README's table --------------------------------------------------------------

README_TABLE_BEGIN = "<!-- bytes per parameter: generated by `python benchmarks/traffic.py`; do not edit -->"
README_TABLE_END = "<!-- end of the generated table -->"


def _per_element(value: float) -> str:
    return f"{value:g}" if value == int(value) else f"{value:.2f}"


def bytes_per_parameter_rows(chunk_size: int = 2**22) -> list[tuple[str, str, str, float, float, float, float]]:
    """Per parameter element of a bf16 model whose states all stream: (optimizer, state precision, master,
    host bytes, bytes to the device and to the host per step for tensors spanning chunks, bytes to the
    device per step in chunks of whole tensors). Tensors are multiples of 256 elements (no padding);
    masters: none, and each of MASTER_BYTES_PER_ELEMENT."""
    spanning, whole = [4 * chunk_size], [chunk_size // 2] * 8  # a tensor over 4 chunks; 2 tensors per chunk
    masters = [None, *MASTER_BYTES_PER_ELEMENT]
    rows = []
    for label, config, states in [("AdamW", None, list(STATE_PRECISIONS)),
                                  ("Apollo, constant + L2", "constant_L2", ["fp32"]),
                                  ("Apollo, belief + stable", "belief_stable", ["fp32"])]:
        for state in states:
            for master in masters:
                precision = Precision("bf16", param=2, grad=2, master=master is not None,
                                      master_precision=master or "fp32")
                if config is None:
                    def link(numels):
                        return adam_stream_link(numels, chunk_size, precision, state=STATE_PRECISIONS[state])
                else:
                    def link(numels):
                        return apollo_stream_link(numels, chunk_size, precision, config)
                n = sum(spanning)
                host = stream_host_bytes("apollo" if config else "adamw", spanning, precision,
                                         state=STATE_PRECISIONS[state]) / n
                (h2d, d2h), (whole_h2d, _) = link(spanning), link(whole)
                rows.append((label, state, master or "none", host, h2d / n, d2h / n, whole_h2d / sum(whole)))
    return rows


def bytes_per_parameter_markdown() -> str:
    """The README's table of bytes per parameter (see `bytes_per_parameter_rows`), between its markers."""
    lines = [README_TABLE_BEGIN,
             "| optimizer (bf16 parameters) | `state_precision` | master | host memory | to the device, per step "
             "| to the host, per step |",
             "|---|---|---|---|---|---|"]
    for label, state, master, host, h2d, d2h, whole_h2d in bytes_per_parameter_rows():
        to_device = _per_element(h2d) if whole_h2d == h2d else \
            f"{_per_element(h2d)} ({_per_element(whole_h2d)} in chunks of whole tensors)"
        lines.append(f"| {label} | {state} | {master} | {_per_element(host)} | {to_device} | {_per_element(d2h)} |")
    return "\n".join([*lines, README_TABLE_END])


if __name__ == "__main__":
    print(bytes_per_parameter_markdown())
