"""A module holding every kind of BatchNorm the guard must find (and some it must not), for the BatchNorm tests."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["Nested"]


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3))
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(n, 4), nn.BatchNorm1d(4)) for n in (3, 4)])
        self.no_stats = nn.BatchNorm1d(4, track_running_stats=False)
        self.norm3d = nn.BatchNorm3d(2)
        self.sync = nn.SyncBatchNorm(4)
        self.layer_norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, 2, 1, 1)
        h = self.stem(x).flatten(1)
        for block in self.blocks:
            h = block(h)
        return self.layer_norm(self.no_stats(h))


def mlp_with_batchnorm() -> nn.Module:
    """The sync-free tests' model: a BatchNorm between linear layers, seeded (the same weights each call)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 128), nn.Linear(128, 2))


def mlp_batch(bad: float | None = None) -> Tensor:
    """16 samples for :func:`mlp_with_batchnorm`; ``bad`` goes into sample 3."""
    x = torch.randn(16, 8)
    if bad is not None:
        x[3, 5] = bad
    return x
