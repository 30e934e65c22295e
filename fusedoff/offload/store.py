"""HostStateStore: one bucket's fp32 states (and master weights) in host memory, chunk-contiguous.

Each state is a sequence of slabs, one per segment of the ChunkPlan: a slab holds whole tensors
and whole chunks, so every tensor's state is a view of one slab and one chunk of one state moves
with one copy. Slabs are bounded in size (see `DEFAULT_SEGMENT_BYTES` in the engine) because
pinning one huge region fails on many systems. Pinning registers ordinary host allocations with
cudaHostRegister rather than taking them from torch's caching pinned allocator, which rounds each
request up to a power of two: the store holds the bytes it needs and no more.
"""

from __future__ import annotations

import ctypes
import functools
import warnings
import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from fusedoff.offload.plan import Chunk, ChunkPlan



# Slabs freed while a CUDA graph was being captured: unpinned at the next pinning (see _unpin).
_deferred_unpins: list[tuple[int, int]] = []


def pin_in_place(tensor: Tensor, device: torch.device) -> bool:
    """Page-locks `tensor`'s memory in place (unlocked when it is freed, after the copies queued on
    `device` have finished); False if that fails."""
    while _deferred_unpins:
        _unpin(*_deferred_unpins.pop())
    cudart = torch.cuda.cudart()
    nbytes = tensor.numel() * tensor.element_size()
    if int(cudart.cudaHostRegister(tensor.data_ptr(), nbytes, 0)) != 0:
        _clear_cuda_error()
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    finalizer = weakref.finalize(tensor, _unpin, tensor.data_ptr(), index)
    finalizer.atexit = False  # the process is ending: nothing to give back, and CUDA may be gone
    return True


def _unpin(pointer: int, device: int) -> None:
    if torch.cuda.is_current_stream_capturing():
        # A synchronisation now would invalidate the user's graph capture (a garbage collection
        # can free a store at any moment): unpin later, before the next pinning.
        _deferred_unpins.append((pointer, device))
        return
    # Copies to or from the slab may still be queued on the pipeline's streams (of this store's
    # device only: touching another device would create a CUDA context there): let them finish
    # before the memory is unlocked and handed back to the host allocator.
    torch.cuda.synchronize(device)
    if int(torch.cuda.cudart().cudaHostUnregister(pointer)) != 0:
        _clear_cuda_error()


def _clear_cuda_error() -> None:
    """Clears the CUDA runtime's last error, which a failed cudaHostRegister leaves set: the next
    launch check anywhere (ours or torch's) would report it as its own failure. torch's `cudart()`
    binding has no cudaGetLastError, so this calls the libcudart torch itself loaded."""
    cudart = _loaded_cudart()
    if cudart is None:
        warnings.warn("fusedoff: could not clear the CUDA error left by a failed cudaHostRegister; "
                      "a later CUDA call may report it", stacklevel=4)
        return
    cudart.cudaGetLastError()


@functools.cache
def _loaded_cudart() -> ctypes.CDLL | None:
    """The libcudart this process loaded for torch: the error state is per library instance, and
    another package (cupy, TensorRT) may have loaded a runtime of another CUDA major version."""
    try:
        with open("/proc/self/maps") as maps:
            paths = list(dict.fromkeys(line.split()[-1] for line in maps if "libcudart.so" in line))
    except OSError:
        return None
    major = (torch.version.cuda or "").split(".")[0]
    torch_runtime = [p for p in paths if p.endswith(f"libcudart.so.{major}") or f"libcudart.so.{major}." in p]
    paths = torch_runtime or paths
    return ctypes.CDLL(paths[0]) if paths else None


class HostStateStore:
    """The fp32 states of one bucket's streamed tensors: one slab per state and plan segment.

    `view(name, t)` is tensor `t`'s state `name`: a flat view of its slab (never a copy), which the
    optimizer hands out as ``opt.state[p][name]``; `chunk(name, chunk)` the contiguous region one
    copy moves.
    """

    def __init__(self, plan: ChunkPlan, names: tuple[str, ...], *, pin: Callable[[Tensor], bool] | None = None) -> None:
        """`pin(slab)` page-locks a slab for the device's copies (None: nothing to pin for)."""
        self.plan = plan
        self.names = names
        self.pinned = pin is not None
        self.slabs: dict[str, list[Tensor]] = {}
        for name in names:
            slabs = []
            for size in plan.segment_sizes:
                slab = torch.zeros(size, dtype=torch.float32)
                if self.pinned and size and not pin(slab):
                    warnings.warn("fusedoff: could not pin host memory for optimizer states; streaming from "
                                  "pageable memory (slower)", stacklevel=3)
                    self.pinned = False
                slabs.append(slab)
            self.slabs[name] = slabs

    @property
    def nbytes(self) -> int:
        return sum(s.numel() * 4 for slabs in self.slabs.values() for s in slabs)

    def chunk(self, name: str, chunk: Chunk) -> Tensor:
        """The host storage of `chunk` for state `name` (a contiguous 1-D view)."""
        return self.slabs[name][chunk.segment][chunk.begin : chunk.begin + chunk.numel]

    def view(self, name: str, tensor: int) -> Tensor:
        """Tensor `tensor` of state `name`, flat: a view of its slab."""
        begin = self.plan.offsets[tensor]
        return self.slabs[name][self.plan.segment_of[tensor]][begin : begin + self.plan.numels[tensor]]
