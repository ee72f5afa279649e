"""Where events go: ``events.jsonl``, TensorBoard and the terminal. Each sink works without a Trainer."""

from lightning_nanguard.reporting.jsonl import JsonlEventLog, read_events
from lightning_nanguard.reporting.sinks import EventSinks
from lightning_nanguard.reporting.tensorboard import TensorBoardReporter
from lightning_nanguard.reporting.terminal import TerminalReporter
from lightning_nanguard.reporting.text import event_markdown, event_text

__all__ = [
    "EventSinks",
    "JsonlEventLog",
    "TensorBoardReporter",
    "TerminalReporter",
    "event_markdown",
    "event_text",
    "read_events",
]
