"""Where events go: ``events.jsonl``, TensorBoard and the terminal. Each sink works without a Trainer.

Trainer-free: where a run's events go and its scalars, through a front-end, is
:mod:`lightning_nanguard.engine.recording`. Repro bundles (:mod:`.repro`) are written and read here too.
"""

from lightning_nanguard.reporting.jsonl import JsonlEventLog, read_events
from lightning_nanguard.reporting.tensorboard import TensorBoardReporter
from lightning_nanguard.reporting.terminal import TerminalReporter
from lightning_nanguard.reporting.text import event_markdown, event_text

__all__ = [
    "JsonlEventLog",
    "TensorBoardReporter",
    "TerminalReporter",
    "event_markdown",
    "event_text",
    "read_events",
]
