"""Loss spikes on a real Trainer: a label typo is skipped and named, a healthy run sees none, a resume keeps state."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from fitting import build_trainer, fit
from spike_models import BATCH, TYPOS, Regression, Regressor
from torch import nn
from torch.utils.data import DataLoader

from lightning_nanguard import NanGuard


def _fit(tmp_path: Path, guard: NanGuard | None, typos: tuple[int, ...], epochs: int = 2, **kwargs: Any) -> Any:
    module = Regressor()
    loader = DataLoader(Regression(typos), batch_size=BATCH)
    trainer, _ = fit(module, loader, root=tmp_path, guard=guard, max_epochs=epochs, **kwargs)
    return module, trainer


def test_a_label_typo_is_skipped_and_its_sample_named(tmp_path: Path) -> None:
    guard = NanGuard(verbose=False, save_repro=False)
    module, _ = _fit(tmp_path, guard, TYPOS, epochs=4)
    steps = [(e.global_step, e.kinds, e.action) for e in guard.events]
    assert steps == [(s, ("loss_spike",), "skipped") for s in (25, 28, 57, 60, 89, 92, 121, 124)]  # every epoch
    first = guard.events[0]
    assert (first.cause, first.offending_samples, first.dataset_indices) == ("data", (0,), (200,))
    assert guard.events[1].dataset_indices == (230,)
    assert first.loss is not None and first.loss > first.details["threshold"] > first.details["baseline"] > 0
    assert first.details["ratio"] > 1e4
    assert (guard.counters.spikes_total, guard.skipped_total, guard.bad_steps_total) == (8, 8, 0)

    clean, _ = _fit(tmp_path / "clean", None, (), epochs=4)
    unguarded, _ = _fit(tmp_path / "unguarded", None, TYPOS, epochs=4)
    assert module.clean_error() < 1.5 * clean.clean_error()  # as if the typos were not there
    assert not unguarded.clean_error() < 100 * clean.clean_error()  # without the guard the typos wreck the run


def test_quarantine_drops_the_typos_for_good(tmp_path: Path) -> None:
    guard = NanGuard(verbose=False, save_repro=False, remedies=["quarantine"])
    _fit(tmp_path, guard, TYPOS)
    assert [e.global_step for e in guard.events] == [25, 28]  # not seen again in the second epoch
    assert guard.remedy_book.quarantined == set(TYPOS)


def test_spikes_never_escalate(tmp_path: Path) -> None:
    guard = NanGuard(verbose=False, save_repro=False, bisect=False, max_events=1, max_consecutive_bad_steps=1)
    _, trainer = _fit(tmp_path, guard, TYPOS)
    assert trainer.global_step == 64 and len(guard.events) == 4
    assert all(e.cause is None and e.action == "skipped" for e in guard.events)  # bisect=False: not investigated


def test_spike_action_warn_applies_the_step(tmp_path: Path) -> None:
    guard = NanGuard(verbose=False, save_repro=False, spike_action="warn")
    _fit(tmp_path, guard, TYPOS, epochs=1)
    assert guard.events[0].global_step == 25
    assert {e.action for e in guard.events} == {"warned"}  # the typo's update landed: later steps spike too
    assert guard.skipped_total == 0


def test_spike_action_off_sees_nothing(tmp_path: Path) -> None:
    guard = NanGuard(verbose=False, save_repro=False, spike_action="off")
    _fit(tmp_path, guard, TYPOS, epochs=1)
    assert guard.events == [] and guard.controller.spikes is None


class FastFalling(pl.LightningModule):
    """A loss that falls by orders of magnitude in the first steps (a large initial error, Adam)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.full((8,), 30.0))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(x @ self.w, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_fast_falling_loss_is_no_spike(tmp_path: Path) -> None:
    losses: list[float] = []

    class Record(pl.Callback):
        def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
            losses.append(float(loss))

    guard = NanGuard(verbose=False)
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard, Record()], max_epochs=3)
    trainer.fit(FastFalling(), DataLoader(Regression(), batch_size=BATCH))
    assert losses[0] / min(losses) > 1e3  # it did fall fast
    assert guard.events == []


def test_resume_keeps_the_statistic(tmp_path: Path) -> None:
    guard = NanGuard(verbose=False, save_repro=False)
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = build_trainer(
        "lightning", tmp_path, callbacks=[guard, checkpoint], max_epochs=1, enable_checkpointing=True
    )
    trainer.fit(Regressor(), DataLoader(Regression(), batch_size=BATCH))
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["callbacks"]
    (saved,) = [value for key, value in state.items() if "NanGuard" in key]
    history = saved["spikes"]["loss"]["history"]
    assert len(history) == 32 and all(math.isfinite(v) and v > 0 for v in history)

    resumed = NanGuard(verbose=False, save_repro=False)
    module = Regressor()
    trainer = build_trainer("lightning", tmp_path, callbacks=[resumed], max_epochs=2)
    trainer.fit(module, DataLoader(Regression((37,)), batch_size=BATCH), ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    # item 37 is in batch 4 of the second epoch: 5 steps after the resume, before a fresh statistic could flag
    assert [(e.global_step, e.kinds) for e in resumed.events] == [(36, ("loss_spike",))]


def test_rebaseline_after_a_level_shift_warns_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """From step 20 on, every label is 100x larger (a curriculum change): five skips, then the new level is normal."""

    class Shifted(Regression):
        def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
            x, y = super().__getitem__(index)
            return x, y * 100 if index >= 160 else y

    guard = NanGuard(verbose=False, save_repro=False, bisect=False)
    module = Regressor()
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard], max_epochs=1)
    with caplog.at_level(logging.WARNING, logger="lightning_nanguard"):
        trainer.fit(module, DataLoader(Shifted(), batch_size=BATCH))
    assert [e.global_step for e in guard.events] == [20, 21, 22, 23, 24]
    assert sum("loss spikes in a row" in r.getMessage() for r in caplog.records) == 1
