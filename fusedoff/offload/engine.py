"""OffloadEngine: where each parameter's states live, and one step path for every placement.

A bucket is the parameters of one param group that share a device, dtype and master-weight
setting, fixed when the bucket first steps. Its `StateLayout` places each tensor's states
(see placement.py): resident ones are device tensors, streamed ones live in a HostStateStore laid
out by a ChunkPlan and move through the device's StreamPipeline, whose buffers every bucket of the
device shares. Either way the states are the entries of ``opt.state[p]``: device tensors, or
views of the host store (never copies), so torch's machinery sees one source of truth.

The engine follows what ``opt.state`` holds (`StateLayout.adopt`): a missing state starts afresh,
an assigned tensor is taken by value into its place, an in-place edit is the state itself.

A step runs an optimizer's `FusedUpdate` (update.py): resident tensors whole, in one call per
phase on the current stream; streamed chunks through the pipeline. Chunks holding only whole,
unsharded tensors run every phase while resident in their buffers (one copy in, one out); the
pieces of tensors spanning chunks, and sharded tensors, take one pass per phase, so that each
phase sees the previous one's whole-tensor results.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fusedoff.offload.pipeline import StreamPipeline, buffer_regions
from fusedoff.offload.runtime import Runtime, runtime_for
from fusedoff.offload.placement import Budget
from fusedoff.offload.plan import ALIGN_ELEMENTS, Chunk, ChunkPlan, aligned_chunk_size, round_up
from fusedoff.offload.store import HostStateStore
from fusedoff.offload.update import FusedUpdate, Phase, StateSpec, UpdateArgs, state_specs
from fusedoff.sharding import like_param, local_tensor, shard_groups
from fusedoff.tensor_layout import flat_view

# NOTE: 4M elements: with AdamW + master weights (3 fp32 states) one buffer set is 48 MiB and the
# default two sets 96 MiB, whatever the model size; large enough that each copy runs at full PCIe
# speed (copies of a few MiB already do).
DEFAULT_CHUNK_SIZE = 4 * 2**20
# Host slabs hold at most this many bytes (a larger tensor gets a slab of its own): pinning one
# huge region fails on many systems.
DEFAULT_SEGMENT_BYTES = 256 * 2**20

# initial(name, param): a state's starting value (None: zeros).
Initial = Callable[[str, Tensor], "Tensor | None"]


@dataclass
class StateLayout:
    """Where the states of one bucket's tensors live: resident on the device or streamed."""

    params: list[Tensor]
    specs: dict[str, StateSpec]
    resident: list[bool]
    plan: ChunkPlan
    store: HostStateStore | None
    pipeline: StreamPipeline | None
    initial: Initial
    index: dict[int, int]  # id(param) -> position in `params`
    sharded: list[bool]
    runtime: Runtime
    before_host_write: Callable[[], None]  # waits for queued copies back into the store
    # The object last placed in opt.state[p][name] for each tensor (None: none yet).
    placed: dict[str, list[Tensor | None]] = field(default_factory=dict)
    # Flat views of the parameters for the step under way, made once per step: a DTensor's local
    # view costs ~30 us, and a pass asks for it once per piece (and per phase).
    _flat_params: dict[int, Tensor] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.specs)

    def adopt(self, t: int, state: dict) -> None:
        """Makes `state` (the dict ``opt.state[params[t]]``) hold this layout's tensors for every
        state name, keeping the values it holds: fresh where missing, by value where replaced."""
        param = self.params[t]
        placed = self.placed
        for name, spec in self.specs.items():
            value = state.get(name)
            if value is not None and value is placed[name][t]:
                continue
            if value is not None and (value.dtype != spec.dtype if spec.dtype != torch.float32
                                      else not value.is_floating_point()):
                raise ValueError(f"state {name!r} is kept as {spec.dtype}, got a {value.dtype} tensor")
            if self.resident[t]:
                state[name] = placed[name][t] = self._resident_state(spec, param, value)
                continue
            local_param = local_tensor(param)
            # The state has the parameter's strides: the store holds it in the parameter's memory order.
            # A block-wise state (one value per block of elements) is flat.
            shaped = self.store.view(name, t)
            if spec.block == 1:
                shaped = shaped.as_strided(local_param.shape, local_param.stride())
            # The previous step's copies back cover whole chunks, this tensor's part included.
            self.before_host_write()
            self.runtime.host_access([shaped], write=True, what=f"{name} of tensor {t} set by the host")
            if value is None:
                start = self.initial(name, param)
                shaped.copy_(local_tensor(start)) if start is not None else shaped.zero_()
            else:
                local = local_tensor(value)
                if local.numel() != shaped.numel():
                    raise ValueError(f"state {name!r} has {local.numel()} elements, expected {shaped.numel()}")
                shaped.copy_(local.reshape(shaped.shape))
            state[name] = placed[name][t] = like_param(shaped, param) if spec.block == 1 else shaped

    def _resident_state(self, spec: StateSpec, param: Tensor, value: Tensor | None) -> Tensor:
        local_param = local_tensor(param)
        if value is None:
            start = self.initial(spec.name, param)
            if start is None:  # the parameter's strides: states are walked in its memory order
                if spec.block != 1:
                    return torch.zeros(spec.numel(local_param.numel()), dtype=spec.dtype, device=param.device)
                return torch.zeros_like(param, dtype=spec.dtype, memory_format=torch.preserve_format)
            value = start
        else:
            start = None
        local = local_tensor(value)
        expected = spec.numel(local_param.numel())
        if local.numel() != expected:
            raise ValueError(f"state {spec.name!r} has {local.numel()} elements, expected {expected}")
        if spec.block != 1:
            if local.dtype == spec.dtype and local.device == param.device and local.dim() == 1 and local.is_contiguous():
                return value
            return local.to(device=param.device, dtype=spec.dtype).reshape(-1).contiguous().clone()
        if (start is None and local.dtype == spec.dtype and local.device == param.device
                and local.shape == local_param.shape and local.stride() == local_param.stride()):
            return value  # an assigned tensor fit to be the state is the state, as in torch
        # A starting value (which may alias the parameter) or a tensor of another dtype, device or
        # layout: a copy in place of it, with the parameter's strides.
        copy = torch.empty_like(local_param, dtype=spec.dtype)
        copy.copy_(local.reshape(local_param.shape))
        return like_param(copy, param)

    def flat_param(self, t: int) -> Tensor:
        # A sharded (DTensor) parameter's states are its local shard's: the plan counts local elements.
        flat = self._flat_params.get(t)
        if flat is None:
            flat = self._flat_params[t] = flat_view(local_tensor(self.params[t].detach()))
        return flat

    def chunk_calls(self, chunk: Chunk, buffers: dict[str, Tensor], grads: dict[int, Tensor],
                    steps: dict[int, Tensor], stats: Tensor | None) -> list[UpdateArgs]:
        """The fused calls for `chunk`: one per gradient dtype among the pieces whose tensor steps."""
        by_dtype: dict[torch.dtype, list] = defaultdict(list)
        for piece in chunk.pieces:
            if piece.tensor in grads:
                by_dtype[grads[piece.tensor].dtype].append(piece)
        calls = []
        for pieces in by_dtype.values():
            calls.append(UpdateArgs(
                tensors=[p.tensor for p in pieces],
                params=[_slice(self.flat_param(p.tensor), p.tensor_offset, p.length) for p in pieces],
                grads=[_slice(grads[p.tensor], p.tensor_offset, p.length) for p in pieces],
                states={name: [_piece(buf, self.specs[name], p) for p in pieces] for name, buf in buffers.items()},
                steps=[steps[p.tensor] for p in pieces],
                stats=[stats[p.tensor] for p in pieces] if stats is not None else [],
                total_numels=[self.params[p.tensor].numel() for p in pieces],
                offsets=[p.tensor_offset for p in pieces],
            ))
        return calls

    def resident_calls(self, tensors: list[int], states: list[dict], grads: dict[int, Tensor],
                       steps: dict[int, Tensor], stats: Tensor | None) -> list[UpdateArgs]:
        """The fused calls for whole resident tensors (`states[i]` is ``opt.state`` of `tensors[i]`),
        as flat views in memory order, like the gradients in `grads`."""
        by_dtype: dict[torch.dtype, list[int]] = defaultdict(list)
        for i, t in enumerate(tensors):
            by_dtype[grads[t].dtype].append(i)
        return [UpdateArgs(
            tensors=[tensors[i] for i in rows],
            params=[self.flat_param(tensors[i]) for i in rows],
            grads=[grads[tensors[i]] for i in rows],
            states={name: [flat_view(local_tensor(states[i][name])) for i in rows] for name in self.names},
            steps=[steps[tensors[i]] for i in rows],
            stats=[stats[tensors[i]] for i in rows] if stats is not None else [],
            total_numels=[self.params[tensors[i]].numel() for i in rows],
            offsets=[0] * len(rows),
        ) for rows in by_dtype.values()]


