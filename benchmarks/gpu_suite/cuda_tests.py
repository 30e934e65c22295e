"""The GPU suite's test stages: the cuda-marked tests in a fixed order, each under a time limit, and a
pytest run that a hung test ended started again without it.

  streams   the real streams, pinning, overlap and device memory: the tests most likely to hang or to
            find what the first GPU run is for, so they run first, in their own stage
  kernels   every other cuda-marked test that is not Triton (kernels, ops, optimizers, FSDP2 on one GPU)
  triton    the Triton kernels on the GPU (each variant compiles on first use: last, after the benchmark)

Each test runs under tests/per_test_timeout.py's --test-timeout: a test that takes too long fails and
the run goes on; a test stuck where the timeout cannot reach it (in C, a CUDA synchronisation that never
returns) ends the process after the grace, and the run starts again without that test and those done
(at most --restarts times). Each hung test's stacks are printed into the log.

    python3 benchmarks/gpu_suite/cuda_tests.py streams [--timeout-s 60] [--deadline-s 100]
    python3 benchmarks/gpu_suite/cuda_tests.py streams kernels triton --collect-only   # the order they would run in,
                                                                              # and modules skipped whole
    python3 benchmarks/gpu_suite/cuda_tests.py --paths tests/test_x.py --timeout-s 2   # any files, no marker

Exit status: 0 when every test passed or skipped, 1 when one failed, timed out or hung.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STREAM_FILES = ("tests/test_offload.py", "tests/test_optimizer_state.py", "tests/test_memory.py")
GROUPS = {  # name: (marker expression, paths, paths left out)
    "streams": ("cuda and not triton", STREAM_FILES, ()),
    "kernels": ("cuda and not triton", ("tests",), STREAM_FILES),
    "triton": ("cuda and triton", ("tests",), ()),
}


def pytest_command(group: str, extra: list[str] = ()) -> list[str]:
    marker, paths, left_out = GROUPS[group]
    return [sys.executable, "-m", "pytest", "-m", marker, *paths, *(f"--ignore={p}" for p in left_out),
            "-p", "no:cacheprovider", *extra]


def read_progress(path: Path) -> tuple[dict[str, str], str | None]:
    """The tests finished, with their outcomes, and the one the process was in when it ended (None: it
    ended between tests)."""
    done, running = {}, None
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("start "):
                running = line[len("start "):]
            elif line.startswith("done "):
                outcome, nodeid = line[len("done "):].split(" ", 1)
                done[nodeid] = outcome
                running = None
    return done, running


def summary(done: dict[str, str], hung: list[str]) -> str:
    """'12 passed, 3 skipped, 1 failed (a), 1 timed-out (b), 1 hung (c)': the stage's last line."""
    counts = {}
    for nodeid, outcome in done.items():
        counts.setdefault(outcome, []).append(nodeid)
    if hung:
        counts["hung"] = hung
    parts = []
    for outcome in ("passed", "skipped", "failed", "timed-out", "hung"):
        ids = counts.get(outcome, [])
        if ids:
            named = f" ({', '.join(i.split('::', 1)[-1] for i in ids[:4])}{', ...' if len(ids) > 4 else ''})"
            parts.append(f"{len(ids)} {outcome}{named if outcome not in ('passed', 'skipped') else ''}")
    return ", ".join(parts) or "no tests"


def run_until_done(name: str, command: list[str], args) -> int:
    """`command` (a pytest run) with the time limit and a progress file, started again after each hung test
    without it and the tests done; returns pytest's exit status (1 if a test hung)."""
    with tempfile.TemporaryDirectory(prefix=f"fusedoff_{name}_") as scratch:
        return _run_until_done(name, command, args, Path(scratch) / "progress.txt")


