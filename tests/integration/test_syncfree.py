"""``NanGuard(sync_free=True)`` on a real Trainer with torch's fused optimizers (CPU).

A bad step is a bitwise no-op (weights, optimizer state with Adam's step count, BatchNorm
statistics), its event and diagnosis are those of the default mode, the flags are read one step
late, and a healthy step reads nothing from the device inside the guard's hooks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from fitting import StepRecorder, build_trainer, fit
from host_reads import HostReadCounter
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NanEvent, NanGuard

BAD_ITEM = 11  # batch 1, position 3


class Net(pl.LightningModule):
    def __init__(self, optimizer: str = "adamw", fused: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
        self.optimizer_name, self.fused = optimizer, fused

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9, fused=self.fused)
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=self.fused)


def _data(bad: tuple[int, ...] = (BAD_ITEM,)) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(48, 4, generator=g), torch.randn(48, generator=g)
    for index in bad:
        x[index, 2] = float("nan")
    return DataLoader(TensorDataset(x, y), batch_size=8)


def _fit(tmp_path: Path, guard: NanGuard, module: Net | None = None, bad: tuple[int, ...] = (BAD_ITEM,)) -> Any:
    recorder = StepRecorder()
    trainer, _ = fit(module or Net(), _data(bad), root=tmp_path, guard=guard, callbacks=[recorder], max_epochs=1)
    return trainer, recorder


def _comparable(event: NanEvent) -> dict[str, Any]:
    data = event.to_dict()
    data.pop("repro_path")
    return data


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_bad_step_is_a_bitwise_no_op_on_the_device(tmp_path: Path, optimizer: str) -> None:
    guard = NanGuard(verbose=False, sync_free=True)
    trainer, recorder = _fit(tmp_path, guard, Net(optimizer))
    assert [(e.global_step, e.batch_idx, e.action) for e in guard.events] == [(1, 1, "skipped")]
    record = recorder.by_step(1)
    assert record.unchanged(), "weights, BatchNorm statistics and optimizer state must be bitwise unchanged"
    if optimizer == "adamw":
        assert record.adam_steps("after") == record.adam_steps("before")  # the step count too
    assert all(r.changed_params() for r in recorder.records if r.global_step != 1)  # healthy steps train
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())
    assert guard.skipped_total == 1 and guard.bad_steps_total == 1


def test_the_event_and_diagnosis_match_the_default_mode(tmp_path: Path) -> None:
    deferred = NanGuard(verbose=False, sync_free=True)
    _fit(tmp_path / "sync_free", deferred)
    default = NanGuard(verbose=False)
    _fit(tmp_path / "default", default)
    assert [_comparable(e) for e in deferred.events] == [_comparable(e) for e in default.events]
    event = deferred.events[0]
    assert (event.cause, event.offending_samples, event.dataset_indices) == ("input", (3,), (BAD_ITEM,))


def test_the_last_step_is_resolved_at_the_end_of_training(tmp_path: Path) -> None:
    guard = NanGuard(verbose=False, sync_free=True, bisect=False)
    _fit(tmp_path, guard, bad=(45,))  # the sixth and last batch
    assert [(e.global_step, e.action) for e in guard.events] == [(5, "skipped")]


@pytest.mark.parametrize(("fused", "reads"), [(True, 0), (False, 1)], ids=["fused", "not-fused-falls-back"])
def test_a_healthy_step_reads_nothing_from_the_device(tmp_path: Path, fused: bool, reads: int) -> None:
    counter = HostReadCounter(ignore_host_copies=True)

    class Counted(NanGuard):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.per_step: list[int] = []

        def on_train_batch_start(self, *args: Any) -> None:
            counter.reads.clear()
            with counter:
                super().on_train_batch_start(*args)

        def on_before_backward(self, *args: Any) -> None:
            with counter:
                super().on_before_backward(*args)

        def on_before_optimizer_step(self, *args: Any) -> None:
            with counter:
                super().on_before_optimizer_step(*args)

        def _after_optimizer_step(self, *args: Any) -> None:
            with counter:
                super()._after_optimizer_step(*args)

        def on_train_batch_end(self, *args: Any) -> None:
            self.per_step.append(sum(counter.reads.values()))

    guard = Counted(verbose=False, sync_free=True, check_params_every_n_steps=0)
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard], max_epochs=1, log_every_n_steps=50)
    trainer.fit(Net(fused=fused), _data(bad=()))
    assert guard.events == [] and len(guard.per_step) == 6
    assert guard.per_step == [reads] * 6  # the default mode reads once per step (tests/integration/test_host_syncs.py)


def test_an_optimizer_that_cannot_skip_on_the_device_keeps_the_host_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    guard = NanGuard(verbose=False, sync_free=True, save_repro=False)
    with caplog.at_level(logging.WARNING, logger="lightning_nanguard"):
        _, recorder = _fit(tmp_path, guard, Net(fused=False))
    assert sum("is not fused" in r.getMessage() for r in caplog.records) == 1
    assert recorder.by_step(1).unchanged()  # skipped the default way
    assert [e.global_step for e in guard.events] == [1]


def test_warn_lets_the_update_through(tmp_path: Path) -> None:
    guard = NanGuard(verbose=False, sync_free=True, action="warn", save_repro=False, bisect=False)
    trainer, recorder = _fit(tmp_path, guard)
    assert (guard.events[0].global_step, guard.events[0].action) == (1, "warned")
    assert not recorder.by_step(1).unchanged()
    assert not all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())


def test_with_a_grad_scaler_the_nan_step_is_skipped_by_the_scaler(tmp_path: Path) -> None:
    """16-mixed on CPU: the guard's flag joins the GradScaler's own, which then skips (and backs off its scale)."""
    from lightning.pytorch.plugins import MixedPrecision

    guard = NanGuard(verbose=False, sync_free=True, save_repro=False)
    recorder = StepRecorder()
    trainer = build_trainer(
        "lightning", tmp_path, callbacks=[guard, recorder], max_epochs=1, plugins=[MixedPrecision("16-mixed", "cpu")]
    )
    trainer.fit(Net(), _data())
    assert [(e.global_step, e.action) for e in guard.events] == [(1, "skipped")]
    assert recorder.by_step(1).unchanged()
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())


def test_a_loss_spike_is_skipped_on_the_device(tmp_path: Path) -> None:
    from spike_models import TYPOS, Regression, Regressor

    class FusedRegressor(Regressor):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, fused=True)

    guard = NanGuard(verbose=False, sync_free=True, save_repro=False)
    recorder = StepRecorder()
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard, recorder], max_epochs=1)
    trainer.fit(FusedRegressor(), DataLoader(Regression(TYPOS), batch_size=8))
    assert [(e.global_step, e.kinds, e.action, e.dataset_indices) for e in guard.events] == [
        (25, ("loss_spike",), "skipped", (200,)),
        (28, ("loss_spike",), "skipped", (230,)),
    ]
    assert recorder.by_step(25).unchanged() and recorder.by_step(28).unchanged()


@pytest.mark.parametrize("kind", ["bn_overflow", "masked_div", "input_data"])
def test_each_failure_class_is_skipped_on_the_device_and_diagnosed_as_in_the_default_mode(
    tmp_path: Path, kind: str
) -> None:
    """The common step's one-read check, its flag left on the device (one process, fused AdamW).

    ``bn_overflow`` corrupts only a BatchNorm ``running_var`` (loss and gradients stay finite): the
    buffer's total must carry it into the skip flag, and the select must put the statistics back.
    """
    from models import make_case, make_loader, make_module

    def fused(module: Any) -> Any:
        module.configure_optimizers = lambda: torch.optim.AdamW(module.parameters(), lr=1e-2, fused=True)
        return module

    events = {}
    for mode, sync_free in (("sync_free", True), ("default", False)):
        guard = NanGuard(verbose=False, sync_free=sync_free)
        recorder = StepRecorder()
        case = make_case(kind)
        trainer, _ = fit(
            fused(make_module("lightning", kind)),
            make_loader(case.dataset),
            root=tmp_path / mode,
            guard=guard,
            callbacks=[recorder],
        )
        assert [(e.global_step, e.action) for e in guard.events] == [(1, "skipped")], mode
        assert recorder.by_step(1).unchanged(), f"{mode}: weights, BatchNorm statistics and AdamW state bitwise"
        assert all(r.changed_params() for r in recorder.records if r.global_step != 1), mode
        assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())
        assert guard.active
        events[mode] = [_comparable(e) for e in guard.events]
    assert events["sync_free"] == events["default"]


def _plant_fault(monkeypatch: pytest.MonkeyPatch, name: str, when: Callable[[], bool], message: str) -> None:
    """Make the step check's ``name`` (in ``engine.step.check``) raise ``RuntimeError(message)`` while ``when()``."""
    import lightning_nanguard.engine.step.check as check_module

    real = getattr(check_module, name)

    def planted(*args: Any, **kwargs: Any) -> Any:
        if when():
            raise RuntimeError(message)
        return real(*args, **kwargs)

    monkeypatch.setattr(check_module, name, planted)


