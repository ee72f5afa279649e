"""Benchmark models: few large tensors (conv + BatchNorm), a small transformer, 1,500+ small tensors."""

from __future__ import annotations

from collections.abc import Callable

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset


class _Classifier(LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def conv_net() -> nn.Module:
    """Few large tensors: three conv blocks with BatchNorm (about 0.6M parameters, 20 tensors)."""

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2)]

    return nn.Sequential(*block(3, 64), *block(64, 128), *block(128, 256), nn.Flatten(), nn.Linear(256 * 16, 10))


class _Transformer(nn.Module):
    def __init__(self, vocab: int = 256, width: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, 10)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


class _ManySmall(nn.Module):
    """750 residual Linear(8, 8) layers: 1,500 small parameter tensors."""

    def __init__(self, depth: int = 750, width: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = h + 0.01 * torch.tanh(layer(h))
        return self.head(h)


def _images(n: int = 256) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))


def _tokens(n: int = 256) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, 256, (n, 64), generator=g), torch.randint(0, 10, (n,), generator=g))


def _vectors(n: int = 256) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 10, (n,), generator=g))


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], TensorDataset], int]] = {
    "conv+BN (few large tensors)": (conv_net, _images, 32),
    "transformer (2 layers)": (_Transformer, _tokens, 16),
    "1,500 small tensors": (_ManySmall, _vectors, 32),
}


def make(name: str, seed: int = 0) -> tuple[LightningModule, DataLoader]:
    """A fresh LightningModule (same initial weights for the same seed) and its loader."""
    build_net, build_data, batch_size = MODELS[name]
    torch.manual_seed(seed)
    return _Classifier(build_net()), DataLoader(build_data(), batch_size=batch_size, shuffle=False)