def _run_until_done(name: str, command: list[str], args, progress: Path) -> int:
    hung: list[str] = []
    start = time.monotonic()
    rc = 0
    for attempt in range(args.restarts + 1):
        done, _ = read_progress(progress)
        run = [*command, "-q", "-rfE", f"--test-timeout={args.timeout_s:g}", f"--test-timeout-grace={args.grace_s:g}",
               f"--test-progress={progress}", *(f"--deselect={nodeid}" for nodeid in [*done, *hung])]
        again = f" (again, without {len(done)} done and {len(hung)} hung)" if attempt else ""
        print(f"== {name}{again}: pytest {' '.join(command[3:])}", flush=True)
        rc = subprocess.run(run, cwd=ROOT).returncode
        _, running = read_progress(progress)
        if running is None:
            break
        hung.append(running)
        print(f"HUNG: {running}: the process was ended {args.timeout_s + args.grace_s:g} s after the test "
              f"started (a timeout it could not take); its stacks:", flush=True)
        print(progress.read_text(errors="replace").split(f"start {running}\n")[-1][:3000], flush=True)
        if args.deadline_s is not None and time.monotonic() - start > args.deadline_s:
            print(f"{name}: past --deadline-s, the rest is not run", flush=True)
            break
    rc = 1 if hung else (0 if rc == 5 else rc)  # 5: nothing collected (no such tests here)
    print(f"{name}: {summary(read_progress(progress)[0], hung)}; exit {rc}", flush=True)
    return rc


def collect(groups: list[str]) -> int:
    """Prints the tests of `groups` in the order the stages run them, from one collection of every
    cuda-marked test (the stages' marker expressions, paths and --ignore, applied here)."""
    import pytest

    class Collected:
        items: list = []
        skipped: list = []  # (module, reason): modules that skip whole, e.g. for a package not installed

        def pytest_collectreport(self, report):
            if report.skipped:
                reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
                Collected.skipped.append((report.nodeid, reason.removeprefix("Skipped: ")))

        def pytest_collection_finish(self, session):
            Collected.items = [(item.nodeid, "triton" in item.keywords) for item in session.items]

    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet):  # pytest's own list, in collection order: the groups' below
        status = pytest.main(["--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests"],
                             plugins=[Collected()])
    if status not in (0, 5):
        print(quiet.getvalue()[-3000:], flush=True)
    for group in groups:
        marker, paths, left_out = GROUPS[group]
        triton = marker == "cuda and triton"

        def place(nodeid: str) -> int | None:
            """The index of the group's path that holds the test (pytest runs them in that order), or None."""
            path = nodeid.split("::", 1)[0]
            if path in left_out:
                return None
            return next((i for i, p in enumerate(paths) if path == p or path.startswith(p + "/")), None)

        ids = sorted((nodeid for nodeid, is_triton in Collected.items
                      if is_triton == triton and place(nodeid) is not None), key=place)
        print(f"== {group}: {len(ids)} tests, in this order:")
        print("\n".join(f"  {i}" for i in ids), flush=True)
    print(f"== modules skipped whole at collection: {len(Collected.skipped)}")
    print("\n".join(f"  skipped {module}: {reason}" for module, reason in Collected.skipped), flush=True)
    return 0 if status in (0, 5) else int(status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("groups", nargs="*", help=f"of {', '.join(GROUPS)}")
    parser.add_argument("--paths", nargs="+", default=None,
                        help="run these test files (no marker) instead of the groups: the rehearsal's own tests")
    parser.add_argument("--timeout-s", type=float, default=float(os.environ.get("TEST_TIMEOUT_S", 60)),
                        help="per test (default $TEST_TIMEOUT_S or 60)")
    parser.add_argument("--grace-s", type=float, default=10.0, help="after a timeout a test could not take")
    parser.add_argument("--restarts", type=int, default=3, help="runs started again after a hung test")
    parser.add_argument("--deadline-s", type=float, default=None, help="start no run again after this")
    parser.add_argument("--collect-only", action="store_true", help="only list the tests, in their order")
    parser.add_argument("--pytest-args", type=shlex.split, default=[], help="more pytest arguments, in one string")
    args = parser.parse_args(argv)
    if any(g not in GROUPS for g in args.groups) or not (args.groups or args.paths):
        parser.error(f"name groups of {', '.join(GROUPS)}, or --paths")
    if args.paths:
        command = [sys.executable, "-m", "pytest", *args.paths, "-p", "no:cacheprovider", *args.pytest_args]
        return run_until_done("tests", command, args)
    if args.collect_only:
        return collect(args.groups)
    status = 0
    for group in args.groups:
        status = max(status, run_until_done(group, pytest_command(group, args.pytest_args), args))
    return status


if __name__ == "__main__":
    sys.exit(main())
