import os

# OpenMP threads that wait at a barrier sleep instead of spinning. The tests run many small torch ops
# (references, oracles) on a shared machine with few cores: with spinning waiters, a parallel region
# whose other thread has been descheduled stalls the region, and small-op tests ran ~3x slower
# than with one thread (tests/test_apollo.py: 51 s with 2 spinning threads, 17 s passive, 17 s with one
# thread). Passive waiting keeps every kernel exactly as multi-threaded as before (fusedoff's CPU
# kernels use torch's thread count) and changes no result. It must be set before libgomp is loaded,
# that is before torch is first imported; an OMP_WAIT_POLICY already in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# The GPU suite's per-test time limit and progress file (--test-timeout, --test-progress).
from tests.per_test_timeout import *  # noqa: F401,F403 (its hooks, listed in its __all__)

# Triton runs through its interpreter on machines without a GPU; this must be set before triton
# is first imported. torch.cuda.is_available() asks the driver without initialising CUDA.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The test backend cuda_emulated, added to fusedoff.backends (after TRITON_INTERPRET: fusedoff imports triton).
import fusedoff.testing  # noqa: E402,F401


def _emulation_unavailable() -> str | None:
    """Why the emulated CUDA kernels cannot run here, or None."""
    from fusedoff import NativeExtensionUnavailable
    from fusedoff.testing.emulation import load_emulated_extension

    try:
        load_emulated_extension()
    except NativeExtensionUnavailable as exc:
        return str(exc)
    return None


def pytest_collection_modifyitems(config, items):
    # `emulated` tests need fusedoff._C_emulated (FUSEDOFF_CUDA_EMULATION=1 builds it). Where it is
    # missing they skip, unless FUSEDOFF_REQUIRE_EMULATION=1 (make test, so CI) makes that a failure.
    if any(item.get_closest_marker("emulated") for item in items):
        reason = _emulation_unavailable()
        if reason is not None:
            if os.environ.get("FUSEDOFF_REQUIRE_EMULATION", "") == "1":
                raise pytest.UsageError(f"FUSEDOFF_REQUIRE_EMULATION=1 but the emulated CUDA kernels do not load: {reason}")
            mark = pytest.mark.skip(reason=f"the emulated CUDA kernels are not built: {reason}")
            for item in items:
                if item.get_closest_marker("emulated"):
                    item.add_marker(mark)
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU (run by benchmarks' GPU suite on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


@pytest.fixture(autouse=True)
def _sigint_handler_kept(request):
    """Every test leaves SIGINT's handler as it found it: the fault injection (tests/test_step_faults.py)
    raises a real SIGINT and needs Python's KeyboardInterrupt. A test that leaves another handler
    (a training library's signal connector, say) fails here, naming itself, and the handler is put back."""
    import signal

    before = signal.getsignal(signal.SIGINT)
    yield
    after = signal.getsignal(signal.SIGINT)
    if after is not before:
        signal.signal(signal.SIGINT, before)
        pytest.fail(f"{request.node.nodeid} left SIGINT handled by {after!r} (it was {before!r})", pytrace=False)
