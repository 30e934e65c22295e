"""fusedoff: fused optimizers whose state lives in host memory and streams to the GPU."""

from fusedoff._ext import NativeExtensionUnavailable
from fusedoff.optim import Adam, AdamW

__version__ = "0.1.0"

__all__ = ["Adam", "AdamW", "NativeExtensionUnavailable", "__version__"]
