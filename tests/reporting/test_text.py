"""Text and markdown renderings of an event (``lightning_nanguard.reporting.text``)."""

from __future__ import annotations

import math
from typing import Any

from event_factory import make_event

from lightning_nanguard import NanEvent
from lightning_nanguard.reporting import event_markdown, event_text


def simple_event(**changes: Any) -> NanEvent:
    return make_event(bare=True, global_step=7, batch_idx=7, loss=math.nan).replace(**changes)


def rich_event(**changes: Any) -> NanEvent:
    event = make_event(
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
        nonfinite_params=(),
        details={"batch_size": 32, "module_type": "CosineNormLinear", "source_text": "x.sqrt()", "hint": "a|b"},
        cause=None,
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


# ------------------------------------------------------------------------------------ what the guard verified


def test_verified_indices_and_blame() -> None:
    event = rich_event(cause="data", indices_verified=True, blame_verified=True, details={"batch_size": 32})
    body = dict(line.strip().split(": ", 1) for line in event_text(event).splitlines()[1:])
    assert body["offending samples"] == "[5, 23] of 32 (dataset indices [45, 63]) (verified)"
    assert body["blame"] == "verified: bad beside known-healthy samples"
    assert "| blame | verified: bad beside known-healthy samples |" in event_markdown(event)


def test_unverified_indices_and_blame_say_why() -> None:
    details = {
        "batch_size": 32,
        "indices_unverified": "an IterableDataset cannot be re-read",
        "blame_unverified": "max_bisect_passes reached",
    }
    event = rich_event(cause="data", indices_verified=False, blame_verified=False, details=details)
    body = dict(line.strip().split(": ", 1) for line in event_text(event).splitlines()[1:])
    assert body["offending samples"] == (
        "[5, 23] of 32 (dataset indices [45, 63]) (not verified: an IterableDataset cannot be re-read)"
    )
    assert body["blame"] == "not verified: max_bisect_passes reached"


def test_events_without_the_verification_fields_read_as_before() -> None:
    text = event_text(rich_event())
    assert "(verified)" not in text and "not verified" not in text and "blame" not in text


def test_rows_of_several_records_show_each_rows_records() -> None:
    event = rich_event(dataset_indices=None, sample_records=((10, 11), (40,)), indices_verified=True)
    assert "offending samples: [5, 23] of 32 (records per row [10, 11], [40]) (verified)" in event_text(event)


def test_several_loaders_mark_their_indices_once() -> None:
    event = rich_event(
        offending_samples=(5, 2),
        dataset_indices=(13, 6),
        sample_loaders=("a", "b"),
        indices_verified=False,
        details={"loader_batch_sizes": [["a", 8], ["b", 4]], "indices_unverified": "loader 'b': no re-read"},
    )
    assert (
        "offending samples: loader 'a': [5] of 8 (dataset indices [13]); loader 'b': [2] of 4 (dataset indices [6])"
        " (indices not verified: loader 'b': no re-read)"
    ) in event_text(event)
    records = event.replace(dataset_indices=None, sample_records=((1, 2), (3,)), indices_verified=True)
    assert "loader 'a': [5] of 8 (records per row [1, 2]); loader 'b': [2] of 4 (records per row [3])" in (
        event_text(records)
    )


def test_a_batch_event_names_no_sample() -> None:
    hint = "guard the denominator (clamp_min(1) on the target count) or check that a batch has a target"
    event = simple_event(cause="batch", details={"hint": hint})
    assert event_text(event).splitlines()[1:] == [
        "  non-finite: loss",
        "  cause: batch: the batch as a whole, no record is at fault",
        "  loss: nan",
        f"  hint: {hint}",
    ]
