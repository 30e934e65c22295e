"""How to build ``fusedoff._C``: shared by ``setup.py`` (ahead of time) and ``_ext.py`` (JIT).

This module imports nothing from torch or fusedoff so that ``setup.py`` can load it by path.

Environment switches:
  CUDA_HOME / CUDA_PATH       the CUDA toolkit root (honoured first)
  FUSEDOFF_CUDA=0|1|auto      force the CUDA sources off / on (on: fail if no toolkit); default auto
  TORCH_CUDA_ARCH_LIST        GPU architectures; default "7.5;8.0;9.0;10.0;12.0+PTX", the wheel's (see
                              DEFAULT_CUDA_ARCH_LIST); one GPU's, such as "9.0", builds faster
  MAX_JOBS                    parallel compile jobs (read by torch.utils.cpp_extension)
  FUSEDOFF_CUDA_EMULATION=1   also build the test module fusedoff._C_emulated: the CUDA kernels
                              compiled as host C++ behind csrc/emulation (never in user wheels)
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from pathlib import Path

# Every GPU architecture the supported torch builds ship (torch 2.11 to 2.14, CUDA 13: sm_75 to sm_120),
# in the fewest targets: a cubin runs on its own major version's later minors (sm_80's on sm_86/87/89,
# sm_100's on sm_103, sm_120's on sm_121), and sm_120's PTX is compiled by the driver for a later GPU.
# The kernels are memory-bound: a minor version's own cubin would gain nothing worth its build time.
DEFAULT_CUDA_ARCH_LIST = "7.5;8.0;9.0;10.0;12.0+PTX"
EXTENSION_NAME = "fusedoff._C"
EMULATED_EXTENSION_NAME = "fusedoff._C_emulated"

_PACKAGE_DIR = Path(__file__).resolve().parent
CSRC_DIR = _PACKAGE_DIR.parent / "csrc"


def _is_toolkit_root(path: Path) -> bool:
    return (path / "bin" / "nvcc").is_file() and (path / "include" / "cuda_runtime.h").is_file()


def _nvcc_wrapper_targets(nvcc: Path) -> list[Path]:
    """Toolkit roots named inside an ``nvcc`` that is a small wrapper script (as on our CI machines)."""
    try:
        if nvcc.stat().st_size > 64 * 1024:
            return []  # a real compiler binary, not a script
        text = nvcc.read_text(errors="ignore")
    except OSError:
        return []
    roots = []
    for token in text.replace('"', " ").replace("'", " ").split():
        if token.endswith("/bin/nvcc"):
            roots.append(Path(token).parent.parent)
    return roots


def find_cuda_home() -> Path | None:
    """The CUDA toolkit root, or None.

    torch guesses the parent of the folder holding the ``nvcc`` on PATH; where that ``nvcc`` is a
    wrapper script outside the toolkit the guess has no ``lib64/libcudart.so`` and links fail. So:
    CUDA_HOME/CUDA_PATH if set, then the resolved ``nvcc`` (following symlinks and wrapper
    scripts), then the conventional install folders; a candidate counts only if it holds both
    ``bin/nvcc`` and ``include/cuda_runtime.h``.
    """
    for var in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(var)
        if value:
            root = Path(value)
            if not _is_toolkit_root(root):
                raise RuntimeError(f"{var}={value} is not a CUDA toolkit (no bin/nvcc or include/cuda_runtime.h)")
            return root
    candidates: list[Path] = []
    nvcc_on_path = shutil.which("nvcc")
    if nvcc_on_path:
        nvcc = Path(nvcc_on_path)
        candidates.append(nvcc.resolve().parent.parent)
        candidates.extend(_nvcc_wrapper_targets(nvcc))
    candidates.append(Path("/usr/local/cuda"))
    candidates.extend(Path(p) for p in sorted(glob.glob("/usr/local/cuda-*"), reverse=True))
    for root in candidates:
        if _is_toolkit_root(root):
            return root.resolve()
    return None


def cuda_build_requested(cuda_home: Path | None) -> bool:
    """Whether to compile the CUDA sources, from FUSEDOFF_CUDA and the toolkit found."""
    mode = os.environ.get("FUSEDOFF_CUDA", "auto").strip().lower()
    if mode in ("0", "off", "false", "no"):
        return False
    if mode in ("1", "on", "true", "yes"):
        if cuda_home is None:
            raise RuntimeError("FUSEDOFF_CUDA=1 but no CUDA toolkit was found; set CUDA_HOME")
        return True
    if mode != "auto":
        raise RuntimeError(f"FUSEDOFF_CUDA must be 0, 1 or auto, got {mode!r}")
    return cuda_home is not None


def prepare_cuda_environment(cuda_home: Path) -> None:
    """Make torch.utils.cpp_extension use ``cuda_home`` (it reads CUDA_HOME once, at import)."""
    os.environ["CUDA_HOME"] = str(cuda_home)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCH_LIST)
    import sys

    module = sys.modules.get("torch.utils.cpp_extension")
    if module is not None:
        module.CUDA_HOME = str(cuda_home)


def sources(with_cuda: bool) -> list[str]:
    files = [CSRC_DIR / "ops.cpp", *sorted((CSRC_DIR / "cpu").glob("*.cpp"))]
    if with_cuda:
        files += sorted((CSRC_DIR / "cuda").glob("*.cu"))
    return [str(f) for f in files]


# [note: one rounding everywhere] Every backend rounds each operation of the math headers as
# written: no multiply-add is fused into an FMA (GCC fuses them in C++ wherever the instruction set
# has one, as in the AVX2/AVX-512 host kernels, and nvcc everywhere), so the host kernels, the CUDA
# kernels and their host emulation (the `emulated` tests hold them equal bit for bit) give the same
# bits. The kernels are memory-bound: an FMA saves no time there.
FP_CONTRACT_OFF = ["-ffp-contract=off"]


# [note: one binary for every torch] (csrc/ops.cpp): the extension is built against torch's stable C ABI
# for the oldest torch supported (pyproject.toml's `torch>=`), so one build loads in it and every later
# torch; and on CPython's limited API for the oldest Python supported (a cp310-abi3 wheel).
OLDEST_TORCH = (2, 11)
ABI3_TAG = "cp310"


TORCH_CXX = re.compile(r"\b(at|c10|torch)::")


def torch_cxx_symbols(library: Path) -> list[str]:
    """The undefined C++ symbols of `library` in torch's namespaces: what would tie a build to one torch
    (tests/test_stable_abi.py and tools/check_wheel.py; needs binutils' nm)."""
    listed = subprocess.run(["nm", "-D", "--undefined-only", "-C", str(library)], capture_output=True, text=True,
                            check=True).stdout
    return [line.split(None, 1)[-1] for line in listed.splitlines() if TORCH_CXX.search(line)]


def stable_abi_defines() -> list[str]:
    """TORCH_TARGET_VERSION as torch/csrc/stable/version.h spells it: major and minor in the top bytes."""
    major, minor = OLDEST_TORCH
    return [f"-DTORCH_TARGET_VERSION=0x{major:02x}{minor:02x}000000000000"]


def compile_args(with_cuda: bool) -> dict[str, list[str]]:
    # -fno-math-errno lets sqrtf vectorise; -fno-trapping-math lets the compiler compute both sides
    # of a float select (the 8-bit codes' normal/subnormal paths), without which those loops stay
    # scalar (see 'CPU kernel tuning' in benchmarks/results/RESULTS.md); neither changes a result.
    # No -ffast-math (it would change results) and no -march=native (the prebuilt extension must
    # run on any CPU: the kernel picks its ISA at run time).
    # -Wno-psabi: the AVX-512 host kernels run the math headers' templates on 16-lane vectors, and GCC
    # notes that passing one to a function without AVX-512 has another ABI; every such call is inlined.
    # -g0: no debug information (Python's own CFLAGS ask for -g; it was a quarter of the binary).
    cxx = ["-O3", "-g0", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", *FP_CONTRACT_OFF, "-Wno-psabi"]
    defines = ["-DFUSEDOFF_WITH_CUDA"] if with_cuda else []
    args = {"cxx": cxx + defines + stable_abi_defines()}
    if with_cuda:
        # No --use_fast_math: it flushes subnormals and approximates sqrt/div, breaking parity;
        # --fmad=false: see [note: one rounding everywhere]. The device code compressed (nvcc leaves it
        # uncompressed here): 14x smaller, decompressed once when the module loads.
        args["nvcc"] = ["-O3", "-lineinfo", "--fmad=false", "-Xfatbin=-compress-all", "--compress-mode=size",
                        *defines]
    return args


# ---- the emulated CUDA kernels (tests only) ------------------------------------------------------

EMULATION_DIR = CSRC_DIR / "emulation"
SANITIZERS = ("thread", "address")  # ThreadSanitizer; AddressSanitizer with UBSan


def emulation_requested() -> bool:
    """Whether setup.py also builds fusedoff._C_emulated (FUSEDOFF_CUDA_EMULATION=1)."""
    return os.environ.get("FUSEDOFF_CUDA_EMULATION", "0").strip().lower() in ("1", "on", "true", "yes")


def emulation_kernel_sources() -> list[str]:
    """ops.cpp, the device kernels compiled as host C++ (csrc/emulation/*_emulated.cpp) and the
    emulator's self-test kernels."""
    return [str(CSRC_DIR / "ops.cpp"), *(str(f) for f in sorted(EMULATION_DIR.glob("*_emulated.cpp"))),
            str(EMULATION_DIR / "emulator_selftest.cpp")]


def emulation_runtime_source() -> str:
    """The emulator itself (grids, fibers, barriers, shuffles)."""
    return str(EMULATION_DIR / "emulator.cpp")


def emulation_include_dirs() -> list[str]:
    # csrc/emulation first: its cuda_runtime.h stands in for the toolkit's.
    return [str(EMULATION_DIR), *include_dirs()]


def emulation_compile_args(sanitizer: str | None = None) -> list[str]:
    """Flags for the emulated kernels; with `sanitizer` ('thread' or 'address') instrumented by it.

    The same flags as the host kernels where they touch results, so the emulated CUDA kernels give
    the host kernels' bits. Sanitized builds keep frame pointers for readable reports and stop at the
    first error (UBSan would otherwise print and go on).
    """
    args = ["-O2", "-fno-math-errno", "-fno-trapping-math", *FP_CONTRACT_OFF, "-DFUSEDOFF_WITH_CUDA",
            "-DFUSEDOFF_CUDA_EMULATION", *stable_abi_defines()]
    if sanitizer == "thread":
        args += ["-fsanitize=thread", "-fno-omit-frame-pointer", "-g"]
    elif sanitizer == "address":
        args += ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g"]
    elif sanitizer is not None:
        raise ValueError(f"sanitizer must be one of {SANITIZERS} or None, got {sanitizer!r}")
    return args


def emulation_runtime_compile_args(sanitizer: str | None = None) -> list[str]:
    """Flags for emulator.cpp: under ThreadSanitizer it is not instrumented itself but announces
    its fibers and the emulated hardware's orderings to TSan ([note: CUDA emulation])."""
    if sanitizer == "thread":
        return ["-O2", "-g", "-DFUSEDOFF_EMULATION_TSAN"]
    return emulation_compile_args(sanitizer)


def emulation_link_args(sanitizer: str | None = None) -> list[str]:
    if sanitizer == "thread":
        return ["-fsanitize=thread"]
    if sanitizer == "address":
        return ["-fsanitize=address,undefined"]
    return []


def include_dirs() -> list[str]:
    return [str(CSRC_DIR / "include")]


def link_args() -> list[str]:
    return ["-fopenmp"]
