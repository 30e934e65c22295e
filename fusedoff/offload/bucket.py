"""Bucket: the parameters of one param group that share a device, dtype and states, and where their
states live.

A bucket is formed when its group first steps and placed then (placement.py): each tensor's states
are resident device tensors or views of a HostStateStore laid out by a ChunkPlan, moved through
the device's StreamPipeline, or (host-computed) views of its `HostShare`'s store, stepped by the
host kernels where they are (host_share.py). Either way they are the entries of ``opt.state[p]``
(device tensors, or views of a host store, never copies), so torch's machinery sees one source of
truth.

The bucket follows what ``opt.state`` holds (`adopt`): a missing state starts afresh, an assigned
tensor is taken by value into its place, an in-place edit is the state itself. The kernels follow
what the parameters hold (see [note: master weights follow the parameters]).

[note: host cost per tensor] A step's Python work per tensor is what decides the step time of a
model with many small tensors. What a step needs and that only changes with the tensors
themselves (flat views of parameters and states, the fused calls' lists, the chunk pieces' views
of the streaming buffers, the dense-layout check of a parameter) is made once and kept while
nothing it depends on changed: the set of tensors stepping (the last set only), the parameters'
storage (checked by data pointer every step, one attribute read), the state objects (checked by
identity every step in `adopt_states`) and the pipeline's buffer sets (the chunk pieces' views are
dropped when they are replaced). Gradients, new tensors at every backward, are the only per-step views.

[note: master weights follow the parameters] torch's optimizers step from what a parameter holds.
A master weight (a `follows_param` state) is a more precise copy of its parameter, and the step
writes the parameter as the master's rounding; anything else that writes the parameter between
two steps (``copy_``, ``load_state_dict``, ``torch.nn.init``, an EMA swap, ``p.data = ...``,
``p.data.copy_(w)``) makes the master stale. The kernels see every such write, element by element:
an fp32 master is read with its parameter, and the update starts from the parameter wherever it is
not one of the master's nearest roundings (either one at a tie: torch's cast of a loaded master
is not a write), from the master elsewhere, which keeps it bit for bit (see [note: every write is
seen] in csrc/include/fusedoff/master.h). The bucket has nothing to watch: no version counter
(which ``.data`` bypasses) and no host read of a parameter. A master loaded or assigned through
``opt.state`` is held to the same rule at the next step; a fresh one is a copy of its parameter. A
split master (its low bits only, see [note: split master weights] there) cannot be checked: the
parameter is its upper half, so a written parameter carries the master with it, low bits kept; the
master is the written value plus less than half a bf16 unit in the last place, and the same bits
written back (a checkpoint, an EMA swap) keep it exact.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from fusedoff.offload.contract import StateSpec, UpdateArgs
from fusedoff.offload.host_share import HostShare
from fusedoff.offload.pipeline import StreamPipeline
from fusedoff.offload.plan import Chunk, ChunkPlan, Piece
from fusedoff.offload.runtime import Runtime
from fusedoff.offload.store import HostStateStore
from fusedoff.sharding import blocks_touched, global_offset, like_param, local_tensor, shard_groups
from fusedoff.tensor_layout import check_dense, flat_view


@dataclass
class Bucket:
    """The states of one bucket's tensors, resident on the device or streamed, and the caches of
    its step (see [note: host cost per tensor])."""

    params: list[Tensor]
    specs: dict[str, StateSpec]
    backend: str
    resident: list[bool]
    plan: ChunkPlan
    store: HostStateStore | None
    pipeline: StreamPipeline | None
    runtime: Runtime
    before_host_write: Callable[[], None]  # waits for queued copies back into the store
    # The tensors the host steps in host memory (see fusedoff/offload/host_share.py; None: none),
    # their part, and the host share they were placed for (and whether it is the automatic one).
    hosted: list[bool] | None = None
    host: HostShare | None = None
    host_share: float = 0.0
    auto_share: bool = False
    sharded: list[bool] = field(init=False)
    # The object last placed in opt.state[p][name] for each tensor (None: none yet).
    placed: dict[str, list[Tensor | None]] = field(init=False)
    # Per tensor: the parameter's (data pointer, shape, strides) its flat view and states were made for.
    _layouts: list[tuple | None] = field(init=False)
    _flat_params: list[Tensor | None] = field(init=False)
    _flat_states: dict[str, list[Tensor | None]] = field(init=False)
    _resident_calls: dict[tuple, list[tuple[list[int], UpdateArgs]]] = field(init=False)
    _piece_views: dict[tuple, list[_PieceViews]] = field(init=False)

    def __post_init__(self) -> None:
        n = len(self.params)
        if self.hosted is None:
            self.hosted = [False] * n
        # The step counts (torch's ``state["step"]``, fp32 on the parameters' device) of every tensor
        # of the bucket in one vector, each ``opt.state[p]["step"]`` a 0-d view of its element: one
        # add counts a step for all (a list of 0-d tensors costs a kernel launch, or a loop, per tensor).
        self.step_counts = torch.zeros(n, dtype=torch.float32, device=self.params[0].device)
        self._step_views: list[Tensor | None] = [None] * n
        self._step_indices: dict[tuple, Tensor] = {}
        self.sharded = [bool(shard_groups(p)) for p in self.params]
        # Each tensor's first element among its whole tensor's (a shard's place in the parameter):
        # the fused calls' offsets, so that blocks and random indices are the whole tensor's.
        self.origins = [global_offset(p) or 0 for p in self.params]
        self.placed = {name: [None] * n for name in self.specs}
        self._layouts = [None] * n
        self._flat_params = [None] * n
        self._flat_states = {name: [None] * n for name in self.specs}
        self._resident_calls, self._piece_views = {}, {}
        self._piece_generation = -1
        # The event of each chunk's last computation (chunk index -> event), and each streamed
        # tensor's chunks: what a forward that reads the tensor waits for when steps overlap it.
        self.chunk_done: dict[int, object] = {}
        self._tensor_chunks: list[list[int]] | None = None
        # The states with one value per block of elements, and that block (see `_heads_apart`).
        self._block_wise = {name for name, spec in self.specs.items() if spec.block != 1}
        blocks = {spec.block for spec in self.specs.values() if spec.block != 1}
        if len(blocks) > 1:
            raise ValueError(f"the block-wise states of one bucket share one block size, got {sorted(blocks)}")
        self._block = next(iter(blocks), 1)

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.specs)

    def chunks_of_tensor(self, t: int) -> list[int]:
        """The indices of the chunks holding pieces of tensor `t` (none for a resident tensor)."""
        if self._tensor_chunks is None:
            self._tensor_chunks = [[] for _ in self.params]
            for chunk in self.plan.chunks:
                for piece in chunk.pieces:
                    self._tensor_chunks[piece.tensor].append(chunk.index)
        return self._tensor_chunks[t]

    def host_stores(self) -> dict[str, HostStateStore]:
        """Its host memory by what it holds: the streamed states, and its host share's (HostShare.stores)."""
        stores = {} if self.store is None else {"streamed states": self.store}
        if self.host is not None:
            stores.update({f"the host share's {name}": store for name, store in self.host.stores().items()})
        return stores

    def release(self) -> None:
        """The bucket is dropped (placed afresh, or its group changed): its host memory goes back to
        the host, which may write it from then on (a new placement's buffers, any allocation).
        Recorded as the host's write of every buffer, so that the race checker reports a copy still
        queued on one that the host did not wait for (the caller waited: `wait_host`)."""
        rt = self.runtime
        if rt.records_accesses:
            for name, store in self.host_stores().items():
                rt.host_access(store.all_slabs(), write=True, what=f"{name} released with the bucket")

    def _forget_views(self, t: int | None = None) -> None:
        self._resident_calls.clear()
        self._piece_views.clear()
        if t is not None:
            self._flat_params[t] = None
            for views in self._flat_states.values():
                views[t] = None

    # ---- the parameters --------------------------------------------------------------------------
    def check_layouts(self, stepping: list[int]) -> None:
        """Raises if a stepping parameter is not dense or no longer has the layout its states were
        placed for; forgets the views of those whose storage moved (``p.data = ...``)."""
        layouts, params = self._layouts, self.params
        for t in stepping:
            local = local_tensor(params[t])
            ptr = local.data_ptr()
            known = layouts[t]
            if known is not None and known[0] == ptr:
                continue
            check_dense(local)
            shape, strides = tuple(local.shape), local.stride()
            if known is not None and (known[1], known[2]) != (shape, strides):
                raise ValueError(f"parameter {t} of this bucket was replaced by one of shape {shape} and strides "
                                 f"{strides}, but its states were laid out for shape {known[1]} and strides {known[2]}; "
                                 "a parameter keeps its shape and memory layout between steps (reload the optimizer "
                                 "state after changing it: load_state_dict lays states out afresh)")
            if known is not None:
                self._forget_views(t)
            layouts[t] = (ptr, shape, strides)

    def flat_param(self, t: int) -> Tensor:
        flat = self._flat_params[t]
        if flat is None:
            flat = self._flat_params[t] = flat_view(local_tensor(self.params[t].detach()))
        return flat

    def step_increment(self, stepping: list[int], found_inf: Tensor | None) -> Callable[[], None]:
        """What adds one to the step counts of `stepping`, or nothing where ``found_inf`` is non-zero
        (any non-zero flag skips, NaN too, as in the kernels: see ops.increment_steps_), without a
        host sync: made now (its allocations), applied by calling it."""
        counts = self.step_counts
        stepped = 1.0 if found_inf is None else (found_inf.reshape(()).to(counts.device) == 0).to(counts.dtype)
        if len(stepping) == len(counts):
            return functools.partial(counts.add_, stepped)
        key = tuple(stepping)
        index = self._step_indices.get(key)
        if index is None:
            self._step_indices.clear()
            index = self._step_indices[key] = torch.tensor(stepping, dtype=torch.long, device=counts.device)
        ones = torch.ones(len(stepping), dtype=counts.dtype, device=counts.device) * stepped
        return functools.partial(counts.index_add_, 0, index, ones)

    # ---- opt.state -----------------------------------------------------------------------------------
    def adopt_states(self, stepping: list[int], state: dict, created: list[Tensor]) -> list[Tensor]:
        """``opt.state[params[t]]`` of each stepping tensor (read without waiting for the host: inside
        the step) made to hold this bucket's tensors; returns their step counts. A new or reset state
        (``del opt.state[p]``) starts afresh, every state with it, as in torch. The parameters whose
        ``opt.state`` entry this made are added to `created` (a step that fails before its changes
        takes them back)."""
        params, placed = self.params, tuple(self.placed.items())
        views = self._step_views
        steps = []
        for t in stepping:
            param = params[t]
            values = dict.get(state, param)
            if values is None:
                values = {}
                dict.__setitem__(state, param, values)
                created.append(param)
            step, view = values.get("step"), views[t]
            if step is not view or view is None:
                if view is None:
                    view = views[t] = self.step_counts[t]
                if step is None:
                    values.clear()  # a new or reset state: every state starts afresh
                    view.zero_()
                else:  # a loaded or assigned count, taken by value
                    view.copy_(step.reshape(()) if isinstance(step, Tensor) else torch.tensor(float(step)))
                values["step"] = view
            steps.append(view)
            for name, objects in placed:  # nothing replaced: nothing to adopt
                value = values.get(name)
                if value is None or value is not objects[t]:
                    self.adopt(t, values)
                    break
        return steps

    def adopt(self, t: int, state: dict) -> None:
        """Makes `state` (the dict ``opt.state[params[t]]``) hold this bucket's tensors for every
        state name, keeping the values it holds: fresh where missing, by value where replaced."""
        placed = self.placed
        changed = False
        for name in placed:
            value = state.get(name)
            if value is None or value is not placed[name][t]:
                changed = True
                break
        if not changed:
            return
        param = self.params[t]
        self._forget_views(t)
        for name, spec in self.specs.items():
            value = state.get(name)
            if value is not None and value is placed[name][t]:
                continue
            if value is not None and (value.dtype != spec.dtype if spec.dtype != torch.float32
                                      else not value.is_floating_point()):
                raise ValueError(f"state {name!r} is kept as {spec.dtype}, got a {value.dtype} tensor")
            # A fresh master is the parameter; an assigned one is checked against it by the kernels.
            if self.resident[t]:
                state[name] = placed[name][t] = self._resident_state(spec, param, value)
                continue
            local_param = local_tensor(param)
            # The state has the parameter's strides: the store holds it in the parameter's memory order.
            # A block-wise state (one value per block of elements) is flat.
            shaped = (self.host.store if self.hosted[t] else self.store).view(name, t)
            if spec.block == 1:
                shaped = shaped.as_strided(local_param.shape, local_param.stride())
            # The previous step's copies back cover whole chunks, this tensor's part included (and
            # the host worker's step of a host-computed tensor).
            self.before_host_write()
            self.runtime.host_access([shaped], write=True, what=f"{name} of tensor {t} set by the host")
            if value is None:
                if spec.follows_param:
                    shaped.copy_(local_param.detach())
                else:
                    shaped.zero_()
            else:
                local = local_tensor(value)
                if local.numel() != shaped.numel():
                    raise ValueError(f"state {name!r} has {local.numel()} elements, expected {shaped.numel()}")
                shaped.copy_(local.reshape(shaped.shape))
            state[name] = placed[name][t] = like_param(shaped, param) if spec.block == 1 else shaped

    def _resident_state(self, spec: StateSpec, param: Tensor, value: Tensor | None) -> Tensor:
        local_param = local_tensor(param)
        start = None
        # A block-wise state has a value for each block its tensor touches, counted from its whole
        # tensor's first element (a shard's part of its parameter's blocks).
        expected = spec.numel(local_param.numel()) if spec.block == 1 else blocks_touched(param, spec.block)
        if value is None:
            if not spec.follows_param:  # the parameter's strides: states are walked in its memory order
                if spec.block != 1:
                    return torch.zeros(expected, dtype=spec.dtype, device=param.device)
                return torch.zeros_like(param, dtype=spec.dtype, memory_format=torch.preserve_format)
            value = start = param.detach()
        local = local_tensor(value)
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

    def _flat_state(self, name: str, t: int) -> Tensor:
        views = self._flat_states[name]
        flat = views[t]
        if flat is None:
            flat = views[t] = flat_view(local_tensor(self.placed[name][t]))
        return flat

    # ---- the fused calls ------------------------------------------------------------------------------
    def resident_calls(self, tensors: list[int], grads: list[Tensor], steps: list[Tensor],
                       stats: Tensor | None) -> list[UpdateArgs]:
        """The fused calls for whole resident tensors (`grads[i]`, `steps[i]` of `tensors[i]`, the
        gradients flat in memory order), one per gradient dtype; lists kept while nothing changed."""
        key = (tuple(tensors), _dtypes(grads))
        cached = self._resident_calls.get(key)
        if cached is None:
            self._resident_calls.clear()  # one set of tensors kept: a run whose stepping set varies keeps no more
            rows_by_dtype: dict[torch.dtype, list[int]] = defaultdict(list)
            for i, g in enumerate(grads):
                rows_by_dtype[g.dtype].append(i)
            cached = []
            for rows in rows_by_dtype.values():
                ts = [tensors[i] for i in rows]
                cached.append((rows, UpdateArgs(
                    tensors=ts, params=[self.flat_param(t) for t in ts], grads=[],
                    states={name: [self._flat_state(name, t) for t in ts] for name in self.specs},
                    steps=[], stats=[], total_numels=[self.params[t].numel() for t in ts],
                    offsets=[self.origins[t] for t in ts])))
            self._resident_calls[key] = cached
        calls = []
        stat_rows = stats.unbind(0) if stats is not None else ()
        for rows, args in cached:
            calls.append(UpdateArgs(
                tensors=args.tensors, params=args.params, grads=[grads[i] for i in rows], states=args.states,
                steps=[steps[i] for i in rows], stats=[stat_rows[t] for t in args.tensors] if stats is not None else [],
                total_numels=args.total_numels, offsets=args.offsets))
        return self._heads_apart(calls)

    def chunk_touches(self, chunk: Chunk, grads: dict[int, Tensor], steps: dict[int, Tensor],
                      stats: Tensor | None) -> list[Tensor]:
        """What `chunk`'s fused calls read or write besides its buffers: its pieces of the stepping
        parameters and gradients, their step counts and statistics rows (for the race checker)."""
        touched = []
        for p in chunk.pieces:
            if p.tensor in grads:
                touched += [_slice(self.flat_param(p.tensor), p.tensor_offset, p.length),
                            _piece_of(grads[p.tensor], p, self.plan), steps[p.tensor]]
                if stats is not None:
                    touched.append(stats[p.tensor])
        return touched

    def chunk_calls(self, chunk: Chunk, buffers: dict[str, Tensor], grads: dict[int, Tensor],
                    steps: dict[int, Tensor], stats: Tensor | None) -> list[UpdateArgs]:
        """The fused calls for `chunk`: one per gradient dtype among the pieces whose tensor steps.
        The pieces' views of the parameters and of the buffers are kept per chunk and buffer set."""
        if self._piece_generation != self.pipeline.generation:  # views of retired buffer sets: let them go
            self._piece_views.clear()
            self._piece_generation = self.pipeline.generation
        key = (chunk.index, tuple((name, buf.data_ptr()) for name, buf in buffers.items()))
        cached = self._piece_views.get(key)
        if cached is None:
            cached = self._piece_views[key] = [
                _PieceViews(p, _slice(self.flat_param(p.tensor), p.tensor_offset, p.length),
                            {name: _piece(buf, self.specs[name], p) for name, buf in buffers.items()})
                for p in chunk.pieces]
        by_dtype: dict[torch.dtype, list[_PieceViews]] = defaultdict(list)
        for views in cached:
            grad = grads.get(views.piece.tensor)
            if grad is not None:
                by_dtype[grad.dtype].append(views)
        calls = []
        stat_rows = stats.unbind(0) if stats is not None else ()
        for entries in by_dtype.values():
            pieces = [e.piece for e in entries]
            calls.append(UpdateArgs(
                tensors=[p.tensor for p in pieces],
                params=[e.param for e in entries],
                grads=[_piece_of(grads[p.tensor], p, self.plan) for p in pieces],
                states={name: [e.states[name] for e in entries] for name in buffers},
                steps=[steps[p.tensor] for p in pieces],
                stats=[stat_rows[p.tensor] for p in pieces] if stats is not None else [],
                total_numels=[self.params[p.tensor].numel() for p in pieces],
                offsets=[self.origins[p.tensor] + p.tensor_offset for p in pieces],
            ))
        return self._heads_apart(calls)

    def _heads_apart(self, calls: list[UpdateArgs]) -> list[UpdateArgs]:
        """`calls` with each range that starts inside a block of the block-wise states (a shard whose
        first element is inside one of its parameter's blocks: see [note: compressed states of
        shards]) cut in two (`_cut_at_block`)."""
        if not self._block_wise:
            return calls
        block = self._block
        return [_cut_at_block(args, block, self._block_wise) if any(o % block for o in args.offsets) else args
                for args in calls]


