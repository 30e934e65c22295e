"""Placement: which tensors' states stay on the parameters' device and which stream from host memory.

[note: placement order] Within a device's byte budget, parameters are placed in the order of
`param_groups` and their `params` (buckets in the order they first step): each parameter's states
(master weights included) stay on the device if they fit in what remains of the budget, otherwise
they stream. A placement is fixed once made; only the user changes it (a new budget, or
`load_state_dict`, which re-places every state).

[note: automatic budget] With offload="auto" and no budget given, the budget for a CUDA device is
decided at the first step(): the device's total memory, less the peak that this process allocated
before the step (the forward and backward passes), less `AUTO_HEADROOM` of the total (allocator
rounding and fragmentation, the next iterations' temporaries). If every state fits, all are
resident and no streaming buffer is allocated; otherwise the streaming buffers come out of that
figure too and the rest of the states stream.
"""

from __future__ import annotations

import torch

AUTO_HEADROOM = 0.10


def auto_budget(total: int, peak: int, needed: int, buffer_bytes: int) -> int:
    """The automatic budget (see [note: automatic budget]) for `needed` bytes of states."""
    available = int(total * (1.0 - AUTO_HEADROOM)) - peak
    if needed <= available:
        return needed
    return max(0, available - buffer_bytes)


class Budget:
    """Bytes of state left to place on each device; None: unlimited."""

    def __init__(self) -> None:
        self.limits: dict[torch.device, int | None] = {}  # the budget in force, per device
        self.left: dict[torch.device, int | None] = {}

    def decided(self, device: torch.device) -> bool:
        return device in self.limits

    def set(self, device: torch.device, budget: int | None) -> None:
        self.limits[device] = self.left[device] = budget

    def place(self, device: torch.device, sizes: list[int]) -> list[bool]:
        """Resident flags for tensors of `sizes` bytes, greedily in order (see [note: placement order])."""
        left = self.left[device]
        flags = []
        for size in sizes:
            fits = left is None or size <= left
            if fits and left is not None:
                left -= size
            flags.append(fits)
        self.left[device] = left
        return flags
