"""The guard's record of a run: its events, where they go, and the ``nanguard/`` scalars.

Example:
    >>> recorder = IncidentRecorder(verbose=False)
    >>> recorder.events
    []
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lightning_nanguard.events import NanEvent
from lightning_nanguard.reporting.notices import RankNotices
from lightning_nanguard.reporting.scalars import ScalarLog, scalar_tags
from lightning_nanguard.reporting.sinks import EventSinks

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = ["Count", "IncidentRecorder", "show_in_progress_bar"]

PROGRESS_BAR_KEY = "nan_skipped"


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

    @staticmethod
    def progress(trainer: Trainer, skipped_total: int) -> None:
        """``nan_skipped`` in the progress bar, as an integer."""
        if skipped_total:
            show_in_progress_bar(trainer, PROGRESS_BAR_KEY, skipped_total)


def default_tags() -> list[str]:
    """Every tag the guard may log (a recorder used without a Trainer configuration)."""
    return scalar_tags("rollback", ("clip_grad",), has_scaler=True, spikes=True)
