"""``<log_dir>/nanguard/events.jsonl``: one JSON object (``NanEvent.to_dict()``) per line."""

from __future__ import annotations

import json
import os
from pathlib import Path

from lightning_nanguard.core.events import NanEvent

__all__ = ["EVENTS_FILENAME", "JsonlEventLog", "read_events"]

EVENTS_FILENAME = "events.jsonl"


class JsonlEventLog:
    """Appends events to a JSON-lines file, one line per event, created on first write.

    Each line is written with a single ``write`` on a file opened for appending, so lines from
    several processes sharing the file do not interleave.

    Examples:
        >>> import tempfile
        >>> log = JsonlEventLog(Path(tempfile.mkdtemp()) / "events.jsonl")
        >>> log.append(NanEvent(5, 0, 5, 0, ("loss",), "skipped", loss=float("inf")))
        >>> [event.loss for event in read_events(log.path)]
        [inf]
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def append(self, event: NanEvent) -> None:
        """Write ``event`` as one line (allow_nan=False: the dict is already JSON-safe)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(event.to_dict(), allow_nan=False, sort_keys=False) + "\n"
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(line)


def read_events(path: str | os.PathLike[str]) -> list[NanEvent]:
    """Parse an ``events.jsonl`` file back into events (blank lines are ignored)."""
    with open(path, encoding="utf-8") as handle:
        return [NanEvent.from_dict(json.loads(line)) for line in handle if line.strip()]
