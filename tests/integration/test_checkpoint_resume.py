"""Checkpoints written by NanGuard 0.2.0 and 0.3 resume through ``Trainer.fit(ckpt_path=...)`` with their guard state.

``tests/data/nanguard-0.2.0.ckpt`` (``checkpoint_v020.py``): one bad step skipped, its record
quarantined. ``tests/data/nanguard-0.3.0.ckpt`` (``checkpoint_v030.py``): two bad steps skipped
and rolled back, ``clip_grad`` applied twice. Each resumes for one more epoch with the current code:
the restored counters, events, spike statistic and remedy state are checked when training starts,
and training goes on with finite weights.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from fitting import build_trainer

from lightning_nanguard import NanGuard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
import checkpoint_v020 as v020
import checkpoint_v030 as v030


class AtStart(pl.Callback):
    """The guard's restored state when training resumes, and every batch trained on after."""

    def __init__(self, guard: NanGuard) -> None:
        self.guard = guard
        self.state: dict[str, Any] = {}
        self.batches: list[torch.Tensor] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        guard, spikes = self.guard, self.guard.controller.spikes
        assert spikes is not None and spikes.grad_norm is not None
        self.state = {
            "global_step": trainer.global_step,
            "counters": guard.counters,
            "last_grad_norm": guard.last_grad_norm,
            "events": [(e.global_step, e.kinds, e.action, e.cause, e.dataset_indices) for e in guard.events],
            "spike_history": (len(spikes.loss.state_dict()["history"]), len(spikes.grad_norm.state_dict()["history"])),
            "recovery": guard.recovery.state_dict(),
        }

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self.batches.append(batch[0])


def saved_guard_state(path: Path) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(path, weights_only=True)["callbacks"]["NanGuard"]
    return state


def weights_are_finite(module: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in module.parameters())


def test_the_0_3_checkpoint_holds_the_guard_state_of_0_3() -> None:
    state = saved_guard_state(v030.CHECKPOINT)
    assert state["bad_steps_total"] == 2 and state["recovery"]["rollbacks_total"] == 2
    assert state["recovery"]["remedies"]["applied"] == {"clip_grad": 2}
    counters = ["bad_steps_total", "skipped_total", "consecutive_bad_steps", "amp_overflow_total"]
    counters += ["consecutive_overflows", "spikes_total", "consecutive_spikes"]
    assert list(state) == [*counters, "last_grad_norm", "spikes", "events", "recovery"]
    assert {"indices_verified", "blame_verified"} <= set(state["events"][0])  # event fields 0.2.0 did not write


def test_a_0_2_0_checkpoint_resumes_through_fit(tmp_path: Path) -> None:
    saved = saved_guard_state(v020.CHECKPOINT)
    guard = NanGuard(remedies=["quarantine", "clip_grad"], verbose=False, save_repro=False, spike_warmup_steps=4)
    seen = AtStart(guard)
    model = v020.CosineModel()
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard, seen], max_epochs=4)
    trainer.fit(model, v020.loader(), ckpt_path=v020.CHECKPOINT)

    start = seen.state
    assert start["global_step"] == 24
    assert start["counters"].bad_steps_total == 1 and start["counters"].skipped_total == 1
    assert start["counters"].consecutive_bad_steps == 0 and start["counters"].spikes_total == 0
    assert start["last_grad_norm"] == pytest.approx(saved["last_grad_norm"])
    assert start["events"] == [(1, ("loss", "grad"), "skipped", "data", (v020.BLANK_INDEX,))]
    assert start["spike_history"] == (23, 23)
    assert start["recovery"]["rollbacks_total"] == 0
    remedies = start["recovery"]["remedies"]
    assert remedies["applied"] == {"quarantine": 1} and remedies["quarantined"] == [v020.BLANK_INDEX]
    assert remedies["clip_threshold"] is None and len(remedies["healthy_norms"]) == 23
    assert remedies["quarantined_by_loader"] == []  # a key 0.2.0 did not write: its default

    assert trainer.global_step == 32  # one more epoch of 8 batches after the checkpoint's 24 steps
    assert sum(int((batch.abs().sum(dim=1) == 0).sum()) for batch in seen.batches) == 0  # still quarantined
    assert guard.bad_steps_total == 1 and len(guard.events) == 1  # nothing new went wrong
    assert weights_are_finite(model) and guard.last_grad_norm is not None and math.isfinite(guard.last_grad_norm)


def test_a_0_3_checkpoint_resumes_through_fit(tmp_path: Path) -> None:
    saved = saved_guard_state(v030.CHECKPOINT)
    guard = NanGuard(**v030.GUARD_ARGS)
    seen = AtStart(guard)
    model = v030.CosineModel()
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard, seen], max_epochs=v030.EPOCHS + 1)
    trainer.fit(model, v030.loader(), ckpt_path=v030.CHECKPOINT)

    start = seen.state
    assert start["global_step"] == 16
    assert start["counters"].bad_steps_total == 2 and start["counters"].skipped_total == 2
    assert start["counters"].consecutive_bad_steps == 0 and start["counters"].spikes_total == 0
    assert start["last_grad_norm"] == pytest.approx(saved["last_grad_norm"])
    blank = (v030.BLANK_INDEX,)
    assert start["events"] == [
        (1, ("loss", "grad"), "rolled_back", "data", blank),
        (9, ("loss", "grad"), "rolled_back", "data", blank),
    ]
    assert start["spike_history"] == (14, 14)
    assert start["recovery"]["rollbacks_total"] == 2
    remedies = start["recovery"]["remedies"]
    assert remedies["applied"] == {"clip_grad": 2} and remedies["quarantined"] == []
    assert remedies["clip_threshold"] == pytest.approx(2.411261558532715)
    assert remedies == saved["recovery"]["remedies"]

    # One more epoch: its batch 1 (global step 17) is bad again, is rolled back, and clipping tightens.
    assert trainer.global_step == 24
    assert guard.bad_steps_total == 3 and guard.counters.skipped_total == 3 and guard.recovery.rollbacks_total == 3
    assert [(e.global_step, e.action) for e in guard.events] == [
        (1, "rolled_back"),
        (9, "rolled_back"),
        (17, "rolled_back"),
    ]
    book = guard.recovery.book
    assert book.applied == {"clip_grad": 3} and book.clip_threshold == pytest.approx(2.411261558532715 / 2)
    assert weights_are_finite(model) and guard.last_grad_norm is not None and math.isfinite(guard.last_grad_norm)
