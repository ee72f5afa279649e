"""A dropped step leaves no trace in what users monitor: epoch logs, torchmetrics states, EarlyStopping, checkpoints.

Every test records each step's values as ``training_step`` produced them (a callback reads the
returned outputs once per real step; the guard's diagnosis re-runs are not steps), and computes the
expected epoch values over the applied steps itself, from those records.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import fitting
import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from fitting import build_trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from spike_models import BATCH, TYPOS, Regression, Regressor
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NanGuard

N, SIZE = 32, 4  # 8 steps an epoch
POISONED = (9, 22)  # records with a NaN feature: steps 2 and 5 of every epoch


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 3, generator=g)
    y = x.sum(dim=1) + 0.1 * torch.randn(N, generator=g)
    for index in POISONED:
        x[index, 0] = float("nan")
    return TensorDataset(x, y)


class Logging(pl.LightningModule):
    """Logs every reduction Lightning accepts and updates torchmetrics in nested containers."""

    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(3, 1)
        self.automatic_optimization = not manual
        self.guard: NanGuard | None = None
        self.metrics = nn.ModuleDict(
            {
                "collection": torchmetrics.MetricCollection(
                    {"mse": torchmetrics.MeanSquaredError(), "mae": torchmetrics.MeanAbsoluteError()}
                ),
                "seen": torchmetrics.CatMetric(),
            }
        )
        self.nested = nn.ModuleList([torchmetrics.SumMetric()])
        self.epoch_state: list[dict[str, Any]] = []

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:
        x, y = batch
        preds = self.net(x).squeeze(-1)
        loss = nn.functional.mse_loss(preds, y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log_dict({"loss_sum": loss, "worst": loss}, on_epoch=True, on_step=False, reduce_fx="sum")
        self.log("loss_max", loss, on_epoch=True, on_step=False, reduce_fx="max")
        self.log("loss_min", loss, on_epoch=True, on_step=False, reduce_fx="min")
        self.metrics["collection"](preds.detach(), y)
        self.log_dict(self.metrics["collection"], on_epoch=True, on_step=False)
        self.metrics["seen"].update(preds.detach())
        self.nested[0].update(y)
        if not self.automatic_optimization:
            self.manual_backward(loss)
            optimizer = self.optimizers()
            assert self.guard is not None
            if self.guard.check(self, loss) is None:
                optimizer.step()
            optimizer.zero_grad()
        return {
            "loss": loss,
            "raw": loss.detach(),
            "preds": preds.detach(),
            "y": y,
        }  # "loss" is divided under accumulation

    def on_train_epoch_start(self) -> None:
        self.metrics["seen"].reset()
        self.nested[0].reset()

    def on_train_epoch_end(self) -> None:  # after the guard's callback hook, as Lightning orders them
        seen = self.metrics["seen"].compute()  # [] when no update of the epoch was kept
        self.epoch_state.append(
            {
                "seen": seen.reshape(-1).tolist() if isinstance(seen, Tensor) else list(seen),
                "sum": float(self.nested[0].compute()),
            }
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Steps(pl.Callback):
    """Each real step's outputs and whether its update was applied (the weights moved)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self._before: list[Tensor] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._before = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        moved = any(not torch.equal(a, p) for a, p in zip(self._before, pl_module.parameters(), strict=True))
        self.steps.append(
            {
                "epoch": trainer.current_epoch,
                "loss": float(outputs["raw"]),
                "preds": outputs["preds"],
                "y": outputs["y"],
                "size": len(batch[0]),
                "applied": moved,
            }
        )


def expected_epoch(steps: list[dict[str, Any]], epoch: int) -> dict[str, Any]:
    """The epoch values over the applied steps, computed from the recorded per-step values."""
    applied = [s for s in steps if s["epoch"] == epoch and s["applied"]]
    preds = torch.cat([s["preds"] for s in applied])
    y = torch.cat([s["y"] for s in applied])
    losses = [s["loss"] for s in applied]
    return {
        "train_loss_epoch": sum(s["loss"] * s["size"] for s in applied) / sum(s["size"] for s in applied),
        "loss_sum": sum(losses),
        "worst": sum(losses),
        "loss_max": max(losses),
        "loss_min": min(losses),
        "mse": float(((preds - y) ** 2).mean()),
        "mae": float((preds - y).abs().mean()),
        "seen": preds.tolist(),
        "sum": float(y.sum()),
    }


def logged_epochs(log_dir: str) -> list[dict[str, float]]:
    """The epoch rows of the CSVLogger's metrics.csv (what every logger got at epoch end)."""
    with open(Path(log_dir) / "metrics.csv", encoding="utf-8") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("train_loss_epoch")]
    keys = ("train_loss_epoch", "loss_sum", "worst", "loss_max", "loss_min", "mse", "mae")
    return [{key: float(row[key]) for key in keys} for row in rows]


