"""step_flags on a real Trainer's step (its vector, healthy and NaN) and loss_scale with a scaler or not."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from conftest import build_trainer
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NanGuard
from lightning_nanguard.decide.policy import LOCAL_FIELDS
from lightning_nanguard.engine.step.check import loss_scale, step_flags
from lightning_nanguard.trainer.frontend import TrainerFrontEnd


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.layer(x).squeeze(1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Flags(pl.Callback):
    """Calls step_flags with the guard's own step window at every check, as the controller does."""

    def __init__(self, guard: NanGuard) -> None:
        self.guard = guard
        self.vectors: list[dict[str, float]] = []
        self.scales: list[float | None] = []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        c = self.guard.controller
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        front = TrainerFrontEnd(trainer, pl_module)
        vector = step_flags(front, optimizer, grads, c.window, c.spikes, True)
        self.vectors.append(dict(zip(LOCAL_FIELDS, vector.tolist(), strict=True)))
        scale = loss_scale(front.grad_scaler)
        self.scales.append(None if scale is None else float(scale))


def fit(tmp_path: Path, **kwargs: Any) -> Flags:
    x = torch.randn(8, 2)
    x[5, 0] = float("nan")  # batch 2 (of 4) is bad
    guard = NanGuard(verbose=False, save_repro=False, bisect=False, localize=False)
    flags = Flags(guard)
    trainer = build_trainer("lightning", tmp_path, callbacks=[flags, guard], **kwargs)
    trainer.fit(Regression(), DataLoader(TensorDataset(x, x.sum(1)), batch_size=2))
    return flags


def test_the_vector_of_a_healthy_and_a_bad_step(tmp_path: Path) -> None:
    flags = fit(tmp_path)
    healthy, bad = flags.vectors[0], flags.vectors[2]
    assert (healthy["bad"], healthy["others_bad"], healthy["failed"]) == (0.0, 0.0, 0.0)
    assert healthy["grad_norm"] > 0 and math.isfinite(healthy["loss"])  # the norm: clip_grad's with_norm=True
    assert bad["bad"] == 1.0 and bad["others_bad"] == 1.0  # the loss is NaN too
    assert math.isnan(bad["loss"]) and math.isnan(bad["grad_norm"])
    assert flags.scales == [None] * 4  # no GradScaler: no scale


def test_loss_scale_is_the_scalers_own_device_tensor(tmp_path: Path) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    flags = fit(tmp_path, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    assert flags.scales[0] == 1024.0
