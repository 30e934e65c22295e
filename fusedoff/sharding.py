"""Sharded parameters (FSDP2's DTensors): each rank updates and stores only its local shard.

The fused ops and the offload engine see plain tensors: a DTensor parameter, its gradient and its
states are reduced to their local shards here. Elementwise optimizers need nothing else; an
optimizer whose step reads whole-tensor sums (Apollo) all-reduces its per-tensor partial sums over
the process groups that split the tensor, see `all_reduce_over_shards_`.

[note: compressed states of shards]
Compressed states (see [note: compressed states] in csrc/include/fusedoff/state_codec.h) of a
shard are its parameter's: the fused calls get each range's offset among the whole parameter's
elements (`global_offset`), so bf16's random bits are keyed by the parameter's element index, and
8-bit blocks are counted from the parameter's first element: a shard keeps one scale per block of
the parameter it has elements in (`blocks_touched`), that block's part in the shard. When every
shard starts on a block boundary (and for bf16 always) a sharded step is the one-process step bit
for bit. A shard whose elements are no run of the parameter's (``Shard(1)``, tensor parallelism's
strided shards: `global_offset` None) has blocks and random indices of its own, counted from its
own first element in its own memory order, and its rank's coordinate in the random stream's key
(`shard_key`): every element within the one-process bound, as for a straddled block, and no longer
bit for bit. A block that straddles two shards is kept as two blocks, each rank's part with its own
scale (the largest magnitude of that part, never more than the whole block's): every element's
error stays within the map's one-process worst case of [note: compressed states] (half a step of
its coarsest binade, 2^-3 of the value, or the smallest step under its whole block's scale). Not
always within the tighter bound at the element's own place in the map: the tapered map's steps
double at each binade, and a smaller scale can lift an element into a binade of as many bits with
twice the step. No collective
runs: a rank's part decides its own scale. Streamed, the shard's first element is placed at its
offset modulo the block (its `lead` in the chunk plan), so chunks are cut on the parameter's
block boundaries; the head block is a fused range of its own (`Bucket._heads_apart` in offload/bucket.py).

[note: checkpoints of compressed shards]
torch.distributed.checkpoint reshards a DTensor by its elements, but a rank's 8-bit scales
describe its own parts of the parameter's blocks: they are no DTensor, and saved as a plain tensor
one rank's would stand for all. So ``state_dict()`` holds the 8-bit moments of a sharded parameter
decoded to fp32 (DTensors like the parameter, in host memory where the states are), as a state
dict made for DCP holds every optimizer's (see [note: distributed checkpoints across forms] in
fusedoff/optim/checkpoint.py), and loading quantizes them in the loading shards' blocks. Decoding
is exact and quantizing a decoded block gives back its codes and scale, so a checkpoint loaded
where the blocks are the same (the same sharding, or shards on block boundaries in both) continues
bit for bit; a block that was two parts and is now whole (or the reverse) is quantized once more,
within the 8-bit bound. The checkpoint costs fp32 bytes for 8-bit moments: the price of resharding
them without a collective. An empty tensor beside them (optim/checkpoint.py's DECODED_MARK) and their
group's ``saved_state_precision`` "fp32" say they are decoded.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import torch.distributed as dist
from torch import Tensor

DTensor = None
if dist.is_available():  # a torch built without distributed support has no DTensor: nothing is sharded
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except (ImportError, AttributeError):
        DTensor = None


def is_dtensor(t: Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local_tensor(t: Tensor) -> Tensor:
    """The rank's own part of `t` (`t` itself for a plain tensor); writing to it writes to `t`."""
    return t.to_local() if is_dtensor(t) else t


def shard_groups(t: Tensor) -> tuple:
    """The process groups whose ranks hold different parts of `t` (empty: every rank holds all of it)."""
    if not is_dtensor(t):
        return ()
    mesh = t.device_mesh
    return tuple(mesh.get_group(dim) for dim, placement in enumerate(t.placements) if placement.is_shard())


def global_offset(t: Tensor) -> int | None:
    """The index of the local shard's first element among all of `t`'s elements in memory order (0
    for a plain tensor), when the shard holds a contiguous run of them: `t` contiguous, sharded
    along its first dimension only (``Shard(0)``, as ``fully_shard`` shards, on one mesh dimension
    or several) and replicated otherwise. None for any other sharding (``Shard(1)``, strided
    shards, a non-contiguous layout), whose shard is not one run of the tensor's elements.
    """
    if not is_dtensor(t):
        return 0
    if not all(type(p) is Replicate or (type(p) is Shard and p.dim == 0) for p in t.placements):
        return None
    shape = tuple(t.shape)
    if t.stride() != tuple(math.prod(shape[d + 1:]) for d in range(len(shape))):
        return None
    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return offset[0] * math.prod(shape[1:]) if shape else 0


