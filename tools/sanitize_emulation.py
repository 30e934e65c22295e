"""Runs the `emulated` tests under ThreadSanitizer and under AddressSanitizer + UBSan.

    python tools/sanitize_emulation.py [--sanitizer thread|address|all] [--build-dir DIR]
                                       [--planted | --no-planted] [--workers N] [-- PYTEST ARGS]

For each sanitizer it builds fusedoff._C_emulated (the CUDA kernels on the host, csrc/emulation)
instrumented by it into DIR/<sanitizer>, then runs tests/test_cuda_emulation.py (every kernel in
every mode, across every chunk and launch-table boundary, views at odd offsets, the emulator's own
rules) with the sanitizer's runtime preloaded and FUSEDOFF_EMULATED_EXTENSION naming that build;
the first report stops the run and fails it. ``-- -m emulated`` runs every emulated test instead
(about 3 minutes under TSan, over 20 under ASan on two loaded cores: not for every CI run). Under ThreadSanitizer emulator.cpp itself is compiled without instrumentation
(it tells TSan what the emulated hardware orders: [note: CUDA emulation]).

Then (``--planted``, the default) it shows that each sanitizer can fail: it builds a copy of the
kernels with one bug planted and expects its sanitizer to report it on a few tests:
  thread   one __syncthreads removed from the Adam kernel: threads read the step's scalars that
           thread 0 writes to shared memory, unordered (a data race)
  address  the Adam kernel's scalar tail reads one element past its chunk (past the tensor)
A planted bug that goes unreported fails the run. Exit status 0 only if every run is clean and
every planted bug was reported. The builds run side by side, then every run (each sanitizer's tests
split in --workers shards, each planted bug) as a job of its own. CI runs it (.ci/run).

The builds run in a child process with the runtime preloaded (it loads what it built), its
compilers without it. PYTHON: the interpreter to use (default: this one).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fusedoff import _build  # noqa: E402  (imports nothing from torch)

# Preloaded in this order. libstdc++ right after ASan's runtime: python does not link it, and ASan
# must find the real __cxa_throw when it starts (torch throws and catches C++ exceptions).
RUNTIMES = {"thread": ["libtsan.so"], "address": ["libasan.so", "libstdc++.so.6"]}
OPTIONS = {
    # ignore_noninstrumented_modules: torch's own (uninstrumented) copies and thread pools are not ours to check.
    "thread": {"TSAN_OPTIONS": "halt_on_error=1 exitcode=66 ignore_noninstrumented_modules=1 report_signal_unsafe=0"},
    "address": {"ASAN_OPTIONS": "detect_leaks=0 halt_on_error=1 alloc_dealloc_mismatch=0 exitcode=66",
                "UBSAN_OPTIONS": "halt_on_error=1 print_stacktrace=1 exitcode=66"},
}
REPORTS = {"thread": "WARNING: ThreadSanitizer: data race", "address": "ERROR: AddressSanitizer"}
# The planted bugs: (file under csrc, the text, its replacement, the tests that run into it). The
# planted build compiles the kernel file's wrapper alone (PLANTED_SOURCE) and reuses the clean
# build's other objects.
PLANTED_SOURCE = "adam_cuda_emulated.cpp"
PLANTED = {
    "thread": ("cuda/adam_cuda.cu",
               "  __syncthreads();\n  if (block_skips) return;  // AMP overflow: change nothing\n",
               "  if (block_skips) return;  // AMP overflow: change nothing\n",
               "tests/test_adam_op.py::test_against_torch_optim"),
    "address": ("cuda/adam_cuda.cu",
                "  for (int i = runs.vector_end + thread; i < work.numel; i += kThreads)\n",
                "  for (int i = runs.vector_end + thread; i <= work.numel; i += kThreads)\n",
                "tests/test_adam_op.py::test_against_torch_optim"),
}


def runtime_preload(sanitizer: str) -> str:
    paths = []
    for lib in RUNTIMES[sanitizer]:
        path = subprocess.run(["g++", f"-print-file-name={lib}"], capture_output=True, text=True, check=True).stdout.strip()
        if not os.path.isabs(path):
            raise SystemExit(f"sanitize_emulation: g++ has no {lib} (install the compiler's sanitizer runtimes)")
        paths.append(path)
    return " ".join(paths)


def sanitized_env(sanitizer: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "FUSEDOFF_EMULATED_EXTENSION"}
    env.update(OPTIONS[sanitizer], LD_PRELOAD=runtime_preload(sanitizer), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               **extra)
    return env


# Run in the child: build (compilers without the preload), then load what was built.
_BUILD_CHILD = textwrap.dedent("""
    import os, subprocess, sys, json
    os.environ.pop("LD_PRELOAD", None)  # this process keeps its runtime; the compilers it starts do not
    sys.path.insert(0, sys.argv[1])
    from fusedoff import _build
    from torch.utils import cpp_extension
    sanitizer, csrc, out, only, objects_from = sys.argv[2:7]
    _build.CSRC_DIR = __import__("pathlib").Path(csrc)
    _build.EMULATION_DIR = _build.CSRC_DIR / "emulation"
    sources = _build.emulation_kernel_sources()
    ldflags = _build.emulation_link_args(sanitizer)
    if sanitizer == "thread":  # emulator.cpp uninstrumented: its own object
        obj = os.path.join(out, "emulator_uninstrumented.o")
        subprocess.run(["g++", "-std=c++17", "-fPIC", "-c", *_build.emulation_runtime_compile_args(sanitizer),
                        *["-I" + d for d in _build.emulation_include_dirs()], _build.emulation_runtime_source(),
                        "-o", obj], check=True)
        ldflags = [obj, *ldflags]
    else:
        sources.append(_build.emulation_runtime_source())
    if only:  # compile that source alone; the others' objects come from the build in objects_from
        keep = [s for s in sources if os.path.basename(s) == only]
        reused = [os.path.join(objects_from, os.path.basename(s).rsplit(".", 1)[0] + ".o") for s in sources
                  if s not in keep]
        sources, ldflags = keep, [*reused, *ldflags]
    module = cpp_extension.load(name="_C_emulated", sources=sources, extra_include_paths=_build.emulation_include_dirs(),
                                extra_cflags=_build.emulation_compile_args(sanitizer), extra_ldflags=ldflags,
                                build_directory=out, verbose=False)
    print("built", module.__file__)
