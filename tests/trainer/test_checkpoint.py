"""A checkpoint written by NanGuard 0.2.0 (tests/data/nanguard-0.2.0.ckpt) resumes with its guard state."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from conftest import build_trainer

from lightning_nanguard import NanGuard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from checkpoint_v020 import BLANK_INDEX, CHECKPOINT, CosineModel, loader


class Seen(pl.Callback):
    """The guard's state when training resumes, and every batch trained on after."""

    def __init__(self, guard: NanGuard) -> None:
        self.guard = guard
        self.at_start: dict[str, Any] = {}
        self.batches: list[torch.Tensor] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        guard = self.guard
        self.at_start = {
            "counters": (guard.bad_steps_total, guard.skipped_total, guard.consecutive_bad_steps),
            "events": [(e.global_step, e.dataset_indices, e.cause, e.action) for e in guard.events],
            "quarantined": set(guard.remedy_book.quarantined),
            "applied": dict(guard.remedy_book.applied),
            "spike_history": len(guard.controller.spikes.loss.state_dict()["history"]),
        }

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self.batches.append(batch[0])


def test_the_checkpoint_was_written_by_0_2_0() -> None:
    state = torch.load(CHECKPOINT, weights_only=True)["callbacks"]["NanGuard"]
    assert state["bad_steps_total"] == 1 and state["recovery"]["remedies"]["quarantined"] == [BLANK_INDEX]
    fields_020 = (
        "global_step epoch batch_idx rank kinds action nonfinite_grads nonfinite_buffers loss offending_samples "
        "dataset_indices culprit_module culprit_op source_line phase remedies repro_path grad_norm nonfinite_params "
        "details cause"
    )
    assert sorted(state["events"][0]) == sorted(fields_020.split(" "))  # the NanEvent fields of 0.2.0, no later one


def test_a_0_2_0_checkpoint_resumes_with_its_guard_state(tmp_path: Path) -> None:
    guard = NanGuard(remedies=["quarantine", "clip_grad"], verbose=False, save_repro=False, spike_warmup_steps=4)
    seen = Seen(guard)
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard, seen], max_epochs=4)
    trainer.fit(CosineModel(), loader(), ckpt_path=CHECKPOINT)

    assert seen.at_start == {
        "counters": (1, 1, 0),
        "events": [(1, (BLANK_INDEX,), "data", "skipped")],
        "quarantined": {BLANK_INDEX},
        "applied": {"quarantine": 1},
        "spike_history": 23,
    }
    assert trainer.global_step == 32  # one more epoch of 8 batches after the 24 steps of the checkpoint
    blank_rows = sum(int((batch.abs().sum(dim=1) == 0).sum()) for batch in seen.batches)
    assert blank_rows == 0  # the quarantined record is never trained on again
    assert len(guard.events) == 1 and guard.bad_steps_total == 1  # and nothing new went wrong


def test_the_guard_state_round_trips_through_a_weights_only_checkpoint(tmp_path: Path) -> None:
    from lightning_nanguard.core.events import NanEvent
    from lightning_nanguard.decide.policy import Counters
    from lightning_nanguard.trainer.checkpoint import guard_state, load_guard_state

    guard = NanGuard(remedies=["quarantine"], verbose=False)
    controller = guard.controller
    controller.state.counters = Counters(bad_steps_total=3, skipped_total=2, spikes_total=1)
    controller.state.last_grad_norm = 1.5
    controller.recorder.events.append(NanEvent(4, 0, 4, 0, ("loss",), "skipped", dataset_indices=(9,)))
    guard.recovery.book.quarantined.add(9)
    torch.save(guard_state(controller), tmp_path / "state.pt")
    fresh = NanGuard(remedies=["quarantine"], verbose=False)
    load_guard_state(fresh.controller, torch.load(tmp_path / "state.pt", weights_only=True))
    assert fresh.controller.state.counters == controller.state.counters
    assert fresh.last_grad_norm == 1.5 and fresh.events == controller.recorder.events
    assert fresh.remedy_book.quarantined == {9}


def test_missing_keys_read_as_defaults() -> None:
    from lightning_nanguard.decide.policy import Counters
    from lightning_nanguard.trainer.checkpoint import load_guard_state

    guard = NanGuard(verbose=False)
    load_guard_state(guard.controller, {"bad_steps_total": 2})
    assert guard.counters == Counters(bad_steps_total=2) and guard.events == [] and guard.last_grad_norm is None
