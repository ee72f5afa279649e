"""Lightning's ``FSDPStrategy`` (FSDP1) on one GPU: detected and skipped, the diagnosis off, said once at setup.

Lightning refuses FSDP1 on a CPU accelerator, so this only runs where CUDA is (``gpu`` marker). What
it cannot show on one device: that every rank scales its shard by the same global norm under
``clip_grad`` (the norm's shares are summed over ranks, as under ``ModelParallelStrategy``).
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NanGuard


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Weights(pl.Callback):
    """The steps whose update left the weights unchanged, and the steps whose batch held a NaN."""

    def __init__(self) -> None:
        self.unchanged: list[int] = []
        self.nan_batches: list[int] = []
        self._before: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any) -> None:
        self._before = [p.detach().clone() for p in pl_module.parameters()]
        if not bool(torch.isfinite(batch[0]).all()):
            self.nan_batches.append(trainer.global_step)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if all(torch.equal(a, p) for a, p in zip(self._before, pl_module.parameters(), strict=True)):
            self.unchanged.append(trainer.global_step - 1)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fsdp1_on_one_gpu_skips_the_bad_step_and_says_the_diagnosis_is_off(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from lightning.pytorch.strategies import FSDPStrategy

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, generator=g)
    x[11, 1] = float("nan")  # one batch: which step gets it is up to the distributed sampler FSDP1 brings in
    guard, weights = NanGuard(verbose=False, remedies=["clip_grad"]), Weights()
    trainer = pl.Trainer(
        strategy=FSDPStrategy(),
        accelerator="cuda",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=[guard, weights],
    )
    try:
        with caplog.at_level(logging.WARNING, logger="lightning_nanguard"):
            trainer.fit(Regression(), DataLoader(TensorDataset(x, y), batch_size=8))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert guard.active and trainer.global_step == 4
    (bad_step,) = weights.nan_batches  # on an H200 (torch 2.11) the sampler put record 11 in step 2's batch
    (event,) = guard.events
    assert (event.global_step, event.action) == (bad_step, "skipped")
    assert event.offending_samples is None  # bisection is off under FSDP1
    assert bad_step in weights.unchanged
    assert all(bool(torch.isfinite(p).all()) for p in trainer.lightning_module.parameters())
    assert "FSDPStrategy (FSDP1)" in caplog.text
    assert guard.controller.sharding is not None and guard.controller.sharding.kind == "fsdp1"
