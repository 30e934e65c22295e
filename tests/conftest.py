import os

import pytest
import torch

# The GPU suite's per-test time limit and progress file (--test-timeout, --test-progress).
from tests.per_test_timeout import *  # noqa: F401,F403 (its hooks, listed in its __all__)

# Triton runs through its interpreter on machines without a GPU; this must be set before triton
# is first imported. torch.cuda.is_available() asks the driver without initialising CUDA.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _emulation_unavailable() -> str | None:
    """Why the emulated CUDA kernels cannot run here, or None."""
    from fusedoff import _ext

    try:
        _ext.load_emulated_extension()
    except _ext.NativeExtensionUnavailable as exc:
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
