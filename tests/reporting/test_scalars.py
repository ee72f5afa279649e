"""The ``nanguard/`` scalars: which tags a run logs, their values, and the writes at an incident."""

from __future__ import annotations

import math

import pytest

from lightning_nanguard.decide.policy import Counters
from lightning_nanguard.reporting.scalars import COUNTERS, GRAD_NORM, ScalarLog, scalar_tags, scalar_values

BASE = [GRAD_NORM, "nanguard/bad_steps_total", "nanguard/skipped_total"]


@pytest.mark.parametrize(
    ("action", "remedies", "has_scaler", "spikes", "extra"),
    [
        ("skip", (), False, False, []),
        ("skip", (), False, True, ["nanguard/spikes_total"]),
        ("warn", (), True, False, ["nanguard/amp_overflow_total"]),
        ("rollback", (), False, False, ["nanguard/rollbacks_total"]),
        ("skip", ("clip_grad",), False, False, ["nanguard/remedies_total"]),
        (
            "rollback",
            ("lr_backoff",),
            True,
            True,
            [
                "nanguard/spikes_total",
                "nanguard/amp_overflow_total",
                "nanguard/rollbacks_total",
                "nanguard/remedies_total",
            ],
        ),
    ],
)
def test_scalar_tags_follow_the_configuration(
    action: str, remedies: tuple[str, ...], has_scaler: bool, spikes: bool, extra: list[str]
) -> None:
    assert scalar_tags(action, remedies, has_scaler, spikes) == BASE + extra


def test_scalar_values_of_every_tag() -> None:
    counters = Counters(bad_steps_total=5, skipped_total=4, amp_overflow_total=3, spikes_total=2)
    values = scalar_values(counters, grad_norm=0.5, rollbacks_total=1, remedies_total=6)
    assert values == {
        GRAD_NORM: 0.5,
        "nanguard/bad_steps_total": 5.0,
        "nanguard/skipped_total": 4.0,
        "nanguard/spikes_total": 2.0,
        "nanguard/amp_overflow_total": 3.0,
        "nanguard/rollbacks_total": 1.0,
        "nanguard/remedies_total": 6.0,
    }
    assert set(values) == {GRAD_NORM, *COUNTERS}
    assert scalar_values(Counters(), None, 0, 0)[GRAD_NORM] is None


def test_plan_keeps_only_the_runs_tags_and_known_values() -> None:
    log = ScalarLog([GRAD_NORM, "nanguard/skipped_total"])
    metrics = {GRAD_NORM: 2.0, "nanguard/skipped_total": 1, "nanguard/rollbacks_total": 3.0, "val_loss": 0.1}
    assert log.plan(metrics, step=4) == [(4, {GRAD_NORM: 2.0, "nanguard/skipped_total": 1.0})]
    assert log.plan({GRAD_NORM: None}, step=5) == []


@pytest.mark.parametrize("norm", [math.nan, math.inf, -math.inf])
def test_a_non_finite_gradient_norm_is_not_drawn(norm: float) -> None:
    log = ScalarLog(BASE)
    assert log.plan({GRAD_NORM: norm, "nanguard/bad_steps_total": 1.0}, step=3) == [
        (3, {"nanguard/bad_steps_total": 1.0})
    ]


def test_an_incident_writes_the_previous_values_one_step_before() -> None:
    log = ScalarLog(BASE)
    before = {"nanguard/bad_steps_total": 0.0, "nanguard/skipped_total": 0.0, GRAD_NORM: 1.0}
    after = {"nanguard/bad_steps_total": 1.0, "nanguard/skipped_total": 0.0, GRAD_NORM: 1.5}
    assert log.plan(after, step=10, previous=before) == [
        (9, {"nanguard/bad_steps_total": 0.0, GRAD_NORM: 1.0}),  # only what changed
        (10, {"nanguard/bad_steps_total": 1.0, "nanguard/skipped_total": 0.0, GRAD_NORM: 1.5}),
    ]


def test_no_step_before_when_the_tag_was_written_there_or_later() -> None:
    log = ScalarLog(["nanguard/bad_steps_total"])
    log.plan({"nanguard/bad_steps_total": 1.0}, step=9)
    assert log.plan({"nanguard/bad_steps_total": 2.0}, step=10, previous={"nanguard/bad_steps_total": 1.0}) == [
        (10, {"nanguard/bad_steps_total": 2.0})
    ]
    assert log.plan({"nanguard/bad_steps_total": 3.0}, step=12, previous={"nanguard/bad_steps_total": 2.0}) == [
        (11, {"nanguard/bad_steps_total": 2.0}),
        (12, {"nanguard/bad_steps_total": 3.0}),
    ]


def test_no_step_before_step_zero_or_without_previous_values() -> None:
    log = ScalarLog(["nanguard/bad_steps_total"])
    assert log.plan({"nanguard/bad_steps_total": 1.0}, step=0, previous={"nanguard/bad_steps_total": 0.0}) == [
        (0, {"nanguard/bad_steps_total": 1.0})
    ]
    assert log.plan({"nanguard/bad_steps_total": 2.0}, step=5, previous={}) == [(5, {"nanguard/bad_steps_total": 2.0})]
    assert log.plan({"nanguard/bad_steps_total": 3.0}, step=7, previous={"nanguard/bad_steps_total": None}) == [
        (7, {"nanguard/bad_steps_total": 3.0})
    ]
