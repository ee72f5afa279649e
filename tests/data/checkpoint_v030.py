"""The run behind ``nanguard-0.3.0.ckpt``: a checkpoint written by lightning_nanguard 0.3 (before issue 23's moves).

The checkpoint was made once, with the 0.3 package (``0.3.0.dev0``, commit 00bc8c1, the
``lightning_nanguard.adapter`` layout), by running this file with that package first on the path:
``PYTHONPATH=<checkout of 00bc8c1> python tests/data/checkpoint_v030.py`` (run from outside the
repository, so that the working tree's package is not imported instead).

The model and data are ``checkpoint_v020``'s: the blank record makes batch 1 of every epoch NaN.
The guard rolls back after every bad step with ``clip_grad`` as its only remedy, so nothing is
quarantined and the blank record comes back each epoch. After two epochs (16 steps) the saved
guard state holds two bad steps, skipped and rolled back (global steps 1 and 9: two events),
``clip_grad`` applied twice (its threshold tightened from 4.823 to 2.411), two rollbacks, the spike
statistic of both the loss and the gradient norm (14 healthy steps each) and the last gradient norm.
``tests/integration/test_checkpoint_resume.py`` resumes from it with the current code.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_v020 import BLANK_INDEX, CosineModel, loader

__all__ = ["BLANK_INDEX", "CHECKPOINT", "EPOCHS", "GUARD_ARGS", "CosineModel", "loader", "main"]

CHECKPOINT = Path(__file__).with_name("nanguard-0.3.0.ckpt")
EPOCHS = 2
"""Epochs of the saved run: 8 batches each, batch 1 of each NaN."""
GUARD_ARGS: dict[str, Any] = {
    "action": "rollback",
    "rollback_after_consecutive": 1,
    "snapshot_every_n_steps": 1,
    "remedies": ["clip_grad"],
    "verbose": False,
    "save_repro": False,
    "spike_warmup_steps": 4,
}
"""The guard of the saved run (a resumed run uses the same)."""


def main() -> None:  # pragma: no cover - run by hand with the 0.3 package
    import lightning_nanguard
    from lightning_nanguard import NanGuard

    assert lightning_nanguard.__version__.startswith("0.3"), lightning_nanguard.__version__
    torch.manual_seed(0)
    guard = NanGuard(**GUARD_ARGS)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=EPOCHS,
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
