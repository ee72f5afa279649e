"""The collapse task and schedule under a real ``Trainer``: models whose attention can collapse.

``collapse_gpt.py`` holds the task (a bigram chain, then a copy of it), the tiny pre-LN GPT and the
learning-rate schedule that the precursor rule was calibrated on (``python -m studies.attention_collapse``
trains them in plain torch). Here:

- :class:`ScheduledModule`, a ``LightningModule`` with the runs' AdamW and warm-up/cosine
  schedule, which records each attention module's max logit and entropy per step (``record``);
- :class:`CollapsingGPT`, ``collapse_gpt.TinyGPT`` in it (module names ``model.blocks.N.attn``);
- :func:`collapse_batches`, the run's batches (a seed fixes them) and :func:`entropy_onset`.

Example::

    config = RunConfig(attention="sdpa", qk_norm=False, lr=0.15, seed=0)
    trainer.fit(CollapsingGPT(config), collapse_batches(config, steps=100))
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from collapse_gpt import Attention, RunConfig, TinyGPT, lr_at, make_batch, transition_matrix
from torch import Tensor
from torch.utils.data import DataLoader

__all__ = ["CollapsingGPT", "ScheduledModule", "collapse_batches", "entropy_onset"]


class ScheduledModule(pl.LightningModule):
    """AdamW (betas 0.9/0.95, no weight decay) with the collapse runs' schedule, stepped every step."""

    def __init__(self, config: RunConfig) -> None:
        super().__init__()
        self.config = config
        self.entropy: dict[str, list[float]] = {}
        self.max_logit: dict[str, list[float]] = {}

    def record(self, name: str, max_logit: float, entropy: float) -> None:
        """One step's side measurement of attention module ``name``."""
        self.max_logit.setdefault(name, []).append(max_logit)
        self.entropy.setdefault(name, []).append(entropy)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.config.lr, betas=(0.9, 0.95), weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(self.config, step) / self.config.lr)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class CollapsingGPT(ScheduledModule):
    """The collapse runs' tiny GPT; every step records its float64 side measurement of each layer."""

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        torch.manual_seed(config.seed)
        self.model = TinyGPT(config)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        for name, module in self.model.named_modules():
            if isinstance(module, Attention) and module.last is not None:
                self.record(f"model.{name}", module.last[0], module.last[1])
        return loss


def collapse_batches(config: RunConfig, steps: int) -> DataLoader:
    """The first ``steps`` batches of the run with ``config``'s seed."""
    chain, gen = transition_matrix(), torch.Generator().manual_seed(10_000 + config.seed)
    batches = [make_batch(chain, gen, config.batch_size, config.seq_len) for _ in range(steps)]
    return DataLoader(batches, batch_size=None)


def entropy_onset(entropy: list[float], fraction: float = 0.1) -> int | None:
    """The first step after 15 whose entropy is below ``fraction`` of its mean over steps 5 to 15."""
    baseline = sum(entropy[5:16]) / 11
    return next((step for step in range(16, len(entropy)) if entropy[step] < fraction * baseline), None)