def shard_key(t: Tensor) -> int:
    """What tells apart the random streams of the shards of `t` whose elements are no run of the
    parameter's (`global_offset` None: their random indices are their own, from 0): a hash of the
    rank's coordinate on `t`'s mesh; 0 where the indices are the parameter's (a plain tensor, a run)."""
    if global_offset(t) is not None:
        return 0
    key = 0
    for coordinate in t.device_mesh.get_coordinate() or ():
        key = (key * 0x9E3779B1 + int(coordinate) + 1) & 0xFFFFFFFF
    return key


def block_lead(t: Tensor, block: int) -> int:
    """How far into a block of `block` elements, counted from the whole tensor's first element,
    `t`'s local shard starts (0 for a plain tensor, an empty shard, or a shard that is no run of
    elements, which counts its blocks from its own first: see `global_offset`)."""
    return (global_offset(t) or 0) % block if local_tensor(t).numel() else 0


def blocks_touched(t: Tensor, block: int) -> int:
    """How many blocks of `block` elements, counted from the whole tensor's first element (in its
    memory order), `t`'s local shard has elements in: its part of each."""
    return -(-(block_lead(t, block) + local_tensor(t).numel()) // block)


def like_param(local: Tensor, param: Tensor) -> Tensor:
    """`local` (a state of `param`'s local shard, anywhere, e.g. in host memory; flat, or shaped
    already) as a tensor shaped like `param`: a DTensor with `param`'s mesh and placements for a
    DTensor parameter.

    Built directly from the spec, not with DTensor.from_local, which would move a host-resident
    state to the mesh's device (a streamed optimizer's checkpoint must not touch the GPU).
    """
    if not is_dtensor(param):
        return local if local.shape == param.shape else local.view(param.shape)
    shape = param.to_local().shape
    local = local if local.shape == shape else local.view(shape)
    spec = DTensorSpec(param.device_mesh, param.placements,
                       tensor_meta=TensorMeta(param.shape, param.stride(), local.dtype))
    return DTensor(local, spec, requires_grad=False)


def state_for_param(value: Tensor, param: Tensor, key: str) -> Tensor:
    """A loaded state reduced to the part `param` holds on this rank, checked against it."""
    if is_dtensor(param):
        if not is_dtensor(value):
            raise ValueError(f"state {key!r} of a sharded (DTensor) parameter must be a DTensor; load sharded "
                             "checkpoints with torch.distributed.checkpoint's set_optimizer_state_dict")
        if value.placements != param.placements or value.device_mesh != param.device_mesh:
            raise ValueError(f"state {key!r} is sharded as {value.placements} but its parameter as {param.placements}")
        return value.to_local()
    if is_dtensor(value):
        raise ValueError(f"state {key!r} is sharded ({value.placements}) but its parameter is not; gather it first "
                         "(get_optimizer_state_dict with StateDictOptions(full_state_dict=True))")
    return value


def all_reduce_over_shards_(values: Tensor, params: Sequence[Tensor], op: str) -> None:
    """Reduces row t of `values` (this rank's partial results for tensor `params[t]`, a 2-D tensor
    or a column slice of one) over the ranks that hold the other shards of `params[t]`, in place.
    Rows of unsharded tensors are left alone.

    Rows are reduced in runs of neighbours sharing process groups (one collective per run: one in
    an FSDP bucket), through slices: no index tensor is built, so nothing waits for the host.
    Every rank must call this with the same parameters in the same order, as in an FSDP step.
    `op` is "sum" or "max".
    """
    runs: list[tuple[tuple, int, int]] = []  # (groups, first row, end row)
    for t, param in enumerate(params):
        groups = shard_groups(param)
        if not groups:
            continue
        if runs and runs[-1][0] == groups and runs[-1][2] == t:
            runs[-1] = (groups, runs[-1][1], t + 1)
        else:
            runs.append((groups, t, t + 1))
    for groups, first, end in runs:
        rows = values[first:end]
        part = rows.contiguous()  # collectives need dense tensors; a column slice is copied
        for group in groups:
            dist.all_reduce(part, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op], group=group)
        if part.data_ptr() != rows.data_ptr():
            rows.copy_(part)


def zero_redundancy_owner():
    """The ``torch.distributed.optim.ZeroRedundancyOptimizer`` building the optimizer whose
    constructor calls this (found on the call stack: ZeRO-1 builds each rank's local optimizer over
    that rank's tensors only, in ``_init_local_optimizer``), or None.

    Its ``param_groups`` hold every rank's tensors in the order of its consolidated state dict: an
    optimizer keying anything by a tensor's index in the state dict (the bf16 random stream) keys
    it by that order, so that ZeRO's ranks compute what one optimizer over every tensor does.
    """
    try:
        from torch.distributed.optim import ZeroRedundancyOptimizer
    except ImportError:  # a torch without distributed support: no ZeRO
        return None
    frame = sys._getframe(1)
    while frame is not None:  # up the chain of constructors to the frame that called the first
        owner = frame.f_locals.get("self")
        if isinstance(owner, ZeroRedundancyOptimizer):
            return owner
        if frame.f_code.co_name != "__init__":
            return None
        frame = frame.f_back
    return None
