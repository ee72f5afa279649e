"""LoggedValues on Lightning's real result collection: every reduction undone, new keys withdrawn, odd layouts named."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

from lightning_nanguard.trainer.logged_values import LoggedValues


def log(results: _ResultCollection, name: str, value: float, reduce_fx: str = "mean", batch_size: int = 4) -> None:
    results.log(
        "training_step",
        name,
        torch.tensor(value),
        on_step=True,
        on_epoch=True,
        reduce_fx=reduce_fx,
        batch_size=batch_size,
    )


def epoch_values(results: _ResultCollection) -> dict[str, float]:
    return {k: float(v) for k, v in results.metrics(on_step=False)["callback"].items() if k.endswith("_epoch")}


@pytest.fixture
def trainer() -> Any:
    return SimpleNamespace(_results=_ResultCollection(training=True))


def test_mean_sum_max_and_min_are_undone(trainer: Any) -> None:
    results = trainer._results
    for fx, value in (("mean", 1.0), ("sum", 1.0), ("max", 1.0), ("min", 1.0)):
        log(results, f"v_{fx}", value, fx)
    logged = LoggedValues()
    logged.capture(trainer)
    for fx, value in (("mean", float("nan")), ("sum", 50.0), ("max", 99.0), ("min", -99.0)):
        log(results, f"v_{fx}", value, fx)
    logged.restore(trainer)
    for fx, value in (("mean", 3.0), ("sum", 2.0), ("max", 2.0), ("min", 0.5)):
        log(results, f"v_{fx}", value, fx, batch_size=4)
    assert epoch_values(results) == {
        "v_mean_epoch": 2.0,  # (1 * 4 + 3 * 4) / 8: the NaN step's value and batch size are gone
        "v_sum_epoch": 3.0,
        "v_max_epoch": 2.0,
        "v_min_epoch": 0.5,
    }


def test_a_key_the_dropped_step_logged_first_is_withdrawn_after_its_step_value(trainer: Any) -> None:
    results = trainer._results
    logged = LoggedValues()
    logged.capture(trainer)
    log(results, "first", float("nan"))
    logged.restore(trainer)
    step = results.metrics(on_step=True)["callback"]
    assert math.isnan(float(step["first_step"]))  # the step-level value of the dropped step is its real value
    logged.finish_withdrawals()  # the guard calls it at the next step's start or at epoch end
    assert "first_epoch" not in epoch_values(results)  # no 0/0 = NaN at epoch end
    log(results, "first", 4.0)  # a later step logs it: counted from scratch
    assert epoch_values(results)["first_epoch"] == 4.0


def test_an_unexpected_layout_is_named_once_and_left_alone() -> None:
    """The notice says a skipped step's values "stay in the epoch aggregates": they are not touched."""
    aggregate = object()
    trainer = SimpleNamespace(_results={"training_step.loss": aggregate})
    logged = LoggedValues()
    logged.capture(trainer)
    assert logged.unsupported is not None and "'training_step.loss'" in logged.unsupported
    logged.restore(trainer)  # no error
    assert trainer._results == {"training_step.loss": aggregate}  # what the skipped step logged stays
    assert LoggedValues().capture(SimpleNamespace()) is None  # no result collection at all: nothing raised
