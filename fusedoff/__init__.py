"""fusedoff: fused optimizers whose state lives in host memory and streams to the GPU."""

from fusedoff._ext import NativeExtensionUnavailable
from fusedoff.offload.transaction import StepIncompleteError
from fusedoff.optim import Adam, AdamW, Apollo

__version__ = "0.1.0"

__all__ = ["Adam", "AdamW", "Apollo", "NativeExtensionUnavailable", "StepIncompleteError", "__version__"]