class OffloadEngine:
    def __init__(self, mode: str, chunk_size: int | None, num_buffers: int, device_budget: int | None) -> None:
        self.mode = mode
        self.chunk_size = DEFAULT_CHUNK_SIZE if chunk_size is None else aligned_chunk_size(chunk_size)
        if isinstance(num_buffers, bool) or int(num_buffers) != num_buffers or num_buffers < 2:
            raise ValueError(f"num_buffers must be an integer >= 2, got {num_buffers}")
        self.num_buffers = int(num_buffers)
        self.device_budget = device_budget  # as given: None, or bytes per device
        self.budget = Budget()
        self.layouts: dict[tuple, StateLayout] = {}
        self.runtimes: dict[torch.device, Runtime] = {}
        self.pipelines: dict[torch.device, StreamPipeline] = {}
        self._device_peak = 0
        self._host_pending = False

    def runtime(self, device: torch.device) -> Runtime:
        rt = self.runtimes.get(device)
        if rt is None:
            rt = self.runtimes[device] = runtime_for(device)
        return rt

    # ---- placement ---------------------------------------------------------------------------
    def needs_decision(self, device: torch.device) -> bool:
        """True when the budget for `device` is decided from its memory at this first step."""
        return (self.mode == "auto" and self.device_budget is None and self.runtime(device).decides_budget
                and not self.budget.decided(device))

    def decide(self, device: torch.device, budget: int | None) -> None:
        self.budget.set(device, budget)

    def plan_chunk_size(self, specs: tuple[StateSpec, ...]) -> tuple[int, int]:
        """The chunk size and alignment of a plan for `specs`: a block-wise state's blocks stay whole
        in every chunk (the chunk size rounded up to a multiple of the largest block)."""
        align = max([ALIGN_ELEMENTS, *(s.block for s in specs)])
        return round_up(self.chunk_size, align), align

    def buffer_bytes_for(self, states) -> int:
        """The streaming buffers a bucket with `states` (names or specs) needs."""
        specs = state_specs(states)
        return self.num_buffers * buffer_regions(specs, self.plan_chunk_size(specs)[0])[1]

    def layout(self, key: tuple, params: list[Tensor], states, initial: Initial) -> StateLayout:
        """The layout of bucket `key` (its members `params`, states `states`: names or specs),
        placed on first use."""
        layout = self.layouts.get(key)
        if layout is not None:
            return layout
        specs = state_specs(states)
        device = params[0].device
        if not self.budget.decided(device):
            self.budget.set(device, self._initial_budget(device))
        sizes = [sum(s.nbytes(local_tensor(p).numel()) for s in specs) for p in params]
        resident = self.budget.place(device, sizes)
        numels = [0 if r else local_tensor(p).numel() for p, r in zip(params, resident)]
        chunk_size, align = self.plan_chunk_size(specs)
        plan = ChunkPlan(numels, chunk_size, round_up(max(chunk_size, DEFAULT_SEGMENT_BYTES // 4), align), align)
        store = pipeline = None
        rt = self.runtime(device)
        if not all(resident):
            pipeline = self.pipelines.get(device)
            if pipeline is None:
                pipeline = self.pipelines[device] = StreamPipeline(rt, self.chunk_size, self.num_buffers)
            store = HostStateStore(plan, specs, pin=rt.pin if rt.asynchronous else None, unpin=rt.unpin)
        layout = StateLayout(params, {s.name: s for s in specs}, resident, plan, store, pipeline, initial,
                             {id(p): i for i, p in enumerate(params)}, [bool(shard_groups(p)) for p in params],
                             rt, self.wait_host, {s.name: [None] * len(params) for s in specs})
        self.layouts[key] = layout
        self._device_peak = max(self._device_peak, self.device_bytes)
        return layout

    def _initial_budget(self, device: torch.device) -> int | None:
        """The budget where none was decided at the first step (auto on CUDA without one is)."""
        if self.mode == "none" or (self.mode == "auto" and not self.runtime(device).decides_budget):
            return None  # auto never streams CPU parameters' states: they are in host memory already
        return self.device_budget if self.device_budget is not None else 0

    # ---- the step ------------------------------------------------------------------------------
    @staticmethod
    def check_capturable(layout: StateLayout, grads: dict[int, Tensor]) -> None:
        """Raises if this step would stream states while a CUDA graph is being captured."""
        if layout.store is not None and any(not layout.resident[t] for t in grads) and layout.runtime.capturing():
            raise RuntimeError("fusedoff: a step that streams states cannot be captured in a CUDA graph (its copies "
                               "and host synchronisation are outside the graph); capture with every state resident "
                               "(offload='none', or a device_budget that holds them all)")

    def step(self, layout: StateLayout, update: FusedUpdate, states: dict[int, dict], grads: dict[int, Tensor],
             steps: dict[int, Tensor]) -> None:
        """One step of `update` over the tensors of `layout` that have a gradient in `grads`
        (position -> gradient); `states` maps them to their ``opt.state`` dicts, adopted already."""
        layout._flat_params.clear()  # the parameters may have been replaced since the last step
        rt = layout.runtime
        stats = None
        if update.stats_columns:
            stats = torch.zeros(len(layout.params), update.stats_columns, dtype=torch.float64, device=layout.device)
        stepping = sorted(grads)
        resident = [t for t in stepping if layout.resident[t]]
        chunks = []
        if layout.store is not None:
            chunks = [c for c in layout.plan.chunks if any(p.tensor in grads for p in c.pieces)]
        # Produced on the main stream before this step: the gradients (backward) and the step counts.
        rt.main_access([*grads.values(), *steps.values(), *(() if stats is None else (stats,))], write=True,
                       what="gradients, steps and stats made on the main stream")
        whole_pass, spanning = chunks, []
        if len(update.phases) > 1:
            whole_pass = [c for c in chunks if layout.plan.whole_tensors_only(c)
                          and not any(layout.sharded[p.tensor] for p in c.pieces)]
            spanning = [c for c in chunks if c not in whole_pass]
        inputs = [*(layout.flat_param(t) for t in stepping if not layout.resident[t]), *grads.values(),
                  *steps.values(), *(() if stats is None else (stats,))]
        if whole_pass:
            self._stream(layout, update, update.phases, whole_pass, grads, steps, stats, inputs)
        resident_calls = layout.resident_calls(resident, [states[t] for t in resident], grads, steps, stats)
        for phase in update.phases:
            if spanning:
                self._stream(layout, update, (phase,), spanning, grads, steps, stats, inputs)
            for args in resident_calls:  # on the current stream, beside the pipeline's work
                update.call(phase, args)
            if chunks:
                layout.pipeline.join()
            if update.after_phase is not None:
                update.after_phase(phase, stats, layout.params)
        if chunks:
            self._host_pending = True

    def _stream(self, layout: StateLayout, update: FusedUpdate, phases: tuple[Phase, ...], chunks: list[Chunk],
                grads, steps, stats, inputs) -> None:
        if len(phases) == len(update.phases):
            read, write = update.reads, update.writes
        else:
            (phase,) = phases
            read, write = phase.reads, phase.writes

        def compute(chunk: Chunk, buffers: dict[str, Tensor]) -> None:
            for phase in phases:
                for args in layout.chunk_calls(chunk, buffers, grads, steps, stats):
                    update.call(phase, args)

        layout.pipeline.run(layout.plan, layout.store, read=read, write=write, compute=compute, touches=inputs,
                            chunks=chunks)

    def wait_host(self) -> None:
        """Blocks until every copy back to host memory has finished (before host state is read)."""
        if not self._host_pending:
            return
        for pipeline in self.pipelines.values():
            pipeline.wait_host()
        self._host_pending = False
        for layout in self.layouts.values():  # what the host may now read (recorded by the simulator)
            if layout.store is not None:
                layout.runtime.host_access([s for slabs in layout.store.slabs.values() for s in slabs], write=False,
                                           what="host state read after wait_host")

    # ---- memory ----------------------------------------------------------------------------------
    @property
    def buffer_bytes(self) -> int:
        return sum(p.buffer_bytes for p in self.pipelines.values())

    @property
    def device_bytes(self) -> int:
        return self.buffer_bytes + self.resident_bytes

    @property
    def resident_bytes(self) -> int:
        total = 0
        for layout in self.layouts.values():
            for name in layout.names:
                for t, obj in enumerate(layout.placed[name]):
                    if obj is not None and layout.resident[t]:
                        local = local_tensor(obj)
                        total += local.numel() * local.element_size()
        return total

    def memory_stats(self) -> dict:
        self._device_peak = max(self._device_peak, self.device_bytes)
        stores = [layout.store for layout in self.layouts.values() if layout.store is not None]
        limits = list(self.budget.limits.values())
        return {
            "host_bytes": sum(s.nbytes for s in stores),
            "host_pinned": bool(stores) and all(s.pinned for s in stores),
            "resident_bytes": self.resident_bytes,
            "streamed_bytes": sum(s.nbytes for s in stores),
            "device_bytes": self.device_bytes,
            "device_peak_bytes": self._device_peak,
            "chunk_size": self.chunk_size,
            "num_buffers": self.num_buffers,
            # The budget in force: None before it is decided, and where there is no limit
            # (offload="none", CPU parameters under "auto"); a dict by device for several devices.
            "device_budget": limits[0] if len(limits) == 1 else {str(d): b for d, b in self.budget.limits.items()} or None,
        }


def _slice(flat: Tensor, offset: int, length: int) -> Tensor:
    return flat[offset : offset + length]


def _piece(buffer: Tensor, spec: StateSpec, piece) -> Tensor:
    """A piece's part of a state's chunk buffer (its blocks, for a block-wise state: a piece starts
    on a block, the plan being aligned to it)."""
    return _slice(buffer, piece.chunk_offset // spec.block, spec.numel(piece.length))


__all__ = ["ALIGN_ELEMENTS", "DEFAULT_CHUNK_SIZE", "OffloadEngine", "StateLayout"]
