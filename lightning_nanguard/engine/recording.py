"""The Lightning side of :mod:`lightning_nanguard.reporting`: a run's events, where they go, and its scalars.

:class:`EventSinks` resolves, once per fit, where events go from the Trainer (its log directory,
its ``TensorBoardLogger``s, its progress bar); :class:`IncidentRecorder` keeps the run's events,
sends each to those sinks and logs the ``nanguard/`` scalars through the Trainer's loggers.

Example:
    >>> recorder = IncidentRecorder(verbose=False)
    >>> recorder.events
    []
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from torch import nn

from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.engine.rows.samples import bundle_samples, context_samples
from lightning_nanguard.reporting.context import save_incident_context
from lightning_nanguard.reporting.jsonl import EVENTS_FILENAME, JsonlEventLog
from lightning_nanguard.reporting.notices import RankNotices
from lightning_nanguard.reporting.repro import prune_bundles, save_bundle, update_bundle_event
from lightning_nanguard.reporting.scalars import ScalarLog, scalar_tags
from lightning_nanguard.reporting.tensorboard import TensorBoardReporter
from lightning_nanguard.reporting.terminal import TerminalReporter
from lightning_nanguard.trainer._compat import TENSORBOARD_LOGGER_TYPES

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lightning_nanguard.engine.incident.diagnosis import DiagnosisSettings, StepDiagnosis

__all__ = ["Count", "EventSinks", "IncidentRecorder", "show_in_progress_bar"]

log = logging.getLogger(__name__)

PROGRESS_BAR_KEY = "nan_skipped"


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


class Count(int):
    """An ``int`` that reads as one in any progress bar: the rich bar formats every number with ``.3f``.

    Example:
        >>> f"{Count(8):.3f}", f"{Count(8):.3g}", Count(8) + 1
        ('8', '8', 9)
    """

    def __format__(self, spec: str) -> str:
        return str(int(self))


def show_in_progress_bar(trainer: Any, key: str, value: int) -> None:
    """Show a count in the progress bar as ``8``, not ``8.000`` (what ``self.log`` gives: a float).

    Lightning keeps the bar's values in its logger connector; a value put there is shown as is and
    stays until the key is logged again. Without that attribute nothing is shown.
    """
    connector = getattr(trainer, "_logger_connector", None)
    metrics = getattr(connector, "_progress_bar_metrics", None)
    if isinstance(metrics, dict):
        metrics[key] = Count(value)


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
    def events_path(self) -> Any:
        """Path of ``events.jsonl`` once attached."""
        return self.sinks.jsonl.path if self.sinks.jsonl is not None else None

    def attach(self, trainer: Trainer, tags: Sequence[str]) -> None:
        """Resolve the log directory and writers (a collective: every rank calls it) for ``tags``."""
        self.rank = trainer.global_rank
        self.notices.rank, self.notices.world_size = trainer.global_rank, trainer.world_size
        self.sinks.attach(trainer, tags)
        self._scalars = ScalarLog(tags)

    def logging_due(self, trainer: Trainer) -> bool:
        """Whether the Trainer logs metrics at this step."""
        return self.sinks.logging_due(trainer)

    def record(self, trainer: Trainer | None, event: NanEvent) -> None:
        """Keep ``event`` and send it everywhere (only kept when checked outside a Trainer: ``guard.check``)."""
        self.events.append(event)
        if trainer is not None:
            self.sinks.event(event, trainer.global_rank, trainer)

    def scalars(
        self,
        trainer: Trainer,
        metrics: Mapping[str, float | None],
        previous: Mapping[str, float | None] | None = None,
        force: bool = False,
        due: bool | None = None,
    ) -> None:
        """Log the ``nanguard/`` scalars at logging steps, or now (``force`` or an incident: ``previous`` given).

        ``due`` says whether the step is a logging step when the Trainer has moved on since (a step
        resolved late); by default the Trainer is asked.
        """
        if self._scalars is None or not trainer.is_global_zero:
            return
        if force or previous is not None or (due if due is not None else self.logging_due(trainer)):
            for step, values in self._scalars.plan(metrics, trainer.global_step, previous=previous):
                self.sinks.write_scalars(trainer, values, step)

    def save_incident_files(
        self,
        pl_module: nn.Module,
        found: StepDiagnosis,
        settings: DiagnosisSettings,
        module_state: Mapping[str, Any] | str | None = None,
    ) -> NanEvent:
        """Write a bad step's dashboard context and (with ``save_repro``) its repro bundle; never raises.

        ``module_state``: the state to save instead of ``pl_module.state_dict()`` (a sharded model's
        gathered state), or why there is none. Returns the event, with ``repro_path`` when a bundle
        was saved.
        """
        event, micro = found.event, found.micro_batch
        directory = self.sinks.nanguard_dir
        if directory is None or micro is None:
            return event
        localization = found.diagnosis.localization if found.diagnosis is not None else None
        source_path = getattr(localization, "source_path", None)
        context_batch, context_positions = context_samples(event, micro)  # one loader's part with several
        save_incident_context(directory, event, source_path, context_batch, context_positions)
        if settings.save_repro and settings.max_repro_bundles > 0:
            max_bundles, root = settings.max_repro_bundles, settings.source_root
            event = _save_bundle(pl_module, found, directory, max_bundles, root, module_state)
        return event

    @staticmethod
    def progress(trainer: Trainer, skipped_total: int) -> None:
        """``nan_skipped`` in the progress bar, as an integer."""
        if skipped_total:
            show_in_progress_bar(trainer, PROGRESS_BAR_KEY, skipped_total)


def default_tags() -> list[str]:
    """Every tag the guard may log (a recorder used without a Trainer configuration)."""
    return scalar_tags("rollback", ("clip_grad",), has_scaler=True, spikes=True)


def _save_bundle(
    pl_module: nn.Module,
    found: StepDiagnosis,
    directory: str,
    max_bundles: int,
    source_root: str | None,
    module_state: Mapping[str, Any] | str | None = None,
) -> NanEvent:
    """Save the offending samples (or the whole batch) of the step's diagnosed micro-batch; never raises.

    Known-good samples are saved next to them (see
    :func:`~lightning_nanguard.engine.rows.samples.bundle_samples`); with several training loaders
    the bundle records the layout and each saved sample's loader.
    """
    event, micro = found.event, found.micro_batch
    assert micro is not None
    try:
        chosen = bundle_samples(event, micro, found.diagnosis, found.slicer)
        full = found.diagnosis.full_details if found.diagnosis is not None else None
        path = save_bundle(
            directory,
            event,
            pl_module,
            chosen.samples,
            micro.batch_idx,
            chosen.positions,
            chosen.dataset_indices,
            chosen.reference,
            full,
            source_root,
            module_state=module_state,
            layout=chosen.layout,
            sample_loaders=chosen.sample_loaders,
            reference_batch=found.reference_batch if event.cause == "batch" else None,  # the verdict's evidence
        )
        prune_bundles(directory, max_bundles)
    except Exception as error:  # a bundle must never kill training
        log.warning("NanGuard: could not save the repro bundle: %r", error)
        return event
    return event.replace(repro_path=str(path)) if Path(path).exists() else event
