"""A run's events, where they go, and its scalars: :mod:`lightning_nanguard.reporting` wired to a front-end.

:class:`EventSinks` resolves, once per fit, where events go from the front-end (its log directory,
its TensorBoard writers, its progress bar); :class:`IncidentRecorder` keeps the run's events,
sends each to those sinks and logs the ``nanguard/`` scalars through the front-end's loggers.
Every sink is an optional part of the guard (:mod:`lightning_nanguard.engine.parts`): a full disk,
a logger that raises or a broken progress bar switches off that sink alone, never the guard.

Example:
    >>> recorder = IncidentRecorder(verbose=False)
    >>> recorder.events
    []
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console

from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.engine.parts import GuardParts
from lightning_nanguard.reporting.jsonl import EVENTS_FILENAME, JsonlEventLog
from lightning_nanguard.reporting.notices import RankNotices
from lightning_nanguard.reporting.repro import update_bundle_event
from lightning_nanguard.reporting.scalars import ScalarLog, scalar_tags
from lightning_nanguard.reporting.tensorboard import TensorBoardReporter
from lightning_nanguard.reporting.terminal import TerminalReporter

if TYPE_CHECKING:
    from lightning_nanguard.engine.frontend import FrontEnd

__all__ = ["EVENTS_KEPT_IN_CHECKPOINT", "Count", "EventSinks", "IncidentRecorder"]

log = logging.getLogger(__name__)

PROGRESS_BAR_KEY = "nan_skipped"
PARTS_OFF_KEY = "nanguard_parts_off"  # how many optional parts are off after an error (guard_error events)
EVENTS_KEPT_IN_CHECKPOINT = 100
"""How many of the last events a checkpoint keeps (:meth:`IncidentRecorder.state_dict`)."""


def _terminal(rank: int, front: FrontEnd | None) -> TerminalReporter:
    """A reporter printing through the live progress bar, if any, so the panel does not tear it."""
    bar = front.progress_bar if front is not None else None
    if bar is None or not bar.is_enabled:
        return TerminalReporter(rank=rank)
    console = getattr(bar, "_console", None)  # RichProgressBar renders on its own rich Console
    if isinstance(console, Console):
        return TerminalReporter(rank=rank, console=console)
    return TerminalReporter(rank=rank, write=bar.print)


class EventSinks:
    """``events.jsonl`` (every rank), TensorBoard text and scalars (rank zero), terminal (every rank).

    Args:
        verbose: print a terminal report per event.
    """

    def __init__(self, verbose: bool = True, parts: GuardParts | None = None) -> None:
        self.verbose = verbose
        self.parts = parts if parts is not None else GuardParts()
        self.log_dir: str | None = None
        self.jsonl: JsonlEventLog | None = None
        self.tensorboard: list[TensorBoardReporter] = []

    @property
    def nanguard_dir(self) -> str | None:
        """``<log_dir>/nanguard``, where events and repro bundles go."""
        return os.path.join(self.log_dir, "nanguard") if self.log_dir is not None else None

    def attach(self, front: FrontEnd, tags: Sequence[str] | None = None) -> None:
        """Resolve the log directory (a collective: every rank must call this) and the writers.

        The log directory is the front-end's (the Trainer's: its first ``TensorBoardLogger``'s, so a
        run's incidents sit with its scalars). ``tags`` are the scalar tags the run can log (the
        custom-scalars layout shows only those). A log directory that cannot be found (a logger whose
        ``log_dir`` raises) switches off the files (``events_file``, and with it the bundles).
        """
        self.log_dir = self.parts.run("events_file", front.log_dir)
        self.jsonl = None
        if self.log_dir is not None:
            self.jsonl = JsonlEventLog(os.path.join(self.log_dir, "nanguard", EVENTS_FILENAME))
        self.tensorboard = []
        if front.is_global_zero:
            self.parts.run("tensorboard", self._open_tensorboard, front, tags)

    def _open_tensorboard(self, front: FrontEnd, tags: Sequence[str] | None) -> None:
        for writer in front.tensorboard_writers():
            reporter = TensorBoardReporter(writer)
            reporter.register_layout(tags)
            self.tensorboard.append(reporter)

    def event(self, event: NanEvent, rank: int, front: FrontEnd | None = None) -> None:
        """Send one event to every sink still on, its repro bundle included (saved before the step's decision)."""
        parts = self.parts
        if self.jsonl is not None:
            parts.run("events_file", self.jsonl.append, event)
        if event.repro_path is not None:
            parts.run("bundles", update_bundle_event, event)
        if self.verbose:
            parts.run("terminal", lambda: _terminal(rank, front).report(event))
        for reporter in self.tensorboard:
            parts.run("tensorboard", reporter.report, event)

    def write_scalars(self, front: FrontEnd, metrics: Mapping[str, float], step: int) -> None:
        """Log ``metrics`` at ``step`` through every logger of the front-end (rank zero only)."""
        if front.is_global_zero:
            self.parts.run("scalars", _log_metrics, front.loggers, dict(metrics), step)


def _log_metrics(loggers: Sequence[Any], metrics: dict[str, float], step: int) -> None:
    for logger in loggers:
        logger.log_metrics(metrics, step=step)


class Count(int):
    """An ``int`` that reads as one in any progress bar: the rich bar formats every number with ``.3f``.

    Example:
        >>> f"{Count(8):.3f}", f"{Count(8):.3g}", Count(8) + 1
        ('8', '8', 9)
    """

    def __format__(self, spec: str) -> str:
        return str(int(self))


class IncidentRecorder:
    """Keeps ``events`` and sends each to ``events.jsonl``, TensorBoard and the terminal.

    Args:
        verbose: print a panel per event.
    """

    def __init__(self, verbose: bool = True) -> None:
        self.events: list[NanEvent] = []
        self.sinks = EventSinks(verbose)
        self.notices = RankNotices()
        self.rank = 0
        self._scalars: ScalarLog | None = None

    @property
    def parts(self) -> GuardParts:
        """The guard's parts (shared with the controller): each sink runs as one, off alone if it fails."""
        return self.sinks.parts

    @parts.setter
    def parts(self, parts: GuardParts) -> None:
        self.sinks.parts = parts

    @property
    def events_path(self) -> Any:
        """Path of ``events.jsonl`` once attached."""
        return self.sinks.jsonl.path if self.sinks.jsonl is not None else None

    def attach(self, front: FrontEnd, tags: Sequence[str]) -> None:
        """Resolve the log directory and writers (a collective: every rank calls it) for ``tags``."""
        self.rank = front.global_rank
        self.notices.rank, self.notices.world_size = front.global_rank, front.world_size
        self.sinks.attach(front, tags)
        self._scalars = ScalarLog(tags)

    def record(self, front: FrontEnd | None, event: NanEvent) -> None:
        """Keep ``event`` and send it everywhere (only kept when checked outside a fit: ``guard.check``)."""
        self.events.append(event)
        if front is not None:
            self.sinks.event(event, front.global_rank, front)

    def scalars(
        self,
        front: FrontEnd,
        metrics: Mapping[str, float | None],
        previous: Mapping[str, float | None] | None = None,
        force: bool = False,
        due: bool | None = None,
    ) -> None:
        """Log the ``nanguard/`` scalars at logging steps, or now (``force`` or an incident: ``previous`` given).

        ``due`` says whether the step is a logging step when the loop has moved on since (a step
        resolved late); by default the front-end is asked.
        """
        if force or previous is not None:
            logged = self._scalars is not None and front.is_global_zero
        else:
            logged = self.scalars_due(front, due)
        if logged:
            self.write_scalars(front, metrics, previous)

    def scalars_due(self, front: FrontEnd, due: bool | None = None) -> bool:
        """Whether a healthy step's :meth:`scalars` would log (``due``: as there)."""
        if self._scalars is None or not (due if due is not None else front.logging_due()):
            return False
        return front.is_global_zero

    def write_scalars(
        self, front: FrontEnd, metrics: Mapping[str, float | None], previous: Mapping[str, float | None] | None = None
    ) -> None:
        """Log the scalars now, once :meth:`scalars` or :meth:`scalars_due` has said they are due here."""
        assert self._scalars is not None
        self.parts.run("scalars", self._write_scalars, front, self._scalars, metrics, previous)

    @staticmethod
    def _write_scalars(
        front: FrontEnd,
        plan: ScalarLog,
        metrics: Mapping[str, float | None],
        previous: Mapping[str, float | None] | None,
    ) -> None:
        for step, values in plan.plan(metrics, front.global_step, previous=previous):
            _log_metrics(front.loggers, values, step)

    def progress(self, front: FrontEnd, skipped_total: int) -> None:
        """``nan_skipped`` in the progress bar, as an integer."""
        if skipped_total:
            self.parts.run("progress_bar", front.show_in_progress_bar, PROGRESS_BAR_KEY, skipped_total)

    def progress_parts_off(self, front: FrontEnd, count: int) -> None:
        """``nanguard_parts_off`` in the progress bar: how many of the guard's parts an error switched off."""
        self.parts.run("progress_bar", front.show_in_progress_bar, PARTS_OFF_KEY, count)

    def state_dict(self) -> dict[str, Any]:
        """``{"events": [...]}``: the last :data:`EVENTS_KEPT_IN_CHECKPOINT` events, as dicts (primitives)."""
        return {"events": [event.to_dict() for event in self.events[-EVENTS_KEPT_IN_CHECKPOINT:]]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (in place); without ``events`` there are none."""
        self.events[:] = [NanEvent.from_dict(summary) for summary in state.get("events", [])]


def default_tags() -> list[str]:
    """Every tag the guard may log (a recorder used without a Trainer configuration)."""
    return scalar_tags("rollback", ("clip_grad",), has_scaler=True, spikes=True)
