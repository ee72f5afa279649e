"""A tiny model with every part of the guard in play, and the faults the guard must take in its stride.

:class:`EveryPartModule` has a BatchNorm (the BatchNorm check), an ``nn.MultiheadAttention`` (the
precursor watch and QK-clip) and logs a value (the withdrawal of a dropped step's logged values);
``loss_of`` turns its plain MSE into any loss a healthy run can have (zero, negative, crossing zero,
subnormal, huge, another dtype or shape) while keeping the plain loss's gradients. :func:`nan_loader`
gives batches of 4 in which the listed batches hold one NaN input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

__all__ = ["BATCH", "EveryPartModule", "LOSSES", "nan_loader"]

BATCH = 4
LossOf = Callable[[Tensor, int], Tensor]


def _offset(value: float) -> LossOf:
    """The loss's gradients, its value ``value`` (a constant added to a healthy loss, e.g. ``mse - c``)."""
    return lambda loss, step: loss - loss.detach() + value


LOSSES: dict[str, LossOf] = {
    "zero_once": lambda loss, step: loss * 0.0 if step == 5 else loss,  # every target masked in one batch
    "zeros_in_a_row": lambda loss, step: loss * 0.0 if 4 <= step <= 8 else loss,
    "zeros_from_the_start": lambda loss, step: loss * 0.0 if step < 6 else loss,
    "negative": lambda loss, step: loss - 10.0,
    "crossing_zero": lambda loss, step: loss - loss.detach() + (-1.0) ** step * (1 + step % 3) * 0.5,
    "subnormal": _offset(1e-40),
    "tiny": _offset(1e-30),
    "huge": _offset(1e30),
    "near_float32_max": _offset(3.0e38),
    "float64": lambda loss, step: loss.double() * 1e-3 - 1e200 * (step % 2),
    "bfloat16": lambda loss, step: loss.to(torch.bfloat16),
    "float16_near_max": lambda loss, step: (loss - loss.detach() + 6.0e4).to(torch.float16),
    "shape_1": lambda loss, step: loss.reshape(1),
    "all_grads_zero": lambda loss, step: loss * 0.0,
}
"""Losses of healthy runs, each with the gradients of the model's plain loss (or zero)."""


class EveryPartModule(pl.LightningModule):
    """Linear -> BatchNorm -> self-attention over 3 positions -> head; MSE on one target per sample.

    Args:
        loss_of: ``loss_of(mse, global_step)`` is what ``training_step`` returns.
        unused: also hold a layer the forward never uses (its gradients stay ``None``).
    """

    def __init__(self, loss_of: LossOf | None = None, unused: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 1)
        self.unused = nn.Linear(8, 8) if unused else None
        self.loss_of = loss_of

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        h, _ = self.attn(h, h, h)
        return self.head(h.mean(1)).squeeze(-1)

    def training_step(self, batch: Sequence[Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_mse", loss, on_step=True, on_epoch=True)
        return self.loss_of(loss, self.global_step) if self.loss_of is not None else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def nan_loader(batches: int = 12, bad_batches: Sequence[int] = (3, 9), dataset: type[Dataset] | None = None) -> Any:
    """``batches`` batches of 4 samples of shape ``(3, 4)``; one input of each of ``bad_batches`` is NaN."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batches * BATCH, 3, 4, generator=generator)
    y = torch.randn(batches * BATCH, generator=generator)
    for batch in bad_batches:
        x[batch * BATCH + 1, 0, 0] = float("nan")
    data = TensorDataset(x, y) if dataset is None else dataset(x, y)  # type: ignore[call-arg]
    return DataLoader(data, batch_size=BATCH, shuffle=False)
