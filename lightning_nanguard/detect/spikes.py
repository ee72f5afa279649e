"""Loss-spike detection: a finite value far above the recent healthy values, flagged on the device.

:class:`SpikeDetector` flags a value that is both ``sigmas`` robust standard deviations of the
step-to-step change of ``log(value)`` above the median of the recent *accepted* (healthy) values and
``min_ratio`` times that median (on a linear scale when the median is not positive). NaN/Inf is never
a spike. :meth:`~SpikeDetector.check` is one comparison on the value's device and reads nothing; the
statistic lives on the host, fed by :meth:`~SpikeDetector.accept` with the value the caller reads
anyway. The rule, why it was chosen and what it costs: ``docs/guide/spikes.md``.

The caller's protocol, once per step::

    flag = detector.check(loss)               # device tensor, no host read
    ...                                       # the caller reads flag and loss with its other results
    detector.accept(step_was_healthy, value=loss_value)  # host floats: nothing read
    if flag_was_set:
        rebaselined = detector.record_spike()  # True: the history was cleared, warn
"""

from __future__ import annotations

import math
import operator
import struct
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

__all__ = ["SpikeDetector", "SpikeStats"]

_FLOAT32 = torch.float32
_FLOAT32_MAX = torch.finfo(_FLOAT32).max
_FLOAT32_FORMAT = struct.Struct("f")  # a float rounded to float32 and back: pack, unpack
_TINY = 5e-324  # log() floor, the smallest positive double: a value <= 0 in a log-scale window is a huge change
# (a lenient spread), while values in float32's subnormal range (1e-38 and below) keep their real ratios
_Q = 0.9  # quantile of the step-to-step changes that measures their spread
_Q_TO_SIGMA = 2.326348  # 90% quantile of |N(0, 2)|: |x[i] - x[i-1]| for Gaussian noise of std 1


@dataclass(frozen=True)
class SpikeStats:
    """What a :class:`SpikeDetector` compared a value with (bad path only: it reads that value).

    Args:
        value: the last checked value (``None`` before the first :meth:`SpikeDetector.check`).
        threshold: values above it are spikes (``inf`` while the detector warms up).
        baseline: median of the last ``recent`` accepted values (``nan`` with no history).
        spread: robust standard deviation of the step-to-step change, in log units (a relative
            change: 0.1 is about 10%) when ``scale == "log"``, in the value's units otherwise;
            raised to the ``min_ratio`` floor when that is larger, so that
            ``threshold == baseline * exp(sigmas * spread)`` (log) or ``baseline + sigmas * spread``.
        scale: ``"log"`` when the baseline is positive, ``"linear"`` otherwise.
        history: number of accepted values in the window.
        ratio: ``value / baseline`` (``None`` when undefined).
    """

    value: float | None
    threshold: float
    baseline: float
    spread: float
    scale: Literal["log", "linear"]
    history: int
    ratio: float | None

    def details(self) -> dict[str, Any]:
        """The event's ``details``: ``threshold``, ``baseline``, ``spread``, ``spread_scale``, ``ratio``, ``history``.

        Examples:
            >>> SpikeStats(50.0, 3.0, 1.0, 0.1, "log", 32, 50.0).details()["threshold"]
            3.0
        """
        return {
            "threshold": self.threshold,
            "baseline": self.baseline,
            "spread": self.spread,
            "spread_scale": self.scale,
            "ratio": self.ratio,
            "history": self.history,
        }


