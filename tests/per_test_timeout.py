"""A pytest plugin for the GPU suite: a time limit per test, and a progress file that lets a run be
started again after a test that never returned. tests/conftest.py loads it; ``-p tests.per_test_timeout``
loads it elsewhere.

  --test-timeout=S         at S seconds SIGALRM fails the running test (setup, call and teardown
                           together) and the run goes on with the next one.
  --test-timeout-grace=G   a test stuck in C (a CUDA synchronisation that never returns holds the
                           signal off) cannot take that failure: G seconds later faulthandler writes
                           every thread's stack and ends the process.
  --test-progress=FILE     "start NODEID" before and "done OUTCOME NODEID" after each test (passed,
                           skipped, failed, timed-out), and those stacks: a last line "start ..."
                           names the test the process died in, and benchmarks/gpu_suite/cuda_tests.py runs
                           pytest again without it and the tests done.

pytest-timeout is not used: it is on the GPU machine's image (and so in the rehearsal's venv, see
benchmarks/gpu_suite/image_packages.txt), but not in make test's venv, where this plugin's own tests run.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

import pytest

__all__ = ["pytest_addoption", "pytest_runtest_protocol", "pytest_runtest_makereport", "pytest_unconfigure"]

TIMEOUT_MESSAGE = "timed out after"


def pytest_addoption(parser):
    group = parser.getgroup("fusedoff", "fusedoff's GPU suite")
    group.addoption("--test-timeout", type=float, default=0.0, metavar="S",
                    help="fail a test after S seconds (0, the default: no limit)")
    group.addoption("--test-timeout-grace", type=float, default=10.0, metavar="G",
                    help="end the process G seconds after a timeout the test could not take (default 10)")
    group.addoption("--test-progress", default=None, metavar="FILE",
                    help="append 'start NODEID' / 'done NODEID' lines (and a hung test's stacks) to FILE")


def _progress(config):
    path = config.getoption("test_progress")
    if path is None:
        return None
    if not hasattr(config, "_fusedoff_progress"):
        config._fusedoff_progress = open(path, "a", buffering=1)  # noqa: SIM115 (open for the session)
    return config._fusedoff_progress


def _note(log, line: str) -> None:
    if log is not None:
        log.write(line + "\n")
        log.flush()
        os.fsync(log.fileno())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    config = item.config
    limit = config.getoption("test_timeout")
    log = _progress(config)
    _note(log, f"start {item.nodeid}")
    previous = None
    if limit > 0:
        def on_alarm(signum, frame):
            pytest.fail(f"{TIMEOUT_MESSAGE} {limit:g} s (--test-timeout)", pytrace=False)

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, limit)
        faulthandler.dump_traceback_later(limit + config.getoption("test_timeout_grace"), exit=True,
                                          file=log if log is not None else sys.__stderr__)
    item._fusedoff_outcome = "passed"
    try:
        yield
    finally:
        if limit > 0:
            signal.setitimer(signal.ITIMER_REAL, 0)
            faulthandler.cancel_dump_traceback_later()
            signal.signal(signal.SIGALRM, previous)
        _note(log, f"done {item._fusedoff_outcome} {item.nodeid}")


RANK = ("passed", "skipped", "failed", "timed-out")


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The test's outcome over its phases, for the progress file: the worst of them."""
    report = (yield).get_result()
    outcome = "skipped" if report.skipped else "failed" if report.failed else "passed"
    if report.failed and TIMEOUT_MESSAGE in str(report.longrepr):
        outcome = "timed-out"
    current = getattr(item, "_fusedoff_outcome", "passed")
    item._fusedoff_outcome = max(current, outcome, key=RANK.index)


def pytest_unconfigure(config):
    log = getattr(config, "_fusedoff_progress", None)
    if log is not None:
        log.close()
