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

from benchmarks.fixed_instructions import _per_step, _toggle_library

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    shutil.which("cc") is None or not Path("/usr/include/valgrind/callgrind.h").exists(),
    reason="needs a C compiler and valgrind's headers",
)
def test_the_counted_fit_runs_with_the_requests_compiled_in(tmp_path: Any) -> None:
    library = _toggle_library(tmp_path)
    command = [sys.executable, "-m", "benchmarks.fixed_instructions", "--inside", str(library)]
    done = subprocess.run(
        [*command, "--steps", "3", "--warmup", "6", "--hook", "on_before_optimizer_step"],
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
