"""The terminal panel of an event (``lightning_nanguard.reporting.terminal``)."""

from __future__ import annotations

import io
import logging
import math

import pytest
from event_factory import make_event
from rich.console import Console

from lightning_nanguard.reporting import TerminalReporter


def test_terminal_panel() -> None:
    out = io.StringIO()
    TerminalReporter(rank=1, file=out).report(
        make_event(rank=1, offending_samples=(5, 23), nonfinite_buffers=("net.1.running_var",))
    )
    text = out.getvalue()
    assert "[rank 1] NanGuard" in text
    assert "[5, 23]" in text  # not swallowed as rich markup
    assert "net.1.running_var" in text
    assert "step skipped" in text


def test_terminal_defaults_to_stderr_at_print_time(capsys: pytest.CaptureFixture[str]) -> None:
    TerminalReporter().report(make_event(bare=True, global_step=7, batch_idx=7, loss=math.nan))
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "[rank 0] NanGuard" in captured.err


def test_terminal_also_logs(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="lightning_nanguard"):
        TerminalReporter(rank=2, file=io.StringIO()).report(
            make_event(bare=True, global_step=7, batch_idx=7, loss=math.nan)
        )
    assert any("[rank 2]" in r.getMessage() and "non-finite loss" in r.getMessage() for r in caplog.records)


def test_a_given_console_prints_the_panel_and_the_file_gets_nothing() -> None:
    """A live progress bar's own rich Console: the panel goes through it, never to ``file``."""
    console_out, file_out = io.StringIO(), io.StringIO()
    console = Console(file=console_out, width=120, highlight=False)
    TerminalReporter(rank=3, file=file_out, console=console).report(make_event(global_step=41))
    assert "[rank 3] NanGuard" in console_out.getvalue()
    assert "step 41 (epoch 1, batch 4)" in console_out.getvalue()
    assert file_out.getvalue() == ""


def test_a_write_function_gets_the_rendered_panel_as_one_string() -> None:
    """E.g. a TQDM bar's ``print``: called once with the whole panel, no trailing newline."""
    written: list[str] = []
    TerminalReporter(rank=0, write=written.append).report(make_event(bare=True, global_step=3, batch_idx=3))
    assert len(written) == 1
    assert "[rank 0] NanGuard" in written[0]
    assert "step 3 (epoch 0, batch 3): non-finite loss -> step skipped" in written[0]
    assert not written[0].endswith("\n")


def test_the_panel_rows_are_the_event_lines() -> None:
    event = make_event(nonfinite_grads=("fc.weight",), culprit_module="net.norm")
    out = io.StringIO()
    TerminalReporter(file=out).report(event)
    text = out.getvalue()
    assert "parameter grads (1)" in text and "fc.weight" in text
    assert "cause" in text and "data: the offending samples reproduce it on their own" in text
    assert "[3, 5] of 8 (dataset indices [27, 29])" in text


def test_the_panel_shows_what_was_verified_and_stays_readable_at_80_columns() -> None:
    details = {
        "batch_size": 8,
        "indices_unverified": "the collate reorders rows and has no index field",
        "blame_unverified": "max_bisect_passes reached before the check",
    }
    event = make_event(indices_verified=False, blame_verified=False, details=details)
    out = io.StringIO()
    Console(file=out, width=80, highlight=False).print(TerminalReporter().panel(event))
    lines = out.getvalue().splitlines()
    assert all(len(line) <= 80 for line in lines)
    text = " ".join(line.strip("│ ") for line in lines)
    assert "[3, 5] of 8 (dataset indices [27, 29]) (not verified: the collate reorders rows and has no" in text
    assert "blame not verified: max_bisect_passes reached before the check" in " ".join(text.split())
