"""The GPU suite's build stage: one JIT build of fusedoff's native extension, in a child process under a
time limit of its own, into the suite's own extension directory; the stages after it set
FUSEDOFF_NO_JIT=1 and load what it built, or say at once that nothing was built, and never build again.

At the limit the build's whole process group (python, ninja, the compilers) is stopped, TERM then KILL,
and what a killed build leaves behind in its build directory is removed: the lock torch's JIT holds
while it builds (torch up to 2.11 makes it a plain file that only a clean exit removes, so every later
load would wait on it for ever) and a module the linker may have left half written. The directory must
be the suite's own (--ext-dir, exported as TORCH_EXTENSIONS_DIR): no other process builds there, so a
lock in it belongs to this build, or to an earlier one of the suite that was killed.

    python3 benchmarks/gpu_suite/jit_build.py --ext-dir DIR --limit-s 270

Exit status: 0 built, 1 failed (the compiler's error is in the output), 124 timed out.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import time
start = time.time()
from fusedoff._ext import cpu_isa, load_extension
m = load_extension()
print(f"loaded {m.__file__}: cuda kernels {m.with_cuda}, cpu isa {cpu_isa()}, {time.time() - start:.0f} s",
      flush=True)
"""


def build_directory(ext_dir: Path) -> Path:
    """The directory torch's JIT builds fusedoff's module in, under `ext_dir`."""
    os.environ["TORCH_EXTENSIONS_DIR"] = str(ext_dir)
    sys.path.insert(0, str(ROOT))
    from fusedoff import _ext

    name, _ = _ext.jit_plan()
    return _ext.jit_build_directory(name)


def remove_leftovers(build_dir: Path, why: str) -> list[str]:
    """The lock and module a killed build leaves; the names of what was removed."""
    removed = []
    for leftover in (build_dir / "lock", build_dir / f"{build_dir.name}.so"):
        if leftover.exists():
            leftover.unlink()
            removed.append(f"{leftover} ({why})")
    return removed


def stop(process: subprocess.Popen, grace_s: float = 5.0) -> None:
    """TERM to the build's process group, KILL to whatever is left after `grace_s`."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ext-dir", type=Path, required=True, help="the suite's own TORCH_EXTENSIONS_DIR")
    parser.add_argument("--limit-s", type=float, required=True, help="stop the build after this many seconds")
    parser.add_argument("--limit-from", choices=("start", "compile"), default="start",
                        help="count the limit from the start (default), or from the moment torch's JIT takes its "
                             "lock and compiles (the rehearsal: a build stopped mid-compile on any machine)")
    args = parser.parse_args(argv)
    args.ext_dir = args.ext_dir.resolve()
    build_dir = build_directory(args.ext_dir)
    for line in remove_leftovers(build_dir, "left by an earlier build of the suite that was stopped"):
        print(f"removed {line}", flush=True)
    env = {k: v for k, v in os.environ.items() if k != "FUSEDOFF_NO_JIT"} | {
        "TORCH_EXTENSIONS_DIR": str(args.ext_dir), "PYTHONUNBUFFERED": "1"}
    print(f"building in {build_dir} (limit {args.limit_s:g} s, MAX_JOBS={env.get('MAX_JOBS', 'all CPUs')})",
          flush=True)
    start = time.monotonic()
    process = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, env=env, start_new_session=True)
    if args.limit_from == "compile":
        while process.poll() is None and not (build_dir / "lock").exists():
            time.sleep(0.05)
        print(f"torch's JIT took its lock after {time.monotonic() - start:.1f} s", flush=True)
    try:
        rc = process.wait(timeout=args.limit_s)
    except subprocess.TimeoutExpired:
        stop(process)
        removed = remove_leftovers(build_dir, "the stopped build's")
        counted = " from the compile" if args.limit_from == "compile" else ""
        print(f"build: TIMED OUT after {time.monotonic() - start:.0f} s (limit {args.limit_s:g} s{counted}); stopped "
              f"its process group; removed {', '.join(removed) or 'nothing'}; later stages load nothing and build "
              "nothing", flush=True)
        return 124
    if rc != 0:
        print(f"build: FAILED (exit {rc}) after {time.monotonic() - start:.0f} s; later stages do not try again",
              flush=True)
        return 1
    print(f"build: ok in {time.monotonic() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
