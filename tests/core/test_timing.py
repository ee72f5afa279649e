"""Wall time inside the guard's own code (``lightning_nanguard.core.timing``); never asserts on durations."""

from __future__ import annotations

import pytest

from lightning_nanguard.core.timing import GuardClock


def test_off_by_default_measures_nothing() -> None:
    clock = GuardClock()
    with clock.measure("hook"):
        pass
    assert not clock.enabled
    assert dict(clock.calls) == {} and dict(clock.seconds) == {} and clock.total == 0.0


def test_calls_and_seconds_per_name() -> None:
    clock = GuardClock(enabled=True)
    for _ in range(3):
        with clock.measure("a"):
            pass
    with clock.measure("b"):
        pass
    assert dict(clock.calls) == {"a": 3, "b": 1}
    assert set(clock.seconds) == {"a", "b"}
    assert all(seconds >= 0.0 for seconds in clock.seconds.values())
    assert clock.total == pytest.approx(clock.seconds["a"] + clock.seconds["b"])


def test_nested_measurements_count_once_in_the_outermost() -> None:
    clock = GuardClock(enabled=True)
    with clock.measure("outer"), clock.measure("inner"):
        pass
    assert dict(clock.calls) == {"outer": 1}
    with clock.measure("inner"):  # the depth went back to 0
        pass
    assert dict(clock.calls) == {"outer": 1, "inner": 1}


def test_a_raising_body_is_still_counted_and_the_clock_recovers() -> None:
    clock = GuardClock(enabled=True)
    with pytest.raises(ValueError, match="boom"), clock.measure("hook"):
        raise ValueError("boom")
    assert clock.calls["hook"] == 1
    with clock.measure("next"):
        pass
    assert clock.calls["next"] == 1  # not mistaken for a nested call


def test_switching_on_and_off_between_calls() -> None:
    clock = GuardClock()
    with clock.measure("hook"):
        pass
    clock.enabled = True
    with clock.measure("hook"):
        pass
    clock.enabled = False
    with clock.measure("hook"):
        pass
    assert clock.calls["hook"] == 1


def test_reset_forgets_everything() -> None:
    clock = GuardClock(enabled=True)
    with clock.measure("hook"):
        pass
    clock.reset()
    assert dict(clock.calls) == {} and dict(clock.seconds) == {} and clock.total == 0.0
    assert clock.enabled
