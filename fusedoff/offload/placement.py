"""Placement: which tensors' states stay on the parameters' device and which stream from host memory.

`Placement` holds one engine's buckets (bucket.py: the parameters of one param group that share a
device, dtype and states) and the budgets that placed them: it forms the buckets from the param
groups and drops them when their members or storage change, decides the automatic budgets, places
each bucket (its chunk plan, host store and the device's stream pipeline, and its host share: see
[note: the host share]), and predicts, by the same rules, what `fusedoff.memory.predict` asks: the
placement and the bytes of a step (without a host share: see the note).

[note: placement order] Within a device's byte budget, parameters are placed in the order of
`param_groups` and their `params` (buckets in the order they first step): each parameter's states
(master weights included) stay on the device if they fit in what remains of the budget, otherwise
they stream. A placement is fixed once made; only the user changes it (a new budget, or
`load_state_dict`, which re-places every state).

[note: the host share] A param group's ``host_share`` (a number in [0, 1], or "auto": the engine
resolves it, see [note: the automatic host share] in auto_share.py) moves part of each of its
buckets' streamed tensors to the host: their states stay in host memory and
the host kernels step them there (see fusedoff/offload/host_share.py). The tensors are chosen
after the budget placed the bucket, among its streamed tensors (never a resident one: the device
budget is spent first, as without a share) in placement order, each taken if it fits in what is
left of the share of all their elements (0: none, today's placement exactly; 1: all): a tensor
larger than what is left, an embedding say, stays streamed and the next ones are still taken.
Sharded tensors are skipped (they stay streamed). A share that changes between steps
places every state afresh at that step, keeping its value, as a new budget does. The predictions
(`predict_placement`, `predict_link`) do not know the share yet: they are those of share 0.

[note: automatic budget] With offload="auto" and no budget given, the budget for a CUDA device is
decided at the first step(): the device's total memory, less the peak that this process allocated
before the step (the forward and backward passes), less `AUTO_HEADROOM` of the total (allocator
rounding and fragmentation, the next iterations' temporaries). If every state fits, all are
resident and no streaming buffer is allocated; otherwise the streaming buffers come out of that
figure too and the rest of the states stream.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from fusedoff.offload.bucket import Bucket
from fusedoff.offload.contract import OptimizerRules, Phase, StateSpec, moved, state_specs
from fusedoff.offload.host_share import HostShare, host_computed
from fusedoff.offload.pipeline import StreamPipeline, buffer_regions, pass_link_bytes
from fusedoff.offload.plan import ALIGN_ELEMENTS, ChunkPlan, aligned_chunk_size, round_up
from fusedoff.offload.runtime import LinkBytes
from fusedoff.offload.runtimes import DeviceRuntimes
from fusedoff.offload.store import HostStateStore
from fusedoff.sharding import block_lead, is_dtensor, local_tensor

OFFLOAD_MODES = ("auto", "none", "stream")

# NOTE: 4M elements: with AdamW + master weights (3 fp32 states) one buffer set is 48 MiB and the
# default two sets 96 MiB, whatever the model size; large enough that each copy runs at full PCIe
# speed (copies of a few MiB already do).
DEFAULT_CHUNK_SIZE = 4 * 2**20
# Host slabs hold at most this many bytes (a larger tensor gets a slab of its own): pinning one
# huge region fails on many systems.
DEFAULT_SEGMENT_BYTES = 256 * 2**20

AUTO_HEADROOM = 0.10


def auto_budget(total: int, peak: int, needed: int, buffer_bytes: int) -> int:
    """The automatic budget (see [note: automatic budget]) for `needed` bytes of states."""
    available = int(total * (1.0 - AUTO_HEADROOM)) - peak
    if needed <= available:
        return needed
    return max(0, available - buffer_bytes)


class Budget:
    """Bytes of state left to place on each device; None: unlimited."""

    def __init__(self) -> None:
        self.limits: dict[torch.device, int | None] = {}  # the budget in force, per device
        self.left: dict[torch.device, int | None] = {}

    def decided(self, device: torch.device) -> bool:
        return device in self.limits

    def set(self, device: torch.device, budget: int | None) -> None:
        self.limits[device] = self.left[device] = budget

    def place(self, device: torch.device, sizes: list[int]) -> list[bool]:
        """Resident flags for tensors of `sizes` bytes, greedily in order (see [note: placement order])."""
        left = self.left[device]
        flags = []
        for size in sizes:
            fits = left is None or size <= left
            if fits and left is not None:
                left -= size
            flags.append(fits)
        self.left[device] = left
        return flags


def check_device_budget(mode: str, device_budget: int | None) -> None:
    """Raises if `device_budget` cannot go with offload `mode`."""
    if mode not in OFFLOAD_MODES:
        raise ValueError(f"offload must be one of {OFFLOAD_MODES}, got {mode!r}")
    if device_budget is not None:
        if mode == "none":
            raise ValueError("device_budget applies to offload='stream' or 'auto'; offload='none' keeps every "
                             "state on the device")
        if isinstance(device_budget, bool) or not isinstance(device_budget, int) or device_budget < 0:
            raise ValueError(f"device_budget must be None or a number of bytes >= 0, got {device_budget!r}")


class BucketKey(NamedTuple):
    """What the parameters of one bucket share: their param group, device, dtype and states."""

    group_index: int
    device: torch.device
    dtype: torch.dtype
    specs: tuple[StateSpec, ...]


class Members(NamedTuple):
    """A bucket's parameters, in their group's order, and whether any of them is sharded."""

    params: list[Tensor]
    sharded: bool


class _Group(NamedTuple):
    signature: tuple  # the group's parameters' identities and dtypes, and the states each dtype keeps
    buckets: dict[BucketKey, Members]


_generations = itertools.count()


def _host_candidates(params: Sequence[Tensor], resident: Sequence[bool]) -> tuple[list[int], list[bool]]:
    """A bucket's tensors' elements, and which of them a host share may take (streamed, unsharded)."""
    return [local_tensor(p).numel() for p in params], [not r and not is_dtensor(p) for p, r in zip(params, resident)]


class Placement:
    """The buckets of one engine, where their states live, and the budgets that decided it."""

    def __init__(self, mode: str, chunk_size: int | None, num_buffers: int, device_budget: int | None,
                 runtimes: DeviceRuntimes | None = None, decided: dict | None = None,
                 wait_host: Callable[[], None] = lambda: None) -> None:
        check_device_budget(mode, device_budget)
        self.mode = mode
        self.given_chunk_size = chunk_size
        self.chunk_size = DEFAULT_CHUNK_SIZE if chunk_size is None else aligned_chunk_size(chunk_size)
        if isinstance(num_buffers, bool) or int(num_buffers) != num_buffers or num_buffers < 2:
            raise ValueError(f"num_buffers must be an integer >= 2, got {num_buffers}")
        self.num_buffers = int(num_buffers)
        self.device_budget = device_budget  # as given: None, or bytes per device
        self.budget = Budget()
        for device, limit in (decided or {}).items():  # a copy keeps the original's decision
            self.budget.set(device, limit)
        self.runtimes = DeviceRuntimes() if runtimes is None else runtimes
        self.wait_host = wait_host  # blocks until the copies back into host memory are done
        self.buckets: dict[BucketKey, Bucket] = {}
        self._groups: dict[int, _Group] = {}
        self.pipelines: dict[torch.device, StreamPipeline] = {}
        # Changes whenever a bucket is placed or dropped: what is cached about the buckets' chunks
        # (the schedule's waits) is made again.
        self.generation = next(_generations)

    def _buckets_changed(self) -> None:
        self.generation = next(_generations)

    def release(self) -> None:
        """Every bucket dropped, their host memory given back (Bucket.release): the engine places
        afresh, once it waited for the copies back."""
        for bucket in self.buckets.values():
            bucket.release()
        self.buckets = {}
        self._buckets_changed()

    # ---- budgets -------------------------------------------------------------------------------------
    def needs_decision(self, device: torch.device) -> bool:
        """True when the budget for `device` is decided from its memory at this first step."""
        return (self.mode == "auto" and self.device_budget is None and self.runtimes.of(device).decides_budget
                and not self.budget.decided(device))

    def default_budget(self, decides_budget: bool) -> int | None:
        """The budget where none was decided from the device's memory at the first step (auto on a
        device that `decides_budget`, without a budget given, is): None is no limit."""
        if self.mode == "none" or (self.mode == "auto" and not decides_budget):
            return None  # auto never streams CPU parameters' states: they are in host memory already
        return self.device_budget if self.device_budget is not None else 0

    def decide_budgets(self, groups: list[dict], rules: OptimizerRules, devices) -> None:
        """The automatic budget of each device that has none yet (see [note: automatic budget])."""
        for device in devices:
            if not self.needs_decision(device):
                continue
            needed, buffers = 0, 0
            for index, group in enumerate(groups):
                for key, members in self.members(index, group, rules).items():
                    if key.device == device:
                        needed += sum(s.nbytes(local_tensor(p).numel()) for p in members.params for s in key.specs)
                        buffers = max(buffers, self.buffer_bytes_for(key.specs))
            total, peak = self.runtimes.of(device).memory_info()
            self.budget.set(device, auto_budget(total, peak, needed, buffers))

    # ---- chunks and buffers --------------------------------------------------------------------------
    def plan_chunk_size(self, specs: tuple[StateSpec, ...]) -> tuple[int, int]:
        """The chunk size and alignment of a plan for `specs`: a block-wise state's blocks stay whole
        in every chunk (the chunk size rounded up to a multiple of the largest block)."""
        align = max([ALIGN_ELEMENTS, *(s.block for s in specs)])
        return round_up(self.chunk_size, align), align

    def buffer_bytes_for(self, states) -> int:
        """The streaming buffers a bucket with `states` (names or specs) needs."""
        specs = state_specs(states)
        return self.num_buffers * buffer_regions(specs, self.plan_chunk_size(specs)[0])[1]

    def chunk_plan(self, numels: Sequence[int], specs: tuple[StateSpec, ...],
                   leads: Sequence[int] | None = None) -> ChunkPlan:
        """The host layout and chunks of a bucket with `specs` whose streamed tensors have `numels`
        elements (0: resident), shards with `leads` (see plan.py)."""
        chunk_size, align = self.plan_chunk_size(specs)
        return ChunkPlan(numels, chunk_size, round_up(max(chunk_size, DEFAULT_SEGMENT_BYTES // 4), align), align,
                         leads)

    # ---- buckets -------------------------------------------------------------------------------------
    def members(self, index: int, group: dict, rules: OptimizerRules) -> dict[BucketKey, Members]:
        """The buckets of param group `index`: every parameter of the group with the key's device,
        dtype and states, in the group's order; kept while the group's tensors and the states it
        keeps for each dtype are the same. When they change, the group's placed buckets are dropped
        (once their copies back are done): its tensors are placed afresh at their next
        step, their states taken by value from ``opt.state``."""
        params = group["params"]
        dtypes = tuple(p.dtype for p in params)
        specs_of = {dtype: rules._bucket_specs(group, dtype) for dtype in set(dtypes)}
        signature = tuple(map(id, params)), dtypes, specs_of
        known = self._groups.get(index)
        if known is not None and known.signature == signature:
            return known.buckets
        if known is not None:
            self.wait_host()
            for key in [key for key in self.buckets if key.group_index == index]:
                self.buckets.pop(key).release()
            self._buckets_changed()
        grouped: dict[BucketKey, list[Tensor]] = {}
        for p in params:
            grouped.setdefault(BucketKey(index, p.device, p.dtype, specs_of[p.dtype]), []).append(p)
        buckets = {key: Members(members, any(map(is_dtensor, members))) for key, members in grouped.items()}
        self._groups[index] = _Group(signature, buckets)
        return buckets

    def forget_groups_from(self, count: int) -> None:
        """Buckets and memberships of param groups that no longer exist (indices >= `count`)."""
        for index in [index for index in self._groups if index >= count]:
            del self._groups[index]
        dropped = [key for key in self.buckets if key.group_index >= count]
        if dropped:
            self.wait_host()  # (as for a group whose members changed: their copies back done first)
        for key in dropped:
            self.buckets.pop(key).release()
            self._buckets_changed()

    def storage_changed(self, groups: list[dict], rules: OptimizerRules) -> bool:
        """True when a group's options now store its states otherwise than its placed buckets do
        (``group["state_precision"]`` changed since the last step)."""
        for key in self.buckets:
            if key.group_index < len(groups) and rules._bucket_specs(groups[key.group_index], key.dtype) != key.specs:
                return True
        return False

    def share_changed(self, groups: list[dict], share_of: Callable[[dict, Bucket], float]) -> bool:
        """True when a group's host share (`share_of(group, bucket)`, as the engine resolves it for a
        placed bucket) would host other tensors than its placed buckets do. A share that would host
        the same ones (whole tensors: see [note: the host share]) is only recorded: nothing moves."""
        moved = False
        for key, bucket in self.buckets.items():
            if key.group_index >= len(groups):
                continue
            share = share_of(groups[key.group_index], bucket)
            if share == bucket.host_share:
                continue
            if host_computed(*_host_candidates(bucket.params, bucket.resident), share) == bucket.hosted:
                bucket.host_share = share
            else:
                moved = True
        return moved

    def place(self, key: BucketKey, params: list[Tensor], backend: str, host_share: float = 0.0, *,
              auto_share: bool = False) -> Bucket:
        """The bucket of `key` placed: each tensor's states resident while they fit in the device's
        budget (decided now where it is not yet), the rest in a host store streamed through the
        device's pipeline, or `host_share` of them host-computed (see [note: the host share])."""
        device, specs = key.device, key.specs
        rt = self.runtimes.of(device)
        if not self.budget.decided(device):
            self.budget.set(device, self.default_budget(rt.decides_budget))
        sizes = [sum(s.nbytes(local_tensor(p).numel()) for s in specs) for p in params]
        resident = self.budget.place(device, sizes)
        # A shard's block-wise states count blocks from its parameter's first element: its chunks are
        # cut on those blocks' boundaries (see `lead` in plan.py).
        block = max((s.block for s in specs), default=1)
        numels = [local_tensor(p).numel() for p in params]
        hosted = host_computed(*_host_candidates(params, resident), host_share)
        plan = self.chunk_plan([0 if r or h else n for n, r, h in zip(numels, resident, hosted)], specs,
                               [block_lead(p, block) for p in params])
        store = pipeline = host = None
        if not all(resident):
            pipeline = self.pipelines.get(device)
            if pipeline is None:
                pipeline = self.pipelines[device] = StreamPipeline(rt, self.chunk_size, self.num_buffers)
        if not all(r or h for r, h in zip(resident, hosted)):
            store = HostStateStore(plan, specs, pin=rt.pin if rt.asynchronous else None, unpin=rt.unpin)
        if any(hosted):
            host = HostShare(self.chunk_plan([n if h else 0 for n, h in zip(numels, hosted)], specs), specs,
                             key.dtype, len(params), rt)
        bucket = self.buckets[key] = Bucket(params, {s.name: s for s in specs}, backend, resident, plan, store,
                                            pipeline, rt, self.wait_host, hosted, host, host_share, auto_share)
        self._buckets_changed()  # a parameter set's chunks may lie in this bucket
        return bucket

    # ---- bytes on the device ---------------------------------------------------------------------------
    @property
    def buffer_bytes(self) -> int:
        return sum(p.buffer_bytes for p in self.pipelines.values())

    @property
    def resident_bytes(self) -> int:
        total = 0
        for bucket in self.buckets.values():
            for name in bucket.names:
                for t, obj in enumerate(bucket.placed[name]):
                    if obj is not None and bucket.resident[t]:
                        local = local_tensor(obj)
                        total += local.numel() * local.element_size()
        return total

    @property
    def device_bytes(self) -> int:
        return self.buffer_bytes + self.resident_bytes

    def memory_stats(self, link: DeviceRuntimes, device_peak: int) -> dict:
        """``memory_stats()``: where the bytes are, with the bytes `link` counted over the link and
        the most the engine has held on the device (`device_peak`)."""
        stores = [bucket.store for bucket in self.buckets.values() if bucket.store is not None]
        hosts = [bucket.host for bucket in self.buckets.values() if bucket.host is not None]
        limits = list(self.budget.limits.values())
        streamed_bytes = sum(s.nbytes for s in stores)
        host_computed_bytes = sum(h.store.nbytes for h in hosts)
        streamed = sum(sum(s.plan.numels) for s in stores)
        last, streamed_last = link.last_step, link.streamed_last_step
        return {
            "host_bytes": streamed_bytes + host_computed_bytes,
            "host_pinned": bool(stores or hosts) and all(s.pinned for s in stores) and all(h.pinned for h in hosts),
            "resident_bytes": self.resident_bytes,
            "streamed_bytes": streamed_bytes,
            # The parameter elements whose states stream, and the host bytes (the store's alignment
            # padding included) per such element.
            "streamed_params": streamed,
            "host_bytes_per_param": streamed_bytes / streamed if streamed else None,
            # The host's share (see [note: the host share]): the parameter elements the host steps,
            # their states' host bytes, and the page-locked buffers of their parameters, gradients
            # (one per gradient dtype seen) and step counts.
            "host_computed_params": sum(h.numel for h in hosts),
            "host_computed_bytes": host_computed_bytes,
            "host_share_buffer_bytes": sum(h.buffer_bytes for h in hosts),
            # What the copies of the last step() moved, each way, counted as they were issued (none
            # where every state is resident); per element of the parameters streamed or
            # host-computed in that step (the elements whose bytes crossed the link).
            "link_bytes_last_step": last.as_dict(),
            "streamed_params_last_step": streamed_last,
            "link_bytes_per_param_last_step": {way: nbytes / streamed_last for way, nbytes in
                                               last.as_dict().items()} if streamed_last else None,
            "link_bytes_total": link.total.as_dict(),
            "device_bytes": self.device_bytes,
            "device_peak_bytes": device_peak,
            "chunk_size": self.chunk_size,
            "num_buffers": self.num_buffers,
            # The budget in force: None before it is decided, and where there is no limit
            # (offload="none", CPU parameters under "auto"); a dict by device for several devices.
            "device_budget": limits[0] if len(limits) == 1 else {str(d): b for d, b in self.budget.limits.items()} or None,
        }

    # ---- predictions (fusedoff.memory.predict) ---------------------------------------------------------
    def predict_placement(self, buckets: Sequence[tuple[tuple[StateSpec, ...], Sequence[int]]],
                          budget: int | None) -> tuple[list[list[bool]], int]:
        """Where the states of `buckets` ((specs, element counts), in the order they step) would
        live under `budget` bytes (None: no limit): each bucket's resident flags, and the bytes of
        the streaming buffers. The placement rule and the buffers' rule are the ones `place` uses."""
        plan = Budget()
        plan.set(None, budget)
        flags, buffers = [], 0
        for specs, numels in buckets:
            resident = plan.place(None, [sum(s.nbytes(n) for s in specs) for n in numels])
            flags.append(resident)
            if any(n and not r for n, r in zip(numels, resident)):  # the device's buffer sets are shared
                buffers = max(buffers, self.buffer_bytes_for(specs))
        return flags, buffers

    def predict_link(self, specs: tuple[StateSpec, ...], phases: tuple[Phase, ...], numels: Sequence[int]) -> LinkBytes:
        """The bytes one step copies each way for a bucket with `specs` whose every tensor steps, the
        streamed ones having `numels` elements (0: resident), by the rules the engine's step follows:
        chunks of whole tensors run every phase in one pass, the others one pass per phase
        (unsharded tensors). A prediction, for `fusedoff.memory.predict`; a step counts its copies."""
        plan = self.chunk_plan(numels, specs)
        chunks = [c for c in plan.chunks if c.pieces]
        whole, spanning = chunks, []
        if len(phases) > 1:
            whole = [c for c in chunks if plan.whole_tensors_only(c)]
            spanning = [c for c in chunks if not plan.whole_tensors_only(c)]
        by_name = {s.name: s for s in specs}
        link = pass_link_bytes(by_name, whole, *moved(phases))
        for phase in phases if spanning else ():
            link = link + pass_link_bytes(by_name, spanning, phase.reads, phase.writes)
        return link
