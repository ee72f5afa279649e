"""``DETAIL_KEYS``: every ``details`` key the guard writes, documented, and checked where an event is built.

The registry is held equal to the table of ``docs/reference/events.md`` here. That the guard writes
no other key is checked on the real incidents of the whole test suite, of every kind (a Trainer's,
a Fabric loop's, DDP, sharding, spikes, precursors, guard errors, rollbacks, replay): the builder
raises under ``NANGUARD_STRICT_DETAIL_KEYS=1`` (worker processes too), and every event a test
records, whatever made it, is checked after the test (``tests/conftest.py``, ``detail_check.py``).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from lightning_nanguard.core import detail_keys
from lightning_nanguard.core.detail_keys import DETAIL_KEYS, STRICT_ENV, UnregisteredDetailKeyError, check_detail_keys
from lightning_nanguard.core.event_builder import EventSections, Forensics, Found, Rows, Where, build_event
from lightning_nanguard.core.events import NanEvent

EVENTS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "events.md"
WHERE = Where(3, 0, 3, 0)


def documented() -> dict[str, tuple[str, str]]:
    """The rows of the ``details`` table of ``docs/reference/events.md``: key -> (section, meaning)."""
    text = EVENTS_PAGE.read_text(encoding="utf-8")
    table = text[text.index("## Keys of `details`") :]
    rows = re.findall(r"^\| `([a-z_]+)` \| (\w+) \| (.*) \|$", table, flags=re.MULTILINE)
    return {key: (section, meaning) for key, section, meaning in rows}


def test_every_registered_key_is_documented_as_registered_and_nothing_else() -> None:
    registered = {key: (entry.section, entry.meaning) for key, entry in DETAIL_KEYS.items()}
    page = documented()
    assert sorted(set(registered) - set(page)) == [], "registered but not in docs/reference/events.md"
    assert sorted(set(page) - set(registered)) == [], "in docs/reference/events.md but not in DETAIL_KEYS"
    assert page == registered
    assert list(page) == list(registered)  # the same order: found, forensics, rows


def test_the_keys_once_written_without_a_word_in_the_docs_are_registered() -> None:
    for key in ("samples_not_named", "indices_note", "sample_loaders_unknown", "grads_checked", "sharding"):
        assert key in DETAIL_KEYS and f"| `{key}` |" in EVENTS_PAGE.read_text(encoding="utf-8")


def test_an_unregistered_key_raises_under_the_tests() -> None:
    with pytest.raises(UnregisteredDetailKeyError, match=r"'colour' .*not in DETAIL_KEYS"):
        build_event(WHERE, Found(("loss",), details={"colour": "red"}))


def test_a_key_written_by_another_section_than_its_own_raises_under_the_tests() -> None:
    with pytest.raises(UnregisteredDetailKeyError, match="'batch_size' \\(section forensics\\)"):
        build_event(WHERE, Found(("loss",)), Forensics(details={"batch_size": 8}))
    build_event(WHERE, Found(("loss",)), rows=Rows(details={"batch_size": 8}))


def test_in_a_run_an_unregistered_key_is_kept_and_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(STRICT_ENV)
    monkeypatch.setattr(detail_keys, "_told", set())
    with caplog.at_level(logging.WARNING, logger="lightning_nanguard"):
        first = build_event(WHERE, Found(("loss",), details={"colour": "red"}))
        again = build_event(WHERE, Found(("loss",), details={"colour": "blue"}))
    assert first.details == {"colour": "red"} and again.details == {"colour": "blue"}
    assert [r.getMessage() for r in caplog.records if "colour" in r.getMessage()] == [
        "NanGuard: details key 'colour' (section found) is not in DETAIL_KEYS; it is kept"
    ]
    assert EventSections.of(first).found.details == {"colour": "red"}  # kept in the section that reports it
    assert check_detail_keys("rows", {"batch_size": 1, "colour": 2}) == ["colour"]


def test_the_error_passes_through_the_guards_parts_and_pickles() -> None:
    import pickle

    from lightning_nanguard.engine.parts import GuardParts

    parts = GuardParts()
    with pytest.raises(UnregisteredDetailKeyError):
        parts.run("diagnosis", build_event, WHERE, Found(("loss",), details={"colour": "red"}))
    assert parts.on("diagnosis")
    error = pickle.loads(pickle.dumps(UnregisteredDetailKeyError("rows", "colour")))
    assert (error.section, error.key) == ("rows", "colour")


def test_the_check_after_each_test_sees_every_recorded_event_whatever_made_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from detail_check import recorded_events, unregistered_keys

    from lightning_nanguard.engine.recording import IncidentRecorder

    made_elsewhere = NanEvent(3, 0, 3, 0, ("bn_stats",), "skipped", details={"forward_only": "a note"})
    with recorded_events(monkeypatch) as events:
        IncidentRecorder(verbose=False).record(None, made_elsewhere)  # not built by the builder
    assert events == [made_elsewhere] and unregistered_keys(events) == []
    assert unregistered_keys([made_elsewhere.replace(details={"colour": 1})]) == ["colour"]  # this test would fail
