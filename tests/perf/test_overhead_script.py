"""``benchmarks.overhead``: the floor it measures beside the guard, the gradients read alone (timings aside)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from fitting import build_trainer
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.overhead import GradientRead
from lightning_nanguard.detect.check import CPU_SUM_NUMEL


class _Wide(LightningModule):
    """One gradient of ``CPU_SUM_NUMEL`` elements (summed by the read) and two small ones (only fetched)."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Linear(CPU_SUM_NUMEL // 4, 4)
        self.head = nn.Linear(4, 1, bias=False)

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        return self.head(self.wide(batch[0])).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class _Sums(torch.overrides.TorchFunctionMode):
    """The elements of every tensor ``sum`` called on (the read's only reduction)."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: list[int] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is Tensor.sum:
            self.numels.append(args[0].numel())
        return func(*args, **(kwargs or {}))


class _Watched(GradientRead):
    """The read under :class:`_Sums`, with the gradients' versions before and after it."""

    def __init__(self) -> None:
        super().__init__()
        self.sums = _Sums()
        self.versions: list[tuple[list[int], list[int]]] = []

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        before = _grad_versions(pl_module)
        with self.sums:
            super().on_before_optimizer_step(trainer, pl_module, optimizer)
        self.versions.append((before, _grad_versions(pl_module)))


def _grad_versions(module: LightningModule) -> list[int]:
    return [g._version for p in module.parameters() if (g := p.grad) is not None]


def test_the_read_sums_each_large_gradient_once_a_step_times_it_and_writes_nothing(tmp_path: Path) -> None:
    read = _Watched()
    data = DataLoader(TensorDataset(torch.randn(12, CPU_SUM_NUMEL // 4)), batch_size=4)
    trainer = build_trainer("lightning", tmp_path, max_steps=3, callbacks=[read])
    trainer.fit(_Wide(), data)
    assert read.sums.numels == [CPU_SUM_NUMEL] * 3  # the wide weight each step; its bias and the head only fetched
    assert read.clock.calls == {"read": 3} and read.clock.seconds["read"] > 0
    assert all(before == after for before, after in read.versions)  # nothing written
