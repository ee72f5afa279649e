"""Gradient accumulation: the event names the micro-batch and sample that went bad; the whole step is skipped.

``accumulate_grad_batches=2`` and batches of 8 without shuffling: optimizer step ``s`` is made of
batches ``2s`` and ``2s + 1``. Sample 27 sits in batch 3 (position 3), the SECOND micro-batch of
step 1; sample 20 in batch 2, the first.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from fitting import StepRecorder, fit
from models import NAMESPACES
from states import states_equal
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NanGuard


class _BatchNormRegression:
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)  # type: ignore[attr-defined]


def _module(ns_name: str) -> Any:
    return type("BatchNormRegression", (_BatchNormRegression, NAMESPACES[ns_name].LightningModule), {})()


def _data(nan_at: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4, generator=g), torch.randn(64, generator=g)
    x[nan_at, 1] = math.nan
    return TensorDataset(x, y)


def _fit(ns_name: str, tmp_path: Path, nan_at: int, **guard_kwargs: Any) -> tuple[NanGuard, StepRecorder]:
    guard, recorder = NanGuard(verbose=False, save_repro=False, **guard_kwargs), StepRecorder()
    module, loader = _module(ns_name), DataLoader(_data(nan_at), batch_size=8)
    fit(module, loader, root=tmp_path, guard=guard, callbacks=[recorder], ns=ns_name, accumulate_grad_batches=2)
    return guard, recorder


def _step_unchanged(recorder: StepRecorder, first_batch: int) -> bool:
    """Weights, BatchNorm buffers and Adam state after both micro-batches equal those before the first."""
    first, last = recorder.records[first_batch], recorder.records[first_batch + 1]
    assert (first.global_step, last.global_step) == (first_batch // 2, first_batch // 2)
    return (
        states_equal(first.params_before, last.params_after)
        and states_equal(first.buffers_before, last.buffers_after)
        and states_equal(first.optimizer_before, last.optimizer_after)
    )


def _steps_unchanged(recorder: StepRecorder) -> list[int]:
    return [b // 2 for b in range(0, len(recorder.records), 2) if _step_unchanged(recorder, b)]


@pytest.mark.parametrize("ns_name", list(NAMESPACES))
def test_bad_sample_in_second_micro_batch(ns_name: str, tmp_path: Path) -> None:
    """Regression: naming the chosen micro-batch once compared dataclasses holding tensors and crashed the guard."""
    guard, recorder = _fit(ns_name, tmp_path, nan_at=27)
    assert guard.active
    assert len(guard.events) == 1
    event = guard.events[0]
    assert (event.global_step, event.batch_idx, event.offending_samples, event.dataset_indices) == (1, 3, (3,), (27,))
    assert event.details["micro_batch"] == 1
    assert event.action == "skipped"
    assert _steps_unchanged(recorder) == [1]


@pytest.mark.parametrize("ns_name", list(NAMESPACES))
def test_bad_sample_in_first_micro_batch(ns_name: str, tmp_path: Path) -> None:
    guard, recorder = _fit(ns_name, tmp_path, nan_at=20)
    assert guard.active
    event = guard.events[0]
    assert len(guard.events) == 1
    assert (event.global_step, event.batch_idx, event.offending_samples, event.dataset_indices) == (1, 2, (4,), (20,))
    assert event.details["micro_batch"] == 0
    assert _steps_unchanged(recorder) == [1]


def test_whole_accumulated_step_is_skipped_without_diagnosis(tmp_path: Path) -> None:
    """With bisection and localisation off the skip alone: both micro-batches' updates (BN included) are undone."""
    guard, recorder = _fit("lightning", tmp_path, nan_at=27, bisect=False, localize=False)
    assert guard.active
    assert [(e.global_step, e.batch_idx, e.action, e.kinds) for e in guard.events] == [
        (1, 3, "skipped", ("loss", "grad", "bn_stats"))
    ]
    assert _steps_unchanged(recorder) == [1]
    # the first micro-batch on its own did move the BatchNorm statistics (so restoring them was needed)
    first = recorder.records[2]
    assert not states_equal(first.buffers_before, first.buffers_after)
    assert guard.skipped_total == 1
