"""TensorBoard output through an existing ``SummaryWriter`` (the Trainer's ``TensorBoardLogger``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.reporting.text import event_markdown

__all__ = ["CHARTS", "EVENT_TEXT_TAG", "SCALAR_TAGS", "TensorBoardReporter", "custom_scalars_layout"]

EVENT_TEXT_TAG = "nanguard/events"
SCALAR_TAGS: tuple[str, ...] = (
    "nanguard/grad_norm",
    "nanguard/bad_steps_total",
    "nanguard/skipped_total",
)
CHARTS: dict[str, str] = {
    "nanguard/grad_norm": "gradient norm",
    "nanguard/bad_steps_total": "bad steps",
    "nanguard/skipped_total": "skipped steps",
    "nanguard/spikes_total": "loss and gradient spikes",
    "nanguard/amp_overflow_total": "AMP overflows (skipped by the GradScaler)",
    "nanguard/rollbacks_total": "rollbacks",
    "nanguard/remedies_total": "remedies applied",
}
"""Chart title of each ``nanguard/`` scalar tag, in the order the charts appear."""


def custom_scalars_layout(tags: Iterable[str] | None = None) -> dict[str, dict[str, list[Any]]]:
    """The "NanGuard" group of TensorBoard's custom-scalars dashboard: one chart per tag the run logs.

    One series per chart: counters such as ``bad_steps_total`` and ``skipped_total`` are often
    equal, and two equal series drawn in one chart hide each other.

    Args:
        tags: the scalar tags the run can log (default: every tag in :data:`CHARTS`). Tags under
            ``nanguard/`` that :data:`CHARTS` does not know get a chart titled by their name;
            other tags are ignored.

    Example:
        >>> charts = custom_scalars_layout(["nanguard/grad_norm", "nanguard/skipped_total"])["NanGuard"]
        >>> list(charts), charts["skipped steps"]
        (['gradient norm', 'skipped steps'], ['Multiline', ['nanguard/skipped_total']])
    """
    wanted = list(CHARTS) if tags is None else list(dict.fromkeys(tags))
    ordered = [t for t in CHARTS if t in wanted] + [t for t in wanted if t not in CHARTS and t.startswith("nanguard/")]
    charts = {CHARTS.get(tag, tag.removeprefix("nanguard/").replace("_", " ")): ["Multiline", [tag]] for tag in ordered}
    return {"NanGuard": charts}


class TensorBoardReporter:
    """Writes NanGuard scalars, event reports and the dashboard layout to a ``SummaryWriter``.

    Args:
        writer: a ``torch.utils.tensorboard.SummaryWriter`` (e.g. ``TensorBoardLogger.experiment``).

    Example:
        >>> import tempfile
        >>> from torch.utils.tensorboard import SummaryWriter
        >>> reporter = TensorBoardReporter(SummaryWriter(tempfile.mkdtemp()))
        >>> reporter.register_layout()
        >>> reporter.report(NanEvent(3, 0, 3, 0, ("loss",), "skipped"))
    """

    def __init__(self, writer: Any) -> None:
        self.writer = writer
        self._layout_registered = False

    def register_layout(self, tags: Iterable[str] | None = None) -> None:
        """Register the custom-scalars layout for the scalar ``tags`` the run can log (once per writer).

        Args:
            tags: see :func:`custom_scalars_layout` (default: every NanGuard tag).
        """
        if not self._layout_registered:
            self.writer.add_custom_scalars(custom_scalars_layout(tags))
            self._layout_registered = True

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        """Write scalar values (tags already under ``nanguard/``)."""
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def report(self, event: NanEvent) -> None:
        """Write the markdown report of ``event`` as text and flush so it survives a crash."""
        self.writer.add_text(EVENT_TEXT_TAG, event_markdown(event), event.global_step)
        self.writer.flush()
