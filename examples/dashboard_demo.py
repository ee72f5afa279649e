"""A run with several kinds of incidents, to look at in the NanGuard tab of TensorBoard.

The classifier of ``cosine_norm_demo.py`` (its first layer divides by the norm of each input patch,
with no epsilon) trained on the same synthetic shapes, with three kinds of trouble:

* a few blank images: ``0 / 0 = NaN`` in the first layer; each is caught, skipped and quarantined
  (``remedies=["quarantine"]``), so it is never trained on again;
* a corrupt stretch of the data: several consecutive batches holding an image with an Inf pixel;
  after three bad steps in a row NanGuard rolls back to its last good snapshot
  (``action="rollback"``) and backs off the learning rate (``"lr_backoff"``);
* mixed precision with a GradScaler (fp16) starting from a loss scale of 2^24: the first steps
  overflow and the scaler skips them while it lowers the scale (counted as AMP overflows: normal,
  not incidents).

Run it from the repository root, then open TensorBoard on the logs (with ``demo.sh``'s run next to
it if you ran that too)::

    python examples/dashboard_demo.py
    tensorboard --logdir nanguard_demo_logs --samples_per_plugin=text=0
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins import MixedPrecision

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cosine_norm_demo import CosineNormClassifier, ShapesDataModule, tensorboard_command

from lightning_nanguard import NanGuard

BATCH_SIZE = 32
BLANK = (40, 300, 470)  # blank images: NaN in the first layer
CORRUPT = (200, 232, 264, 296)  # an Inf pixel, one per batch in four consecutive batches (no shuffling)


class CorruptShapes(ShapesDataModule):
    """The demo's shapes, with an Inf pixel in the images at ``corrupt_indices``."""

    def __init__(self, corrupt_indices: Sequence[int] = CORRUPT, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.corrupt_indices = tuple(corrupt_indices)

    def setup(self, stage: str) -> None:
        super().setup(stage)
        for index in self.corrupt_indices:
            self.train_set.images[index, 0, 5, 5] = math.inf


def main(argv: Sequence[str] | None = None) -> Trainer:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--save-dir", default="nanguard_demo_logs", help="TensorBoard log directory")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)

    seed_everything(0, verbose=False)
    torch.set_num_threads(1)
    data = CorruptShapes(num_train=512, num_val=64, blank_indices=BLANK, batch_size=BATCH_SIZE, shuffle=False)
    guard = NanGuard(
        action="rollback",
        snapshot_every_n_steps=4,
        rollback_after_consecutive=3,
        remedies=["quarantine", "lr_backoff"],
        max_remedy_applications=10,
        max_repro_bundles=3,
    )
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=args.epochs,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**24))],
        logger=TensorBoardLogger(args.save_dir, name="dashboard_demo"),
        callbacks=[guard],
        log_every_n_steps=2,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(CosineNormClassifier(channels=8, lr=0.01), data)
    kinds = sorted({kind for event in guard.events for kind in event.kinds})
    actions = sorted({event.action for event in guard.events})
    print(f"\n{len(guard.events)} incidents ({', '.join(kinds)}; {', '.join(actions)}) in {trainer.log_dir}")
    command = f"{tensorboard_command()} --logdir {args.save_dir} --samples_per_plugin=text=0"
    print(f"view them with:  {command}  (then the NanGuard tab)")
    return trainer


if __name__ == "__main__":
    main()
