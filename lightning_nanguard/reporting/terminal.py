"""Terminal report of an event, rendered with rich and prefixed with the process rank."""

from __future__ import annotations

import io
import logging
import sys
from collections.abc import Callable
from typing import TextIO

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.reporting.text import event_lines, event_text

__all__ = ["TerminalReporter"]

log = logging.getLogger("lightning_nanguard")


class TerminalReporter:
    """Prints one concise panel per event and logs the same text at DEBUG level.

    Args:
        rank: global rank shown in the panel title.
        file: stream to print to (default ``sys.stderr`` at print time, so pytest's capture works).
        console: a rich ``Console`` to print through (e.g. the one a live progress bar renders on,
            so the panel appears above the bar instead of glued to it).
        write: a function taking the rendered text (e.g. a TQDM progress bar's ``print``).

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> TerminalReporter(rank=1, file=out).report(NanEvent(2, 0, 2, 1, ("loss",), "skipped"))
        >>> "[rank 1] NanGuard" in out.getvalue()
        True
    """

    def __init__(
        self,
        rank: int = 0,
        file: TextIO | None = None,
        console: Console | None = None,
        write: Callable[[str], None] | None = None,
    ) -> None:
        self.rank = rank
        self.file = file
        self.console = console
        self.write = write

    def panel(self, event: NanEvent) -> Panel:
        """The rich renderable of ``event``."""
        table = Table.grid(padding=(0, 1))
        table.add_column(style="bold")
        table.add_column(overflow="fold")
        for label, value in event_lines(event):
            table.add_row(Text(label), Text(value))  # Text: no markup parsing of '[5, 23]'
        title = Text(f"[rank {self.rank}] NanGuard", style="bold red")
        body = Group(Text(event.headline(), style="bold"), table)
        return Panel(body, title=title, title_align="left", expand=False)

    def report(self, event: NanEvent) -> None:
        """Render ``event``; the plain text also goes to the ``lightning_nanguard`` logger (DEBUG)."""
        panel = self.panel(event)
        if self.console is not None:
            self.console.print(panel)
        elif self.write is not None:
            buffer = io.StringIO()
            Console(file=buffer, highlight=False, width=100).print(panel)
            self.write(buffer.getvalue().rstrip("\n"))
        else:
            Console(file=self.file or sys.stderr, highlight=False, soft_wrap=False).print(panel)
        log.debug("[rank %d] %s", self.rank, event_text(event))
