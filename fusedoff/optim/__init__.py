"""The thin torch.optim.Optimizer classes."""

from fusedoff.optim.adam import Adam, AdamW

__all__ = ["Adam", "AdamW"]
