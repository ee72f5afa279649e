"""What the guard knows between hooks (``lightning_nanguard.engine.state``)."""

from __future__ import annotations

from lightning_nanguard.decide.policy import Counters
from lightning_nanguard.engine.state import GuardState


def test_a_new_state_is_clean() -> None:
    state = GuardState()
    assert state.counters == Counters()
    assert state.last_grad_norm is None and state.reported_step is None
    assert not (state.failing or state.disabled or state.pending_rollback or state.step_was_bad)


def test_states_share_nothing() -> None:
    first, second = GuardState(), GuardState()
    first.counters = first.counters.replace(bad_steps_total=3)
    first.pending_rollback = True
    assert second.counters.bad_steps_total == 0 and not second.pending_rollback


def test_fields_are_mutable_and_compare_by_value() -> None:
    state = GuardState()
    state.last_grad_norm, state.reported_step, state.failing = 2.5, 7, True
    assert state == GuardState(last_grad_norm=2.5, reported_step=7, failing=True)
    assert state != GuardState()
