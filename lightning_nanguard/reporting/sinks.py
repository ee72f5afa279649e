"""All the places an event goes during training, resolved once per fit from the Trainer."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from rich.console import Console

from lightning_nanguard._compat import TENSORBOARD_LOGGER_TYPES
from lightning_nanguard.events import NanEvent
from lightning_nanguard.reporting.jsonl import EVENTS_FILENAME, JsonlEventLog
from lightning_nanguard.reporting.tensorboard import TensorBoardReporter
from lightning_nanguard.reporting.terminal import TerminalReporter

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = ["EventSinks"]


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

    def attach(self, trainer: Trainer) -> None:
        """Resolve the log directory (a collective: every rank must call this) and the writers."""
        self.log_dir = trainer.log_dir or trainer.default_root_dir
        self.jsonl = JsonlEventLog(os.path.join(self.log_dir, "nanguard", EVENTS_FILENAME))
        self.tensorboard = []
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                if isinstance(logger, TENSORBOARD_LOGGER_TYPES):
                    reporter = TensorBoardReporter(logger.experiment)
                    reporter.register_layout()
                    self.tensorboard.append(reporter)

    def event(self, event: NanEvent, rank: int, trainer: Trainer | None = None) -> None:
        """Send one event everywhere."""
        if self.jsonl is not None:
            self.jsonl.append(event)
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

    def scalars(self, trainer: Trainer, metrics: Mapping[str, float], force: bool = False) -> None:
        """Log ``metrics`` through every Trainer logger, on logging steps (or always with ``force``)."""
        if (force or self.logging_due(trainer)) and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(dict(metrics), step=trainer.global_step)