""")


def build(sanitizer: str, csrc: Path, out: Path, python: str, only: str = "", objects_from: Path | None = None) -> Path:
    """Builds the module from `csrc` into `out`; with `only`, compiles that source alone and links
    it with the other objects of the build in `objects_from`."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("_C_emulated*.so"):  # emulator.o is outside ninja's view: always relink
        stale.unlink()
    env = sanitized_env(sanitizer, MAX_JOBS=os.environ.get("MAX_JOBS", str(os.cpu_count() or 1)))
    proc = subprocess.run([python, "-c", _BUILD_CHILD, str(REPO), sanitizer, str(csrc), str(out), only,
                           str(objects_from or "")], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout + proc.stderr)
        raise SystemExit(f"sanitize_emulation: the {sanitizer} build failed (exit {proc.returncode})")
    return next(out.glob("_C_emulated*.so"))


def run_tests(sanitizer: str, module: Path, python: str, pytest_args: list[str], log: Path) -> tuple[int, str]:
    env = sanitized_env(sanitizer, FUSEDOFF_EMULATED_EXTENSION=str(module), FUSEDOFF_REQUIRE_EMULATION="1")
    # --capture=sys: a sanitizer writes its report to fd 2 and ends the process at once, before pytest
    # would print what it captured there.
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--capture=sys", *pytest_args]
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    return proc.returncode, log.read_text(errors="replace")


def planted_copy(sanitizer: str, root: Path) -> Path:
    """A copy of csrc with the sanitizer's planted bug."""
    rel, old, new, _ = PLANTED[sanitizer]
    csrc = root / "csrc"
    shutil.rmtree(csrc, ignore_errors=True)
    shutil.copytree(REPO / "csrc", csrc)
    path = csrc / rel
    text = path.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"sanitize_emulation: the planted {sanitizer} bug no longer applies to csrc/{rel}")
    path.write_text(text.replace(old, new))
    return csrc