def fit(tmp_path: Path, module: Logging, guard: NanGuard, epochs: int = 3, **kwargs: Any) -> tuple[Any, Steps]:
    steps = Steps()
    module.guard = guard
    callbacks = [steps, *kwargs.pop("callbacks", [])]
    trainer, _ = fitting.fit(
        module,
        DataLoader(dataset(), batch_size=SIZE),
        root=tmp_path,
        guard=guard,
        callbacks=callbacks,
        max_epochs=epochs,
        logger=CSVLogger(tmp_path),
        **kwargs,
    )
    return trainer, steps


def assert_epochs_match(trainer: Any, module: Logging, steps: Steps, epochs: int) -> None:
    logged = logged_epochs(trainer.logger.log_dir)
    assert len(logged) == epochs
    for epoch in range(epochs):
        expected = expected_epoch(steps.steps, epoch)
        assert logged[epoch] == pytest.approx({k: expected[k] for k in logged[epoch]}, rel=1e-5), epoch
        assert module.epoch_state[epoch]["seen"] == pytest.approx(expected["seen"])  # a list ("cat") state
        assert module.epoch_state[epoch]["sum"] == pytest.approx(expected["sum"])  # a metric in a ModuleList
    last = expected_epoch(steps.steps, epochs - 1)
    assert float(trainer.callback_metrics["train_loss_epoch"]) == pytest.approx(last["train_loss_epoch"], rel=1e-5)


def test_skipped_nan_steps_leave_no_trace_in_epoch_values_metrics_or_monitors(tmp_path: Path) -> None:
    guard = NanGuard(verbose=False, save_repro=False)
    stopping = EarlyStopping(monitor="train_loss_epoch", patience=3, mode="min")  # check_finite=True
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="train_loss_epoch", save_top_k=1)
    module = Logging()
    trainer, steps = fit(tmp_path, module, guard, callbacks=[stopping, checkpoint], enable_checkpointing=True)

    skipped = [(s["epoch"], i % 8) for i, s in enumerate(steps.steps) if not s["applied"]]
    assert skipped == [(epoch, batch) for epoch in range(3) for batch in (2, 5)]  # the poisoned batches only
    assert all(math.isnan(s["loss"]) for s in steps.steps if not s["applied"])  # they really were NaN
    assert trainer.current_epoch == 3 and not stopping.stopped_epoch  # no early stop: every epoch ran
    assert_epochs_match(trainer, module, steps, epochs=3)
    best = checkpoint.best_model_score
    assert best is not None and math.isfinite(float(best)) and Path(checkpoint.best_model_path).is_file()
    expected_best = min(expected_epoch(steps.steps, epoch)["train_loss_epoch"] for epoch in range(3))
    assert float(best) == pytest.approx(expected_best, rel=1e-5)


def test_the_step_level_value_of_a_dropped_step_is_its_real_value(tmp_path: Path) -> None:
    trainer, _ = fit(tmp_path, Logging(), NanGuard(verbose=False, save_repro=False), epochs=1, log_every_n_steps=1)
    with open(Path(trainer.logger.log_dir) / "metrics.csv", encoding="utf-8") as handle:
        step_values = [row["train_loss_step"] for row in csv.DictReader(handle) if row.get("train_loss_step")]
    assert len(step_values) == 8 and [i for i, v in enumerate(step_values) if v == "nan"] == [2, 5]


def test_a_spike_skip_leaves_no_trace_either(tmp_path: Path) -> None:
    class LoggingRegressor(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            loss = super().training_step(batch, batch_idx)
            self.log("train_loss", loss, on_step=False, on_epoch=True)
            return loss

    losses: list[tuple[int, float, int]] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            losses.append((trainer.global_step - 1, float(outputs["loss"]), len(batch[0])))

    guard = NanGuard(verbose=False, save_repro=False)
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard, Record()], max_epochs=1)
    trainer.fit(LoggingRegressor(), DataLoader(Regression(TYPOS), batch_size=BATCH))
    spikes = [e.global_step for e in guard.events if e.kinds == ("loss_spike",) and e.action == "skipped"]
    assert spikes == [25, 28]
    applied = [(loss, size) for step, loss, size in losses if step not in spikes]
    expected = sum(loss * size for loss, size in applied) / sum(size for _, size in applied)
    assert float(trainer.callback_metrics["train_loss"]) == pytest.approx(expected, rel=1e-5)


def test_sync_free_steps_are_dropped_from_the_aggregates_one_step_late(tmp_path: Path) -> None:
    class Fused(Logging):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=0.01, fused=True)

    module = Fused()
    trainer, steps = fit(tmp_path, module, NanGuard(verbose=False, save_repro=False, sync_free=True), epochs=2)
    assert [i % 8 for i, s in enumerate(steps.steps) if not s["applied"]] == [2, 5, 2, 5]
    assert_epochs_match(trainer, module, steps, epochs=2)


