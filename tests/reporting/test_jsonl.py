"""``events.jsonl``: one ``NanEvent.to_dict()`` per line (``lightning_nanguard.reporting.jsonl``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from event_factory import make_event

from lightning_nanguard import read_events
from lightning_nanguard.reporting import JsonlEventLog
from lightning_nanguard.reporting.jsonl import EVENTS_FILENAME


def _strict_json(line: str) -> Any:
    def reject(constant: str) -> None:
        raise AssertionError(f"non-JSON constant {constant} in {line!r}")

    return json.loads(line, parse_constant=reject)


def test_jsonl_append_and_read(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "nanguard" / "events.jsonl"
    log = JsonlEventLog(path)
    assert not path.exists()  # created on first write only
    events = [
        make_event(),
        make_event(bare=True, global_step=7, batch_idx=7, loss=math.nan),
        make_event(bare=True, global_step=9, batch_idx=7, loss=-math.inf, action="warned"),
    ]
    for event in events:
        log.append(event)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 3
    assert [_strict_json(line) for line in lines] == [event.to_dict() for event in events]
    assert [e.to_dict() for e in read_events(path)] == [e.to_dict() for e in events]


def test_jsonl_appends_across_instances_and_ignores_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    JsonlEventLog(path).append(make_event(bare=True, global_step=1, batch_idx=7, loss=math.nan))
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("\n   \n")
    JsonlEventLog(str(path)).append(make_event(bare=True, global_step=2, batch_idx=7, loss=math.nan))
    assert [event.global_step for event in read_events(path)] == [1, 2]


def test_the_file_name_is_events_jsonl() -> None:
    assert EVENTS_FILENAME == "events.jsonl"


def test_one_line_per_event_in_field_order(tmp_path: Path) -> None:
    path = tmp_path / EVENTS_FILENAME
    JsonlEventLog(path).append(make_event(global_step=5, loss=math.inf, grad_norm=math.nan))
    text = path.read_text(encoding="utf-8")
    assert text.endswith("}\n") and text.count("\n") == 1
    data = json.loads(text)
    assert list(data)[:6] == ["global_step", "epoch", "batch_idx", "rank", "kinds", "action"]
    assert (data["global_step"], data["loss"], data["grad_norm"]) == (5, "inf", "nan")


def test_read_events_rebuilds_tuples_and_non_finite_floats(tmp_path: Path) -> None:
    path = tmp_path / EVENTS_FILENAME
    event = make_event(loss=-math.inf)
    JsonlEventLog(path).append(event)
    (back,) = read_events(path)
    assert back.kinds == ("loss", "grad", "bn_stats") and back.dataset_indices == (27, 29)
    assert back.loss == -math.inf and back.grad_norm == math.inf
    assert back.details == event.details and back.cause == "data"


def test_a_truncated_last_line_is_an_error_for_read_events(tmp_path: Path) -> None:
    """``read_events`` is strict (the dashboard skips a half-written line; scripts must see it)."""
    path = tmp_path / EVENTS_FILENAME
    JsonlEventLog(path).append(make_event())
    with open(path, "a", encoding="utf-8") as handle:
        handle.write('{"global_step": 13, "ki')
    with pytest.raises(json.JSONDecodeError):
        read_events(path)
