"""Runs that collapse by themselves: the warning comes at least 10 steps before the onset this test computes.

The tiny pre-LN GPT, task and learning-rate schedule of ``benchmarks/attention_collapse.py`` (the
evidence for the defaults), trained by a real ``Trainer`` with ``NanGuard()`` defaults: at a peak
learning rate of 0.15, ``blocks.1.attn``'s max logit runs away and its attention turns one-hot (no
NaN, no loss spike); at 0.01 it trains healthily. The test measures every step's attention entropy
itself (float64, from the layer's queries and keys) and takes as the onset the first step after 15
where the collapsing layer's mean entropy is below 0.1 of its mean over steps 5 to 15.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fitting import build_trainer
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_nanguard import NanGuard

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import attention_collapse as bench

STEPS = 100  # the collapse at lr 0.15 begins around step 50; the schedule is the 300-step one


class CollapsingGPT(pl.LightningModule):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        torch.manual_seed(config.seed)
        self.model = bench.TinyGPT(config)
        self.entropy: dict[str, list[float]] = {}
        self.max_logit: dict[str, list[float]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        for name, module in self.model.named_modules():
            if isinstance(module, bench.Attention) and module.last is not None:
                self.max_logit.setdefault(f"model.{name}", []).append(module.last[0])
                self.entropy.setdefault(f"model.{name}", []).append(module.last[1])
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.config.lr, betas=(0.9, 0.95), weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: bench.lr_at(self.config, step) / self.config.lr
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _batches(config: Any) -> DataLoader:
    chain, gen = bench.transition_matrix(), torch.Generator().manual_seed(10_000 + config.seed)
    batches = [bench.make_batch(chain, gen, config.batch_size, config.seq_len) for _ in range(STEPS)]
    return DataLoader(batches, batch_size=None)


def _onset(entropy: list[float]) -> int | None:
    baseline = sum(entropy[5:16]) / 11
    return next((step for step in range(16, len(entropy)) if entropy[step] < 0.1 * baseline), None)


def _train(tmp_path: Path, attention: str, lr: float) -> tuple[NanGuard, CollapsingGPT]:
    config = bench.RunConfig(attention=attention, qk_norm=False, lr=lr, seed=0)
    module, guard = CollapsingGPT(config), NanGuard(verbose=False)
    build_trainer("lightning", tmp_path, callbacks=[guard], max_steps=STEPS).fit(module, _batches(config))
    return guard, module


@pytest.mark.parametrize("attention", ["manual", "sdpa"])
def test_a_collapsing_layer_is_named_at_least_10_steps_before_its_entropy_collapses(
    tmp_path: Path, attention: str
) -> None:
    guard, module = _train(tmp_path, attention, lr=0.15)
    onset = _onset(module.entropy["model.blocks.1.attn"])
    assert onset is not None and max(module.max_logit["model.blocks.1.attn"]) > 200  # it did collapse
    warnings = [e for e in guard.events if e.kinds == ("precursor",)]
    assert warnings, f"no warning; onset at step {onset}"
    first = warnings[0]
    assert first.culprit_module == "model.blocks.1.attn"
    assert onset - first.global_step >= 10, (first.global_step, onset)
    assert all(e.kinds == ("precursor",) for e in guard.events)  # no NaN, no spike: nothing else to report
    assert guard.counters.skipped_total == 0


def test_a_healthy_run_at_a_low_learning_rate_gets_no_warning(tmp_path: Path) -> None:
    guard, module = _train(tmp_path, "sdpa", lr=0.01)
    assert guard.events == []
    assert max(module.max_logit["model.blocks.1.attn"]) < 80
