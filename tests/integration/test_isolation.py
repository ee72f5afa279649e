"""Isolation inside a real training run: forensics on every bad step leave no trace.

The isolation guarantee of the issue: with dropout, BatchNorm, ``self.log``, ``self.log_dict``,
torchmetrics metrics and a step-interval LR scheduler in the model, a run where NanGuard bisects
and localises every bad step ends bitwise identical to a run where it does not (both skip the same
bad steps): weights, optimizer and scheduler state, BatchNorm buffers, RNG streams, logged metrics
and metric states. The re-run of ``training_step`` on its own is tested in
``tests/diagnose/test_isolation.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fitting import StepRecorder, fit
from forensics_models import (
    IsolationModule,
    one_thread,  # noqa: F401 (fixture)
)
from states import clone_state, states_equal
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NanGuard

pytestmark = pytest.mark.usefixtures("one_thread")

N_SAMPLES, BATCH, EPOCHS = 48, 8, 2
BAD = (11, 12, 40)  # steps 1 and 5 (and 7 and 11 in the second epoch) are bad; 11, 12 share a batch


def isolation_data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N_SAMPLES, 8, generator=g)
    y = torch.randint(0, 4, (N_SAMPLES,), generator=g)
    x[list(BAD)] = 0.0  # blank samples: sqrt(0) in the backward
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(2))


class Observer(StepRecorder):
    """Also records logged metrics, metric states and the RNG after every batch."""

    def __init__(self) -> None:
        super().__init__()
        self.after: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.after.append(
            {
                "callback_metrics": clone_state(dict(trainer.callback_metrics)),
                "logged_metrics": clone_state(dict(trainer.logged_metrics)),
                "metrics": metric_states(pl_module),
                "rng": torch.get_rng_state(),
                "lr": trainer.optimizers[0].param_groups[0]["lr"],
            }
        )


def metric_states(module: IsolationModule) -> dict[str, Any]:
    state = {}
    for name in ("mse", "acc"):
        metric = getattr(module, name)
        for key in metric._defaults:
            state[f"{name}.{key}"] = clone_state(getattr(metric, key))
        state[f"{name}._update_count"] = metric._update_count
        state[f"{name}._computed"] = clone_state(metric._computed)
        state[f"{name}._forward_cache"] = clone_state(metric._forward_cache)
    return state


def train(root: Path, forensics: bool) -> tuple[IsolationModule, Any, NanGuard, Observer]:
    torch.manual_seed(0)
    module = IsolationModule()
    guard = NanGuard(bisect=forensics, localize=forensics, save_repro=forensics, verbose=False)
    observer = Observer()
    trainer, _ = fit(module, isolation_data(), root=root, guard=guard, callbacks=[observer], max_epochs=EPOCHS)
    return module, trainer, guard, observer


def test_training_is_bitwise_identical_with_and_without_forensics(tmp_path: Path) -> None:
    module_on, trainer_on, guard_on, observer_on = train(tmp_path / "on", forensics=True)
    module_off, trainer_off, guard_off, observer_off = train(tmp_path / "off", forensics=False)

    # the same bad steps were skipped, and the forensics really ran in one run only
    assert [e.global_step for e in guard_on.events] == [e.global_step for e in guard_off.events]
    assert len(guard_on.events) >= 2 and guard_on.skipped_total == guard_off.skipped_total
    assert all(e.offending_samples is not None and e.culprit_op == "SqrtBackward0" for e in guard_on.events)
    assert all(e.offending_samples is None and e.culprit_op is None for e in guard_off.events)
    assert sum(e.details["bisect_passes"] for e in guard_on.events) > 2 * len(guard_on.events)

    # every batch: weights, buffers, optimizer state, logged values, metric states, RNG
    assert len(observer_on.records) == len(observer_off.records) == EPOCHS * N_SAMPLES // BATCH
    for on, off in zip(observer_on.records, observer_off.records, strict=True):
        assert states_equal(on.params_after, off.params_after), on.global_step
        assert states_equal(on.buffers_after, off.buffers_after), on.global_step
        assert states_equal(on.optimizer_after, off.optimizer_after), on.global_step
    for step, (on, off) in enumerate(zip(observer_on.after, observer_off.after, strict=True)):
        for key in on:
            assert states_equal(on[key], off[key]), f"{key} differs after batch {step}"

    # and at the end
    assert states_equal(module_on.state_dict(), module_off.state_dict())
    assert states_equal(
        clone_state(trainer_on.optimizers[0].state_dict()), clone_state(trainer_off.optimizers[0].state_dict())
    )
    assert states_equal(
        trainer_on.lr_scheduler_configs[0].scheduler.state_dict(),
        trainer_off.lr_scheduler_configs[0].scheduler.state_dict(),
    )
    assert states_equal(clone_state(dict(trainer_on.callback_metrics)), clone_state(dict(trainer_off.callback_metrics)))
    assert states_equal(clone_state(dict(trainer_on.logged_metrics)), clone_state(dict(trainer_off.logged_metrics)))
    assert not any(
        "on_before_optimizer_step" in key or "on_after_backward" in key for key in trainer_on.callback_metrics
    )
    assert states_equal(metric_states(module_on), metric_states(module_off))
    assert torch.equal(torch.get_rng_state(), observer_off.after[-1]["rng"])