def test_a_fault_in_the_one_read_check_drops_the_step_in_hand_then_turns_the_guard_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The promise holds in the sync-free mode too: a step its check could not vouch for is not applied."""
    guard = NanGuard(verbose=False, sync_free=True, save_repro=False)
    message = "planted fault in the sync-free check"
    _plant_fault(monkeypatch, "staged_loss_and_total", lambda: guard.controller.parts.step == 3, message)
    _, recorder = _fit(tmp_path, guard, bad=())
    assert not guard.active
    (error,) = [e for e in guard.events if "guard_error" in e.kinds]
    assert (error.global_step, error.action, error.details["part"]) == (3, "skipped", "core")
    assert "planted fault in the sync-free check" in error.details["error"]
    assert recorder.by_step(3).unchanged()  # not vouched for: not applied, BatchNorm statistics included
    assert all(recorder.by_step(step).changed_params() for step in (0, 1, 2, 4, 5))  # checked, then unguarded


def test_a_fault_in_the_full_check_of_a_deferred_bad_step_keeps_it_skipped_and_turns_the_guard_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The NaN step's total is not finite: skipped on the device, then checked in full a step later, which fails."""
    guard = NanGuard(verbose=False, sync_free=True, save_repro=False)
    message = "planted fault in the deferred full check"
    _plant_fault(monkeypatch, "fused_health_check", lambda: guard.controller.sync.resolving is not None, message)
    trainer, recorder = _fit(tmp_path, guard)
    assert not guard.active
    (error,) = [e for e in guard.events if "guard_error" in e.kinds]
    assert error.details["part"] == "core" and "planted fault in the deferred full check" in error.details["error"]
    assert recorder.by_step(1).unchanged()  # skipped on the device before the host could check it
    assert all(recorder.by_step(step).changed_params() for step in (0, 2, 3, 4, 5))
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())