class _PieceViews(NamedTuple):
    """A chunk piece's views, kept per chunk and buffer set: of its parameter, and of each state's buffer."""

    piece: Piece
    param: Tensor
    states: dict[str, Tensor]


def _cut_at_block(args: UpdateArgs, block: int, block_wise: set[str]) -> UpdateArgs:
    """`args` with each range cut at its first `block` boundary: its head up to there, a block of
    its own with the first value of each block-wise state, and the rest, whose blocks are the
    parameter's. The kernels count a range's blocks from its first element, and take a block-wise
    range's offset as a block's first element: the head's is the block it is part of. `block_wise`
    names the states with one value per block; the others have one per element."""
    out = UpdateArgs(tensors=[], params=[], grads=[], states={name: [] for name in args.states}, steps=[], stats=[],
                     total_numels=[], offsets=[])
    for i, offset in enumerate(args.offsets):
        n = args.params[i].numel()
        head = min(-offset % block, n)
        block_start = offset - offset % block
        parts = [(0, n, 0, None, block_start)]  # (an empty shard's range: nothing of a block)
        if head:
            parts = [(0, head, 0, 1, block_start)]
            if head < n:
                parts.append((head, n, 1, None, offset + head))
        for begin, end, first_block, end_block, part_offset in parts:
            out.tensors.append(args.tensors[i])
            out.params.append(args.params[i][begin:end])
            out.grads.append(args.grads[i][begin:end])
            for name, values in args.states.items():
                out.states[name].append(values[i][first_block:end_block] if name in block_wise
                                        else values[i][begin:end])
            out.steps.append(args.steps[i])
            if args.stats:
                out.stats.append(args.stats[i])
            out.total_numels.append(args.total_numels[i])
            out.offsets.append(part_offset)
    return out


def _dtypes(grads: list[Tensor]) -> tuple:
    """The gradients' dtypes, as one entry when they share it."""
    if not grads:
        return ()
    first = grads[0].dtype
    if all(g.dtype == first for g in grads):
        return (first,)
    return tuple(g.dtype for g in grads)


def _slice(flat: Tensor, offset: int, length: int) -> Tensor:
    return flat[offset : offset + length]


def _piece_of(grad: Tensor, piece, plan: ChunkPlan) -> Tensor:
    """A piece's part of a flat gradient (the gradient itself for a piece covering its tensor)."""
    if piece.length == plan.numels[piece.tensor]:
        return grad
    return grad[piece.tensor_offset : piece.tensor_offset + piece.length]


def _piece(buffer: Tensor, spec: StateSpec, piece) -> Tensor:
    """A piece's part of a state's chunk buffer (for a block-wise state, the blocks it touches: a
    piece starts on a block, the plan being aligned to it, but for a shard's first piece, which
    starts at its `lead`, inside its first block)."""
    first = piece.chunk_offset // spec.block
    return buffer[first : -(-(piece.chunk_offset + piece.length) // spec.block)]
