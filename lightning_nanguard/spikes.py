"""Loss-spike detection on the device: a finite value far above the recent healthy values.

:class:`SpikeDetector` keeps the last ``window`` *accepted* (healthy) values of a per-step
scalar, the training loss or the gradient norm, in a tensor on that scalar's device, and flags a
new value that is both

- ``sigmas`` robust standard deviations above the recent level, and
- ``min_ratio`` times the recent level,

without reading anything to the host: :meth:`~SpikeDetector.check` returns a 1-element float32
flag tensor that the caller folds into its own single read of the step.

The statistic, for positive values (the usual case), works on ``log(value)``, so a spike is a
*factor* above the recent level whatever the units of the loss:

- ``baseline``: the median of the last ``recent`` (16) accepted values;
- ``spread``: a robust standard deviation of the step-to-step change of ``log(value)`` over the
  window: the 90% quantile of ``|log(v[i]) - log(v[i-1])|`` divided by 2.326 (its value for
  Gaussian noise). Changes from one step to the next do not see a trend: a loss that falls a
  thousandfold within the window keeps the spread of its noise, not of its fall.
- ``threshold = baseline * max(min_ratio, exp(sigmas * spread))``.

When the baseline is not positive (losses that can be negative, e.g. a Gaussian negative
log-likelihood) the same rule runs on the values themselves:
``threshold = baseline + max(sigmas * spread, (min_ratio - 1) * |baseline|)``.

NaN/Inf values are never spikes (they are the NaN/Inf check's business) and never enter the
history. The detector is inactive (never flags) until ``warmup`` values have been accepted, and
again for ``warmup`` values after a re-baseline.

Cost: :meth:`~SpikeDetector.check` is a handful of kernels on one element; the statistic (about
twenty small kernels on the window: a median, a sort, an index) is recomputed every
``refresh_every`` accepted values, so the threshold a value meets is at most that many steps old.

The caller's protocol, once per step::

    flag = detector.check(loss)       # device tensor, no host read
    ...                               # the caller reads flag with its other step results, decides
    detector.accept(step_was_healthy) # a bool, or a device bool tensor (then no read is needed)
    if flag_was_set:
        rebaselined = detector.record_spike()  # host side; True: the history was cleared, warn
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = ["SpikeDetector", "SpikeStats"]

_FLOAT32 = torch.float32
_TINY = 1e-30  # log() floor: values <= 0 in a log-scale window give huge changes (a lenient spread)
_Q = 0.9  # quantile of the step-to-step changes that measures their spread
_Q_TO_SIGMA = 2.326348  # 90% quantile of |N(0, 2)|: |x[i] - x[i-1]| for Gaussian noise of std 1


@dataclass(frozen=True)
class SpikeStats:
    """A host-side reading of a :class:`SpikeDetector` (bad path only: it reads the device).

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

        Example:
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
    """Flags values far above the recent accepted values, decided on the device with no host read.

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

    Example:
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
        self._history: Tensor | None = None  # [window] float32, oldest first, NaN = empty slot
        # log(max(value, tiny)) of the same slots, taken one value at a time: on a CPU with several threads
        # torch's log of a whole window can cost milliseconds (its parallel path), of one element microseconds
        self._logs: Tensor | None = None
        self._pending_log: Tensor | None = None
        self._quantile_index: Tensor | None = None  # [window] int64: by number of valid changes, see _allocate
        self._threshold: Tensor | None = None  # [1] float32, for the next check
        self._constants: tuple[Tensor, ...] = ()  # (log(min_ratio), inf) on the device
        self._statistic: tuple[Tensor, ...] = ()  # (threshold, baseline, margin, changes) for stats()
        self._checked: tuple[Tensor, ...] = ()  # the statistic and the value of the last check
        self._pending: Tensor | None = None  # [1] float32, NaN/Inf as NaN: the value of the last check
        self._loaded: list[float] = []  # history restored by load_state_dict, placed on next use
        self._stale = 0  # accept calls that may have changed the history since the last refresh

    # ------------------------------------------------------------------ the healthy path

    def check(self, value: Tensor) -> Tensor:
        """1-element float32 flag on ``value``'s device: 1.0 when ``value`` is a spike, else 0.0.

        No host read. NaN/Inf is never a spike. The value is kept for :meth:`accept`.

        Args:
            value: a one-element tensor (a 0-dim loss, any floating dtype: computed in float32).

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
        threshold = self._ready(value.device)
        raw = value.detach().reshape(1).to(_FLOAT32)
        # NaN and +/-Inf become NaN: never above the threshold, an empty slot if accepted anyway
        current = torch.nan_to_num(raw, nan=math.nan, posinf=math.nan, neginf=math.nan)
        self._pending = current
        self._pending_log = current.clamp_min(_TINY).log()
        self._checked = (*self._statistic, raw)
        return (current > threshold).to(_FLOAT32)

    def accept(self, accepted: Tensor | bool) -> None:
        """Tell whether the value of the last :meth:`check` came from a healthy step.

        Only accepted values enter the history, and never NaN/Inf. With a ``bool`` nothing is read
        (an ``accept(True)`` after a NaN/Inf value leaves an empty slot in the window); with a tensor
        (bool or 0/1, one element, on the value's device) the choice is made on the device and a
        NaN/Inf value is left out, so a caller that has not read the step's result yet can still
        feed the history. ``True`` also ends a run of spikes (see :meth:`record_spike`); a tensor
        leaves that count alone.

        Raises:
            RuntimeError: no :meth:`check` since the last ``accept``.
        """
        if self._pending is None:
            raise RuntimeError("SpikeDetector.accept: call check(value) first (once per step, then accept once).")
        current, self._pending = self._pending, None
        current_log, self._pending_log = self._pending_log, None
        history, logs = self._history, self._logs
        assert history is not None and logs is not None and current_log is not None
        if isinstance(accepted, Tensor):
            take = accepted.detach().reshape(1).to(device=current.device, dtype=torch.bool) & (current == current)
            self._history = torch.where(take, torch.cat((history[1:], current)), history)
            self._logs = torch.where(take, torch.cat((logs[1:], current_log)), logs)
        elif accepted:
            self.consecutive_spikes = 0
            self._history = torch.cat((history[1:], current))
            self._logs = torch.cat((logs[1:], current_log))
        else:
            return
        self._stale += 1
        if self._stale >= self.refresh_every:
            self._refresh()

    # ------------------------------------------------------------------ host side (bad path)

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
        """The statistic the last :meth:`check` compared its value with (host read: bad steps only).

        Unchanged by the ``accept``/``record_spike`` that follow that check.
        """
        if not self._checked:
            return SpikeStats(None, math.inf, math.nan, math.nan, "log", len(self._loaded), None)
        threshold, baseline, margin, changes, raw = (float(t.reshape(-1)[0].item()) for t in self._checked)
        if math.isnan(threshold):  # warming up
            threshold = margin = math.inf
        positive = baseline > 0
        ratio = raw / baseline if positive and math.isfinite(raw) else None
        spread = margin / self.sigmas  # the larger of the measured spread and the min_ratio floor
        history = int(changes) + 1 if changes > 0 else len(self._values())
        return SpikeStats(raw, threshold, baseline, spread, "log" if positive else "linear", history, ratio)

    def describe(self) -> dict[str, Any]:
        """The event's ``details`` for a spike: see :meth:`SpikeStats.details` (host read)."""
        return self.stats().details()

    def reset(self) -> None:
        """Forget the history and the run of spikes (the detector warms up again)."""
        self.consecutive_spikes = 0
        self._clear()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The history (oldest first) and counters as primitives (``torch.load(weights_only=True)``-safe)."""
        return {
            "history": self._values(),
            "consecutive_spikes": self.consecutive_spikes,
            "spikes_total": self.spikes_total,
            "rebaselines_total": self.rebaselines_total,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the history moves to the device of the next checked value.

        A history longer than ``window`` keeps its newest values; non-finite entries are dropped;
        missing keys default to an empty history and zero counters.
        """
        values = [float(v) for v in state_dict.get("history", [])]
        self._loaded = [v for v in values if math.isfinite(v)][-self.window :]
        self.consecutive_spikes = int(state_dict.get("consecutive_spikes", 0))
        self.spikes_total = int(state_dict.get("spikes_total", 0))
        self.rebaselines_total = int(state_dict.get("rebaselines_total", 0))
        self._history = self._logs = self._threshold = self._pending = self._pending_log = None
        self._statistic = self._checked = ()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, window={self.window}, warmup={self.warmup}, "
            f"sigmas={self.sigmas}, min_ratio={self.min_ratio}, recent={self.recent}, "
            f"rebaseline_after={self.rebaseline_after}, refresh_every={self.refresh_every})"
        )

    # ------------------------------------------------------------------ internals

    def _values(self) -> list[float]:
        """Accepted values in the window, oldest first (host read)."""
        if self._history is None:
            return list(self._loaded)
        return [v for v in self._history.tolist() if not math.isnan(v)]

    def _ready(self, device: torch.device) -> Tensor:
        """The threshold on ``device``; allocates the state there on first use, after loading or a move."""
        if self._threshold is None or self._threshold.device != device:
            self._allocate(device)
        assert self._threshold is not None
        return self._threshold

    def _allocate(self, device: torch.device) -> None:
        if self._history is not None:  # the value moved: carry the history along
            history = self._history.to(device)
        else:
            values = torch.full((self.window,), math.nan, dtype=_FLOAT32)
            if self._loaded:
                values[self.window - len(self._loaded) :] = torch.tensor(self._loaded, dtype=_FLOAT32)
            history = values.to(device)
            self._loaded = []
        self._history = history
        self._logs = torch.stack([v.clamp_min(_TINY).log() for v in history])  # once: one element at a time
        # n valid changes, sorted first (NaN sorts last): their 90% quantile sits at round(0.9 * (n - 1)).
        # Below `warmup` values (warmup - 1 changes) the table points at the last change, NaN while the
        # window is not full: a NaN threshold flags nothing.
        changes = torch.arange(self.window, dtype=torch.float64)
        index = ((changes - 1).clamp_min(0) * _Q).round().to(torch.int64)
        index[changes < self.warmup - 1] = self.window - 2
        self._quantile_index = index.to(device)
        # 0-dim constants on the device: torch.where with Python floats builds them on every call
        self._constants = (
            torch.tensor(math.log(self.min_ratio), dtype=_FLOAT32, device=device),
            torch.tensor(math.inf, dtype=_FLOAT32, device=device),
        )
        self._refresh()

    def _clear(self) -> None:
        self._loaded = []
        if self._history is not None:  # a new tensor, not fill_(): the old one may be an inference tensor
            self._history = torch.full_like(self._history, math.nan)
            self._logs = torch.full_like(self._history, math.nan)
            self._refresh()

    def _refresh(self) -> None:
        """Recompute the threshold (and the statistic behind it) from the history, on the device.

        About twenty small kernels and no host read. While the detector warms up, the quantile index
        points at an empty (NaN) change, so the threshold is NaN and no value compares above it.
        """
        history, index = self._history, self._quantile_index
        assert history is not None and index is not None
        baseline = history[-self.recent :].nanmedian()  # NaN while empty
        positive = baseline > 0
        assert self._logs is not None
        values = torch.where(positive, self._logs, history)
        changes = (values[1:] - values[:-1]).abs().sort().values  # NaN (empty slots) sort last
        valid = (changes == changes).sum().reshape(1)
        # index_select, not changes[index[valid]]: indexing with a 0-dim tensor reads it to the host
        margin = changes.index_select(0, index.index_select(0, valid)) * (self.sigmas / _Q_TO_SIGMA)
        # log scale: threshold = baseline * exp(max(margin, log(min_ratio)));
        # linear scale: threshold = baseline + max(margin, (min_ratio - 1) * |baseline|), never 0 above 0
        log_ratio, inf = self._constants
        floor = torch.where(positive, log_ratio, baseline.abs() * (self.min_ratio - 1.0))
        margin = torch.maximum(margin, floor)
        linear = torch.where(margin > 0, margin + baseline, inf)
        self._threshold = torch.where(positive, margin.exp() * baseline, linear)
        self._statistic = (self._threshold, baseline, margin, valid)
        self._stale = 0


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"SpikeDetector: `{name}` must be an int >= {minimum}, got {value!r}.")


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor"
    return f"{type(value).__name__} {value!r}"
