"""TensorBoard output through a ``SummaryWriter`` (``lightning_nanguard.reporting.tensorboard``).

Written with a real ``SummaryWriter`` and read back with TensorBoard's ``EventAccumulator``
(``tb_reader`` in conftest.py).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from event_factory import make_event
from torch.utils.tensorboard import SummaryWriter

from lightning_nanguard.reporting import TensorBoardReporter, event_markdown
from lightning_nanguard.reporting.tensorboard import CHARTS, EVENT_TEXT_TAG, SCALAR_TAGS, custom_scalars_layout


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
    reporter.report(make_event(global_step=3))
    writer.close()

    run = tb_reader(tmp_path)
    assert run.scalars("nanguard/grad_norm") == [(2, 1.5), (3, math.inf)]
    assert run.scalars("nanguard/skipped_total") == [(2, 0.0), (3, 1.0)]
    assert f"{EVENT_TEXT_TAG}/text_summary" in run.tags["tensors"]
    texts = run.texts(f"{EVENT_TEXT_TAG}/text_summary")
    assert [step for step, _ in texts] == [3]
    assert texts[0][1] == event_markdown(make_event(global_step=3))
    layouts = run.layouts()
    assert len(layouts) == 1
    category = layouts[0].category[0]
    assert category.title == "NanGuard"
    assert [chart.title for chart in category.chart] == ["gradient norm", "bad steps", "skipped steps", "rollbacks"]
    assert [list(chart.multiline.tag) for chart in category.chart] == [[tag] for tag in tags]


def test_tensorboard_report_flushes_immediately(tmp_path: Path, tb_reader: Any) -> None:
    """The event must be on disk right after report(), before the writer is closed (a crash may follow)."""
    writer = SummaryWriter(str(tmp_path), flush_secs=3600)
    TensorBoardReporter(writer).report(make_event(bare=True, global_step=7, batch_idx=7, loss=math.nan))
    run = tb_reader(tmp_path)
    assert [step for step, _ in run.texts(f"{EVENT_TEXT_TAG}/text_summary")] == [7]
    writer.close()


class RecordingWriter:
    """The ``SummaryWriter`` calls a reporter makes, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def add_custom_scalars(self, layout: Any) -> None:
        self.calls.append(("add_custom_scalars", layout))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.calls.append(("add_scalar", tag, value, step))

    def add_text(self, tag: str, text: str, step: int) -> None:
        self.calls.append(("add_text", tag, text, step))

    def flush(self) -> None:
        self.calls.append(("flush",))


def test_report_writes_the_markdown_at_the_event_step_then_flushes() -> None:
    writer = RecordingWriter()
    event = make_event(global_step=21)
    TensorBoardReporter(writer).report(event)
    assert writer.calls == [("add_text", "nanguard/events", event_markdown(event), 21), ("flush",)]


def test_scalars_are_written_as_given_in_order() -> None:
    writer = RecordingWriter()
    TensorBoardReporter(writer).scalars({"nanguard/skipped_total": 2.0, "nanguard/grad_norm": 0.5}, step=9)
    assert writer.calls == [
        ("add_scalar", "nanguard/skipped_total", 2.0, 9),
        ("add_scalar", "nanguard/grad_norm", 0.5, 9),
    ]


def test_the_layout_is_registered_once_with_the_first_tags() -> None:
    writer = RecordingWriter()
    reporter = TensorBoardReporter(writer)
    reporter.register_layout(["nanguard/grad_norm"])
    reporter.register_layout(["nanguard/skipped_total"])
    assert writer.calls == [
        ("add_custom_scalars", {"NanGuard": {"gradient norm": ["Multiline", ["nanguard/grad_norm"]]}})
    ]


def test_layout_of_repeated_tags_has_one_chart_each() -> None:
    charts = custom_scalars_layout(["nanguard/skipped_total", "nanguard/grad_norm", "nanguard/skipped_total"])
    assert charts == {
        "NanGuard": {
            "gradient norm": ["Multiline", ["nanguard/grad_norm"]],
            "skipped steps": ["Multiline", ["nanguard/skipped_total"]],
        }
    }
    assert custom_scalars_layout([]) == {"NanGuard": {}}
