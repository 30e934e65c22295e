"""What the GPU suite found, printed first: python, torch, triton, CUDA (torch's and the toolkit's), the
driver, the GPU, the build tools, and whether host memory can be pinned here.

The pinned-memory probe asks what the streaming engine needs: cudaHostRegister on an ordinary 64 MiB
host tensor (what fusedoff/offload/store.py does with its slabs) and torch's own pinned allocator
(pin_memory=True). Where pinning is refused (some sandboxes refuse cudaHostRegister) the engine falls back
to pageable memory, its copies become synchronous, and the streamed figures mean something else: the
probe says so, with one timed 64 MiB host-to-device copy from pinned and from pageable memory.

    python3 benchmarks/gpu_suite/machine.py
"""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
import sys
import time

PROBE_BYTES = 64 * 2**20


def _run(command: list[str]) -> str:
    if shutil.which(command[0]) is None:
        return f"{command[0]}: not found"
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{command[0]}: {exc}"
    return (result.stdout or result.stderr).strip()


def _driver_version() -> str:
    """The CUDA driver's API version (cuDriverGetVersion), e.g. 13.0, or why it is unknown."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"no libcuda ({exc})"
    version = ctypes.c_int()
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return "cuDriverGetVersion failed"
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def _h2d_gb_per_s(host, device) -> float:
    import torch

    device.copy_(host, non_blocking=True)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return host.numel() * host.element_size() / (time.perf_counter() - start) / 1e9


def pinning_probe() -> list[str]:
    """pin_memory and cudaHostRegister on 64 MiB, and the copy rates they give; lines to print. The
    register comes last: a refusal leaves a CUDA error set that the next CUDA call would report."""
    import torch

    if not torch.cuda.is_available():
        return ["pinned memory: not probed (no CUDA device)"]
    n = PROBE_BYTES // 4
    device = torch.empty(n, dtype=torch.float32, device="cuda")
    lines = [f"pageable (64 MiB): h2d {_h2d_gb_per_s(torch.ones(n), device):.1f} GB/s"]
    try:
        pinned = torch.ones(n, pin_memory=True)
        pin_ok = pinned.is_pinned()
        lines.append(f"torch pin_memory=True (64 MiB): {'ok' if pin_ok else 'NOT pinned'}, "
                     f"h2d {_h2d_gb_per_s(pinned, device):.1f} GB/s")
    except RuntimeError as exc:
        pin_ok = False
        lines.append(f"torch pin_memory=True (64 MiB): FAILED ({str(exc).splitlines()[0]})")
    registered = torch.ones(n)
    cudart = torch.cuda.cudart()
    status = int(cudart.cudaHostRegister(registered.data_ptr(), PROBE_BYTES, 0))
    register_ok = status == 0
    if register_ok:
        lines.append(f"cudaHostRegister(64 MiB): ok, h2d {_h2d_gb_per_s(registered, device):.1f} GB/s")
        cudart.cudaHostUnregister(registered.data_ptr())
    else:
        lines.append(f"cudaHostRegister(64 MiB): REFUSED (cudaError {status})")
    fallback = "no" if register_ok else "YES: fusedoff's streamed states stay pageable and their copies are synchronous"
    lines.append(f"pinned-memory summary: cudaHostRegister {'ok' if register_ok else 'refused'}, torch pin_memory "
                 f"{'ok' if pin_ok else 'failed'}; pageable fallback: {fallback}")
    return lines


def main() -> int:
    print(f"python {sys.version.split()[0]} on {platform.machine()}, {os.cpu_count()} CPUs")
    try:
        import torch
    except ImportError as exc:
        print(f"torch: NOT IMPORTABLE ({exc})")
        return 1
    try:
        import triton

        triton_version = triton.__version__
    except ImportError as exc:
        triton_version = f"not importable ({exc})"
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton_version}")
    print(f"CUDA driver API {_driver_version()}; nvidia-smi: "
          f"{_run(['nvidia-smi', '--query-gpu=name,driver_version,memory.total', '--format=csv,noheader'])}")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        print(f"GPU 0: {props.name}, {props.total_memory / 2**30:.0f} GiB, compute capability {props.major}.{props.minor}, "
              f"{props.multi_processor_count} SMs; {torch.cuda.device_count()} device(s)")
    else:
        print("GPU: none visible to torch")
    nvcc = _run(["nvcc", "--version"]).splitlines()
    print(f"nvcc: {nvcc[-1] if nvcc else '?'} | ninja {_run(['ninja', '--version'])} | "
          f"c++ {_run(['c++', '-dumpversion'])}")
    for line in pinning_probe():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
