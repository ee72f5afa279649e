"""Wall time spent inside the guard's own code, for benchmarks and for users who want to know.

Every callable NanGuard installs (callback hooks, the strategy's after-step work, the recording
batch sampler) runs under one :class:`GuardClock`. It is off by default and then costs one
attribute read per call; switched on (``guard.clock.enabled = True``) it adds two
``perf_counter()`` calls per call.

Example:
    >>> clock = GuardClock(enabled=True)
    >>> with clock.measure("on_before_optimizer_step"):
    ...     _ = sum(range(1000))
    >>> clock.calls["on_before_optimizer_step"], clock.total > 0
    (1, True)
    >>> clock.reset(); clock.total
    0.0
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from time import perf_counter  # bound at import: a test that replaces time.perf_counter leaves the guard's own clock

__all__ = ["GuardClock"]

_UNMEASURED = contextlib.nullcontext()  # reusable: enters and exits doing nothing


class GuardClock:
    """Accumulates wall time per named callable (see module docs).

    Args:
        enabled: start measuring at once.

    Attributes:
        seconds: total seconds per callable name.
        calls: number of measured calls per callable name.
    """

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: defaultdict[str, int] = defaultdict(int)
        self._depth = 0

    def measure(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Time the body under ``name``; nested measurements count once (in the outermost).

        Off (or nested): a shared do-nothing context manager, so an unmeasured call costs no generator.
        """
        if not self.enabled or self._depth:
            return _UNMEASURED
        return _Measurement(self, name)

    @property
    def total(self) -> float:
        """Seconds measured in all callables."""
        return float(sum(self.seconds.values()))

    def reset(self) -> None:
        """Forget everything measured so far."""
        self.seconds.clear()
        self.calls.clear()


class _Measurement:
    """One outermost measured call of a :class:`GuardClock` (a plain class: cheaper than a generator)."""

    __slots__ = ("_clock", "_name", "_start")

    def __init__(self, clock: GuardClock, name: str) -> None:
        self._clock = clock
        self._name = name
        self._start = 0.0

    def __enter__(self) -> None:
        self._clock._depth += 1
        self._start = perf_counter()

    def __exit__(self, *exc: object) -> None:
        clock = self._clock
        clock.seconds[self._name] += perf_counter() - self._start
        clock.calls[self._name] += 1
        clock._depth -= 1