class SpikeDetector:
    """Flags values far above the recent accepted values: one comparison on the device, no host read.

    One instance watches one per-step scalar: the loss (``name="loss"``) or, where it is computed
    every step anyway, the gradient norm (``name="grad_norm"``).

    Args:
        window: number of recent accepted values kept (the spread is measured over them).
        warmup: accepted values needed before the detector can flag anything (it starts flagging
            within ``warmup + refresh_every - 1`` accepted values); at most ``window``.
        sigmas: how many robust standard deviations of the step-to-step change a spike lies above
            the baseline.
        min_ratio: a spike is also at least this many times the baseline (for a positive
            baseline; ``min_ratio - 1`` times ``|baseline|`` above it otherwise). Keeps a flat,
            nearly noise-free curve from turning every wobble into a spike.
        recent: number of most recent accepted values whose median is the baseline; at most
            ``window``.
        rebaseline_after: spikes in a row (reported with :meth:`record_spike`) after which the
            history is cleared, so that a real level shift does not become an endless skip.
        refresh_every: recompute the statistic every this many accepted values (1: every step).
        name: what is watched, for messages.

    Examples:
        >>> detector = SpikeDetector(warmup=4)
        >>> for loss in [1.0, 0.9, 1.1, 1.0]:
        ...     _ = detector.check(torch.tensor(loss))
        ...     detector.accept(True)
        >>> detector.check(torch.tensor(1.2))
        tensor([0.])
        >>> detector.check(torch.tensor(1e5))
        tensor([1.])
        >>> stats = detector.stats()
        >>> stats.baseline, round(stats.threshold, 3)
        (1.0, 3.0)
    """

    def __init__(
        self,
        window: int = 128,
        warmup: int = 16,
        sigmas: float = 6.0,
        min_ratio: float = 3.0,
        recent: int = 16,
        rebaseline_after: int = 5,
        refresh_every: int = 4,
        name: str = "loss",
    ) -> None:
        _check_int("window", window, 3)
        _check_int("warmup", warmup, 2)
        _check_int("recent", recent, 1)
        _check_int("rebaseline_after", rebaseline_after, 1)
        _check_int("refresh_every", refresh_every, 1)
        if not (isinstance(sigmas, int | float) and math.isfinite(sigmas) and sigmas > 0):
            raise ValueError(f"SpikeDetector: `sigmas` must be a finite number > 0, got {sigmas!r}.")
        if not (isinstance(min_ratio, int | float) and math.isfinite(min_ratio) and min_ratio >= 1):
            raise ValueError(f"SpikeDetector: `min_ratio` must be a finite number >= 1, got {min_ratio!r}.")
        self.window = window
        self.warmup = min(warmup, window)
        self.sigmas = float(sigmas)
        self.min_ratio = float(min_ratio)
        self.recent = min(recent, window)
        self.rebaseline_after = rebaseline_after
        self.refresh_every = refresh_every
        self.name = name
        self.consecutive_spikes = 0
        self.spikes_total = 0
        self.rebaselines_total = 0
        self._history: deque[float] = deque(maxlen=window)  # accepted values, oldest first (host floats)
        self._logs: deque[float] = deque(maxlen=window)  # log(max(value, tiny)) of the same values
        self._changes = _Changes()  # |b - a| of each pair of consecutive values and logs, kept sorted
        self._arrived: list[float] = []  # accepted values not yet in the window (folded in at the next refresh)
        self._statistic = _Statistic.warming_up(0)  # what the device threshold holds
        self._thresholds: dict[torch.device, Tensor] = {}  # the threshold on each device it was used on
        self._pending: Tensor | float | None = None  # the value of the last check, until accept()
        self._checked: tuple[_Statistic, Tensor | float] | None = None  # the last check: its statistic and value

    # ------------------------------------------------------------------ the healthy path

    def check(self, value: Tensor) -> Tensor:
        """1-element float32 flag on ``value``'s device: 1.0 when ``value`` is a spike, else 0.0.

        Three small kernels on the device, no host read. NaN/Inf is never a spike. The value is kept
        for :meth:`accept`.

        Args:
            value: a one-element tensor (a 0-dim loss, any floating dtype: compared in float32).

        Raises:
            TypeError: ``value`` is not a floating-point tensor.
            ValueError: ``value`` has more than one element.
        """
        if not isinstance(value, Tensor) or not value.is_floating_point():
            raise TypeError(f"SpikeDetector.check: expected a floating-point tensor, got {_describe(value)}.")
        if value.numel() != 1:
            raise ValueError(
                f"SpikeDetector.check: expected a single {self.name} value, got a tensor of shape {tuple(value.shape)} "
                "(reduce it first, e.g. sum the micro-batch losses)."
            )
        raw = value.reshape(1) if value.dim() > 1 else value  # 0-dim compares as 1 element with the threshold
        if raw.requires_grad:
            raw = raw.detach()
        self._pending = raw
        self._checked = (self._statistic, raw)
        threshold = self._threshold_on(raw.device)
        # NaN and +/-Inf become NaN, which never compares above a threshold: they are the NaN/Inf check's business
        finite = torch.nan_to_num(
            raw if raw.dtype == _FLOAT32 else raw.to(_FLOAT32), nan=math.nan, posinf=math.nan, neginf=math.nan
        )
        return (finite > threshold).to(_FLOAT32)

    def above(self, value: Tensor) -> Tensor:
        """``value > threshold`` on ``value``'s device (bool, one element); one kernel, nothing kept.

        For a flag the device needs now when the host will :meth:`check_value` the same float32 value
        later (which decides and keeps it): both compare with the same float32 threshold. NaN is never
        above; +Inf is, so where Inf must not count, the caller's flag covers it otherwise.

        Example:
            >>> SpikeDetector(warmup=2).above(torch.tensor([1e30])).tolist()  # warming up: no threshold yet
            [False]
        """
        return torch.gt(value, self._threshold_on(value.device))

    def check_value(self, value: float) -> bool:
        """:meth:`check` of a value already on the host (read with the step's other results): no kernel.

        The same comparison as on the device: ``value`` (a float32 read to the host) against the
        threshold rounded to float32; NaN and +/-Inf are never a spike. The value is kept for
        :meth:`accept` and :meth:`stats`.

        Examples:
            >>> detector = SpikeDetector(warmup=2, refresh_every=1)
            >>> for loss in [1.0, 1.0]:
            ...     _ = detector.check_value(loss)
            ...     detector.accept(True)
            >>> detector.check_value(1.5), detector.check_value(4.0), detector.check_value(math.inf)
            (False, True, False)
        """
        self._pending = value
        self._checked = (self._statistic, value)
        return math.isfinite(value) and value > self._statistic.threshold32

    def accept(self, accepted: Tensor | bool, value: float | None = None) -> None:
        """Tell whether the value of the last :meth:`check` came from a healthy step.

        Only accepted, finite values enter the history. ``True`` also ends a run of spikes (see
        :meth:`record_spike`).

        Args:
            accepted: whether the step was healthy (a one-element tensor is read to the host).
            value: the checked value as a float, when the caller has read it already (the guard
                reads it with the step's other results): then nothing is read here. Without it the
                pending value is read (one host read).

        Raises:
            RuntimeError: no :meth:`check` since the last ``accept``.
        """
        if self._pending is None:
            raise RuntimeError("SpikeDetector.accept: call check(value) first (once per step, then accept once).")
        pending, self._pending = self._pending, None
        if isinstance(accepted, Tensor):
            accepted = bool(accepted.reshape(-1)[0])
        if not accepted:
            return
        self.consecutive_spikes = 0
        if value is not None:
            current = float(value)
        else:
            current = pending if isinstance(pending, float) else float(pending.float().reshape(-1)[0])
        if not math.isfinite(current):
            return
        arrived = self._arrived
        arrived.append(current)  # the threshold changes at the refresh only: the window takes it then
        if len(arrived) >= self.refresh_every:
            self._refresh()

    # ------------------------------------------------------------------ host side

    def record_spike(self) -> bool:
        """Count a spike the caller acted on; after ``rebaseline_after`` in a row, clear the history.

        Returns:
            ``True`` when this spike triggered a re-baseline: the history is empty and refills from
            the coming healthy steps (no spike can be flagged during the next ``warmup`` steps).
            The caller should warn: the level of the watched value probably shifted for good
            (e.g. a curriculum change) rather than spiked.
        """
        self.spikes_total += 1
        self.consecutive_spikes += 1
        if self.consecutive_spikes < self.rebaseline_after:
            return False
        self.consecutive_spikes = 0
        self.rebaselines_total += 1
        self._clear()
        return True

    def stats(self) -> SpikeStats:
        """The statistic the last :meth:`check` compared its value with (reads that value: bad steps only).

        Unchanged by the ``accept``/``record_spike`` that follow that check.
        """
        if self._checked is None:
            self._fold()
            return SpikeStats(None, math.inf, math.nan, math.nan, "log", len(self._history), None)
        statistic, raw = self._checked
        value = raw if isinstance(raw, float) else float(raw.float().reshape(-1)[0])
        positive = statistic.baseline > 0
        ratio = value / statistic.baseline if positive and math.isfinite(value) else None
        spread = statistic.margin / self.sigmas  # the larger of the measured spread and the min_ratio floor
        scale: Literal["log", "linear"] = "log" if positive or math.isnan(statistic.baseline) else "linear"
        return SpikeStats(value, statistic.threshold, statistic.baseline, spread, scale, statistic.history, ratio)

    def describe(self) -> dict[str, Any]:
        """The event's ``details`` for a spike: see :meth:`SpikeStats.details`."""
        return self.stats().details()

    def reset(self) -> None:
        """Forget the history and the run of spikes (the detector warms up again)."""
        self.consecutive_spikes = 0
        self._clear()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The history (oldest first) and counters as primitives (``torch.load(weights_only=True)``-safe)."""
        self._fold()
        return {
            "history": list(self._history),
            "consecutive_spikes": self.consecutive_spikes,
            "spikes_total": self.spikes_total,
            "rebaselines_total": self.rebaselines_total,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the threshold is recomputed at once).

        A history longer than ``window`` keeps its newest values; non-finite entries are dropped;
        missing keys default to an empty history and zero counters.
        """
        values = [float(v) for v in state_dict.get("history", [])]
        self._history = deque((v for v in values if math.isfinite(v)), maxlen=self.window)
        self._logs = deque((math.log(max(v, _TINY)) for v in self._history), maxlen=self.window)
        self._changes = _Changes.of(self._history, self._logs)
        self._arrived = []
        self.consecutive_spikes = int(state_dict.get("consecutive_spikes", 0))
        self.spikes_total = int(state_dict.get("spikes_total", 0))
        self.rebaselines_total = int(state_dict.get("rebaselines_total", 0))
        self._pending, self._checked = None, None
        self._refresh()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_thresholds"] = {}  # device tensors are rebuilt where they are next used
        state["_pending"], state["_checked"] = None, None
        return state

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, window={self.window}, warmup={self.warmup}, "
            f"sigmas={self.sigmas}, min_ratio={self.min_ratio}, recent={self.recent}, "
            f"rebaseline_after={self.rebaseline_after}, refresh_every={self.refresh_every})"
        )

    # ------------------------------------------------------------------ internals

    def _threshold_on(self, device: torch.device) -> Tensor:
        threshold = self._thresholds.get(device)
        if threshold is None:
            threshold = torch.full((1,), self._statistic.threshold, dtype=_FLOAT32, device=device)
            self._thresholds[device] = threshold
        return threshold

    def _clear(self) -> None:
        self._arrived.clear()
        self._history.clear()
        self._logs.clear()
        self._changes = _Changes()
        self._refresh()

    def _refresh(self) -> None:
        """Recompute the statistic from the history (host floats) and write the threshold to the devices."""
        self._fold()
        written = self._statistic.threshold  # what every device threshold holds now
        self._statistic = _Statistic.of(
            self._history, self._logs, self.warmup, self.recent, self.sigmas, self.min_ratio, self._changes
        )
        if self._statistic.threshold == written:
            return  # unchanged (inf while warming up): no kernel
        for threshold in self._thresholds.values():
            threshold.fill_(self._statistic.threshold)  # a kernel with a host scalar: no synchronisation

    def _fold(self) -> None:
        """Move the values accepted since the last refresh into the window (its values, logs and changes)."""
        if not self._arrived:
            return
        history, logs, changes = self._history, self._logs, self._changes
        for value in self._arrived:
            log = math.log(value if value > _TINY else _TINY)  # accepted values are finite
            changes.slide(history, logs, value, log)
            history.append(value)
            logs.append(log)
        self._arrived.clear()


