"""The thin torch.optim.Optimizer classes."""

from fusedoff.optim.adam import Adam, AdamW
from fusedoff.optim.apollo import Apollo

__all__ = ["Adam", "AdamW", "Apollo"]
