"""The guard's own failure never kills training (``lightning_nanguard.engine.failure``), with a stand-in guard."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from event_factory import make_event

from lightning_nanguard.core.events import NonFiniteTrainingError
from lightning_nanguard.core.timing import GuardClock
from lightning_nanguard.decide.policy import Counters
from lightning_nanguard.engine.failure import failsafe
from lightning_nanguard.engine.state import CounterView, GuardState


class Guard:
    """What ``failsafe`` needs of ``NanGuard``: ``clock``, ``controller.state`` and ``controller.fail``.

    ``active`` is ``NanGuard``'s property: the state's ``disabled`` flag, which the wrapper reads.
    """

    bad_steps = CounterView("bad_steps_total", "Bad steps so far.")
    skipped_steps = CounterView("skipped_total", "Skipped steps so far.")

    def __init__(self) -> None:
        self.clock = GuardClock(enabled=True)
        self.failures: list[tuple[BaseException, str]] = []
        self.controller = SimpleNamespace(
            state=GuardState(), fail=lambda error, where: self.failures.append((error, where))
        )
        self.calls: list[Any] = []
        self.counters = Counters(bad_steps_total=4, skipped_total=3)

    @property
    def active(self) -> bool:
        return not self.controller.state.disabled

    @active.setter
    def active(self, value: bool) -> None:
        self.controller.state.disabled = not value

    @failsafe
    def on_hook(self, value: Any, raise_: BaseException | None = None) -> Any:
        """The hook's own docstring."""
        self.calls.append(value)
        if raise_ is not None:
            raise raise_
        return value * 2


def test_a_hook_runs_timed_and_returns_its_value() -> None:
    guard = Guard()
    assert guard.on_hook(21) == 42
    assert guard.calls == [21] and guard.clock.calls["on_hook"] == 1
    assert Guard.on_hook.__name__ == "on_hook" and Guard.on_hook.__doc__ == "The hook's own docstring."


def test_an_inactive_guard_does_nothing() -> None:
    guard = Guard()
    guard.active = False
    assert guard.on_hook(1) is None
    assert guard.calls == [] and guard.clock.calls == {}


def test_an_inactive_but_failing_guard_still_runs_its_hooks() -> None:
    """Under DDP a failing rank keeps joining the per-step collectives until every rank disables."""
    guard = Guard()
    guard.active = False
    guard.controller.state.failing = True
    assert guard.on_hook(1) == 2


@pytest.mark.parametrize("error", [RuntimeError("internal"), KeyError("x"), ZeroDivisionError()])
def test_an_internal_error_is_handed_to_the_controller(error: Exception) -> None:
    guard = Guard()
    assert guard.on_hook(1, raise_=error) is None
    assert guard.failures == [(error, "on_hook")]
    assert guard.clock.calls["on_hook"] == 1  # timed even when it failed


def test_the_guards_decision_to_stop_passes_through() -> None:
    guard = Guard()
    stop = NonFiniteTrainingError("stop", [make_event()])
    with pytest.raises(NonFiniteTrainingError) as raised:
        guard.on_hook(1, raise_=stop)
    assert raised.value is stop and guard.failures == []


def test_base_exceptions_are_not_swallowed() -> None:
    guard = Guard()
    with pytest.raises(KeyboardInterrupt):
        guard.on_hook(1, raise_=KeyboardInterrupt())
    assert guard.failures == []


def test_counter_views_read_the_counters_as_ints() -> None:
    guard = Guard()
    assert (guard.bad_steps, guard.skipped_steps) == (4, 3)
    guard.counters = guard.counters.replace(bad_steps_total=5)
    assert guard.bad_steps == 5 and type(guard.bad_steps) is int


def test_a_counter_view_on_the_class_is_documented() -> None:
    view = Guard.bad_steps
    assert isinstance(view, CounterView) and view.__doc__ == "Bad steps so far." and view.name == "bad_steps_total"
