"""``benchmarks.fixed_instructions``: its fit runs with the callgrind requests in place, and its summary is read right.

Under valgrind the client requests switch counting on and off; outside it they are no-ops, so the
harness itself (the compiled requests, the wrapped clock, the fit) runs here in seconds. The full
count (two fits under callgrind, about a minute) is the benchmark's own business.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.fixed_instructions import _count_inside, _per_step, _toggle_library

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    shutil.which("cc") is None or not Path("/usr/include/valgrind/callgrind.h").exists(),
    reason="needs a C compiler and valgrind's headers",
)
@pytest.mark.parametrize(
    "counted",
    [
        ["--hook", "on_before_optimizer_step"],
        ["--region", "lightning_nanguard.detect.spikes:SpikeDetector.accept"],
    ],
    ids=["hook", "region"],
)
def test_the_counted_fit_runs_with_the_requests_compiled_in(tmp_path: Any, counted: list[str]) -> None:
    library = _toggle_library(tmp_path)
    command = [sys.executable, "-m", "benchmarks.fixed_instructions", "--inside", str(library)]
    done = subprocess.run(
        [*command, "--steps", "3", "--warmup", "6", *counted],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "max_steps=9" in done.stderr  # warm-up and counted steps: the whole fit ran


def test_a_callgrind_summary_is_read_per_step(tmp_path: Any) -> None:
    out = tmp_path / "callgrind.out"
    out.write_text("events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw\nsummary: 1000 10 20 30 40 50 1 2 3\n")
    per = _per_step(out, steps=10)
    assert per["Ir"] == 100.0 and per["I1mr"] == 3.0 and per["DLmw"] == 0.3
    assert per["est. cycles"] == pytest.approx(100.0 + 10 * (3.0 + 4.0 + 5.0) + 100 * (0.1 + 0.2 + 0.3))


def test_a_summary_without_its_trailing_zero_counts_reads_them_as_zero(tmp_path: Any) -> None:
    """callgrind leaves counts that are zero off the end of the line (a small region: no last-level write miss)."""
    out = tmp_path / "callgrind.out"
    out.write_text("events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw\nsummary: 1000 10 20 30 40 50 1 2\n")
    per = _per_step(out, steps=10)
    assert per["DLmw"] == 0.0 and per["DLmr"] == 0.2
    assert per["est. cycles"] == pytest.approx(100.0 + 10 * (3.0 + 4.0 + 5.0) + 100 * (0.1 + 0.2))


def _countdown(n: int) -> int:
    """Counts down by calling itself through the module (the counted wrapper); raises at the bottom below 0."""
    if n < 0:
        raise ValueError("below zero")
    return 0 if n == 0 else 1 + _countdown(n - 1)


def test_a_region_is_counted_around_its_outermost_calls_only() -> None:
    """``--region``: collection switched on when the outermost call begins and off when it ends, once each."""
    module, original = sys.modules[__name__], _countdown
    switches: list[int] = []
    try:
        _count_inside(f"{__name__}:_countdown", lambda: switches.append(1))
        assert module._countdown(3) == 3  # four nested calls
        assert len(switches) == 2
        with pytest.raises(ValueError, match="below zero"):
            module._countdown(-1)  # a call that raises still switches collection off
        assert len(switches) == 4
    finally:
        module._countdown = original
