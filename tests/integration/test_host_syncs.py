"""A healthy step under NanGuard reads device values to the host at most once.

On CUDA a host read is a synchronisation; on CPU it is not, but the same calls (``item``,
``tolist``, ``bool(tensor)``...) can be counted: a ``TorchFunctionMode`` sees every tensor method
call made while the guard's hooks run.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from host_reads import HostReadCounter
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NanGuard


class CountingGuard(NanGuard):
    """NanGuard whose per-step hooks run under the counter (one count per optimizer step)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.per_step: list[int] = []
        self._counter = HostReadCounter()

    def _counted(self, hook: Any, *args: Any) -> Any:
        with self._counter:
            return hook(*args)

    def on_train_batch_start(self, *args: Any) -> None:
        self._counter.reads.clear()
        self._counted(super().on_train_batch_start, *args)

    def on_before_backward(self, *args: Any) -> None:
        self._counted(super().on_before_backward, *args)

    def on_before_optimizer_step(self, *args: Any) -> None:
        self._counted(super().on_before_optimizer_step, *args)

    def _after_optimizer_step(self, *args: Any) -> None:
        self._counted(super()._after_optimizer_step, *args)

    def on_train_batch_end(self, *args: Any) -> None:
        self._counted(super().on_train_batch_end, *args)
        self.per_step.append(sum(self._counter.reads.values()))


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("log_every_n_steps", [1, 50], ids=["norm-every-step", "norm-on-logging-steps"])
def test_healthy_step_reads_the_device_at_most_once(tmp_path: Any, log_every_n_steps: int) -> None:
    data = TensorDataset(torch.randn(64, 4), torch.randn(64))
    guard = CountingGuard(verbose=False, check_params_every_n_steps=0)
    trainer = pl.Trainer(
        max_steps=8,
        callbacks=[guard],
        default_root_dir=tmp_path,
        log_every_n_steps=log_every_n_steps,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Net(), DataLoader(data, batch_size=8))
    assert guard.events == []
    assert len(guard.per_step) == 8
    assert max(guard.per_step) == 1, guard.per_step


def test_counter_sees_host_reads() -> None:
    """The counter itself works: a per-tensor isfinite loop reads once per tensor."""
    counter = HostReadCounter()
    grads = [torch.ones(3) for _ in range(5)]
    with counter:
        for g in grads:
            bool(torch.isfinite(g).all())
    assert sum(counter.reads.values()) == 5


class GradVersions(pl.Callback):
    """Records every gradient's ``_version`` (its in-place write count) at ``on_before_optimizer_step``."""

    def __init__(self) -> None:
        self.per_step: list[list[int]] = []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.per_step.append([p.grad._version for p in pl_module.parameters() if p.grad is not None])


@pytest.mark.parametrize("clip", [False, True], ids=["default", "with-clip_grad-norm-every-step"])
def test_a_healthy_check_writes_no_gradient(tmp_path: Any, clip: bool) -> None:
    """The guard's check between two recorders (before and after it in the callback list) only reads."""
    before, after = GradVersions(), GradVersions()
    guard = NanGuard(verbose=False, remedies=["clip_grad"] if clip else [], check_params_every_n_steps=0)
    trainer = pl.Trainer(
        max_steps=6,
        callbacks=[before, guard, after],
        default_root_dir=tmp_path,
        log_every_n_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Net(), DataLoader(TensorDataset(torch.randn(48, 4), torch.randn(48)), batch_size=8))
    assert guard.events == [] and len(before.per_step) == 6
    assert after.per_step == before.per_step
