"""The work after the optimizer step (``lightning_nanguard.engine.after_step``), with a plain front-end and recovery.

The recovery itself (snapshot, rollback, remedies) has its own tests; here a recording stand-in
shows what ``AfterStep`` asks of it, when, and what it records and raises.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fronts import PlainFront
from torch import nn

from lightning_nanguard.core.events import NonFiniteTrainingError
from lightning_nanguard.decide.policy import Counters
from lightning_nanguard.engine.after_step import AfterStep, ParamCheckSettings
from lightning_nanguard.engine.recording import IncidentRecorder
from lightning_nanguard.engine.state import GuardState
from lightning_nanguard.engine.step.window import StepWindow


class FakeRecovery:
    """Records the calls; ``rollback`` restores nothing and says so (``None``) when there is no snapshot."""

    def __init__(self, available: bool = True) -> None:
        self.snapshot = SimpleNamespace(available=available, nbytes=2**20, seconds=0.002)
        self.book = SimpleNamespace(total=2)
        self.rollbacks_total = 0
        self.calls: list[Any] = []

    def rollback(self, *args: Any) -> str | None:
        self.calls.append("rollback")
        if not self.snapshot.available:
            return None
        self.rollbacks_total += 1
        return "rolled back to step 4"

    def apply(self, *args: Any, **kwargs: Any) -> list[str]:
        self.calls.append(("apply", kwargs))
        return ["lr x0.5"]

    def capture(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append("capture")
        self.snapshot.available = True


def build(
    action: str = "skip", every: int = 5, snapshot_every: int = 10, available: bool = True
) -> tuple[AfterStep, FakeRecovery, IncidentRecorder]:
    recovery = FakeRecovery(available)
    recorder = IncidentRecorder(verbose=False)
    window = StepWindow()
    window.batch_idx = 3
    after = AfterStep(GuardState(), recovery, recorder, window)  # type: ignore[arg-type]
    after.settings = ParamCheckSettings(
        check_params_every_n_steps=every, snapshot_every_n_steps=snapshot_every, action=action
    )
    return after, recovery, recorder


def broken_module() -> nn.Module:
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with torch.no_grad():
        net[0].weight[1, 0] = math.nan
        net[1].running_var[0] = math.inf
    return net


def test_a_pending_rollback_runs_first_and_restarts_the_run_of_bad_steps() -> None:
    after, recovery, _ = build(action="rollback")
    after.state.pending_rollback = True
    after.state.counters = Counters(consecutive_bad_steps=3, bad_steps_total=3)
    after.run(
        PlainFront(broken_module(), global_step=4), collective=False
    )  # a check step, but the rollback comes first
    assert recovery.calls == ["rollback"]
    assert not after.state.pending_rollback
    assert after.state.counters == Counters(consecutive_bad_steps=0, bad_steps_total=3)


def test_a_pending_rollback_without_a_snapshot_stops_training() -> None:
    after, _, _ = build(action="rollback", available=False)
    after.state.pending_rollback = True
    with pytest.raises(NonFiniteTrainingError, match=r"a rollback is due \(consecutive bad steps\) but no last good"):
        after.run(PlainFront(nn.Linear(1, 1), global_step=0), collective=False)


def test_a_failing_guard_does_not_roll_back() -> None:
    after, recovery, recorder = build(action="rollback")
    after.state.pending_rollback, after.state.failing = True, True
    after.run(PlainFront(broken_module(), global_step=4), collective=False)
    assert recovery.calls == [] and recorder.events == [] and after.state.pending_rollback


@pytest.mark.parametrize(("global_step", "checked"), [(3, False), (4, True), (8, False), (9, True)])
def test_weights_are_checked_every_n_steps(global_step: int, checked: bool) -> None:
    after, _, recorder = build(action="warn", every=5)
    after.run(PlainFront(broken_module(), global_step=global_step), collective=False)  # the step after global_step
    assert len(recorder.events) == int(checked)


def test_no_check_when_check_params_every_n_steps_is_zero() -> None:
    after, _, recorder = build(action="warn", every=0)
    after.run(PlainFront(broken_module(), global_step=4), collective=False)
    assert recorder.events == []


def test_non_finite_weights_with_action_warn_are_recorded_and_counted() -> None:
    after, recovery, recorder = build(action="warn")
    module = broken_module()
    after.named_params = list(module.named_parameters())
    after.state.counters = Counters(bad_steps_total=1, consecutive_bad_steps=1)
    after.run(PlainFront(module, global_step=9), collective=False)
    (event,) = recorder.events
    assert (event.kinds, event.action, event.cause) == (("param",), "warned", "state")
    assert event.nonfinite_params == ("0.weight", "1.running_var")  # parameters, then BatchNorm buffers
    assert (event.global_step, event.batch_idx) == (9, 3)
    assert "finite gradients" in event.details["hint"]
    assert after.state.counters == Counters(bad_steps_total=2, consecutive_bad_steps=1)
    assert recovery.calls == []


def test_non_finite_weights_with_action_skip_stop_training() -> None:
    after, _, recorder = build(action="skip")
    module = broken_module()
    after.named_params = list(module.named_parameters())
    with pytest.raises(NonFiniteTrainingError, match="NaN/Inf reached the weights") as raised:
        after.run(PlainFront(module, global_step=4), collective=False)
    (event,) = recorder.events
    assert event.action == "raised" and raised.value.events == [event]
    assert after.state.counters.bad_steps_total == 1


def test_non_finite_weights_with_action_rollback_roll_back_and_apply_state_remedies() -> None:
    after, recovery, recorder = build(action="rollback")
    module = broken_module()
    after.named_params = list(module.named_parameters())
    after.run(PlainFront(module, global_step=4), collective=False)
    assert recovery.calls == ["rollback", ("apply", {"cause": "state", "rolled_back": True})]
    (event,) = recorder.events
    assert event.action == "rolled_back" and event.remedies == ("rolled back to step 4", "lr x0.5")


def test_rollback_without_a_snapshot_raises_instead() -> None:
    after, recovery, _ = build(action="rollback", available=False)
    with pytest.raises(NonFiniteTrainingError, match="NaN/Inf reached the weights"):
        after.run(PlainFront(broken_module(), global_step=4), collective=False)
    assert recovery.calls == []


class AnotherRankIsBad:
    """The reduce of a 2-rank run where only the other rank's weights are non-finite."""

    def __init__(self) -> None:
        self.asked: list[bool] = []

    def any(self, flag: bool) -> bool:
        self.asked.append(flag)
        return True


