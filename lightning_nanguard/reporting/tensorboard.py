"""TensorBoard output through an existing ``SummaryWriter`` (the Trainer's ``TensorBoardLogger``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_nanguard.events import NanEvent
from lightning_nanguard.reporting.text import event_markdown

__all__ = ["EVENT_TEXT_TAG", "SCALAR_TAGS", "TensorBoardReporter", "custom_scalars_layout"]

EVENT_TEXT_TAG = "nanguard/events"
SCALAR_TAGS: tuple[str, ...] = (
    "nanguard/grad_norm",
    "nanguard/bad_steps_total",
    "nanguard/skipped_total",
)


def custom_scalars_layout() -> dict[str, dict[str, list[Any]]]:
    """The "NanGuard" group of TensorBoard's custom-scalars dashboard.

    Example:
        >>> list(custom_scalars_layout())
        ['NanGuard']
    """
    return {
        "NanGuard": {
            "gradient norm": ["Multiline", ["nanguard/grad_norm"]],
            "bad steps": ["Multiline", ["nanguard/bad_steps_total", "nanguard/skipped_total"]],
            "recovery": ["Multiline", [r"nanguard/(rollbacks|remedies|amp_overflow)_total"]],
        }
    }


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

    def register_layout(self) -> None:
        """Register the custom-scalars layout (once per writer)."""
        if not self._layout_registered:
            self.writer.add_custom_scalars(custom_scalars_layout())
            self._layout_registered = True

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        """Write scalar values (tags already under ``nanguard/``)."""
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def report(self, event: NanEvent) -> None:
        """Write the markdown report of ``event`` as text and flush so it survives a crash."""
        self.writer.add_text(EVENT_TEXT_TAG, event_markdown(event), event.global_step)
        self.writer.flush()
