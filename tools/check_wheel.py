"""What the binary wheel holds, checked after `make wheel` (which runs this): fails on any surprise.

    python tools/check_wheel.py [dist]

- one wheel, tagged cp310-abi3-manylinux_2_N_x86_64 (N: the oldest glibc it runs on, printed);
- one binary, fusedoff/_C.abi3.so: not the tests' emulated kernels, nor a module another build left;
- that binary needs only torch's libraries (torch's wheel brings libc10, libtorch_*, libgomp and the
  CUDA runtime) and what every manylinux system has, and names no C++ symbol of torch's (only the
  stable C shims: [note: one binary for every torch]);
- no debug information; the device code for exactly _build.DEFAULT_CUDA_ARCH_LIST: a cubin for each
  architecture and PTX for those marked +PTX, read from the fatbin headers (the toolkit here has no
  cuobjdump).
"""

from __future__ import annotations

import re
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from fusedoff import _build  # noqa: E402  (imports no torch: setup.py loads it by path too)

WHEEL_NAME = re.compile(r"^fusedoff-[\w.]+-cp310-abi3-manylinux_2_(\d+)_x86_64\.whl$")
# torch's wheel and its CUDA runtime dependency provide these (they are loaded by `import torch`,
# which `import fusedoff` does first); the rest are manylinux's own (PEP 600's allowed libraries).
TORCH_PROVIDES = {"libc10.so", "libtorch_cpu.so", "libtorch_cuda.so", "libcudart.so.13", "libgomp.so.1"}
MANYLINUX = {"libstdc++.so.6", "libm.so.6", "libgcc_s.so.1", "libc.so.6", "libpthread.so.0", "libdl.so.2",
             "librt.so.1", "ld-linux-x86-64.so.2"}

FATBIN_MAGIC = 0xBA55ED50
PTX, CUBIN = 1, 2


def needed(library: Path) -> set[str]:
    """The libraries `library` names as NEEDED (readelf: binutils)."""
    dynamic = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic))


def device_code(library: Path) -> Counter:
    """(kind, architecture) -> how many translation units carry it, from the .nv_fatbin section: each
    unit's fatbin header (magic, version, header size, payload size) and its entries' headers (kind
    1 PTX / 2 cubin, header size, payload size, ..., the architecture at byte 28)."""
    with tempfile.TemporaryDirectory() as scratch:
        section = Path(scratch) / "fatbin"
        subprocess.run(["objcopy", "-O", "binary", "--only-section=.nv_fatbin", str(library), str(section)], check=True)
        data = section.read_bytes()
    found: Counter = Counter()
    offset = 0
    while offset < len(data):
        if data[offset:offset + 8] == bytes(8):  # alignment between units
            offset += 8
            continue
        magic, _version, header_size, payload = struct.unpack_from("<IHHQ", data, offset)
        if magic != FATBIN_MAGIC:
            raise SystemExit(f"check_wheel: no fatbin header at byte {offset} of {library.name}'s device code")
        entry, end = offset + header_size, offset + header_size + payload
        while entry < end:
            kind, _, entry_header, size = struct.unpack_from("<HHIQ", data, entry)
            if kind not in (PTX, CUBIN):
                raise SystemExit(f"check_wheel: a fatbin entry of kind {kind} in {library.name}")
            found[("ptx" if kind == PTX else "sm", struct.unpack_from("<I", data, entry + 28)[0])] += 1
            entry += entry_header + size
        offset = end
    return found


def expected_device_code(arch_list: str) -> set[tuple[str, int]]:
    expected = set()
    for arch in arch_list.split(";"):
        number = int(arch.removesuffix("+PTX").replace(".", ""))
        expected.add(("sm", number))
        if arch.endswith("+PTX"):
            expected.add(("ptx", number))
    return expected


def main(dist: Path) -> int:
    wheels = sorted(dist.glob("*.whl"))
    if len(wheels) != 1 or not WHEEL_NAME.match(wheels[0].name):
        raise SystemExit(f"check_wheel: expected one cp310-abi3 manylinux wheel in {dist}, found {[w.name for w in wheels]}")
    wheel = wheels[0]
    glibc = WHEEL_NAME.match(wheel.name).group(1)
    with zipfile.ZipFile(wheel) as archive, tempfile.TemporaryDirectory() as scratch:
        binaries = [name for name in archive.namelist() if re.search(r"\.so(\.|$)", name)]
        if binaries != ["fusedoff/_C.abi3.so"]:
            raise SystemExit(f"check_wheel: the wheel's binaries are {binaries}, not only fusedoff/_C.abi3.so")
        library = Path(archive.extract("fusedoff/_C.abi3.so", scratch))
        libraries = needed(library)
        if libraries - TORCH_PROVIDES - MANYLINUX:
            raise SystemExit(f"check_wheel: _C needs {sorted(libraries - TORCH_PROVIDES - MANYLINUX)}, which neither torch "
                             "nor a manylinux system provides")
        if cxx := _build.torch_cxx_symbols(library):
            raise SystemExit(f"check_wheel: _C names C++ symbols of torch's: {cxx[:5]}")
        sections = subprocess.run(["readelf", "-S", "-W", str(library)], capture_output=True, text=True, check=True).stdout
        if ".debug_" in sections:
            raise SystemExit("check_wheel: _C carries debug information")
        code = device_code(library)
        units = set(code.values())
        expected = expected_device_code(_build.DEFAULT_CUDA_ARCH_LIST)
        if set(code) != expected or len(units) != 1:
            raise SystemExit(f"check_wheel: device code {dict(code)}; expected {sorted(expected)} in every unit")
        size = library.stat().st_size
    archs = ", ".join(f"{kind}_{number}" for kind, number in sorted(code, key=lambda k: (k[1], k[0])))
    print(f"check_wheel: {wheel.name}: {wheel.stat().st_size / 1e6:.1f} MB ({size / 1e6:.1f} MB unpacked); "
          f"glibc >= 2.{glibc}; needs {', '.join(sorted(libraries & TORCH_PROVIDES))} from torch; no C++ symbol of "
          f"torch's; no debug information; device code {archs} in each of {units.pop()} units")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "dist"))
