"""The packages some tests need and fusedoff does not: a test module (or a test) that needs one skips,
saying which and why, where it is not installed, as on the GPU machine's image (no expecttest, see
benchmarks/gpu_suite/image_packages.txt) or a user's plain `pip install fusedoff pytest`.

The skip asks only whether the package is there (importlib.util.find_spec), never whether importing it
works: a package that is installed but broken fails its tests as before. make test's venv holds every
one of them, and tests/test_gpu_suite.py fails there if one is missing, so nothing skips in CI."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

import pytest

OPTIONAL = {  # package: what needs it (all in make test's venv: the test extra, the demo extra, the integrations)
    "expecttest": "torch.testing._internal's optimizer database, which imports it",
    "transformers": "the Hugging Face Trainer recipe",
    "accelerate": "the accelerate and Hugging Face Trainer recipes",
    "lightning": "the Lightning recipe",
    "matplotlib": "the plots",
}


def require(package: str) -> ModuleType:
    """`package`, imported; or the test skipped (the whole module, where called at its top level)."""
    __tracebackhide__ = True  # the skip reported at the caller's line
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"needs {package}, for {OPTIONAL[package]}; not installed here", allow_module_level=True)
    return importlib.import_module(package)
