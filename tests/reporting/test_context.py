"""The per-event context files the dashboard shows: source lines, stack, thumbnails (``reporting.context``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from event_factory import make_event
from png_reader import decode_png

from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.reporting.context import read_source_window, save_incident_context
from lightning_nanguard_tensorboard.layout import CONTEXT_FILENAME, INCIDENTS_DIRNAME

HERE = Path(__file__).resolve()


def event(**changes: Any) -> NanEvent:
    """Step 12, batch 3: samples 1 and 3 (dataset indices 41, 43), no source line, no details."""
    base = make_event(
        bare=True, epoch=1, batch_idx=3, kinds=("loss", "grad"), offending_samples=(1, 3), dataset_indices=(41, 43)
    )
    return base.replace(**changes)


def load_context(directory: Path) -> dict[str, Any]:
    return json.loads((directory / CONTEXT_FILENAME).read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------------ save_incident_context


def test_context_holds_source_window_stack_and_thumbnails(tmp_path: Path) -> None:
    line = 30  # a line of code in this file (its window and stack text are read back)
    stack = [
        {"file": str(HERE), "line": 20, "function": "outer"},
        {"file": str(HERE), "line": line, "function": "decode_png"},
    ]
    images = torch.rand(4, 3, 16, 16)
    images[3, 0, 2, 2] = math.nan
    ev = event(source_line=f"tests/{HERE.name}:{line}", details={"stack": stack})
    directory = save_incident_context(tmp_path, ev, str(HERE), (images, torch.zeros(4)), [1, 3])
    assert directory == tmp_path / INCIDENTS_DIRNAME / "step-12"
    context = load_context(directory)
    assert context["format"] == 1
    assert context["event"] == {"global_step": 12, "rank": 0, "epoch": 1, "batch_idx": 3, "kinds": ["loss", "grad"]}
    lines = HERE.read_text(encoding="utf-8").splitlines()
    source = context["source"]
    assert source["file"] == f"tests/{HERE.name}"  # as the event shows it, never the absolute path read
    assert (source["line"], source["first_line"]) == (line, line - 5)
    assert source["lines"] == lines[line - 6 : line + 5]
    assert [f["function"] for f in context["stack"]] == ["outer", "decode_png"]  # innermost last
    assert context["stack"][1]["text"] == lines[line - 1].strip()
    thumbs = context["thumbnails"]
    assert [(t["position"], t["dataset_index"], t["file"]) for t in thumbs] == [
        (1, 41, "sample-1.png"),
        (3, 43, "sample-3.png"),
    ]
    assert thumbs[1]["nonfinite_values"] == 1 and thumbs[0]["nonfinite_values"] == 0
    assert context["image_batch"] == {"layout": "NCHW", "shape": [4, 3, 16, 16], "dtype": "torch.float32"}
    for t in thumbs:
        assert decode_png((directory / t["file"]).read_bytes())[:2] == (16, 16)
    assert not list(directory.glob("*.tmp"))


def test_positions_default_to_the_offending_samples_and_are_capped(tmp_path: Path) -> None:
    ev = event(offending_samples=tuple(range(12)), dataset_indices=tuple(range(100, 112)))
    directory = save_incident_context(tmp_path, ev, batch=torch.rand(12, 1, 8, 8), max_thumbnails=3)
    context = load_context(directory)  # type: ignore[arg-type]
    assert [t["position"] for t in context["thumbnails"]] == [0, 1, 2]
    assert "first 3 of 12 samples shown" in context["notes"]


def test_rows_of_several_records_keep_their_records_with_the_thumbnail(tmp_path: Path) -> None:
    ev = event(dataset_indices=None, sample_records=((10, 11), (40,)))
    context = load_context(save_incident_context(tmp_path, ev, batch=torch.rand(4, 1, 8, 8)))  # type: ignore[arg-type]
    assert [(t["position"], t["dataset_index"], t["records"]) for t in context["thumbnails"]] == [
        (1, None, [10, 11]),
        (3, None, [40]),
    ]
    plain = load_context(save_incident_context(tmp_path, event(), batch=torch.rand(4, 1, 8, 8)))  # type: ignore[arg-type]
    assert all("records" not in t for t in plain["thumbnails"])  # one record a row: as before


def test_without_image_batch_or_source_the_reasons_are_written(tmp_path: Path) -> None:
    ev = event(source_line="does/not/exist.py:3")
    context = load_context(save_incident_context(tmp_path, ev, None, torch.zeros(4, 16, 32), [1]))  # type: ignore[arg-type]
    assert context["source"] is None and context["thumbnails"] == [] and context["image_batch"] is None
    assert context["notes"] == ["source file not readable: does/not/exist.py", "the batch holds no image-like tensor"]
    context = load_context(save_incident_context(tmp_path, event(offending_samples=None), None, None, None))  # type: ignore[arg-type]
    assert context["notes"] == ["no source line in the event", "no batch given"]


def test_innermost_stack_frame_is_the_source_when_no_culprit_line(tmp_path: Path) -> None:
    ev = event(details={"stack": [{"file": str(HERE), "line": 3, "function": "f"}]})
    context = load_context(save_incident_context(tmp_path, ev))  # type: ignore[arg-type]
    assert context["source"]["line"] == 3 and context["source"]["first_line"] == 1


def test_events_at_the_same_step_get_their_own_directories(tmp_path: Path) -> None:
    names = [save_incident_context(tmp_path, event()).name for _ in range(3)]  # type: ignore[union-attr]
    assert names == ["step-12", "step-12-2", "step-12-3"]
    assert save_incident_context(tmp_path, event(rank=2)).name == "step-12-rank2"  # type: ignore[union-attr]


def test_never_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory", encoding="utf-8")
    assert save_incident_context(blocker, event()) is None
    assert "could not save the incident context of step 12" in caplog.text
    # a broken thumbnail (positions past the batch) and malformed stack entries: the rest is still written
    bad = event(details={"stack": [{"file": None}, "garbage", {"file": "x.py", "line": "12"}]})
    context = load_context(save_incident_context(tmp_path, bad, batch=torch.rand(2, 1, 8, 8), positions=[5]))  # type: ignore[arg-type]
    assert context["thumbnails"] == [] and context["stack"] == [
        {"file": "x.py", "line": 12, "function": None, "text": None}
    ]


def test_source_window_at_the_edges_of_a_file(tmp_path: Path) -> None:
    path = tmp_path / "short.py"
    path.write_text("a = 1\nb = 2\nc = 3\n", encoding="utf-8")
    assert read_source_window(str(path), 3, context_lines=5) == {
        "line": 3,
        "first_line": 1,
        "lines": ["a = 1", "b = 2", "c = 3"],
    }
    assert read_source_window(str(path), 4) is None
    assert read_source_window(str(tmp_path / "missing.py"), 1) is None
