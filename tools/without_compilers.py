"""Runs a command with no C, C++ or CUDA compiler, linker driver or ninja on PATH: the wheel's proof
(`tools/wheel_proof.sh`) runs the suite this way, as on a user's machine that has none.

    python tools/without_compilers.py -- COMMAND [ARG ...]

PATH becomes one folder of links to every other program PATH held (the first of each name, as the
shell would find it); CUDA_HOME, CUDA_PATH, CC and CXX are unset. Before running the command it checks
that none of the compilers is found any more, so a compiler that slipped through fails here, not later.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

# gcc/g++/cc/c++ (and x86_64-linux-gnu-gcc-12 and such), clang, nvcc, ninja, the linkers ld and
# ld.gold/ld.bfd, and cpp: what torch.utils.cpp_extension or setuptools would call to build.
COMPILER = re.compile(r"^([\w.-]*-)?(cc|c\+\+|cpp|gcc|g\+\+|clang|clang\+\+|nvcc|ninja|ld(\.\w+)?)(-[\d.]+)?$")
CHECKED = ("cc", "c++", "gcc", "g++", "clang", "clang++", "nvcc", "ninja", "ld")


def linked_path(folder: Path, path: str) -> int:
    """Fills `folder` with links to PATH's programs but the compilers; returns how many were left out."""
    left_out = 0
    for directory in path.split(os.pathsep):
        if not directory or not os.path.isdir(directory):
            continue
        for entry in sorted(os.listdir(directory)):
            source = os.path.join(directory, entry)
            if (folder / entry).exists() or not (os.path.isfile(source) and os.access(source, os.X_OK)):
                continue
            if COMPILER.match(entry):
                left_out += 1
                continue
            (folder / entry).symlink_to(source)
    return left_out


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print(__doc__, file=sys.stderr)
        return 2
    command = argv[argv.index("--") + 1:]
    folder = Path(tempfile.mkdtemp(prefix="fusedoff-no-compilers-"))
    left_out = linked_path(folder, os.environ.get("PATH", ""))
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH", "CC", "CXX")}
    env["PATH"] = str(folder)
    found = {name: shutil.which(name, path=env["PATH"]) for name in CHECKED}
    if any(found.values()):
        print(f"without_compilers: still found {[n for n, p in found.items() if p]}", file=sys.stderr)
        return 2
    print(f"without_compilers: PATH holds {len(os.listdir(folder))} programs; {left_out} compilers, linkers "
          f"and build tools left out ({', '.join(CHECKED)}: none found)", flush=True)
    executable = shutil.which(command[0], path=env["PATH"]) or command[0]
    os.execve(executable, command, env)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
