"""The state of every random number generator training draws from, to put back bitwise.

A diagnosis re-runs the step (its dropout draws from the generators) and a rollback restores an
earlier state: both must leave the generators as training would have them.
"""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["RngState"]


class RngState:
    """Snapshot of the torch (CPU and CUDA), ``random`` and NumPy random number generators.

    Example:
        >>> state = RngState.capture()
        >>> a = torch.rand(1)
        >>> state.restore()
        >>> bool(torch.rand(1) == a)
        True
    """

    def __init__(self, cpu: torch.Tensor, cuda: list[torch.Tensor], python: Any, numpy: Any) -> None:
        self.cpu, self.cuda, self.python, self.numpy = cpu, cuda, python, numpy

    @classmethod
    def capture(cls) -> RngState:
        """Record the current state of every generator."""
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        try:
            import numpy as np

            numpy_state: Any = np.random.get_state()
        except ImportError:  # pragma: no cover - numpy ships with torch in practice
            numpy_state = None
        return cls(torch.get_rng_state(), cuda, random.getstate(), numpy_state)

    def restore(self) -> None:
        """Put every generator back to the recorded state."""
        torch.set_rng_state(self.cpu)
        if self.cuda:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.python)
        if self.numpy is not None:
            import numpy as np

            np.random.set_state(self.numpy)