def test_another_ranks_non_finite_weights_stop_every_rank_without_an_event_here() -> None:
    after, _, recorder = build(action="skip")
    after.agreement = AnotherRankIsBad()  # type: ignore[assignment]
    with pytest.raises(NonFiniteTrainingError, match="on another rank") as raised:
        after.run(PlainFront(nn.Linear(2, 2), global_step=4), collective=True)
    assert after.agreement.asked == [False]  # type: ignore[attr-defined]
    assert recorder.events == [] and raised.value.events == []
    assert after.state.counters.bad_steps_total == 1  # counted on every rank alike


def test_a_failing_guard_still_joins_the_reduce() -> None:
    after, _, recorder = build(action="skip")
    after.agreement = AnotherRankIsBad()  # type: ignore[assignment]
    after.state.failing = True
    after.run(PlainFront(broken_module(), global_step=4), collective=True)
    assert after.agreement.asked == [False]  # type: ignore[attr-defined]  # it does not read its weights
    assert recorder.events == []


@pytest.mark.parametrize(("global_step", "bad", "captured"), [(9, False, True), (8, False, False), (9, True, False)])
def test_a_snapshot_every_n_healthy_steps_under_rollback(global_step: int, bad: bool, captured: bool) -> None:
    after, recovery, _ = build(action="rollback", every=0, snapshot_every=10)
    after.state.step_was_bad = bad
    after.run(PlainFront(nn.Linear(2, 2), global_step=global_step), collective=False)
    assert recovery.calls == (["capture"] if captured else [])


def test_no_snapshot_when_the_weights_are_not_finite() -> None:
    after, recovery, _ = build(action="rollback", every=0, snapshot_every=10)
    after.run(PlainFront(broken_module(), global_step=9), collective=False)
    assert "capture" not in recovery.calls and "rollback" in recovery.calls


def test_no_snapshots_under_other_actions() -> None:
    after, recovery, _ = build(action="skip", every=0, snapshot_every=1)
    after.run(PlainFront(nn.Linear(2, 2), global_step=9), collective=False)
    assert recovery.calls == []


def test_the_initial_snapshot_only_of_finite_weights() -> None:
    after, recovery, _ = build(action="rollback", available=False)
    after.initial_snapshot(PlainFront(broken_module(), global_step=0))
    assert recovery.calls == []
    after.initial_snapshot(PlainFront(nn.Linear(2, 2), global_step=0))
    assert recovery.calls == ["capture"]


def test_scalar_values_come_from_the_counters_and_the_recovery() -> None:
    after, recovery, _ = build()
    after.state.last_grad_norm = 0.5
    recovery.rollbacks_total = 3
    values = after.values(Counters(bad_steps_total=4, skipped_total=2))
    assert values["nanguard/grad_norm"] == 0.5
    assert (values["nanguard/bad_steps_total"], values["nanguard/skipped_total"]) == (4.0, 2.0)
    assert (values["nanguard/rollbacks_total"], values["nanguard/remedies_total"]) == (3.0, 2.0)