def test_the_last_step_of_an_epoch_dropped_sync_free_is_settled_before_the_monitors(tmp_path: Path) -> None:
    class LastBad(Logging):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=0.01, fused=True)

    data = dataset()
    data.tensors[0][:] = torch.nan_to_num(data.tensors[0])
    data.tensors[0][N - 1, 0] = float("nan")  # the last batch of every epoch
    module, steps = LastBad(), Steps()
    guard = NanGuard(verbose=False, save_repro=False, sync_free=True)
    module.guard = guard
    stopping = EarlyStopping(monitor="train_loss_epoch", patience=5)
    trainer = build_trainer(
        "lightning", tmp_path, callbacks=[guard, steps, stopping], max_epochs=2, logger=CSVLogger(tmp_path)
    )
    trainer.fit(module, DataLoader(data, batch_size=SIZE))
    assert [i % 8 for i, s in enumerate(steps.steps) if not s["applied"]] == [7, 7]
    assert trainer.current_epoch == 2
    assert_epochs_match(trainer, module, steps, epochs=2)


def test_gradient_accumulation_drops_every_micro_batch_of_the_step(tmp_path: Path) -> None:
    module = Logging()
    trainer, steps = fit(
        tmp_path, module, NanGuard(verbose=False, save_repro=False), epochs=1, accumulate_grad_batches=2
    )
    # micro-batches 2 and 5 are poisoned: optimizer steps (2, 3) and (4, 5) are dropped, with both micro-batches
    for index, step in enumerate(steps.steps):
        step["applied"] = index // 2 not in (1, 2)
    assert_epochs_match(trainer, module, steps, epochs=1)


def test_manual_optimisation_a_batch_guard_check_rejects_is_dropped_at_its_end(tmp_path: Path) -> None:
    module = Logging(manual=True)
    trainer, steps = fit(tmp_path, module, NanGuard(verbose=False, save_repro=False), epochs=2)
    assert [i % 8 for i, s in enumerate(steps.steps) if not s["applied"]] == [2, 5, 2, 5]
    assert_epochs_match(trainer, module, steps, epochs=2)


def test_an_epoch_whose_every_step_is_dropped_hands_monitors_no_nan(tmp_path: Path) -> None:
    class BadEpoch(Logging):
        def training_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:
            if self.current_epoch == 1:
                batch = (batch[0] * float("nan"), batch[1])
            return super().training_step(batch, batch_idx)

    data = dataset()
    data.tensors[0][:] = torch.nan_to_num(data.tensors[0])
    module, steps = BadEpoch(), Steps()
    guard = NanGuard(verbose=False, save_repro=False, bisect=False, localize=False)
    module.guard = guard
    seen: list[float] = []

    class Monitor(pl.Callback):
        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            seen.append(float(trainer.callback_metrics["train_loss_epoch"]))

    trainer = build_trainer(
        "lightning", tmp_path, callbacks=[guard, steps, Monitor()], max_epochs=3, logger=CSVLogger(tmp_path)
    )
    trainer.fit(module, DataLoader(data, batch_size=SIZE))
    assert [s["applied"] for s in steps.steps if s["epoch"] == 1] == [False] * 8
    assert seen[1] == seen[0] and all(math.isfinite(v) for v in seen)  # epoch 1 changed nothing: epoch 0's value
    logged = logged_epochs(trainer.logger.log_dir)
    assert len(logged) == 2 and all(math.isfinite(v) for row in logged for v in row.values())  # no NaN epoch row


def test_a_metric_whose_state_cannot_be_restored_is_named_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    class FloatState(torchmetrics.Metric):  # a custom update that re-binds its state to a Python float
        def __init__(self) -> None:
            super().__init__()
            self.add_state("total", torch.tensor(0.0), dist_reduce_fx="sum")

        def update(self, x: Tensor) -> None:
            self.total = float(self.total) + 1.0  # type: ignore[assignment]

        def compute(self) -> Tensor:
            return torch.tensor(float(self.total))

        def _apply(self, fn: Any, exclude_state: Any = ()) -> Any:  # its own state handling: a tensor again to move
            self.total = torch.as_tensor(self.total, dtype=torch.float32)
            return super()._apply(fn, exclude_state)

    class WithCustom(Logging):
        def __init__(self) -> None:
            super().__init__()
            self.custom = FloatState()

        def training_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:
            self.custom.update(batch[0])
            return super().training_step(batch, batch_idx)

    module = WithCustom()
    with caplog.at_level("WARNING", logger="lightning_nanguard"):
        trainer, steps = fit(tmp_path, module, NanGuard(verbose=False, save_repro=False), epochs=2)
    warnings = [r.getMessage() for r in caplog.records if "cannot be restored" in r.getMessage()]
    assert len(warnings) == 1 and "custom.total (float)" in warnings[0]
    assert_epochs_match(trainer, module, steps, epochs=2)  # every other metric and log is still right
