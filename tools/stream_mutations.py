"""Proof that the stream simulation can fail: remove each single wait or event record of the engine.

For every line of fusedoff/offload/pipeline.py, engine.py, schedule.py, bucket.py and host_share.py
(and fusedoff/optim/base.py) that orders device work (a wait on an event or a stream, an event
record, a host synchronisation, the main stream's join, the host's wait before writing into the
store, the host's wait for its worker), this
script copies the package to a scratch folder, removes that one line's effect, runs
tests/test_stream_simulation.py and tests/test_overlap.py and tests/test_host_share.py (and the simulated cases of
tests/test_outside_writes.py and tests/test_step_faults.py) against the copy, and reports whether
the tests failed (caught: by the race checker, or by a wrong value) or passed (missed).

    .venv/bin/python tools/stream_mutations.py            # prints "N of M single-wait removals caught"
    .venv/bin/python tools/stream_mutations.py host_share  # only the files whose path holds one of these

Exit status 0 when every removal is caught. It takes a few minutes (a missed removal runs the
whole simulation file); it is not part of every CI run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("fusedoff/offload/pipeline.py", "fusedoff/offload/engine.py", "fusedoff/offload/schedule.py",
           "fusedoff/offload/bucket.py", "fusedoff/offload/host_share.py", "fusedoff/optim/base.py")
# (pattern, replacement): the replacement keeps the line's indentation and makes it do nothing.
RULES = (
    (re.compile(r"^(\s*)(rt|self\.runtime)\.(wait_event|wait_stream)\(.*\)\s*(#.*)?$"), r"\1pass  # MUTATED"),
    (re.compile(r"^(\s*)([\w\[\]\.\(\)]+) = (rt|self\.runtime)\.(record|timer)\(.*\)\s*(#.*)?$"), r"\1\2 = None  # MUTATED"),
    (re.compile(r"^(\s*)(\w+\.)?runtime\.synchronize\(.*\)\s*(#.*)?$"), r"\1pass  # MUTATED"),
    (re.compile(r"^(\s*)(rt|(\w+\.)?runtime)\.wait_host_compute\(.*\)\s*(#.*)?$"), r"\1pass  # MUTATED"),
    (re.compile(r"^(\s*)self\.before_host_write\(\)\s*(#.*)?$"), r"\1pass  # MUTATED"),
    (re.compile(r"^(\s*)(\w+\.)*pipeline\.join\(\)\s*(#.*)?$"), r"\1pass  # MUTATED"),
    (re.compile(r"^(\s*)self\.(_engine\.)?join\(\)\s*(#.*)?$"), r"\1pass  # MUTATED"),
    (re.compile(r"^(\s*)pipeline\.wait_host\(\)\s*(#.*)?$"), r"\1pass  # MUTATED"),
)


@dataclass
class Mutation:
    path: str
    line: int  # 1-based
    original: str
    mutated: str


def mutations() -> list[Mutation]:
    out = []
    for path in TARGETS:
        for number, line in enumerate((ROOT / path).read_text().splitlines(), start=1):
            for pattern, replacement in RULES:
                if pattern.match(line):
                    out.append(Mutation(path, number, line.strip(), pattern.sub(replacement, line)))
                    break
    return out


def run(mutation: Mutation, scratch: Path) -> tuple[bool, str]:
    """(caught, how) for one mutation applied to a copy of the package in `scratch`."""
    package = scratch / "fusedoff"
    if package.exists():
        shutil.rmtree(package)
    shutil.copytree(ROOT / "fusedoff", package, ignore=shutil.ignore_patterns("__pycache__"))
    target = scratch / mutation.path
    lines = target.read_text().splitlines()
    lines[mutation.line - 1] = mutation.mutated
    target.write_text("\n".join(lines) + "\n")
    env = {**os.environ, "PYTHONPATH": f"{scratch}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONDONTWRITEBYTECODE": "1"}
    where = subprocess.run([sys.executable, "-c", "import fusedoff; print(fusedoff.__file__)"], env=env,
                           capture_output=True, text=True, cwd=scratch)
    if not where.stdout.startswith(str(scratch)):
        raise SystemExit(f"the scratch copy is not the one imported ({where.stdout.strip()} {where.stderr[-500:]})")
    # The test file and an empty pytest configuration in the scratch folder: the project's own
    # configuration would put the repository (and its unmutated package) first on sys.path.
    (scratch / "tests").mkdir(exist_ok=True)
    for test_file in (ROOT / "tests").glob("*.py"):  # conftest.py and what it imports: cuda tests skip here
        shutil.copy(test_file, scratch / "tests")
    (scratch / "pytest.ini").write_text("[pytest]\n")
    # The simulated cases of the outside-write tests too: a streamed master's kernel reads the
    # parameter beside it, and assigned masters are written into the store between two steps. And
    # those of the fault tests: after a failure among a step's changes, the host writes a loaded
    # checkpoint into the store once the pipeline has settled.
    test = subprocess.run([sys.executable, "-m", "pytest", "tests/test_stream_simulation.py", "tests/test_outside_writes.py",
                           "tests/test_overlap.py", "tests/test_host_share.py", "tests/test_step_faults.py",
                           "-k", "not test_outside_writes and not test_step_faults or simulated", "-c", "pytest.ini", "-x",
                           "-q", "-p", "no:cacheprovider"],
                          env=env, capture_output=True, text=True, cwd=scratch)
    if "fusedoff" not in test.stdout + test.stderr and test.returncode not in (0, 1):
        raise SystemExit(f"pytest did not run: {test.stdout[-2000:]} {test.stderr[-2000:]}")
    if test.returncode == 0:
        return False, "the simulation tests passed"
    output = test.stdout + test.stderr
    failed = re.search(r"FAILED (\S+)", output)
    kind = "race reported" if "RaceError" in output else ("deadlock" if "deadlock" in output else "wrong values")
    return True, f"{kind} ({failed.group(1).split('::')[-1] if failed else 'collection failed'})"


def main() -> int:
    only = sys.argv[1:]
    found = [m for m in mutations() if not only or any(part in m.path for part in only)]
    caught = 0
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fusedoff_mut_") as scratch:
        for i, mutation in enumerate(found, start=1):
            ok, how = run(mutation, Path(scratch))
            caught += ok
            print(f"[{i}/{len(found)}] {'caught' if ok else 'MISSED'}: {mutation.path}:{mutation.line} "
                  f"`{mutation.original}` -> {how}", flush=True)
    print(f"{caught} of {len(found)} single-wait removals caught ({time.perf_counter() - start:.0f} s)")
    return 0 if caught == len(found) else 1


if __name__ == "__main__":
    sys.exit(main())
