"""The check every test runs on the events it records: only ``details`` keys of ``DETAIL_KEYS``.

``tests/conftest.py`` wraps ``IncidentRecorder.record`` for each test (:func:`recorded_events`) and,
after it, fails the test with :func:`unregistered_message` when an event holds a key the registry
(and so ``docs/reference/events.md``) lacks, whatever made the event: the builder, a front-end, a
watch. The builder itself raises at once (``NANGUARD_STRICT_DETAIL_KEYS=1``, set by the conftest).

Example:
    >>> from lightning_nanguard.core.events import NanEvent
    >>> unregistered_keys([NanEvent(1, 0, 1, 0, ("loss",), "skipped", details={"batch_size": 4, "colour": 1})])
    ['colour']
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from lightning_nanguard.core.detail_keys import DETAIL_KEYS
from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.engine.recording import IncidentRecorder

__all__ = ["recorded_events", "unregistered_keys", "unregistered_message"]


def unregistered_keys(events: Iterable[NanEvent]) -> list[str]:
    """The ``details`` keys of ``events`` that ``DETAIL_KEYS`` does not hold, sorted."""
    return sorted({key for event in events for key in event.details if key not in DETAIL_KEYS})


def unregistered_message(keys: list[str]) -> str:
    return (
        f"details keys {keys} are not in DETAIL_KEYS: register them in lightning_nanguard/core/detail_keys.py "
        "and document them in docs/reference/events.md"
    )


@contextmanager
def recorded_events(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[NanEvent]]:
    """Every event an ``IncidentRecorder`` records in this process while inside, in order."""
    events: list[NanEvent] = []
    record = IncidentRecorder.record

    def recording(self: IncidentRecorder, front: Any, event: NanEvent) -> None:
        events.append(event)
        record(self, front, event)

    monkeypatch.setattr(IncidentRecorder, "record", recording)
    yield events
