"""Multi-task training with several training loaders (issue 18): one task head per loader.

``trainer.fit(model, train_dataloaders=collection)`` with ``collection`` a dict, a list, a nested
collection or a ``CombinedLoader``: ``training_step`` receives the loaders' batches in the same
collection. Each loader's dataset is ``(x, y)`` with ``x`` all zeros for chosen items, where the
shared cosine-normalised projection has an infinite derivative (``sqrt(0)``): NaN gradients for
exactly those items. The ground truth the tests use is computed here without the guard:
:class:`OrderLog` records the order each loader's sampler yields, :class:`BatchKeeper` the batches
the Trainer gave ``training_step``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler, TensorDataset

from lightning_nanguard.trainer._compat import CALLBACK_BASES

__all__ = ["BatchKeeper", "MultiTaskModule", "OrderLog", "blank_dataset", "get_part", "loader", "stream_loader"]

FEATURES = 4


def blank_dataset(n: int, blank: Sequence[int], seed: int) -> TensorDataset:
    """``(x, y)``; ``x`` is all zeros for the ``blank`` items (NaN gradients), random otherwise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    x[list(blank)] = 0.0
    return TensorDataset(x, torch.randn(n, generator=g))


class OrderLog(Sampler[int]):
    """A sampler that logs every index it yields, one list per pass (the ground truth of the batch order)."""

    def __init__(self, base: Sampler[int]) -> None:
        self.base = base
        self.passes: list[list[int]] = []

    def __iter__(self) -> Iterator[int]:
        self.passes.append([])
        for index in self.base:
            self.passes[-1].append(int(index))
            yield index

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]


def loader(dataset: TensorDataset, batch_size: int, shuffle: bool = True, seed: int = 0) -> DataLoader:
    """A loader whose sampler is an :class:`OrderLog` (``loader.sampler.passes``)."""
    base: Sampler[int] = (
        RandomSampler(dataset, generator=torch.Generator().manual_seed(seed)) if shuffle else SequentialSampler(dataset)
    )
    return DataLoader(dataset, batch_size=batch_size, sampler=OrderLog(base))


class _Stream(IterableDataset):
    def __init__(self, dataset: TensorDataset) -> None:
        self.dataset = dataset

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for i in range(len(self.dataset)):
            yield self.dataset[i]


def stream_loader(dataset: TensorDataset, batch_size: int) -> DataLoader:
    """The dataset as an ``IterableDataset``: no batch sampler, so its dataset indices cannot be recorded."""
    return DataLoader(_Stream(dataset), batch_size=batch_size)


def get_part(batch: Any, path: Sequence[str | int]) -> Any:
    """The batch of the loader at ``path`` in the combined batch (plain indexing)."""
    for step in path:
        batch = batch[step]
    return batch


class MultiTaskModule(pl.LightningModule):
    """A shared cosine-normalised projection and one head per loader, at ``paths`` in the combined batch."""

    def __init__(self, paths: Sequence[Sequence[str | int]] = (("a",), ("b",))) -> None:
        super().__init__()
        self.paths = [tuple(path) for path in paths]
        self.shared = nn.Linear(FEATURES, FEATURES, bias=False)
        self.heads = nn.ModuleList(nn.Linear(FEATURES, 1) for _ in self.paths)

    def task_loss(self, x: Tensor, y: Tensor, head: nn.Module) -> Tensor:
        h = self.shared(x)
        norm = (h * h).sum(-1, keepdim=True).sqrt()  # ORIGIN: multitask_norm
        return F.mse_loss(head(h / (norm + 1e-6)).squeeze(-1), y)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        losses = []
        for path, head in zip(self.paths, self.heads, strict=True):
            part = get_part(batch, path)
            if part is not None:  # CombinedLoader(mode="max_size"): an exhausted loader gives None
                x, y = part
                losses.append(self.task_loss(x, y, head))
        return torch.stack(losses).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


class BatchKeeper(*CALLBACK_BASES):  # type: ignore[misc]
    """Keeps every batch ``training_step`` received, by ``(epoch, batch_idx)``, and which steps changed weights."""

    def __init__(self) -> None:
        self.batches: dict[tuple[int, int], Any] = {}
        self.changed: dict[tuple[int, int], bool] = {}
        self._before: list[Tensor] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.batches[(trainer.current_epoch, batch_idx)] = batch
        self._before = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        after = list(pl_module.parameters())
        self.changed[(trainer.current_epoch, batch_idx)] = any(
            not torch.equal(a, b) for a, b in zip(self._before, after, strict=True)
        )
