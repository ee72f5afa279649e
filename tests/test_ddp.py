"""DDP on two CPU processes (gloo): a NaN on rank 1 only is skipped on both ranks, the weights stay identical.

Runs ``tests/ddp_script.py`` once in a subprocess (Lightning launches the second process itself)
and checks the per-rank JSON results. Marked ``slow`` but part of the default run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("ddp_script.py")
TIMEOUT_S = 180

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    out = tmp_path_factory.mktemp("ddp")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for var in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"):
        env.pop(var, None)  # a clean launch, whatever the calling environment holds
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out)],
        cwd=str(out),
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, f"DDP run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results = {}
    for path in sorted(out.glob("rank*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        results[data["rank"]] = data
    return results


def test_both_ranks_finish_with_identical_weights(ranks: dict[int, dict[str, Any]]) -> None:
    assert sorted(ranks) == [0, 1]
    for data in ranks.values():
        assert data["world_size"] == 2
        assert data["global_step"] == 4
        assert data["finite"]
        assert data["active"]
    assert ranks[0]["weights_sha256"] == ranks[1]["weights_sha256"]


def test_ddp_strategy_is_wrapped_on_every_rank(ranks: dict[int, dict[str, Any]]) -> None:
    for data in ranks.values():
        assert data["strategy_class_during_fit"] == "NanGuardDDPStrategy"
        assert data["strategy_class_after_fit"] == "DDPStrategy"


def test_both_ranks_skip_the_same_step(ranks: dict[int, dict[str, Any]]) -> None:
    assert ranks[0]["skipped_steps"] == ranks[1]["skipped_steps"] == [1]
    assert ranks[0]["skipped_total"] == ranks[1]["skipped_total"] == 1


def test_the_event_names_rank_1_and_its_sample(ranks: dict[int, dict[str, Any]]) -> None:
    events = ranks[1]["events"]
    assert len(events) == 1
    event = events[0]
    assert (event["rank"], event["global_step"], event["batch_idx"], event["action"]) == (1, 1, 1, "skipped")
    assert event["offending_samples"] == [3]
    assert event["dataset_indices"] == [11]
    assert {"loss", "grad"} <= set(event["kinds"])


def test_only_the_offending_rank_reports(ranks: dict[int, dict[str, Any]]) -> None:
    assert ranks[0]["events"] == []
    assert ranks[0]["bad_steps_total"] == 0
