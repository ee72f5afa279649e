"""Mixed precision on CPU: a GradScaler overflow is counted, not an incident; a real NaN is; a collapsing scale is.

``plugins=[MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu", ...))]`` runs a real
GradScaler on CPU (``precision="16-mixed"`` alone silently becomes bf16 on CPU).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from fitting import StepRecorder, build_trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins import MixedPrecision
from tensorboard_runs import read_tensorboard
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NanGuard

INIT_SCALE = 65536.0  # the GradScaler default; three halvings (3 overflow steps) bring these grads into fp16 range


class Regression(pl.LightningModule):
    """``Linear(4, hidden...)`` regression, the loss computed in float32 from the (fp16 under autocast) output."""

    def __init__(self, hidden: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 1)) if hidden else nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _overflow_data() -> TensorDataset:
    """Positive inputs and far negative targets: every scaled output gradient has the same sign, so an fp16
    overflow gives +Inf gradients only (no Inf - Inf = NaN)."""
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.rand(64, 4, generator=g) + 0.5, torch.full((64,), -4.0))


def _mixed_sign_data(nan_at: tuple[int, ...] = ()) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4, generator=g), torch.randn(64, generator=g)
    for i in nan_at:
        x[i, 1] = math.nan
    return TensorDataset(x, y)


def _fp16(init_scale: float = INIT_SCALE) -> tuple[MixedPrecision, torch.amp.GradScaler]:
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    return MixedPrecision("16-mixed", "cpu", scaler=scaler), scaler


def _unchanged_steps(recorder: StepRecorder) -> list[int]:
    return [r.global_step for r in recorder.records if not r.changed_params()]


def test_scaler_overflow_is_counted_not_an_incident(tmp_path: Path) -> None:
    plugin, scaler = _fp16()
    guard, recorder = NanGuard(verbose=False), StepRecorder()
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    trainer = build_trainer(
        "lightning", tmp_path, plugins=[plugin], callbacks=[guard, recorder], logger=logger, log_every_n_steps=1
    )
    trainer.fit(Regression(), DataLoader(_overflow_data(), batch_size=8))

    assert guard.events == []
    assert guard.amp_overflow_total == 3
    assert guard.skipped_total == 0  # the GradScaler skipped those steps itself
    assert _unchanged_steps(recorder) == [0, 1, 2]
    assert scaler.get_scale() == INIT_SCALE / 8
    assert read_tensorboard(logger.log_dir).scalars("nanguard/amp_overflow_total")[-1][1] == 3.0


def test_scaler_overflow_with_nan_grads_is_not_an_incident(tmp_path: Path) -> None:
    plugin, _ = _fp16(init_scale=2.0**100)  # huge but finite: the scaled loss stays finite in float32
    guard = NanGuard(verbose=False)
    trainer = build_trainer("lightning", tmp_path, plugins=[plugin], callbacks=[guard])
    trainer.fit(Regression(hidden=8), DataLoader(_mixed_sign_data(), batch_size=8))
    assert guard.events == []
    assert guard.amp_overflow_total == 8


def test_loss_scale_below_min_loss_scale_is_an_incident(tmp_path: Path) -> None:
    plugin, _ = _fp16()
    guard = NanGuard(min_loss_scale=20000.0, verbose=False)
    trainer = build_trainer("lightning", tmp_path, plugins=[plugin], callbacks=[guard])
    trainer.fit(Regression(), DataLoader(_overflow_data(), batch_size=8))

    # step 0 backs off to 32768 (fine); steps 1 and 2 would set 16384 and 8192 < 20000
    assert [(e.global_step, e.kinds, e.action, e.details["loss_scale"]) for e in guard.events] == [
        (1, ("loss_scale",), "skipped", 16384.0),
        (2, ("loss_scale",), "skipped", 8192.0),
    ]
    assert guard.amp_overflow_total == 3


def test_consecutive_overflows_are_an_incident(tmp_path: Path) -> None:
    plugin, _ = _fp16()
    guard = NanGuard(max_consecutive_overflows=3, verbose=False)
    trainer = build_trainer("lightning", tmp_path, plugins=[plugin], callbacks=[guard])
    trainer.fit(Regression(), DataLoader(_overflow_data(), batch_size=8))

    assert [(e.global_step, e.kinds, e.details["consecutive_overflows"]) for e in guard.events] == [
        (2, ("loss_scale",), 3)
    ]


def test_real_nan_under_grad_scaler_is_an_incident_and_skipped(tmp_path: Path) -> None:
    plugin, _ = _fp16(init_scale=1024.0)
    guard, recorder = NanGuard(verbose=False, save_repro=False), StepRecorder()
    trainer = build_trainer("lightning", tmp_path, plugins=[plugin], callbacks=[guard, recorder])
    trainer.fit(Regression(hidden=8), DataLoader(_mixed_sign_data(nan_at=(11,)), batch_size=8))

    assert len(guard.events) == 1
    event = guard.events[0]
    assert (event.global_step, event.action, event.offending_samples, event.dataset_indices) == (
        1,
        "skipped",
        (3,),
        (11,),
    )
    assert "loss" in event.kinds and "grad" in event.kinds
    assert event.loss is not None and math.isnan(event.loss)
    assert guard.amp_overflow_total == 0
    assert guard.skipped_total == 1
    assert recorder.by_step(1).unchanged()
    assert _unchanged_steps(recorder) == [1]


def test_bf16_mixed_nan_is_detected_and_skipped(tmp_path: Path) -> None:
    guard, recorder = NanGuard(verbose=False, save_repro=False), StepRecorder()
    trainer = build_trainer("lightning", tmp_path, precision="bf16-mixed", callbacks=[guard, recorder])
    trainer.fit(Regression(hidden=8), DataLoader(_mixed_sign_data(nan_at=(11,)), batch_size=8))

    assert getattr(trainer.precision_plugin, "scaler", None) is None
    assert [(e.global_step, e.action, e.dataset_indices) for e in guard.events] == [(1, "skipped", (11,))]
    assert {"loss", "grad"} <= set(guard.events[0].kinds)
    assert recorder.by_step(1).unchanged()
    assert _unchanged_steps(recorder) == [1]
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())


def test_nan_only_gradients_under_grad_scaler_are_an_incident(tmp_path: Path) -> None:
    """0/0 in a backward (a sqrt at an exact zero) is NaN without any Inf: not an overflow."""
    from models import make_case, make_loader, make_module

    case = make_case("cosine_norm")
    plugin, _ = _fp16(init_scale=1024.0)
    guard = NanGuard(verbose=False, save_repro=False)
    trainer = build_trainer("lightning", tmp_path, plugins=[plugin], callbacks=[guard])
    trainer.fit(make_module("lightning", "cosine_norm"), make_loader(case.dataset))

    assert [(e.global_step, e.kinds, e.dataset_indices) for e in guard.events] == [(1, ("grad",), (11,))]
    assert guard.amp_overflow_total == 0


@pytest.mark.parametrize("kind", ["cosine_norm", "masked_div", "log_zero"])
def test_nan_only_gradients_from_the_scaling_are_an_overflow(kind: str, tmp_path: Path) -> None:
    """A scale of 2^24 makes fp16 backward values Inf, and Inf - Inf or Inf * 0 turn them all into NaN.

    Clean data: the (unscaled) re-run of each batch is finite, so these are the GradScaler's
    overflows, which it skips while it lowers the scale, not incidents (no event, no remedy, no bundle).
    """
    from models import make_case, make_loader, make_module

    case = make_case(kind, bad=())
    plugin, scaler = _fp16(init_scale=2.0**24)
    guard = NanGuard(verbose=False, remedies=["lr_backoff"])
    recorder = StepRecorder()
    trainer = build_trainer("lightning", tmp_path, plugins=[plugin], callbacks=[guard, recorder])
    trainer.fit(make_module("lightning", kind), make_loader(case.dataset))
    assert guard.events == [] and guard.bad_steps_total == 0
    assert guard.amp_overflow_total == 4 and _unchanged_steps(recorder) == [0, 1, 2, 3]  # the scaler skipped them
    assert scaler.get_scale() == 2.0**20
    assert not (Path(guard.log_dir) / "nanguard").exists()  # no event, bundle or incident context written


def test_under_a_grad_scaler_the_gradients_are_not_read_twice(tmp_path: Path, monkeypatch: Any) -> None:
    """The scaler tested every gradient when it unscaled them: its flag stands in for the guard's gradient read."""
    import lightning_nanguard.engine.step.check as controller

    checked: list[int] = []
    original = controller.fused_health_check

    def spy(grads: Any, *args: Any, **kwargs: Any) -> Any:
        checked.append(len(grads))
        return original(grads, *args, **kwargs)

    monkeypatch.setattr(controller, "fused_health_check", spy)
    plugin, _ = _fp16()
    guard = NanGuard(verbose=False, save_repro=False)
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard], plugins=[plugin], log_every_n_steps=50)
    trainer.fit(Regression(hidden=8), DataLoader(_mixed_sign_data(nan_at=(19,)), batch_size=8))
    assert checked == [0] * 8  # no step read the gradients itself
    assert [(e.global_step, e.action) for e in guard.events] == [(2, "skipped")]  # the NaN is still caught