def collected(sanitizer: str, module: Path, python: str, pytest_args: list[str]) -> list[str]:
    """The test ids that `pytest_args` select, collected as the sanitized run would collect them."""
    env = sanitized_env(sanitizer, FUSEDOFF_EMULATED_EXTENSION=str(module), FUSEDOFF_REQUIRE_EMULATION="1")
    proc = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", *pytest_args],
                          cwd=REPO, env=env, capture_output=True, text=True)
    ids = [line for line in proc.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if proc.returncode != 0 or not ids:
        sys.stdout.write(proc.stdout[-5000:] + proc.stderr[-5000:])
        raise SystemExit(f"sanitize_emulation: collecting the {sanitizer} run's tests failed (exit {proc.returncode})")
    return ids


def tests_job(sanitizer: str, module: Path, python: str, pytest_args: list[str], log: Path, label: str):
    """A run of the clean build's tests: (report lines, failed run or None)."""
    start = time.perf_counter()
    code, text = run_tests(sanitizer, module, python, pytest_args, log)
    tail = "\n".join(text.strip().splitlines()[-2:])
    verdict = "clean" if code == 0 else f"FAILED (exit {code})"
    lines = [f"[{sanitizer}] {label}: {time.perf_counter() - start:.0f} s, {verdict}\n{tail}"]
    if code != 0:
        lines.append(text[-20000:])
    return lines, None if code == 0 else f"{sanitizer} {label}"


def planted_job(sanitizer: str, clean_build: Path, args, python: str):
    """Builds the planted bug beside the clean build's objects and expects its sanitizer to report it."""
    start = time.perf_counter()
    planted = args.build_dir / f"{sanitizer}-planted"
    module = build(sanitizer, planted_copy(sanitizer, planted), planted / "build", python, only=PLANTED_SOURCE,
                   objects_from=clean_build)
    code, text = run_tests(sanitizer, module, python, [PLANTED[sanitizer][3], "-m", "emulated", "-x"],
                           planted / "pytest.log")
    caught = code != 0 and REPORTS[sanitizer] in text
    lines = [f"[{sanitizer}] planted bug ({PLANTED[sanitizer][0]}): "
             f"{'reported' if caught else 'NOT REPORTED'} ({time.perf_counter() - start:.0f} s)"]
    if caught:
        lines.append("    " + "\n    ".join(text[text.index(REPORTS[sanitizer]):].splitlines()[:6]))
    else:
        lines.append(text[-5000:])
    return lines, None if caught else f"{sanitizer}-planted"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sanitizer", choices=[*RUNTIMES, "all"], default="all")
    parser.add_argument("--build-dir", type=Path, default=REPO / "build" / "emulation-sanitized")
    parser.add_argument("--planted", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="runs side by side after the builds (default: the CPUs)")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments (default: the emulation tests)")
    args = parser.parse_args()
    python = os.environ.get("PYTHON", sys.executable)
    sanitizers = list(RUNTIMES) if args.sanitizer == "all" else [args.sanitizer]
    pytest_args = args.pytest_args or ["tests/test_cuda_emulation.py"]
    workers = max(1, args.workers)
    # Two phases, each keeping every core busy: the builds side by side (ninja's jobs share the cores),
    # then every run as a job of its own, longest first: a sanitizer's tests in `workers` shards (the
    # slowest sanitizer, ASan, dominates), the planted bugs (a one-file build and a few tests each).
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(sanitizers)) as pool:
        modules = dict(zip(sanitizers, pool.map(lambda s: build(s, REPO / "csrc", args.build_dir / s, python),
                                                sanitizers)))
    lines = [f"builds: {time.perf_counter() - start:.0f} s ({', '.join(sanitizers)} side by side)"]
    jobs = []
    for sanitizer in sanitizers:
        ids = collected(sanitizer, modules[sanitizer], python, pytest_args)
        shards = [ids[i::workers] for i in range(min(workers, len(ids)))]
        for i, shard in enumerate(shards):
            label = f"tests {i + 1} of {len(shards)} ({len(shard)})"
            log = args.build_dir / sanitizer / f"pytest-{i + 1}.log"
            jobs.append(functools.partial(tests_job, sanitizer, modules[sanitizer], python, shard, log, label))
        if args.planted:
            jobs.append(functools.partial(planted_job, sanitizer, args.build_dir / sanitizer, args, python))
    # ASan's jobs first: they are the long ones.
    jobs.sort(key=lambda job: job.args[0] != "address")
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda job: job(), jobs))
    failures = [failed for _, failed in results if failed]
    print("\n".join(lines + [line for job_lines, _ in results for line in job_lines]), flush=True)
    runs = len(sanitizers) * (2 if args.planted else 1)
    failed_runs = {f.split(" ")[0] for f in failures}
    print(f"sanitize_emulation: {runs - len(failed_runs)} passed, {len(failed_runs)} failed"
          + (f": {', '.join(failures)}" if failures else "") + f" ({time.perf_counter() - start:.0f} s)")
    return 1 if failures else 0

if __name__ == "__main__":
    sys.exit(main())
