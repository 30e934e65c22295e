"""CudaRuntime: the runtime seam (runtime.py) on torch's CUDA streams and events.

Also page-locking host memory in place for the host store: cudaHostRegister on ordinary host
allocations (unregistered when they are freed, after the copies queued on their device).

The GPU suite runs this file; CPU CI runs the same engine through the host loopback and the
simulator (fusedoff/testing/simulator.py) instead.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import warnings

import torch
from torch import Tensor

from fusedoff.offload.runtime import Runtime


class CudaRuntime(Runtime):
    decides_budget = True
    asynchronous = True
    measures_time = True

    def new_stream(self):
        return torch.cuda.Stream(self.device)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def record(self, stream):
        return stream.record_event()

    def timer(self, stream):
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def seconds(self, start, end) -> float | None:
        if start is None or end is None or not (start.query() and end.query()):
            return None
        return start.elapsed_time(end) / 1e3

    def wait_event(self, stream, event) -> None:
        if event is not None:
            stream.wait_event(event)

    def wait_stream(self, waiter, waited) -> None:
        waiter.wait_stream(waited)

    def synchronize(self, event) -> None:
        if event is not None:
            event.synchronize()

    def copy(self, stream, dst: Tensor, src: Tensor) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def launch(self, stream, fn, *, reads=(), writes=()) -> None:
        with torch.cuda.stream(stream):
            fn()

    def host_compute(self, fn, *, after, reads=(), writes=()):
        # One thread, tasks in order: the host kernels release the GIL (and use OpenMP inside), so
        # the Python thread goes on queueing while a task runs; the event wait releases it too.
        worker = self.__dict__.get("_worker")
        if worker is None:
            # (its current device is this one: an event synchronize on a thread whose current device
            # is the default would create a CUDA context on GPU 0 in every rank)
            worker = self._worker = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="fusedoff-host", initializer=_start_worker, initargs=(self.device, self.host_threads))

        def task() -> None:
            if after is not None:
                after.synchronize()
            fn()

        return worker.submit(task)

    def wait_host_compute(self, task) -> None:
        if task is None:
            return
        error = task.exception()  # (one thread in order: every earlier task is done too)
        if error is not None and not getattr(task, "fusedoff_error_raised", False):
            task.fusedoff_error_raised = True
            raise error

    def empty(self, numel: int) -> Tensor:
        return torch.empty(numel, dtype=torch.float32, device=self.device)

    def keep_alive(self, tensor: Tensor, stream) -> None:
        tensor.record_stream(stream)

    def pin(self, tensor: Tensor) -> bool:
        return pin_in_place(tensor, self.device)

    def unpin(self, tensors: list[Tensor]) -> None:
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        unpin_slabs(tensors, index)

    def memory_info(self) -> tuple[int, int]:
        return (torch.cuda.get_device_properties(self.device).total_memory,
                torch.cuda.max_memory_allocated(self.device))

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()


# Stores freed while a CUDA graph was being captured: their slabs, kept alive (copies queued
# before the capture may still use them) and unpinned at the next pinning (see unpin_slabs).
_deferred_unpins: list[tuple[list[Tensor], int]] = []


def pin_in_place(tensor: Tensor, device: torch.device) -> bool:
    """Page-locks `tensor`'s memory in place; False if that fails. `unpin_slabs` unlocks it."""
    while _deferred_unpins:
        unpin_slabs(*_deferred_unpins.pop())
    cudart = torch.cuda.cudart()
    nbytes = tensor.numel() * tensor.element_size()
    if int(cudart.cudaHostRegister(tensor.data_ptr(), nbytes, 0)) != 0:
        _clear_cuda_error()
        return False
    return True


def unpin_slabs(slabs: list[Tensor], device: int) -> None:
    """Unlocks slabs pinned by `pin_in_place`, once the copies queued on `device` have finished
    (a store's finalizer: the store holds the slabs until then)."""
    if torch.cuda.is_current_stream_capturing():
        # A synchronisation now would invalidate the user's graph capture (a garbage collection
        # can free a store at any moment): keep the memory, unpin before the next pinning.
        _deferred_unpins.append((slabs, device))
        return
    # Copies to or from the slabs may still be queued on the pipeline's streams (of this store's
    # device only: touching another device would create a CUDA context there): let them finish
    # before the memory is unlocked and handed back to the host allocator.
    torch.cuda.synchronize(device)
    for slab in slabs:
        if int(torch.cuda.cudart().cudaHostUnregister(slab.data_ptr())) != 0:
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


def _start_worker(device: torch.device, threads: int | None) -> None:
    """The worker thread's current CUDA device (where a driver is: tests run the worker without one)
    and the OpenMP threads its host kernels use (None: torch's default for a new thread)."""
    if torch.cuda.is_available():
        torch.cuda.set_device(device)
    if threads is not None:
        limit_openmp_threads(threads)


def limit_openmp_threads(threads: int) -> None:
    """The calling thread's OpenMP parallel regions (the host kernels': they ask torch's
    ``at::get_num_threads()``, which is this thread's setting) use `threads` threads. Only this
    thread's: torch.set_num_threads would also change what every thread started later gets. torch
    sets a new thread's count at its first parallel call, so that comes first."""
    from threadpoolctl import threadpool_limits

    torch.get_num_threads()
    threadpool_limits(threads, user_api="openmp")
