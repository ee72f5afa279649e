"""What ``NonFiniteTrainingError`` says and carries when the guard stops (``lightning_nanguard.decide.messages``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from event_factory import make_event

from lightning_nanguard.decide.messages import stop_history, stop_message
from lightning_nanguard.decide.policy import Counters, Policy, StepDecision

EVENT = make_event(bare=True, global_step=30, batch_idx=30)
HEADLINE = "step 30 (epoch 0, batch 30): non-finite loss -> step skipped"


def raised(escalation: str | None) -> StepDecision:
    return StepDecision("incident", action="raise", escalation=escalation)


def test_action_raise_names_the_event_and_what_to_do() -> None:
    message = stop_message(raised(None), Counters(), Policy(action="raise"), EVENT, Path("/runs/events.jsonl"))
    assert message.startswith(f"NanGuard: {HEADLINE}. The optimizer step was not applied")
    assert "action='skip'" in message
    assert message.endswith(" Events are in /runs/events.jsonl.")


def test_action_raise_for_another_ranks_event_and_no_events_file() -> None:
    message = stop_message(raised(None), Counters(), Policy(action="raise"), None, None)
    assert message.startswith("NanGuard: another rank saw NaN/Inf (see its event). ")
    assert "Events are in" not in message


def test_max_consecutive_bad_steps_names_the_count_and_the_limit() -> None:
    counters = Counters(consecutive_bad_steps=4, bad_steps_total=9)
    message = stop_message(
        raised("max_consecutive_bad_steps"), counters, Policy(max_consecutive_bad_steps=4), EVENT, None
    )
    assert message.startswith(
        f"NanGuard: 4 consecutive bad steps reached max_consecutive_bad_steps=4; last: {HEADLINE}."
    )
    assert "remedies=['clip_grad', 'lr_backoff']" in message


def test_max_events_names_the_total_and_the_limit() -> None:
    counters = Counters(consecutive_bad_steps=1, bad_steps_total=12)
    message = stop_message(raised("max_events"), counters, Policy(max_events=12), None, "events.jsonl")
    assert message.startswith(
        "NanGuard: 12 bad steps in total reached max_events=12; last: on another rank (see its events)."
    )
    assert message.endswith("Events are in events.jsonl.")


HISTORY = [make_event(bare=True, global_step=step, batch_idx=step) for step in range(1, 8)]


def test_history_of_a_plain_raise_is_the_last_event() -> None:
    assert stop_history(raised(None), HISTORY, Policy(), HISTORY[-1]) == [HISTORY[-1]]
    assert stop_history(raised(None), HISTORY, Policy(), None) == []  # another rank's event


def test_history_of_max_events_is_every_event() -> None:
    history = stop_history(raised("max_events"), HISTORY, Policy(max_events=7), None)
    assert history == HISTORY and history is not HISTORY


@pytest.mark.parametrize(("limit", "steps"), [(3, [5, 6, 7]), (1, [7]), (10, [1, 2, 3, 4, 5, 6, 7])])
def test_history_of_consecutive_bad_steps_is_the_run(limit: int, steps: list[int]) -> None:
    decision = raised("max_consecutive_bad_steps")
    history = stop_history(decision, HISTORY, Policy(max_consecutive_bad_steps=limit), HISTORY[-1])
    assert [event.global_step for event in history] == steps
