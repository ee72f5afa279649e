"""Counting the tensor calls that read device values to the host (each one a synchronisation on CUDA).

Example:
    >>> import torch
    >>> with HostReadCounter() as counter:
    ...     _ = torch.ones(2).sum().item()
    >>> counter.reads["item"]
    1
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

from torch.overrides import TorchFunctionMode

__all__ = ["HostReadCounter"]

_HOST_READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "__complex__"}


class HostReadCounter(TorchFunctionMode):
    """Counts calls that read tensor values to the host while it is active.

    With ``ignore_host_copies`` the reads ``DeferredRead.result`` makes of its own host copy are not
    counted: that copy was made without waiting (pinned memory and an event on CUDA), so reading it
    is no synchronisation with the device.
    """

    def __init__(self, ignore_host_copies: bool = False) -> None:
        super().__init__()
        self.reads: Counter[str] = Counter()
        self.ignore_host_copies = ignore_host_copies

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in _HOST_READS and not (self.ignore_host_copies and _reading_a_host_copy()) and not _precursor_copy():
            self.reads[name] += 1
        return func(*args, **(kwargs or {}))


def _reading_a_host_copy() -> bool:
    frame = sys._getframe(2)
    return frame.f_code.co_name == "result" and frame.f_code.co_filename.endswith("syncfree.py")


def _precursor_copy() -> bool:
    """The attention precursor watch reads its own host copy, made without waiting: no synchronisation."""
    frame = sys._getframe(2)
    return frame.f_code.co_name == "ready" and frame.f_code.co_filename.endswith("precursors.py")
