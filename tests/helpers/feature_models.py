"""Tiny models, data and reference callbacks for the tests of Lightning's built-in callbacks with the guard.

- :class:`BatchNormRegression`: ``Linear -> BatchNorm1d -> ReLU -> Linear`` regression (``net.0`` ...
  ``net.3``); ``lr`` and ``batch_size`` attributes for the tuners; either namespace (:func:`bn_regression`).
- :func:`regression_data`: 64 samples of 4 features; a NaN in feature 1 of each sample in ``nan_at``.
- :class:`EpochData` with :class:`FollowEpoch`: NaN samples that change with the epoch.
- :class:`Finetunable`: a ``backbone`` (bias-free ``Linear``) and a cosine-normalised ``head``; a blank
  sample makes the backbone's features exactly zero, and ``sqrt`` of their zero norm back-propagates
  NaN into ``backbone.weight`` only, and only while the backbone trains.
- :class:`HandSkip`: the reference for a skipped step, done by hand without the guard: every gradient
  dropped in ``on_before_optimizer_step`` (the optimizer then leaves each parameter and its state
  alone) and the BatchNorm buffers put back as they were before the step's first micro-batch; and,
  for forward-only batches (SWA's BatchNorm epoch), the BatchNorm buffers put back after the batch.
- :class:`RecordingLogger`: keeps every ``log_metrics`` call.
"""

from __future__ import annotations

import math
from argparse import Namespace
from collections.abc import Iterable
from typing import Any

import torch
from lightning.pytorch.loggers.logger import Logger
from models import NAMESPACES
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_nanguard.trainer._compat import CALLBACK_BASES

__all__ = [
    "BATCH",
    "N",
    "BatchNormRegression",
    "EpochData",
    "Finetunable",
    "FollowEpoch",
    "HandSkip",
    "RecordingLogger",
    "bn_regression",
    "finetune_data",
    "loader",
    "regression_data",
    "state",
]

N, BATCH = 64, 8  # eight batches an epoch: sample i sits in batch i // 8 at position i % 8