class _Statistic(NamedTuple):
    """The threshold and what it is made of (``inf`` while warming up: nothing compares above it).

    Made with :meth:`make`, which rounds the threshold to float32 once. A named tuple: a refresh
    (every few steps, its code cold by then) makes one in a single call.
    """

    threshold: float
    baseline: float
    margin: float
    history: int
    threshold32: float
    """:attr:`threshold` rounded to float32, as the device compares with it (always representable)."""

    @classmethod
    def make(cls, threshold: float, baseline: float, margin: float, history: int) -> _Statistic:
        return cls(threshold, baseline, margin, history, _FLOAT32_FORMAT.unpack(_FLOAT32_FORMAT.pack(threshold))[0])

    @classmethod
    def warming_up(cls, history: int, baseline: float = math.nan) -> _Statistic:
        return cls.make(math.inf, baseline, math.inf, history)

    @classmethod
    def of(
        cls,
        values: Sequence[float],
        logs: Sequence[float],
        warmup: int,
        recent: int,
        sigmas: float,
        min_ratio: float,
        changes: _Changes | None = None,
    ) -> _Statistic:
        """The statistic of the accepted ``values`` (oldest first) and their ``logs``; see the module docs.

        ``changes``: the sorted changes of ``values`` and ``logs``, kept as they arrive; else sorted here.
        """
        if not values:
            return cls.warming_up(0)
        recent_values = sorted(islice(reversed(values), recent))  # the last `recent`, no copy of the window
        # the low median: an observed value, as torch.median gives
        baseline = recent_values[(len(recent_values) - 1) // 2]
        if len(values) < warmup:
            return cls.warming_up(len(values), baseline)
        positive = baseline > 0
        if changes is None:
            changes = _Changes.of(values, logs)
        ordered = changes.logs if positive else changes.values
        quantile = ordered[round(_Q * (len(ordered) - 1))] if ordered else 0.0
        margin = quantile * sigmas / _Q_TO_SIGMA
        if positive:
            margin = max(margin, math.log(min_ratio))
            return cls.make(_representable(math.log(baseline) + margin, log=True), baseline, margin, len(values))
        margin = max(margin, abs(baseline) * (min_ratio - 1.0))
        return cls.make(_representable(baseline + margin) if margin > 0 else math.inf, baseline, margin, len(values))


class _Changes:
    """``|b - a|`` of each pair of consecutive values (and of their logs), sorted, kept as the window slides.

    A refresh of the statistic then reads its quantile instead of sorting the window (two bisections
    a step instead of a sort of ``window`` changes every ``refresh_every`` steps).

    Examples:
        >>> history, logs, changes = deque([1.0, 4.0], maxlen=3), deque([0.0, 0.0], maxlen=3), _Changes()
        >>> changes = _Changes.of(history, logs)
        >>> changes.slide(history, logs, 2.0, 0.0); history.append(2.0); logs.append(0.0)
        >>> changes.values
        [2.0, 3.0]
        >>> changes.slide(history, logs, 2.5, 0.0); history.append(2.5); logs.append(0.0)
        >>> changes.values  # 4 - 1 left the window with 1.0
        [0.5, 2.0]
    """

    def __init__(self, values: list[float] | None = None, logs: list[float] | None = None) -> None:
        self.values = values if values is not None else []
        self.logs = logs if logs is not None else []

    @classmethod
    def of(cls, values: Sequence[float], logs: Sequence[float]) -> _Changes:
        listed, listed_logs = list(values), list(logs)
        return cls(_sorted_changes(listed), _sorted_changes(listed_logs))

    def slide(self, history: deque[float], logs: deque[float], value: float, log: float) -> None:
        """``value`` (and its ``log``) is about to be appended to ``history`` (and ``logs``)."""
        if not history or history.maxlen == 1:  # no pair before, or none after
            return
        changes, log_changes = self.values, self.logs
        if len(history) == history.maxlen:  # the oldest pair leaves the window
            del changes[bisect_left(changes, abs(history[1] - history[0]))]
            del log_changes[bisect_left(log_changes, abs(logs[1] - logs[0]))]
        insort(changes, abs(value - history[-1]))
        insort(log_changes, abs(log - logs[-1]))


def _sorted_changes(series: list[float]) -> list[float]:
    return sorted(map(abs, map(operator.sub, series[1:], series[:-1])))  # |b - a| of each pair, no generator


def _representable(threshold: float, log: bool = False) -> float:
    """``threshold`` (or ``exp(threshold)`` with ``log``) as the float32 the device compares with.

    Anything at or above float32's largest value, or not a number, becomes ``inf``: no finite float32
    value lies above it, so nothing is flagged, which is what such a threshold means; anything below
    float32's lowest value becomes that value. (A zero loss in a log-scale window is a change of ~70
    nats: sigmas of it overflow float32 and ``math.exp``, and ``fill_`` of a float32 tensor raises.)

    Examples:
        >>> _representable(1e39), _representable(3.0), _representable(math.log(2.0), log=True)
        (inf, 3.0, 2.0)
        >>> _representable(180.0, log=True), _representable(math.nan), _representable(-1e300) == -_FLOAT32_MAX
        (inf, inf, True)
    """
    if log:
        threshold = math.exp(threshold) if threshold < math.log(_FLOAT32_MAX) else math.inf
    if not threshold < _FLOAT32_MAX:  # NaN too
        return math.inf
    return max(threshold, -_FLOAT32_MAX)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"SpikeDetector: `{name}` must be an int >= {minimum}, got {value!r}.")


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor"
    return f"{type(value).__name__} {value!r}"
