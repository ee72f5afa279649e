r"""A run's events from ``nanguard/events.jsonl``, sorted, with what the dashboard adds.

Each event is the JSON object exactly as ``NanEvent.to_dict()`` wrote it (NaN/Inf as the strings
``"nan"``, ``"inf"``, ``"-inf"``), plus one key, ``"_dashboard"``::

    {"index": position in the sorted list (the id the other routes take),
     "bundle": "present" | "pruned" | "none",  (the repro bundle directory of the step exists / was
                                                 pruned since / was never saved)
     "context": whether the event has an incident directory (source lines, stack, thumbnails)}

Every rank's events are kept, sorted by ``(global_step, rank)`` (file order among equals); lines
that are not a complete JSON object (the half-written last line of a live run) are skipped. The
parsed file is cached until its size or modification time changes.

Example:
    >>> import json, os, tempfile
    >>> run_dir = tempfile.mkdtemp()
    >>> os.makedirs(os.path.join(run_dir, "nanguard"))
    >>> with open(os.path.join(run_dir, "nanguard", "events.jsonl"), "w") as f:
    ...     _ = f.write(json.dumps({"global_step": 5, "rank": 1, "repro_path": "/elsewhere"}) + "\n")
    ...     _ = f.write(json.dumps({"global_step": 5, "rank": 0, "repro_path": None}) + "\n")
    ...     _ = f.write('{"global_step": 9, "ra')
    >>> events = IncidentStore().events(RunLocation("run", run_dir, run_dir))
    >>> [(e["global_step"], e["rank"], e["_dashboard"]["bundle"]) for e in events]
    [(5, 0, 'none'), (5, 1, 'pruned')]
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from lightning_nanguard_tensorboard.layout import INCIDENTS_DIRNAME, bundle_dirname, incident_dirname
from lightning_nanguard_tensorboard.runs import RunLocation

__all__ = ["DASHBOARD_KEY", "IncidentStore", "parse_events", "step_and_rank"]

DASHBOARD_KEY = "_dashboard"


def step_and_rank(event: dict[str, Any]) -> tuple[int, int] | None:
    """``(global_step, rank)`` of a parsed line, or ``None`` when it is not an event.

    Example:
        >>> step_and_rank({"global_step": 3}), step_and_rank({"global_step": "3"})
        ((3, 0), None)
    """
    step, rank = event.get("global_step"), event.get("rank", 0)
    if isinstance(step, bool) or not isinstance(step, int) or isinstance(rank, bool) or not isinstance(rank, int):
        return None
    return step, rank


def parse_events(text: str) -> list[dict[str, Any]]:
    """The events of an ``events.jsonl`` text, in file order; incomplete or foreign lines skipped."""
    events = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a half-written line of a run still training, or a corrupt one
        if isinstance(event, dict) and step_and_rank(event) is not None:
            events.append(event)
    return events


def _listdir(path: str | None) -> set[str]:
    if path is None:
        return set()
    try:
        return set(os.listdir(path))
    except OSError:
        return set()


def _annotate(run: RunLocation, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    events = sorted(events, key=lambda e: step_and_rank(e) or (0, 0))
    bundles = _listdir(run.path())
    incidents = _listdir(run.path(INCIDENTS_DIRNAME))
    seen: dict[tuple[int, int], int] = {}
    for index, event in enumerate(events):
        step, rank = step_and_rank(event) or (0, 0)
        seen[(step, rank)] = occurrence = seen.get((step, rank), 0) + 1
        if event.get("repro_path"):
            bundle = "present" if bundle_dirname(step, rank) in bundles else "pruned"
        else:
            bundle = "none"
        event[DASHBOARD_KEY] = {
            "index": index,
            "bundle": bundle,
            "context": incident_dirname(step, rank, occurrence) in incidents,
        }
    return events


def _mtime(path: str | None) -> int:
    try:
        return os.stat(path).st_mtime_ns if path is not None else 0
    except OSError:
        return 0


class IncidentStore:
    """Parsed and annotated events per run (thread-safe).

    Re-read when ``events.jsonl`` changes, re-annotated when a bundle or incident directory appears
    or disappears (their parent directories' modification times change).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[tuple[int, ...], list[dict[str, Any]]]] = {}

    def events(self, run: RunLocation) -> list[dict[str, Any]]:
        """The run's events (a shared list: callers must not modify it)."""
        path = run.path(os.path.basename(run.events_path))
        if path is None:
            return []
        try:
            stat = os.stat(path)
        except OSError:
            return []
        signature = (stat.st_size, stat.st_mtime_ns, _mtime(run.path()), _mtime(run.path(INCIDENTS_DIRNAME)))
        with self._lock:
            cached = self._cache.get(path)
            if cached is not None and cached[0] == signature:
                return cached[1]
        with open(path, encoding="utf-8", errors="replace") as handle:
            events = _annotate(run, parse_events(handle.read()))
        with self._lock:
            self._cache[path] = (signature, events)
        return events

    def event(self, run: RunLocation, index: int) -> dict[str, Any] | None:
        events = self.events(run)
        return events[index] if 0 <= index < len(events) else None
