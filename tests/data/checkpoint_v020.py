"""The model, data and run behind ``nanguard-0.2.0.ckpt``: a checkpoint written by lightning_nanguard 0.2.0.

The checkpoint was made once, with the 0.2.0 package (commit 14a17ad), by running this file:
``python tests/data/checkpoint_v020.py``. It holds the guard state 0.2.0 wrote (counters, the
last events, quarantined dataset indices, a clip threshold, the spike statistic), and
``tests/trainer/test_checkpoint.py`` resumes from it with the current code.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

CHECKPOINT = Path(__file__).with_name("nanguard-0.2.0.ckpt")
BLANK_INDEX = 5
"""The dataset index of the all-zero record: divided by its own norm, it makes the step NaN."""


class CosineModel(pl.LightningModule):
    """A linear layer on cosine-normalised inputs: a blank record gives NaN gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        x = x / x.norm(dim=1, keepdim=True)
        return nn.functional.mse_loss(self.layer(x).squeeze(1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def dataset(blank: bool = True) -> TensorDataset:
    """32 records of 4 features; record ``BLANK_INDEX`` is all zeros when ``blank``."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=generator) + 0.5
    if blank:
        x[BLANK_INDEX] = 0.0
    return TensorDataset(x, x.sum(dim=1))


def loader(blank: bool = True) -> DataLoader:
    """Batches of 4 in order (the blank record sits in batch 1)."""
    return DataLoader(dataset(blank), batch_size=4, shuffle=False)


def main() -> None:  # pragma: no cover - run by hand with the 0.2.0 package
    from lightning_nanguard import NanGuard

    torch.manual_seed(0)
    guard = NanGuard(remedies=["quarantine", "clip_grad"], verbose=False, save_repro=False, spike_warmup_steps=4)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(CHECKPOINT.parent / "_run"),
        callbacks=[guard],
    )
    trainer.fit(CosineModel(), loader())
    trainer.save_checkpoint(CHECKPOINT)
    print(guard.state_dict())


if __name__ == "__main__":  # pragma: no cover
    main()
