"""A real NaN in a small image classifier, caught by NanGuard through the LightningCLI config.

The model's first layer is a cosine-normalised convolution: each output is the cosine between a
filter and the input patch under it, ``<w, x> / (|w| * |x|)``. The patch norm ``|x|`` is
computed without an epsilon, so a patch that is all zero gives ``0 / 0 = NaN``. Ordinary images
never have such a patch (their background is grey and noisy), but the synthetic dataset below
contains a few blank, all-zero images, as a real dataset can (a failed decode, an empty frame).
Whenever a blank image lands in a batch:

* its first-layer output is NaN, and the BatchNorm after it spreads the NaN to the whole batch
  (the batch mean is NaN) and into its ``running_mean``/``running_var``;
* the loss is NaN, and so is every gradient.

Without NanGuard one such step makes every weight NaN and the run is lost. With NanGuard
(``--config configs/nanguard.yaml``) the step is skipped, the BatchNorm statistics are restored,
and training goes on. Run it from the repository root::

    python examples/cosine_norm_demo.py fit --config configs/demo.yaml --config configs/nanguard.yaml

(``bash scripts/demo.sh`` does this after setting up ``.venv``). Leave out
``--config configs/nanguard.yaml`` to see the run without the guard.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import ArgsType, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_nanguard import NanEvent, NanGuard, read_events
from lightning_nanguard.reporting.jsonl import EVENTS_FILENAME

NUM_CLASSES = 4
CLASS_NAMES = ("square", "disk", "bar", "cross")


class CosineNormConv2d(nn.Module):
    """Convolution whose outputs are cosines between each filter and the input patch under it.

    ``out[n, c, i, j] = <w_c, x_patch(i, j)> / (|w_c| * |x_patch(i, j)|)``, in ``[-1, 1]``.

    There is deliberately no epsilon in the denominator: an all-zero patch gives ``0 / 0 = NaN``.
    (The usual fix is ``|x| + eps``; this demo keeps the bug so that NanGuard has something real
    to catch.)

    Args:
        in_channels: channels of the input.
        out_channels: number of filters.
        kernel_size: side of the square filters.
        padding: zero padding on each side, as in ``nn.Conv2d``.
    """

    ones: Tensor

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3, padding: int = 1) -> None:
        super().__init__()
        self.padding = padding
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels, kernel_size, kernel_size))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        # Summing x**2 over each patch is a convolution with a kernel of ones.
        self.register_buffer("ones", torch.ones(1, in_channels, kernel_size, kernel_size), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        dot = F.conv2d(x, self.weight, padding=self.padding)  # (N, out, H, W)
        patch_norm = F.conv2d(x.pow(2), self.ones, padding=self.padding).sqrt()  # (N, 1, H, W); no eps!
        weight_norm = torch.linalg.vector_norm(self.weight.flatten(1), dim=1).view(1, -1, 1, 1)  # (1, out, 1, 1)
        return dot / (patch_norm * weight_norm)


class ShapesDataset(Dataset[tuple[Tensor, Tensor]]):
    """Small grey-scale images of four shapes on a noisy grey background, some of them blank.

    Shapes have intensity 1 on a background of ``background``, plus Gaussian noise, so no 3x3
    patch of an ordinary image is all zero. Blank images are exactly zero everywhere. Every
    image is generated up front from ``seed``: the dataset is the same on every run.

    Args:
        num_images: number of images.
        size: height and width in pixels.
        blank_indices: indices whose image is replaced by an all-zero one (its label is kept).
        background: intensity of the background.
        noise_std: standard deviation of the Gaussian noise added to every pixel.
        seed: seed of the generator.
    """

    def __init__(
        self,
        num_images: int,
        size: int = 16,
        blank_indices: Sequence[int] = (),
        background: float = 0.2,
        noise_std: float = 0.05,
        seed: int = 0,
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(NUM_CLASSES, (num_images,), generator=generator)
        shapes = torch.stack([_draw_shape(int(label), size, generator) for label in self.labels])
        noise = noise_std * torch.randn(shapes.shape, generator=generator)
        self.images = background + (1.0 - background) * shapes + noise
        self.blank_indices = tuple(i for i in blank_indices if 0 <= i < num_images)
        self.images[list(self.blank_indices)] = 0.0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.images[index], self.labels[index]


def _draw_shape(label: int, size: int, generator: torch.Generator) -> Tensor:
    """A ``(1, size, size)`` image of the shape ``CLASS_NAMES[label]`` at a random place and scale."""
    radius = int(torch.randint(3, size // 3 + 1, (1,), generator=generator))
    cy, cx = (int(v) for v in torch.randint(radius, size - radius, (2,), generator=generator))
    ys, xs = torch.meshgrid(torch.arange(size) - cy, torch.arange(size) - cx, indexing="ij")
    if CLASS_NAMES[label] == "square":
        mask = (ys.abs() <= radius - 1) & (xs.abs() <= radius - 1)
    elif CLASS_NAMES[label] == "disk":
        mask = ys**2 + xs**2 <= radius**2
    elif CLASS_NAMES[label] == "bar":
        mask = (ys.abs() <= 1) & (xs.abs() <= radius)
    else:  # cross
        mask = ((ys.abs() <= 1) & (xs.abs() <= radius)) | ((xs.abs() <= 1) & (ys.abs() <= radius))
    return mask.float().unsqueeze(0)


class ShapesDataModule(LightningDataModule):
    """Training images with a few blank ones, and clean validation images.

    Args:
        num_train: number of training images.
        num_val: number of validation images (none of them blank).
        blank_indices: training-set indices of the blank images.
        batch_size: images per batch.
        shuffle: shuffle the training set each epoch (the blank images then land in different
            batches every epoch).
        seed: seed of the data generator (the validation set uses ``seed + 1``).
    """

    def __init__(
        self,
        num_train: int = 512,
        num_val: int = 128,
        blank_indices: tuple[int, ...] = (100, 280, 433),
        batch_size: int = 32,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.num_train = num_train
        self.num_val = num_val
        self.blank_indices = blank_indices
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed

    def setup(self, stage: str) -> None:
        self.train_set = ShapesDataset(self.num_train, blank_indices=self.blank_indices, seed=self.seed)
        self.val_set = ShapesDataset(self.num_val, seed=self.seed + 1)

    def train_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=self.shuffle)

    def val_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return DataLoader(self.val_set, batch_size=self.batch_size)


class CosineNormClassifier(LightningModule):
    """``CosineNormConv2d -> BatchNorm -> ReLU -> max-pool -> Conv -> ReLU -> global max-pool -> Linear``.

    Args:
        channels: filters of the first layer (the second has twice as many).
        lr: learning rate of Adam.
    """

    def __init__(self, channels: int = 8, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr = lr
        self.net = nn.Sequential(
            CosineNormConv2d(1, channels),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.AdaptiveMaxPool2d(1),
            nn.Flatten(),
            nn.Linear(2 * channels, NUM_CLASSES),
        )

    def forward(self, images: Tensor) -> Tensor:
        logits: Tensor = self.net(images)
        return logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", (logits.argmax(dim=1) == labels).float().mean())
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.log("val_loss", F.cross_entropy(logits, labels))
        self.log("val_acc", (logits.argmax(dim=1) == labels).float().mean(), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def _relative(path: str | os.PathLike[str]) -> str:
    """``path`` relative to the working directory when it lies below it, else absolute."""
    absolute = Path(path).resolve()
    try:
        return str(absolute.relative_to(Path.cwd()))
    except ValueError:
        return str(absolute)


def tensorboard_command() -> str:
    """How to start TensorBoard from the user's shell: this interpreter's script, else ``tensorboard`` on PATH.

    The script beside the interpreter comes first: ``scripts/demo.sh`` puts ``.venv/bin`` on the
    PATH of the demo only, so a bare ``tensorboard`` found there would not run in the user's shell.
    """
    beside = Path(sys.executable).parent / "tensorboard"  # the venv's script, e.g. .venv/bin/tensorboard
    if beside.exists():
        relative = os.path.relpath(beside)
        return relative if not relative.startswith("..") else str(beside)
    if shutil.which("tensorboard"):
        return "tensorboard"
    return f"{sys.executable} -m tensorboard.main"


def all_finite(module: nn.Module) -> bool:
    """Whether every parameter and buffer (BatchNorm statistics included) of ``module`` is finite."""
    tensors = [*module.parameters(), *module.buffers()]
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def summarize(trainer: Trainer, model: nn.Module) -> str:
    """Where the logs are and what NanGuard did, as printed at the end of the demo."""
    lines = ["", "== NanGuard demo summary"]
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            lines.append(f"TensorBoard logs:  {_relative(logger.log_dir)}")
            lines.append(f"  view them with:  {tensorboard_command()} --logdir {_relative(logger.log_dir)}")
        elif logger.log_dir is not None:
            lines.append(f"{type(logger).__name__ + ' logs:':<19}{_relative(logger.log_dir)}")
    guards = [callback for callback in getattr(trainer, "callbacks", []) if isinstance(callback, NanGuard)]
    if not guards:
        lines.append("NanGuard is not in trainer.callbacks (add --config configs/nanguard.yaml).")
    for guard in guards:
        events_path = Path(guard.log_dir or ".") / "nanguard" / EVENTS_FILENAME
        events: list[NanEvent] = read_events(events_path) if events_path.exists() else []
        lines.append(f"NanGuard events:   {_relative(events_path)}" + ("" if events else " (none written)"))
        kinds = sorted({kind for event in events for kind in event.kinds})
        steps = [event.global_step for event in events]
        lines.append(
            f"bad steps: {guard.bad_steps_total}, skipped: {guard.skipped_total}"
            + (f", non-finite: {', '.join(kinds)}, at global steps {steps}" if events else "")
        )
    metrics = trainer.callback_metrics
    if "val_acc" in metrics:
        lines.append(f"final val_acc: {float(metrics['val_acc']):.3f}")
    lines.append(f"final weights and BatchNorm statistics finite: {all_finite(model)}")
    return "\n".join(lines)


def main(args: ArgsType = None) -> LightningCLI:
    """Run the LightningCLI (``fit``, ``validate``, ...) and, after ``fit``, print the summary."""
    cli = LightningCLI(CosineNormClassifier, ShapesDataModule, args=args)
    if cli.subcommand == "fit":
        print(summarize(cli.trainer, cli.model), flush=True)
    return cli


if __name__ == "__main__":
    main()
