"""A stand-in for a third-party package shipping a fused op as a custom autograd Function.

It lives in its own package (not the test's module), as a custom kernel or a fused op from an
installed library would: the guard must still name the Function and the line of the user's
``.apply(...)`` call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["RootMeanSquare", "rms"]


class RootMeanSquare(torch.autograd.Function):
    """``sqrt(mean(x**2, -1))`` with a hand-written backward ``x / (n * rms)``: 0/0 = NaN for an all-zero row."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        value = x.pow(2).mean(-1).sqrt()
        ctx.save_for_backward(x, value)
        return value

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        x, value = ctx.saved_tensors
        return grad[..., None] * x / (x.shape[-1] * value[..., None])


def rms(x: Tensor) -> Tensor:
    """The package's own wrapper around :class:`RootMeanSquare` (its ``.apply`` line is in this package)."""
    return RootMeanSquare.apply(x)
