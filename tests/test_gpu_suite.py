"""The GPU suite's machinery, the cheap parts of its rehearsal (bash benchmarks/gpu_suite.sh --rehearse runs
all of it): a build stopped at its limit leaves no lock, later stages never build and never wait, a test
that hangs cannot eat its stage, and a benchmark killed at any moment keeps every row it measured."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "gpu_suite"
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_step  # noqa: E402
import peers  # noqa: E402
import timing  # noqa: E402
import traffic  # noqa: E402
from gpu_suite import cuda_tests, image_packages, jit_build  # noqa: E402

from fusedoff import _ext  # noqa: E402
from tests.optional_packages import OPTIONAL  # noqa: E402


# ---- item 1: one build, with a clean limit; later stages load it or nothing -------------------------------

@pytest.fixture
def own_extension_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("FUSEDOFF_CUDA", "0")  # no CUDA_HOME written into this process's environment
    return tmp_path / "ext"


def test_no_jit_reports_unavailable_at_once_beside_a_stale_lock(own_extension_dir):
    name, _ = _ext.jit_plan()
    build_dir = _ext.jit_build_directory(name)
    assert build_dir == own_extension_dir / name
    build_dir.mkdir(parents=True)
    (build_dir / "lock").touch()  # torch <= 2.11 would wait on this for ever
    start = time.monotonic()
    with pytest.raises(_ext.NativeExtensionUnavailable, match="FUSEDOFF_NO_JIT is set and no native extension"):
        _ext._import_jit_built("no prebuilt module here")
    assert time.monotonic() - start < 5


def test_a_build_stopped_at_its_limit_leaves_no_lock_and_no_process(own_extension_dir, monkeypatch, capsys):
    """jit_build.py with a stand-in for torch's JIT: it takes the lock, starts a 'compiler' in its
    process group, writes half a module and never finishes."""
    name, _ = _ext.jit_plan()
    build_dir = own_extension_dir / name
    pid_file = own_extension_dir / "compiler.pid"
    monkeypatch.setattr(jit_build, "CHILD", textwrap.dedent(f"""
        import pathlib, subprocess, time
        build_dir = pathlib.Path({str(build_dir)!r})
        build_dir.mkdir(parents=True, exist_ok=True)
        compiler = subprocess.Popen(["sleep", "300"])
        pathlib.Path({str(pid_file)!r}).write_text(str(compiler.pid))
        (build_dir / "{name}.so").write_bytes(b"half a module")
        (build_dir / "lock").touch()
        time.sleep(300)
    """))
    start = time.monotonic()
    assert jit_build.main(["--ext-dir", str(own_extension_dir), "--limit-s", "1", "--limit-from", "compile"]) == 124
    assert time.monotonic() - start < 60
    assert not (build_dir / "lock").exists() and not (build_dir / f"{name}.so").exists()
    compiler = int(pid_file.read_text())
    time.sleep(0.2)
    assert not running(compiler)  # the whole process group was stopped, not only the python that led it
    assert "TIMED OUT" in capsys.readouterr().out


def running(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, and not a zombie its new parent has yet to reap)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_a_failed_build_is_reported_once(own_extension_dir, monkeypatch, capsys):
    monkeypatch.setattr(jit_build, "CHILD", "raise SystemExit('error: expected ; before }')")
    assert jit_build.main(["--ext-dir", str(own_extension_dir), "--limit-s", "60"]) == 1
    assert "FAILED" in capsys.readouterr().out


# ---- item 2: a time limit per test; a run a hung test ended starts again without it -------------------------

def test_per_test_timeouts_and_a_hung_test(tmp_path):
    (tmp_path / "test_hangs.py").write_text(textwrap.dedent("""
        import signal, time
        def test_1_passes(): pass
        def test_2_too_slow(): time.sleep(60)
        def test_3_stuck_in_c():
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(60)
        def test_4_after_the_hang(): pass
    """))
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(SUITE / "cuda_tests.py"), "--paths", str(tmp_path / "test_hangs.py"),
         "--timeout-s", "1", "--grace-s", "1", "--pytest-args",
         f"-p tests.per_test_timeout --rootdir {tmp_path} -c /dev/null"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == ("tests: 2 passed, 1 timed-out (test_2_too_slow), "
                                              "1 hung (test_3_stuck_in_c); exit 1"), result.stdout
    assert "test_3_stuck_in_c" in result.stdout.split("HUNG:")[1]  # its stacks, for the log
    assert time.monotonic() - start < 60


def test_progress_file_reading(tmp_path):
    progress = tmp_path / "p.txt"
    progress.write_text("start a::x\ndone passed a::x\nstart a::y[1 2]\ndone failed a::y[1 2]\nstart a::z\n")
    done, running = cuda_tests.read_progress(progress)
    assert done == {"a::x": "passed", "a::y[1 2]": "failed"} and running == "a::z"
    assert cuda_tests.summary(done, ["a::z"]) == "1 passed, 1 failed (y[1 2]), 1 hung (z)"


def test_real_stream_tests_run_first():
    assert list(cuda_tests.GROUPS)[0] == "streams"
    marker, paths, _ = cuda_tests.GROUPS["streams"]
    assert set(paths) == {"tests/test_offload.py", "tests/test_optimizer_state.py", "tests/test_memory.py"}
    assert all((ROOT / p).is_file() for p in paths)
    _, _, left_out = cuda_tests.GROUPS["kernels"]
    assert set(left_out) == set(paths)  # every other cuda test runs in the next group, the stream ones once


# ---- item 3: a CSV row per contender as soon as it is measured, all of it within the deadline -------------

def fake_contender(name: str, step, emitted: list, seen: dict) -> bench_step.Contender:
    def build(workload):
        seen[name] = len(emitted)  # rows already in the CSV when this contender starts
        return peers.Built(step, events=False)

    return bench_step.Contender(name, "peer", "none", name, traffic.Traffic(memory=1), build)


@pytest.fixture
def dry_args(tmp_path):
    return bench_step.parse_args(["--dry-run", "--sizes", "4096", "--tensor-size", "1024", "--repeats", "3",
                                  "--warmup", "2", "--out-dir", str(tmp_path)])


def test_rows_are_written_per_contender_before_the_next_one_starts(monkeypatch, dry_args):
    emitted, seen = [], {}
    contenders = [fake_contender(n, lambda: None, emitted, seen) for n in ("a", "b", "c")]
    monkeypatch.setattr(bench_step, "contenders_for", lambda optimizer, workload, args: contenders)
    bench_step.run_group((4096, "adamw", "fp32"), dry_args, traffic.Bandwidth(host=1e10), float("inf"), "",
                         emitted.append)
    assert [[r["contender"] for r in rows] for rows in emitted] == [["a"], ["b"], ["c"]]
    assert seen == {"a": 0, "b": 1, "c": 2}
    assert all(rows[0]["status"] == "ok" and rows[0]["repeats"] == 3 for rows in emitted)


def test_warm_up_is_bounded_by_the_deadline(monkeypatch, dry_args):
    emitted, seen = [], {}
    slow = fake_contender("slow", lambda: time.sleep(30), emitted, seen)
    monkeypatch.setattr(bench_step, "contenders_for", lambda optimizer, workload, args: [slow])
    monkeypatch.setattr(bench_step, "estimate_seconds", lambda *a: 0.0)
    start = time.monotonic()
    bench_step.run_group((4096, "adamw", "fp32"), dry_args, traffic.Bandwidth(host=1e10),
                         time.perf_counter() + 1.0, "", emitted.append)
    assert time.monotonic() - start < 10
    assert emitted[0][0]["status"].startswith("skipped: the deadline passed in its first step")


def test_a_group_past_the_deadline_is_not_allocated(monkeypatch, dry_args):
    allocated = []
    make = bench_step.make_workload

    def spy(*args, **kwargs):
        workload = make(*args, **kwargs)
        allocated.append(len(workload.params))
        return workload

    monkeypatch.setattr(bench_step, "make_workload", spy)
    emitted = []
    bench_step.run_group((4096, "adamw", "fp32"), dry_args, traffic.Bandwidth(host=1e10),
                         time.perf_counter() - 1.0, "", emitted.append)
    assert allocated == [0]
    assert emitted and all(rows[0]["status"] == "skipped: past the deadline" for rows in emitted)


def test_csv_is_replaced_whole(tmp_path):
    path = tmp_path / "r.csv"
    timing.write_csv(path, [{"a": 1}], {"m": "x"})
    timing.write_csv(path, [{"a": 1}, {"a": 2}], {"m": "x"})
    assert [r["a"] for r in timing.read_csv(path)] == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.csv"]


# ---- item 6: the environment, first -------------------------------------------------------------------------

def test_environment_report_runs_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("the GPU suite prints it on a GPU")
    result = subprocess.run([sys.executable, str(SUITE / "machine.py")], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"torch {torch.__version__}" in result.stdout
    assert "pinned memory: not probed (no CUDA device)" in result.stdout


# ---- item 7: the GPU machine's own packages -----------------------------------------------------------------

def test_the_image_packages_are_pinned_and_in_the_image():
    pinned, image = image_packages.read()
    assert {"torch", "triton", "pytest", "numpy", "setuptools", "ninja"} <= set(pinned)
    assert pinned["torch"] == "2.11.0" and pinned["triton"] == "3.6.0"
    assert all(version for version in pinned.values()), pinned  # each one pinned
    assert set(pinned) <= image
    assert not {"expecttest", "deepspeed", "torchao", "bitsandbytes"} & image
    present = {"torch": "2.11.0", "Py_CPUInfo": "9.0.0", "py-cpuinfo2": "10.1.1", "expecttest": "0.3.0"}
    assert image_packages.not_in_image(image, present) == ["expecttest 0.3.0", "py-cpuinfo2 10.1.1"]


def test_optional_packages_are_all_in_make_tests_venv():
    """Where a test's package is missing it skips (tests/optional_packages.py): never in CI's venv."""
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip("not make test's venv (.venv)")
    assert [p for p in OPTIONAL if importlib.util.find_spec(p) is None] == []


def test_tests_needing_an_absent_package_skip_instead_of_failing_collection():
    """The optional packages made absent in a pytest of their tests: each skips with its reason (the GPU
    machine's image has no expecttest: tests/test_torch_conformance.py failed its collection there)."""
    block = f"import sys; sys.modules.update(dict.fromkeys({sorted(OPTIONAL)!r}))"  # None: not installed
    tests = ["tests/test_torch_conformance.py", "tests/test_integrations.py", "tests/test_demo.py::test_demo_plot",
             "tests/test_memory.py::test_plot_writes_a_png"]
    result = subprocess.run(
        [sys.executable, "-c", f"{block}; import pytest; sys.exit(pytest.main({tests!r} + ['-q', '-rs', '-p', "
         "'no:cacheprovider']))"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "8 skipped" in result.stdout.splitlines()[-1], result.stdout
    # each at its test's line (the whole module, for the conformance tests); the Trainer's tests need
    # accelerate too, and skip for it first
    for module, package in (("test_torch_conformance", "expecttest"), ("test_integrations", "accelerate"),
                            ("test_integrations", "lightning"), ("test_demo", "matplotlib"),
                            ("test_memory", "matplotlib")):
        assert re.search(rf"SKIPPED \[\d\] tests/{module}.py:\d+: needs {package}, for ", result.stdout), module
