"""Reading small device flags to the host: one synchronisation per device, however many flags.

The guard's hot path reads nothing here (its one read per step is the flag vector); these helpers
serve the bad path and the diagnosis, where many 0-dim flags (one per tensor) are read at once.

Example:
    >>> read_flags([torch.tensor(True), torch.tensor(False)])
    [True, False]
    >>> all_true([torch.tensor(True), torch.tensor(True)]), all_true([])
    (True, True)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["all_true", "read_flags"]


def read_flags(flags: Sequence[Tensor]) -> list[bool]:
    """0-dim boolean (or numeric, non-zero = ``True``) tensors as host bools, one read per device.

    Flags may live on several devices (an op can mix a CUDA tensor with a CPU scalar tensor): they
    are stacked and read per device, and returned in the order given.
    """
    by_device: dict[torch.device, list[int]] = {}
    for position, flag in enumerate(flags):
        by_device.setdefault(flag.device, []).append(position)
    values = [False] * len(flags)
    for positions in by_device.values():
        stacked = torch.stack([flags[i].reshape(()) for i in positions]).tolist()
        for position, value in zip(positions, stacked, strict=True):
            values[position] = bool(value)
    return values


def all_true(flags: Sequence[Tensor]) -> bool:
    """Whether every flag holds (one read per device; ``True`` for no flags)."""
    return all(read_flags(flags))
