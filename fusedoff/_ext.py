"""Loads the native extension: prebuilt ``fusedoff._C`` -> JIT build -> a deferred, clear error.

Nothing here runs at ``import fusedoff``: the first call that needs a native backend (cpu or cuda)
loads or builds the extension, once per process. When that fails, ``import fusedoff`` and the
pure-PyTorch backend keep working and the native backends raise ``NativeExtensionUnavailable``
naming what is missing.

``FUSEDOFF_NO_JIT=1`` never builds: the prebuilt module, else the module an earlier JIT build left in
torch's extension cache (``TORCH_EXTENSIONS_DIR``), imported as it is, else the error at once. The GPU
suite builds once in its build stage and sets it for every later stage, so that no stage waits on a
build's lock or compiles again what failed. ``FUSEDOFF_NO_PREBUILT=1`` passes over the prebuilt module
(the suite's rehearsal builds with the JIT in a checkout that has one).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import sys
import time
import types
from pathlib import Path

import torch

from fusedoff import _build


class NativeExtensionUnavailable(RuntimeError):
    """The C++/CUDA extension could neither be imported nor built here."""


def _import_prebuilt() -> tuple[types.ModuleType | None, str]:
    """The prebuilt module: built on torch's stable ABI, it loads in its `oldest_torch` and every later
    torch (see [note: one binary for every torch] in csrc/ops.cpp); in an older one it does not load."""
    try:
        from fusedoff import _C  # type: ignore[attr-defined]
    except ImportError as exc:
        return None, f"no usable prebuilt fusedoff._C ({exc})"
    return _C, ""


def jit_plan() -> tuple[str, bool]:
    """The JIT build's module name (one per torch and CUDA version, so that a torch upgrade never
    reuses a stale binary) and whether it compiles the CUDA sources; raises NativeExtensionUnavailable
    for a bad CUDA_HOME or FUSEDOFF_CUDA."""
    try:
        cuda_home = _build.find_cuda_home() if torch.version.cuda else None
        with_cuda = torch.version.cuda is not None and _build.cuda_build_requested(cuda_home)
    except RuntimeError as exc:  # a bad CUDA_HOME or FUSEDOFF_CUDA: say so, and degrade
        raise NativeExtensionUnavailable(f"fusedoff: cannot build the native extension: {exc}") from exc
    if with_cuda:
        _build.prepare_cuda_environment(cuda_home)
    version_tag = torch.__version__.replace(".", "_").replace("+", "_")
    return f"fusedoff_C_{version_tag}{'' if with_cuda else '_cpu'}", with_cuda


def jit_build_directory(name: str) -> Path:
    """Where torch's JIT builds and keeps module `name` (its cache layout, without creating it)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch.utils import cpp_extension

        accelerator = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(cpp_extension.get_default_build_root(), f"{python}_{accelerator}")
    return Path(root) / name


def _switch(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def _import_jit_built(prebuilt_reason: str) -> types.ModuleType:
    """FUSEDOFF_NO_JIT: the module an earlier JIT build linked, or the error at once (no build, no lock)."""
    name, _ = jit_plan()
    path = jit_build_directory(name) / f"{name}.so"
    if not path.is_file():
        raise NativeExtensionUnavailable(
            f"fusedoff: FUSEDOFF_NO_JIT is set and no native extension was built: {prebuilt_reason}; no {path}. "
            "The pure-PyTorch backend (backend='torch') still works."
        )
    return _import_module_file(name, path, "FUSEDOFF_NO_JIT is set and ")


def _import_module_file(name: str, path: Path, context: str = "") -> types.ModuleType:
    """The extension module in file `path`; NativeExtensionUnavailable if it does not load."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise NativeExtensionUnavailable(f"fusedoff: {context}{path} does not load: {exc}") from exc
    return module


def _jit_build(prebuilt_reason: str) -> types.ModuleType:
    from torch.utils import cpp_extension

    missing = []
    if shutil.which("ninja") is None:
        missing.append("ninja (pip install ninja)")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        missing.append("a C++ compiler (c++/g++)")
    if not _build.CSRC_DIR.is_dir():
        missing.append(f"the C++ sources (expected in {_build.CSRC_DIR}; install from a source checkout)")
    if missing:
        raise NativeExtensionUnavailable(
            f"fusedoff: cannot build the native extension: missing {', '.join(missing)}; {prebuilt_reason}. "
            "The pure-PyTorch backend (backend='torch') still works."
        )

    name, with_cuda = jit_plan()
    args = _build.compile_args(with_cuda)
    print(
        f"fusedoff: building the native extension {name} (C++{' + CUDA' if with_cuda else ''}) "
        "once into torch's extension cache...",
        file=sys.stderr,
        flush=True,
    )
    start = time.perf_counter()
    try:
        module = cpp_extension.load(
            name=name,
            sources=_build.sources(with_cuda),
            extra_include_paths=_build.include_dirs(),
            extra_cflags=args["cxx"],
            extra_cuda_cflags=args.get("nvcc"),
            extra_ldflags=_build.link_args(),
            with_cuda=with_cuda,
        )
    except Exception as exc:
        raise NativeExtensionUnavailable(
            f"fusedoff: building the native extension failed: {exc}. The pure-PyTorch backend (backend='torch') "
            "still works."
        ) from exc
    print(f"fusedoff: built {name} in {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
    return module


@functools.cache
def _load() -> tuple[types.ModuleType | None, NativeExtensionUnavailable | None]:
    module, reason = (None, "FUSEDOFF_NO_PREBUILT is set") if _switch("FUSEDOFF_NO_PREBUILT") else _import_prebuilt()
    if module is None:
        try:
            module = _import_jit_built(reason) if _switch("FUSEDOFF_NO_JIT") else _jit_build(reason)
        except NativeExtensionUnavailable as exc:
            return None, exc
    return module, None


def load_extension() -> types.ModuleType:
    """The native module (building it on first use); raises NativeExtensionUnavailable."""
    module, error = _load()
    if error is not None:
        raise error
    return module


def native_available() -> bool:
    return _load()[1] is None


def cpu_isa() -> str:
    """The instruction set the host kernels dispatch to on this CPU ("avx512", "avx2", "baseline")."""
    load_extension()
    return torch.ops.fusedoff.cpu_isa()


def cuda_kernels_available() -> bool:
    return native_available() and bool(load_extension().with_cuda)

