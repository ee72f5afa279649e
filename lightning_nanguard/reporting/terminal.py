"""Terminal report of an event, rendered with rich and prefixed with the process rank."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from lightning_nanguard.events import NanEvent
from lightning_nanguard.reporting.text import event_lines, event_text

__all__ = ["TerminalReporter"]

log = logging.getLogger("lightning_nanguard")


class TerminalReporter:
    """Prints one concise panel per event to stderr and logs the same text at WARNING level.

    Args:
        rank: global rank shown in the panel title.
        file: stream to print to (default ``sys.stderr`` at print time, so pytest's capture works).

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> TerminalReporter(rank=1, file=out).report(NanEvent(2, 0, 2, 1, ("loss",), "skipped"))
        >>> "[rank 1] NanGuard" in out.getvalue()
        True
    """

    def __init__(self, rank: int = 0, file: TextIO | None = None) -> None:
        self.rank = rank
        self.file = file

    def report(self, event: NanEvent) -> None:
        """Render ``event``; also sent to the ``lightning_nanguard`` logger for log files."""
        table = Table.grid(padding=(0, 1))
        table.add_column(style="bold")
        table.add_column(overflow="fold")
        for label, value in event_lines(event):
            table.add_row(Text(label), Text(value))  # Text: no markup parsing of '[5, 23]'
        console = Console(file=self.file or sys.stderr, highlight=False, soft_wrap=False)
        title = Text(f"[rank {self.rank}] NanGuard", style="bold red")
        body = Group(Text(event.headline(), style="bold"), table)
        console.print(Panel(body, title=title, title_align="left", expand=False))
        log.debug("[rank %d] %s", self.rank, event_text(event))
