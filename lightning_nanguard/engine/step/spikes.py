"""Which values the loss-spike check watches, and what a spike says (:mod:`lightning_nanguard.detect.spikes` at a step).

A :class:`SpikeWatch` owns the :class:`~lightning_nanguard.detect.spikes.SpikeDetector` of the step loss
and, when the gradient norm is computed on every step anyway (``clip_grad``), one of the norm. Per
checked step it adds one flag to the step's device vector (no host read), is told afterwards
whether the step was healthy, and on a spike describes it for the event.

Example:
    >>> watch = SpikeWatch(SpikeSettings(warmup=4))
    >>> for loss in [1.0, 0.9, 1.1, 1.0]:
    ...     _ = watch.check(torch.tensor(loss), grad_norm=None)
    ...     watch.accept(True, loss=loss)
    >>> watch.check(torch.tensor(1e4), grad_norm=None).item()
    1.0
    >>> watch.spike_kinds()
    ('loss_spike',)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_nanguard.core.defaults import default_of
from lightning_nanguard.core.events import EventKind
from lightning_nanguard.detect.spikes import SpikeDetector, SpikeStats

__all__ = ["GRAD_NORM_MIN_RATIO", "SpikeSettings", "SpikeWatch"]

GRAD_NORM_MIN_RATIO = 100.0  # measured: 17 false alarms over 37 healthy runs at 3x, none at 100x (docs/spikes.md)


@dataclass(frozen=True)
class SpikeSettings:
    """The detector's parameters (the ``NanGuard`` ``spike_*`` arguments; defaults are ``SpikeDetector``'s)."""

    window: int = default_of(SpikeDetector, "window")
    warmup: int = default_of(SpikeDetector, "warmup")
    sigmas: float = default_of(SpikeDetector, "sigmas")
    min_ratio: float = default_of(SpikeDetector, "min_ratio")
    rebaseline_after: int = default_of(SpikeDetector, "rebaseline_after")

    def detector(self, name: str) -> SpikeDetector:
        """A fresh detector watching ``name``.

        The gradient norm jumps tenfold and more on healthy runs (full-batch Adam) while the loss
        stays flat: its detector needs a spike of at least ``GRAD_NORM_MIN_RATIO`` times the median.
        """
        return SpikeDetector(
            window=self.window,
            warmup=self.warmup,
            sigmas=self.sigmas,
            min_ratio=max(self.min_ratio, GRAD_NORM_MIN_RATIO) if name == "grad_norm" else self.min_ratio,
            rebaseline_after=self.rebaseline_after,
            name=name,
        )


class SpikeWatch:
    """The step loss's detector and, optionally, the gradient norm's (see module docs).

    Args:
        settings: detector parameters.
        watch_grad_norm: also watch the gradient norm (only where it is computed on every step).
    """

    def __init__(self, settings: SpikeSettings, watch_grad_norm: bool = False) -> None:
        self.settings = settings
        self.loss = settings.detector("loss")
        self.grad_norm = settings.detector("grad_norm") if watch_grad_norm else None
        self._checked: list[SpikeDetector] = []
        self._loss_only = [self.loss]  # what a check of the loss alone checked (shared, never changed)

    @classmethod
    def reconfigured(
        cls, current: SpikeWatch | None, settings: SpikeSettings | None, with_norm: bool, saved: dict[str, Any]
    ) -> SpikeWatch | None:
        """The watch for new ``settings``: ``current`` when nothing changed (its history kept), else a new one.

        A new watch starts from ``current``'s state, or from ``saved`` (loaded before any watch existed).
        """
        if settings is None:
            return None
        if current is not None and current.settings == settings and (current.grad_norm is not None) == with_norm:
            return current
        watch = cls(settings, watch_grad_norm=with_norm)
        watch.load_state_dict(current.state_dict() if current is not None else saved)
        return watch

    def check(self, loss: Tensor | float | None, grad_norm: Tensor | float | None = None) -> Tensor | bool | None:
        """The step's spike flag on the device (``None`` when nothing was checked); no host read.

        Values already read to the host (floats, or ``None``) are compared there: the flag is a
        ``bool`` and no kernel runs.
        """
        if not isinstance(loss, Tensor) and not isinstance(grad_norm, Tensor):
            norm = self.grad_norm
            if grad_norm is None or norm is None:  # the loss alone (most steps): no list made
                self._checked = self._loss_only if loss is not None else []
                return loss is not None and self.loss.check_value(loss)
            spike = norm.check_value(grad_norm)
            if loss is None:
                self._checked = [norm]
                return spike
            self._checked = [self.loss, norm]
            return self.loss.check_value(loss) or spike
        self._checked = []
        flags: list[Tensor] = []
        for detector, value in ((self.loss, loss), (self.grad_norm, grad_norm)):
            if detector is not None and isinstance(value, Tensor):
                flags.append(detector.check(value))
                self._checked.append(detector)
        if not flags:
            return None
        return flags[0] if len(flags) == 1 else torch.maximum(flags[0], flags[1])

    def accept(self, healthy: bool, loss: float | None = None, grad_norm: float | None = None) -> None:
        """After the shared decision: the checked values enter the history only if the step was healthy.

        ``loss`` and ``grad_norm`` are the checked values as read with the step's flags (nothing is
        read here then). The detectors still describe this check until the next one.
        """
        checked = self._checked
        if checked is self._loss_only:  # the loss alone (most steps)
            self.loss.accept(healthy, loss)
            return
        for detector in checked:
            detector.accept(healthy, value=loss if detector is self.loss else grad_norm)

    def rebaseline(self) -> None:
        """Several spikes in a row: a real level shift. Start the statistics over."""
        for detector in (self.loss, self.grad_norm):
            if detector is not None:
                detector.reset()

    # ------------------------------------------------------------------ bad path (host reads)

    def _spiked(self) -> list[tuple[SpikeDetector, SpikeStats]]:
        found = []
        for detector in self._checked:
            stats = detector.stats()
            if stats.value is not None and math.isfinite(stats.value) and stats.value > stats.threshold:
                found.append((detector, stats))
        return found

    def spike_kinds(self) -> tuple[EventKind, ...]:
        """``("loss_spike",)``, ``("grad_spike",)``, both or none, for the values of this step."""
        kinds: dict[str, EventKind] = {"loss": "loss_spike", "grad_norm": "grad_spike"}
        return tuple(kinds[detector.name] for detector, _ in self._spiked())

    def loss_threshold(self) -> float | None:
        """The loss above which a (sub-)batch counts as a spike, when the loss spiked."""
        return next((stats.threshold for detector, stats in self._spiked() if detector.name == "loss"), None)

    def details(self) -> dict[str, Any]:
        """The event's details: per watched value that spiked, its value, threshold and statistic.

        The loss's are at the top level (``threshold``, ``baseline``, ``spread``, ``ratio``, ...); the
        gradient norm's under ``grad_norm_spike``.
        """
        details: dict[str, Any] = {}
        for detector, stats in self._spiked():
            values = {**stats.details(), "value": stats.value}
            if detector.name == "loss":
                details.update(values)
            else:
                details["grad_norm_spike"] = values
        return details

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Both detectors' histories (primitives)."""
        state = {"loss": self.loss.state_dict()}
        if self.grad_norm is not None:
            state["grad_norm"] = self.grad_norm.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; missing keys leave a detector empty."""
        self.loss.load_state_dict(state.get("loss", {}))
        if self.grad_norm is not None:
            self.grad_norm.load_state_dict(state.get("grad_norm", {}))