class _BatchNormRegression:
    def __init__(
        self, optimizer: str = "adam", lr: float = 1e-2, batch_size: int = BATCH, scheduler: bool = False
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
        self.optimizer_name = optimizer
        self.lr = lr
        self.batch_size = batch_size
        self.use_scheduler = scheduler  # a StepLR stepped every optimizer step (halves the LR every 3 steps)
        self.data: Dataset | None = None  # for train_dataloader() (the batch-size finder rebuilds the loader)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x).squeeze(-1)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=False)  # type: ignore[attr-defined]
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        params = self.parameters()  # type: ignore[attr-defined]
        if self.optimizer_name == "sgd":
            optimizer: torch.optim.Optimizer = torch.optim.SGD(params, lr=self.lr, momentum=0.9)
        else:
            optimizer = torch.optim.Adam(params, lr=self.lr)
        if not self.use_scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def bn_regression(ns: str = "lightning", **kwargs: Any) -> Any:
    """A :class:`BatchNormRegression` deriving from the ``LightningModule`` of namespace ``ns``."""
    cls = type("BatchNormRegression", (_BatchNormRegression, NAMESPACES[ns].LightningModule), {})
    return cls(**kwargs)


class BatchNormRegression(_BatchNormRegression, NAMESPACES["lightning"].LightningModule):  # type: ignore[misc]
    """A ``lightning.pytorch`` :class:`BatchNormRegression` with a ``train_dataloader`` over ``self.data``."""

    def train_dataloader(self) -> DataLoader:
        assert self.data is not None
        return loader(self.data, self.batch_size)


def regression_data(nan_at: Iterable[int] = (), n: int = N) -> TensorDataset:
    """``y = x @ w + noise``; each sample in ``nan_at`` gets a NaN in feature 1."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([0.5, -1.0, 0.25, 2.0]) + 0.1 * torch.randn(n, generator=g)
    for index in nan_at:
        x[index, 1] = math.nan
    return TensorDataset(x, y)


def loader(dataset: Dataset, batch_size: int = BATCH) -> DataLoader:
    """No shuffling, no workers: batch ``b`` holds samples ``b * batch_size ...``."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=0)


class EpochData(Dataset):
    """:func:`regression_data` whose NaN samples depend on the epoch: ``bad[epoch]`` (set by :class:`FollowEpoch`)."""

    def __init__(self, bad: dict[int, tuple[int, ...]]) -> None:
        self.x, self.y = regression_data().tensors
        self.bad = bad
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        x = self.x[index]
        if index in self.bad.get(self.epoch, ()):
            x = x.clone()
            x[1] = math.nan
        return x, self.y[index]


class FollowEpoch(*CALLBACK_BASES):  # type: ignore[misc]
    """Tells an :class:`EpochData` the epoch at ``on_train_epoch_start`` (batch 0 is read before: keep it healthy)."""

    def __init__(self, data: EpochData) -> None:
        self.data = data

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self.data.epoch = trainer.current_epoch


# ------------------------------------------------------------------------------------ fine-tuning


class Finetunable(NAMESPACES["lightning"].LightningModule):  # type: ignore[misc]
    """A bias-free ``backbone``, a cosine-normalised ``head``: a blank sample gives NaN in ``backbone.weight.grad``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Linear(8, 16, bias=False)
        self.head = nn.Parameter(torch.randn(4, 16) / 4)
        self.lr = 1e-2

    def forward(self, x: Tensor) -> Tensor:
        features = self.backbone(x)
        norm = (features * features).sum(-1, keepdim=True).sqrt()  # 0 for a blank sample: d/dx sqrt = inf
        head = self.head / self.head.norm(dim=-1, keepdim=True)
        return 10.0 * (features / (norm + 1e-6)) @ head.T

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def finetune_data(blank_at: Iterable[int] = ()) -> TensorDataset:
    """64 samples of 8 features, 4 classes; each sample in ``blank_at`` is all zeros."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 8, generator=g)
    y = torch.randint(0, 4, (N,), generator=g)
    for index in blank_at:
        x[index] = 0.0
    return TensorDataset(x, y)


# ------------------------------------------------------------------------------------ references


class HandSkip(*CALLBACK_BASES):  # type: ignore[misc]
    """Skips optimizer steps by hand, without the guard (see module docs).

    Args:
        steps: global steps whose update is dropped (all their micro-batches' BatchNorm updates undone).
        forward_only: ``(epoch, batch_idx)`` of batches whose BatchNorm update is undone at the batch's end
            (batches that take no optimizer step, such as SWA's BatchNorm epoch).
    """

    def __init__(self, steps: Iterable[int] = (), forward_only: Iterable[tuple[int, int]] = ()) -> None:
        self.steps = set(steps)
        self.forward_only = set(forward_only)
        self.skipped: list[int] = []
        self._saved: dict[str, Tensor] | None = None
        self._saved_step: int | None = None

    @staticmethod
    def _buffers(pl_module: Any) -> dict[str, Tensor]:
        return {name: b.detach().clone() for name, b in pl_module.named_buffers()}

    @staticmethod
    def _restore(pl_module: Any, saved: dict[str, Tensor]) -> None:
        with torch.no_grad():
            for name, buffer in pl_module.named_buffers():  # the tensors the model holds now, by name
                buffer.copy_(saved[name])

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        forward_only = (trainer.current_epoch, batch_idx) in self.forward_only
        if (step in self.steps and self._saved_step != step) or forward_only:
            self._saved, self._saved_step = self._buffers(pl_module), step

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step not in self.steps:
            return
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = None
        assert self._saved is not None and self._saved_step == trainer.global_step
        self._restore(pl_module, self._saved)
        self.skipped.append(trainer.global_step)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (trainer.current_epoch, batch_idx) in self.forward_only:
            assert self._saved is not None
            self._restore(pl_module, self._saved)
            self._saved, self._saved_step = None, None


def state(module: nn.Module) -> dict[str, Tensor]:
    """A detached copy of ``module.state_dict()`` (parameters and buffers)."""
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


# ------------------------------------------------------------------------------------ logging


class RecordingLogger(Logger):
    """A ``lightning.pytorch`` logger that keeps every ``log_metrics`` call as ``(step, metrics)``."""

    def __init__(self, save_dir: str) -> None:
        super().__init__()
        self._save_dir = save_dir
        self.logged: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    def log_dir(self) -> str:
        return self._save_dir

    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((step, {key: float(value) for key, value in metrics.items()}))

    def keys(self, prefix: str) -> list[tuple[int | None, tuple[str, ...]]]:
        """``(step, sorted keys starting with prefix)`` of each call that logged such a key."""
        out = []
        for step, metrics in self.logged:
            keys = tuple(sorted(k for k in metrics if k.startswith(prefix)))
            if keys:
                out.append((step, keys))
        return out
