"""``python -m benchmarks.gpu_steps`` runs end to end: on CPU, tiny shapes (``--quick``), one command, a JSON report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_steps_script_runs_on_cpu_quick(tmp_path: Any) -> None:
    out = tmp_path / "steps.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_steps", "--device", "cpu", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["device"].startswith("CPU") and report["quick"] is True
    assert list(report["models"]) == ["GPT-2 small", "ResNet-50", "1,500 small tensors"]
    for model in report["models"].values():
        variants = model["variants"]
        assert list(variants) == ["no guard", "NanGuard()", "precursors off", "sync_free=True"]
        assert variants["no guard"]["median_ratio"] == 1.0
        assert all(v["median_step_ms"] > 0 for v in variants.values())
        assert variants["no guard"]["median_guard_us_per_step"] == 0.0
        assert all(variants[v]["median_guard_us_per_step"] > 0 for v in list(variants)[1:])
    table = done.stdout
    assert "| model | tensors | no guard (ms/step) |" in table and "sync_free=True" in table
