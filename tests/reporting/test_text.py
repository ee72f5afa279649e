"""Reporting sinks without a Trainer: text/markdown rendering, terminal panel, TensorBoard, events.jsonl."""

from __future__ import annotations

import io
import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
from torch.utils.tensorboard import SummaryWriter

from lightning_nanguard import NanEvent, read_events
from lightning_nanguard.reporting import (
    JsonlEventLog,
    TensorBoardReporter,
    TerminalReporter,
    event_markdown,
    event_text,
)
from lightning_nanguard.reporting.tensorboard import CHARTS, EVENT_TEXT_TAG, SCALAR_TAGS, custom_scalars_layout


def simple_event(**changes: Any) -> NanEvent:
    return NanEvent(7, 0, 7, 0, ("loss",), "skipped", loss=math.nan).replace(**changes)


def rich_event(**changes: Any) -> NanEvent:
    event = NanEvent(
        global_step=12,
        epoch=1,
        batch_idx=4,
        rank=1,
        kinds=("loss", "grad", "bn_stats"),
        action="skipped",
        nonfinite_grads=tuple(f"layers.{i}.weight" for i in range(10)),
        nonfinite_buffers=("net.1.running_var",),
        loss=math.inf,
        offending_samples=(5, 23),
        dataset_indices=(45, 63),
        culprit_module="net.norm",
        culprit_op="SqrtBackward0",
        source_line="tests/models.py:98",
        phase="backward",
        remedies=("skipped batch",),
        repro_path="/runs/nanguard/step-12",
        grad_norm=math.nan,
        details={"batch_size": 32, "module_type": "CosineNormLinear", "source_text": "x.sqrt()", "hint": "a|b"},
    )
    return event.replace(**changes)


# ------------------------------------------------------------------------------------ text and markdown


def test_event_text_simple() -> None:
    assert event_text(simple_event()) == (
        "step 7 (epoch 0, batch 7): non-finite loss -> step skipped\n  non-finite: loss\n  loss: nan"
    )


def test_event_markdown_simple() -> None:
    assert event_markdown(simple_event()) == (
        "| **NanGuard** | step 7 (epoch 0, batch 7): non-finite loss -> step skipped |\n"
        "|---|---|\n"
        "| non-finite | loss |\n"
        "| loss | nan |"
    )


def test_event_markdown_renders_as_one_table_without_an_empty_row() -> None:
    """TensorBoard's own markdown renderer: the headline is the header row, no row is empty."""
    from tensorboard.plugin_util import markdown_to_safe_html

    html = markdown_to_safe_html(event_markdown(rich_event()))
    assert html.count("<table>") == 1
    assert "<th><strong>NanGuard</strong></th>" in html
    assert "<th></th>" not in html and "<td></td>" not in html
    assert "<td>hint</td>\n<td>a&#124;b</td>" in html  # the escaped pipe stays inside its cell


def test_event_text_rich() -> None:
    lines = event_text(rich_event()).splitlines()
    assert lines[0] == rich_event().headline()
    body = dict(line.strip().split(": ", 1) for line in lines[1:])
    assert body["non-finite"] == "loss, grad, bn_stats"
    shown = ", ".join(f"layers.{i}.weight" for i in range(8))
    assert body["parameter grads (10)"] == f"{shown} (+2 more)"  # at most 8 names, then a count
    assert body["BatchNorm buffers (1)"] == "net.1.running_var"
    assert body["loss"] == "inf"
    assert body["grad norm"] == "nan"
    assert body["offending samples"] == "[5, 23] of 32 (dataset indices [45, 63])"
    assert body["origin"] == "backward of SqrtBackward0 in module net.norm (CosineNormLinear)"
    assert body["source"] == "tests/models.py:98  x.sqrt()"
    assert body["remedies"] == "skipped batch"
    assert body["repro bundle"].startswith("/runs/nanguard/step-12")


def test_event_markdown_quotes_code_and_escapes_pipes() -> None:
    text = event_markdown(rich_event())
    assert text.startswith("| **NanGuard** | step 12 (epoch 1, batch 4)")
    assert "| BatchNorm buffers (1) | `net.1.running_var` |" in text
    assert "`SqrtBackward0`" in text
    assert "| hint | a&#124;b |" in text  # a '|' inside a cell would break the table
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert all(line.count("|") == 3 for line in rows)


def test_text_for_an_event_without_attribution() -> None:
    event = simple_event(details={"not_attributable": "the whole batch is needed (BatchNorm)"})
    assert "offending samples: not attributable to individual samples: the whole batch is needed (BatchNorm)" in (
        event_text(event)
    )


def test_origin_in_the_lightning_module_itself() -> None:
    event = simple_event(culprit_module="", culprit_op="LogBackward0", phase="forward")
    assert "origin: forward of LogBackward0 in module <LightningModule>" in event_text(event)


# ------------------------------------------------------------------------------------ terminal


def test_terminal_panel() -> None:
    out = io.StringIO()
    TerminalReporter(rank=1, file=out).report(rich_event())
    text = out.getvalue()
    assert "[rank 1] NanGuard" in text
    assert "[5, 23]" in text  # not swallowed as rich markup
    assert "net.1.running_var" in text
    assert "step skipped" in text


