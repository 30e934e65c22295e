"""Runs a command with no C, C++ or CUDA compiler, linker driver or ninja on PATH: the wheel's proof
(`tools/wheel_proof.sh`) runs the suite this way, as on a user's machine that has none.

    python tools/without_compilers.py -- COMMAND [ARG ...]

PATH becomes one folder of links to every other program PATH held (the first of each name, as the
shell would find it), a temporary folder removed when the command ends; CUDA_HOME, CUDA_PATH, CC and
CXX are unset. Before running the command it checks, apart from the names it left out, that what the
builds would call is not found: the compilers of Python's own build configuration (setuptools'), the
C++ compiler torch.utils.cpp_extension calls, nvcc and ninja; and that no program left answers as a
C compiler does. A compiler that slipped through fails here, not later.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

# gcc/g++/cc/c++ (and x86_64-linux-gnu-gcc-12 and such), clang, nvcc, ninja, the linkers ld and
# ld.gold/ld.bfd, and cpp: what torch.utils.cpp_extension or setuptools would call to build.
COMPILER = re.compile(r"^([\w.-]*-)?(cc|c\+\+|cpp|gcc|g\+\+|clang|clang\+\+|nvcc|ninja|ld(\.\w+)?)(-[\d.]+)?$")



def build_commands() -> set[str]:
    """What a build would call, found independently of COMPILER: sysconfig's CC, CXX and LDSHARED (the
    commands setuptools runs), torch.utils.cpp_extension's C++ compiler (CXX, else c++), nvcc, ninja."""
    commands = {"c++", "cc", "nvcc", "ninja"}
    for var in ("CC", "CXX", "LDSHARED"):
        value = sysconfig.get_config_var(var)
        if value:
            commands.add(value.split()[0])
    return commands


def answers_as_a_compiler(path: str) -> bool:
    """Whether `path` accepts `-E -` and preprocesses C: a compiler under a name COMPILER missed."""
    try:
        done = subprocess.run([path, "-E", "-x", "c", "-"], input="#define X 1\nint y = X;\n", capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and "int y = 1;" in done.stdout


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
    with tempfile.TemporaryDirectory(prefix="fusedoff-no-compilers-") as scratch:
        folder = Path(scratch)
        left_out = linked_path(folder, os.environ.get("PATH", ""))
        env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH", "CC", "CXX")}
        env["PATH"] = str(folder)
        commands = build_commands()
        found = sorted(c for c in commands if shutil.which(c, path=env["PATH"]))
        answering = sorted(name for name in os.listdir(folder) if re.search(r"(cc|\+\+|cpp|clang)", name)
                           and answers_as_a_compiler(str(folder / name)))
        if found or answering:
            print(f"without_compilers: still found {found + answering}", file=sys.stderr)
            return 2
        print(f"without_compilers: PATH holds {len(os.listdir(folder))} programs; {left_out} compilers, linkers and "
              f"build tools left out; none of {', '.join(sorted(commands))} is found", flush=True)
        executable = shutil.which(command[0], path=env["PATH"]) or command[0]
        return subprocess.run([executable, *command[1:]], env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