# ---------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_the_guards_hooks_never_synchronise_on_a_healthy_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every hook NanGuard installs runs under ``set_sync_debug_mode("error")`` (Lightning's own code does not).

    The first two steps are left out: they allocate the pinned host buffer and take the reference
    sample. A synchronising call would raise inside a hook, which the guard turns into "disabled
    itself after an internal error": so the guard must end the run active and silent.
    """

    class SyncChecked(NanGuard):
        strict = False

        def _strictly(self, hook: Any, *args: Any) -> Any:
            torch.cuda.set_sync_debug_mode("error" if self.strict else "default")
            try:
                return hook(*args)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            self.strict = batch_idx >= 2
            self._strictly(super().on_train_batch_start, trainer, module, batch, batch_idx)

        def on_before_backward(self, *args: Any) -> None:
            self._strictly(super().on_before_backward, *args)

        def on_before_optimizer_step(self, *args: Any) -> None:
            self._strictly(super().on_before_optimizer_step, *args)

        def _after_optimizer_step(self, *args: Any) -> None:
            self._strictly(super()._after_optimizer_step, *args)

    guard = SyncChecked(verbose=False, sync_free=True, check_params_every_n_steps=0)
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard], accelerator="cuda", log_every_n_steps=50)
    with caplog.at_level(logging.WARNING, logger="lightning_nanguard"):
        trainer.fit(Net(fused=True), _data(bad=()))
    assert guard.active and guard.events == [], caplog.text
    assert "internal error" not in caplog.text