def test_terminal_defaults_to_stderr_at_print_time(capsys: pytest.CaptureFixture[str]) -> None:
    TerminalReporter().report(simple_event())
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "[rank 0] NanGuard" in captured.err


def test_terminal_also_logs(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="lightning_nanguard"):
        TerminalReporter(rank=2, file=io.StringIO()).report(simple_event())
    assert any("[rank 2]" in r.getMessage() and "non-finite loss" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------------ TensorBoard


def test_layout_charts_every_known_tag_by_default_one_series_each() -> None:
    layout = custom_scalars_layout()
    assert list(layout) == ["NanGuard"]
    charts = layout["NanGuard"]
    assert [tags for kind, tags in charts.values()] == [[tag] for tag in CHARTS]
    assert {kind for kind, _ in charts.values()} == {"Multiline"}
    assert set(SCALAR_TAGS) <= {tags[0] for _, tags in charts.values()}


def test_layout_only_charts_the_tags_the_run_logs() -> None:
    tags = ["nanguard/skipped_total", "nanguard/grad_norm", "nanguard/bad_steps_total", "val_loss"]
    charts = custom_scalars_layout(tags)["NanGuard"]
    assert list(charts) == ["gradient norm", "bad steps", "skipped steps"]  # CHARTS order, foreign tags ignored
    assert not any("rollbacks" in t or "amp_overflow" in t for _, series in charts.values() for t in series)
    # bad_steps_total and skipped_total are equal under action="skip": never in one chart
    assert all(len(series) == 1 for _, series in charts.values())
    assert custom_scalars_layout(["nanguard/new_counter_total"])["NanGuard"] == {
        "new counter total": ["Multiline", ["nanguard/new_counter_total"]]
    }


def test_tensorboard_reporter_writes_text_scalars_and_layout(tmp_path: Path, tb_reader: Any) -> None:
    writer = SummaryWriter(str(tmp_path))
    reporter = TensorBoardReporter(writer)
    tags = ["nanguard/grad_norm", "nanguard/bad_steps_total", "nanguard/skipped_total", "nanguard/rollbacks_total"]
    reporter.register_layout(tags)
    reporter.register_layout()  # once per writer
    reporter.scalars({"nanguard/grad_norm": 1.5, "nanguard/skipped_total": 0.0}, step=2)
    reporter.scalars({"nanguard/grad_norm": math.inf, "nanguard/skipped_total": 1.0}, step=3)
    reporter.report(rich_event(global_step=3))
    writer.close()

    run = tb_reader(tmp_path)
    assert run.scalars("nanguard/grad_norm") == [(2, 1.5), (3, math.inf)]
    assert run.scalars("nanguard/skipped_total") == [(2, 0.0), (3, 1.0)]
    assert f"{EVENT_TEXT_TAG}/text_summary" in run.tags["tensors"]
    texts = run.texts(f"{EVENT_TEXT_TAG}/text_summary")
    assert [step for step, _ in texts] == [3]
    assert texts[0][1] == event_markdown(rich_event(global_step=3))
    layouts = run.layouts()
    assert len(layouts) == 1
    category = layouts[0].category[0]
    assert category.title == "NanGuard"
    assert [chart.title for chart in category.chart] == ["gradient norm", "bad steps", "skipped steps", "rollbacks"]
    assert [list(chart.multiline.tag) for chart in category.chart] == [[tag] for tag in tags]


def test_tensorboard_report_flushes_immediately(tmp_path: Path, tb_reader: Any) -> None:
    """The event must be on disk right after report(), before the writer is closed (a crash may follow)."""
    writer = SummaryWriter(str(tmp_path), flush_secs=3600)
    TensorBoardReporter(writer).report(simple_event())
    run = tb_reader(tmp_path)
    assert [step for step, _ in run.texts(f"{EVENT_TEXT_TAG}/text_summary")] == [7]
    writer.close()


# ------------------------------------------------------------------------------------ events.jsonl


def _strict_json(line: str) -> Any:
    def reject(constant: str) -> None:
        raise AssertionError(f"non-JSON constant {constant} in {line!r}")

    return json.loads(line, parse_constant=reject)


def test_jsonl_append_and_read(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "nanguard" / "events.jsonl"
    log = JsonlEventLog(path)
    assert not path.exists()  # created on first write only
    events = [rich_event(), simple_event(), simple_event(global_step=9, loss=-math.inf, action="warned")]
    for event in events:
        log.append(event)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 3
    assert [_strict_json(line) for line in lines] == [event.to_dict() for event in events]
    assert [e.to_dict() for e in read_events(path)] == [e.to_dict() for e in events]


def test_jsonl_appends_across_instances_and_ignores_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    JsonlEventLog(path).append(simple_event(global_step=1))
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("\n   \n")
    JsonlEventLog(str(path)).append(simple_event(global_step=2))
    assert [event.global_step for event in read_events(path)] == [1, 2]
