"""Measured rates for the step's cost model (fusedoff/costs.py): the host side here, the link and the
device where there is a GPU.

Host: the fused optimizers' step on CPU tensors with ``backend="cpu"`` (the C++ host kernel the
host-computed placement runs), for each state and master precision on bf16 parameters, in elements
per second on the given number of threads; and the host memory's bandwidth, bytes read + written
per second: a large tensor copied into another (a memcpy, as into pinned pages), and an in-place pass
over one (read and written where it lies, as the kernel does: no write-allocate reads), whose rate the
model takes as the host memory's.

GPU (only where ``torch.cuda.is_available()``): pinned host -> device and device -> host copies, both
at once on two streams, and the device kernel's bandwidth (a resident fused AdamW step on bf16
parameters with fp32 states and masters, its bytes per element from the cost model over its time).

Timing: a warm-up, then the median of `repeats` timed calls. Sizes are several times a server's
last-level cache (this project's CI machine has 300 MiB of L3): 32M elements per kernel step (about
900 MB of state, parameter and gradient at 28 bytes per element), 1 GiB per memory pass.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from fusedoff import costs

NUMEL = 32 * 2**20
# The setups whose host kernel is measured: (optimizer, state precision, master precision) on bf16
# parameters (Adam and AdamW run one kernel: AdamW stands for both).
HOST_SETUPS = tuple([("adamw", state, master) for state in costs.STATE_PRECISIONS for master in costs.MASTER_PRECISIONS]
                    + [("apollo", "fp32", master) for master in costs.MASTER_PRECISIONS])


@dataclass
class Calibration:
    """What `measure` measured: rates in bytes or elements per second (None: not measured here)."""

    threads: int
    numel: int
    host_kernel: dict[tuple[str, str, str], float] = field(default_factory=dict)  # elements/s
    host_copy: float | None = None  # bytes read + written per second, copy into another tensor
    host_inplace: float | None = None  # bytes read + written per second, in place
    h2d: float | None = None
    d2h: float | None = None
    both: float | None = None
    device_kernel: float | None = None  # bytes read + written per second by the fused step
    device: str = "none"

    def rates(self, base: costs.Rates) -> costs.Rates:
        """Rates with the measured figures, and `base`'s where nothing was measured (no GPU: the link
        and the device). The host memory bandwidth is the in-place pass's (the kernel's pattern)."""
        measured = self.h2d is not None
        name = "measured" if measured else f"measured host + {base.name}"
        return costs.Rates(
            name, h2d=self.h2d or base.h2d, d2h=self.d2h or base.d2h, both=self.both or base.both,
            device_memory=self.device_kernel or base.device_memory, host_memory=self.host_inplace or base.host_memory,
            host_kernel=dict(self.host_kernel), host_threads=self.threads,
            source=f"host measured here ({self.threads} threads)"
            + (f", link and device measured on {self.device}" if measured else f"; link and device: {base.source}"))


def _median_seconds(fn: Callable[[], object], repeats: int, warmup: int,
                    sync: Callable[[], object] = lambda: None) -> float:
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples)


@contextmanager
def _threads(threads: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _optimizer(optimizer: str, state: str, master: str, params: list[torch.Tensor], backend: str):
    import fusedoff

    masters = dict(master_weights=False) if master == costs.NO_MASTER else dict(master_precision=master)
    if optimizer == "apollo":
        return fusedoff.Apollo(params, lr=1e-3, backend=backend, offload="none", **masters)
    return fusedoff.AdamW(params, lr=1e-3, backend=backend, offload="none", state_precision=state, **masters)


def _step_seconds(optimizer: str, state: str, master: str, numel: int, repeats: int, warmup: int,
                  device: str = "cpu") -> float:
    param = torch.nn.Parameter(torch.randn(numel, device=device).to(torch.bfloat16))
    param.grad = torch.randn_like(param) * 1e-3
    opt = _optimizer(optimizer, state, master, [param], "cpu" if device == "cpu" else "auto")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return _median_seconds(opt.step, repeats, warmup, sync)


def measure_host_kernel(threads: int, numel: int = NUMEL, repeats: int = 7, warmup: int = 2,
                        setups=HOST_SETUPS) -> dict[tuple[str, str, str], float]:
    """Elements per second of the host kernel's step for each (optimizer, state, master) of `setups`."""
    with _threads(threads):
        return {setup: numel / _step_seconds(*setup, numel, repeats, warmup) for setup in setups}


def measure_host_memory(threads: int, nbytes: int = 2**30, repeats: int = 7, warmup: int = 2) -> tuple[float, float]:
    """Bytes read + written per second by a large copy between two host tensors, and by an in-place
    pass over one (``x.mul_(1.0)``)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src).fill_(0.0)
    moved = 2 * nbytes
    with _threads(threads):
        return (moved / _median_seconds(lambda: dst.copy_(src), repeats, warmup),
                moved / _median_seconds(lambda: src.mul_(1.0), repeats, warmup))


def measure_link(nbytes: int = 2**30, repeats: int = 7, warmup: int = 2) -> tuple[float, float, float]:
    """(h2d, d2h, both at once) bytes per second of pinned copies (needs CUDA)."""
    n = nbytes // 4
    host_in = torch.ones(n, pin_memory=True)
    host_out = torch.ones(n, pin_memory=True)
    dev_in = torch.ones(n, device="cuda")
    dev_out = torch.ones(n, device="cuda")
    up, down = torch.cuda.Stream(), torch.cuda.Stream()

    def both() -> None:
        with torch.cuda.stream(up):
            dev_in.copy_(host_in, non_blocking=True)
        with torch.cuda.stream(down):
            host_out.copy_(dev_out, non_blocking=True)

    sync = torch.cuda.synchronize
    h2d = _median_seconds(lambda: dev_in.copy_(host_in, non_blocking=True), repeats, warmup, sync)
    d2h = _median_seconds(lambda: host_out.copy_(dev_out, non_blocking=True), repeats, warmup, sync)
    together = _median_seconds(both, repeats, warmup, sync)
    return 4 * n / h2d, 4 * n / d2h, 8 * n / together


def measure_device_kernel(numel: int = 2**28, repeats: int = 7, warmup: int = 2) -> float:
    """Bytes read + written per second by a resident fused AdamW step on the GPU (bf16 parameters, fp32
    states and masters; its bytes per element from the cost model)."""
    setup = costs.Setup()
    seconds = _step_seconds("adamw", setup.state_precision, setup.master_precision, numel, repeats, warmup, "cuda")
    return numel * costs.element_bytes(setup).kernel / seconds


def measure(threads: int | None = None, *, numel: int = NUMEL, repeats: int = 7, setups=HOST_SETUPS,
            gpu: bool | None = None) -> Calibration:
    """The calibration of this machine: the host always, the link and the device where there is a GPU
    (`gpu`: None asks torch)."""
    threads = torch.get_num_threads() if threads is None else int(threads)
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    calibration = Calibration(threads, numel, host_kernel=measure_host_kernel(threads, numel, repeats, setups=setups))
    calibration.host_copy, calibration.host_inplace = measure_host_memory(threads, repeats=repeats)
    if torch.cuda.is_available() if gpu is None else gpu:
        calibration.h2d, calibration.d2h, calibration.both = measure_link(repeats=repeats)
        calibration.device_kernel = measure_device_kernel(repeats=repeats)
        calibration.device = torch.cuda.get_device_name()
    return calibration


__all__ = ["Calibration", "HOST_SETUPS", "measure", "measure_device_kernel", "measure_host_memory",
           "measure_host_kernel", "measure_link"]
