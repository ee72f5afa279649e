"""A regression task whose dataset has label typos: the loss-spike tests of the guard share it."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import Dataset

TYPOS = (200, 230)  # dataset items whose label is 1e4 instead of ~1 (batches 25 and 28 of the first epoch)
N, BATCH = 256, 8


class Regression(Dataset):
    """``y = x @ w + noise`` with labels of order 1; ``typos`` get a label of 1e4 (a misplaced decimal point)."""

    def __init__(self, typos: tuple[int, ...] = (), seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(N, 8, generator=g)
        self.y = self.x @ torch.linspace(-1, 1, 8) + 0.1 * torch.randn(N, generator=g)
        for index in typos:
            self.y[index] = 1e4

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


class Regressor(pl.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def clean_error(self) -> float:
        data = Regression(seed=1)
        with torch.no_grad():
            return float(nn.functional.mse_loss(self.net(data.x).squeeze(-1), data.y))
