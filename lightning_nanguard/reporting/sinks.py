"""All the places an event goes during training, resolved once per fit from the Trainer."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from rich.console import Console

from lightning_nanguard._compat import TENSORBOARD_LOGGER_TYPES
from lightning_nanguard.events import NanEvent
from lightning_nanguard.reporting.jsonl import EVENTS_FILENAME, JsonlEventLog
from lightning_nanguard.reporting.tensorboard import TensorBoardReporter
from lightning_nanguard.reporting.terminal import TerminalReporter
from lightning_nanguard.repro import update_bundle_event

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = ["EventSinks"]

log = logging.getLogger(__name__)


def _terminal(rank: int, trainer: Trainer | None) -> TerminalReporter:
    """A reporter printing through the live progress bar, if any, so the panel does not tear it."""
    bar = getattr(trainer, "progress_bar_callback", None) if trainer is not None else None
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

    def __init__(self, verbose: bool = True) -> None:
        self.verbose = verbose
        self.log_dir: str | None = None
        self.jsonl: JsonlEventLog | None = None
        self.tensorboard: list[TensorBoardReporter] = []

    @property
    def nanguard_dir(self) -> str | None:
        """``<log_dir>/nanguard``, where events and repro bundles go."""
        return os.path.join(self.log_dir, "nanguard") if self.log_dir is not None else None

    def attach(self, trainer: Trainer, tags: Sequence[str] | None = None) -> None:
        """Resolve the log directory (a collective: every rank must call this) and the writers.

        The log directory is the first ``TensorBoardLogger``'s (so a run's incidents sit with its
        scalars), else the Trainer's ``log_dir`` (its first logger's), else ``default_root_dir``.
        ``tags`` are the scalar tags the run can log (the custom-scalars layout shows only those).
        """
        self.log_dir = _log_dir(trainer)
        self.jsonl = JsonlEventLog(os.path.join(self.log_dir, "nanguard", EVENTS_FILENAME))
        self.tensorboard = []
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                if isinstance(logger, TENSORBOARD_LOGGER_TYPES):
                    reporter = TensorBoardReporter(logger.experiment)
                    reporter.register_layout(tags)
                    self.tensorboard.append(reporter)

    def event(self, event: NanEvent, rank: int, trainer: Trainer | None = None) -> None:
        """Send one event everywhere, its repro bundle included (saved before the step's decision)."""
        if self.jsonl is not None:
            self.jsonl.append(event)
        try:
            update_bundle_event(event)
        except OSError as error:  # a bundle must never kill training
            log.warning("NanGuard: could not update the repro bundle of step %d: %r", event.global_step, error)
        if self.verbose:
            _terminal(rank, trainer).report(event)
        for reporter in self.tensorboard:
            reporter.report(event)

    @staticmethod
    def logging_due(trainer: Trainer) -> bool:
        """Whether the Trainer logs metrics at this step (``log_every_n_steps``)."""
        if not trainer.loggers:
            return False
        connector = getattr(trainer, "_logger_connector", None)
        return bool(connector.should_update_logs) if connector is not None else True

    @staticmethod
    def write_scalars(trainer: Trainer, metrics: Mapping[str, float], step: int) -> None:
        """Log ``metrics`` at ``step`` through every Trainer logger (rank zero only)."""
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(dict(metrics), step=step)


def _log_dir(trainer: Trainer) -> str:
    """The first TensorBoardLogger's ``log_dir``, else ``trainer.log_dir``, else ``default_root_dir``.

    Rank zero's answer, broadcast (one collective on every rank, as ``trainer.log_dir`` does), so
    that every rank writes to the same directory.
    """
    board = next((lg for lg in trainer.loggers if isinstance(lg, TENSORBOARD_LOGGER_TYPES)), None)
    if board is None:
        return str(trainer.log_dir or trainer.default_root_dir)
    return str(trainer.strategy.broadcast(board.log_dir))
