import os

import pytest
import torch

# The GPU suite's per-test time limit and progress file (--test-timeout, --test-progress).
from tests.per_test_timeout import *  # noqa: F401,F403 (its hooks, listed in its __all__)

# Triton runs through its interpreter on machines without a GPU; this must be set before triton
# is first imported. torch.cuda.is_available() asks the driver without initialising CUDA.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU (run by benchmarks' GPU suite on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)
