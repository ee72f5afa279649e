"""Two-process DDP run on CPU (gloo) with a NaN sample on rank 1 only; run by ``test_ddp.py``.

Usage: ``python tests/ddp_script.py OUTPUT_DIR``. Every rank builds its own data (no distributed
sampler), rank 1 with NaN in sample 11 (batch 1, position 3), and writes ``rank<N>.json``: a hash
of its final parameter bytes, the global steps whose update it skipped, its events and counters.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NanGuard

BAD_RANK, BAD_INDEX = 1, 11


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # identical initial weights on every rank
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def train_dataloader(self) -> DataLoader:
        rank = self.trainer.global_rank
        g = torch.Generator().manual_seed(100 + rank)  # different data per rank
        x, y = torch.randn(32, 4, generator=g), torch.randn(32, generator=g)
        if rank == BAD_RANK:
            x[BAD_INDEX, 1] = float("nan")
        return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class SkipLog(pl.Callback):
    """Global steps whose update left every parameter bitwise unchanged, and the strategy class in use."""

    def __init__(self) -> None:
        self.skipped: list[int] = []
        self.strategy_class = ""
        self._before: list[torch.Tensor] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.strategy_class = type(trainer.strategy).__name__

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._before = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if all(torch.equal(a, p) for a, p in zip(self._before, pl_module.parameters(), strict=True)):
            self.skipped.append(trainer.global_step - 1)


def main(out_dir: str) -> None:
    guard, skips = NanGuard(verbose=False, save_repro=False), SkipLog()
    trainer = pl.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=out_dir,
        callbacks=[guard, skips],
    )
    module = Regression()
    trainer.fit(module)
    weights = b"".join(p.detach().cpu().numpy().tobytes() for p in module.parameters())
    result = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "strategy_class_during_fit": skips.strategy_class,
        "strategy_class_after_fit": type(trainer.strategy).__name__,
        "weights_sha256": hashlib.sha256(weights).hexdigest(),
        "finite": all(bool(torch.isfinite(p).all()) for p in module.parameters()),
        "skipped_steps": skips.skipped,
        "skipped_total": guard.skipped_total,
        "bad_steps_total": guard.bad_steps_total,
        "active": guard.active,
        "events": [event.to_dict() for event in guard.events],
    }
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main(sys.argv[1])
