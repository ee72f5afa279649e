"""The sync-free building blocks wired into a real Trainer: a bad step is skipped on the device, read one step later.

A callback wires ``GradientCheck``, ``DeviceSkip``, ``SelectRestore`` and ``DeferredRead`` the way
an opt-in sync-free guard does; the run with a bad batch ends bitwise where the run without it
ends, with no host read inside a step (fused AdamW, and 16-mixed with a GradScaler). The blocks
on their own are tested in ``tests/detect/test_syncfree.py``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from batchnorm_models import mlp_batch, mlp_with_batchnorm
from fitting import fit
from host_reads import HostReadCounter
from lightning.pytorch.plugins import MixedPrecision
from states import states_equal
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard.detect.batchnorm import batchnorm_buffers, batchnorm_running_vars
from lightning_nanguard.detect.streaming import GradientCheck
from lightning_nanguard.detect.syncfree import DeferredRead, DeviceSkip, SelectRestore

NONFINITE = pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "+inf", "-inf"])


_net, _batch = mlp_with_batchnorm, mlp_batch


class SyncFreeSteps(pl.Callback):
    """The building blocks wired the way an opt-in sync-free guard uses them (flags read one step later)."""

    def __init__(self) -> None:
        self.flags: list[list[float]] = []
        self.reads_per_step: list[int] = []
        self.counter = HostReadCounter()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.check = GradientCheck(pl_module.parameters())
        self.buffers = batchnorm_buffers(pl_module)
        self.restore = SelectRestore([t for _, t in self.buffers])
        self.reader = DeferredRead()
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.skip = DeviceSkip(trainer.optimizers[0], scaler)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self.reader.pending:
            self.flags.append(self.reader.result())  # before this step's forward
        self.counter.reads.clear()
        with self.counter:
            self.restore.capture()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        self.loss = loss.detach()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        with self.counter:
            summary = self.check.health_check(
                others=[self.loss, *(t for _, t in self.buffers if t.is_floating_point())],
                nonnegative=batchnorm_running_vars(self.buffers),
            )
            assert self.skip.arm(summary[0])
            self.restore.restore_where_(summary[0])
            self.reader.start(summary)
        self.reads_per_step.append(sum(self.counter.reads.values()))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        while self.reader.pending:
            self.flags.append(self.reader.result())
        self.skip.remove()
        self.check.remove()


class Net(pl.LightningModule):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fused = fused
        self.net = _net()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01, fused=self.fused)


def _fit(root: Path, batches: list[Tensor], callbacks: list[Any], fused: bool = True, **kwargs: Any) -> Net:
    module = Net(fused)
    loader = DataLoader(TensorDataset(torch.cat(batches)), batch_size=16, shuffle=False)
    fit(module, loader, root=root, guard=None, callbacks=callbacks, **kwargs)
    return module


@NONFINITE
def test_trainer_run_with_a_bad_batch_ends_where_the_run_without_it_ends(tmp_path: Path, value: float) -> None:
    torch.manual_seed(2)
    healthy = [_batch() for _ in range(5)]
    with_bad = [*healthy[:2], _batch(value), *healthy[2:]]
    steps = SyncFreeSteps()
    guarded = _fit(tmp_path / "a", with_bad, [steps])
    reference = _fit(tmp_path / "b", healthy, [])
    assert [v[0] for v in steps.flags] == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert steps.reads_per_step == [0] * 6  # no host read inside the step; the flags are read one step later
    assert states_equal(guarded.state_dict(), reference.state_dict())
    opt_state = guarded.trainer.optimizers[0].state_dict()["state"]
    assert all(s["step"].item() == 5.0 for s in opt_state.values())


def test_trainer_with_a_grad_scaler(tmp_path: Path) -> None:
    """16-mixed on CPU: Lightning unscales the non-fused AdamW; the flag joins the scaler's found_inf."""
    torch.manual_seed(2)
    batches = [_batch() for _ in range(2)] + [_batch(math.nan)] + [_batch() for _ in range(2)]
    steps = SyncFreeSteps()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    module = _fit(tmp_path, batches, [steps], fused=False, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    assert [v[0] for v in steps.flags] == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert steps.reads_per_step == [0] * 5
    assert all(torch.isfinite(t).all() for t in module.state_dict().values() if t.is_floating_point())
