"""DDP on two CPU processes (gloo): every decision is the same on every rank, whatever rank the fault is on.

Runs ``tests/helpers/ddp_script.py`` once per scenario in two processes (``launcher.launch``; for
``ddp_spawn``, one process whose Trainer starts the two workers) and checks the per-rank JSON
results. Marked ``slow`` but part of the default run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from launcher import HELPERS, launch

SCRIPT = HELPERS / "ddp_script.py"
TIMEOUT_S = 180

pytestmark = pytest.mark.slow

Ranks = dict[int, dict[str, Any]]


def _run(scenario: str, out: Path) -> Ranks:
    """Two ranks, each its own process; ``spawn``: one process, whose Trainer starts two workers (ddp_spawn)."""
    spawn = scenario == "spawn"
    # a rank waiting alone in a collective would hang: the timeout turns it into a failure
    launched = launch(
        SCRIPT, scenario, out, nprocs=1 if spawn else 2, out_dir=out, timeout=TIMEOUT_S, rank_env=not spawn
    )
    return launched.results(ranks=(0, 1))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    done: dict[str, Ranks] = {}

    def runner(scenario: str) -> Ranks:  # each scenario runs once per module
        if scenario not in done:
            done[scenario] = _run(scenario, tmp_path_factory.mktemp(scenario))
        return done[scenario]

    return runner


def _same_on_every_rank(ranks: Ranks, *keys: str) -> None:
    for key in keys:
        assert ranks[0][key] == ranks[1][key], f"{key} differs: {ranks[0][key]!r} != {ranks[1][key]!r}"


# ------------------------------------------------------------------------------------ a NaN on rank 1


def test_both_ranks_skip_the_same_steps_with_identical_weights(run: Any) -> None:
    ranks = run("skip")
    for data in ranks.values():
        assert (data["world_size"], data["global_step"], data["finite"], data["active"]) == (2, 24, True, True)
        assert data["skipped_steps"] == [1, 20]  # the NaN of rank 1, then its loss spike
    _same_on_every_rank(ranks, "weights_sha256", "skipped_steps", "counters")


def test_ddp_strategy_is_wrapped_on_every_rank(run: Any) -> None:
    for data in run("skip").values():
        assert data["strategy_class_during_fit"] == "NanGuardDDPStrategy"
        assert data["strategy_class_after_fit"] == "DDPStrategy"


def test_the_event_names_rank_1_and_its_sample(run: Any) -> None:
    ranks = run("skip")
    event, spike = ranks[1]["events"]
    assert (event["rank"], event["global_step"], event["batch_idx"], event["action"]) == (1, 1, 1, "skipped")
    assert event["offending_samples"] == [3]
    assert event["dataset_indices"] == [11]
    assert event["cause"] == "input"
    assert {"loss", "grad"} <= set(event["kinds"])
    assert (spike["global_step"], spike["kinds"], spike["action"]) == (20, ["loss_spike"], "skipped")
    assert (spike["cause"], spike["offending_samples"], spike["dataset_indices"]) == ("data", [5], [165])


def test_only_the_offending_rank_reports_but_every_rank_counts(run: Any) -> None:
    ranks = run("skip")
    assert ranks[0]["events"] == []
    expected = {"bad_steps_total": 1, "skipped_total": 2, "consecutive_bad_steps": 0, "spikes_total": 1}
    assert ranks[0]["counters"] == ranks[1]["counters"] == expected  # rank 0 writes TensorBoard: it must count


def test_the_shared_cause_decides_the_remedies_on_every_rank(run: Any) -> None:
    ranks = run("skip")
    assert ranks[0]["quarantined"] == ranks[1]["quarantined"] == [11, 165]  # rank 1's input and data causes
    assert [e["remedies"] for e in ranks[1]["events"]] == [
        ["quarantine: dataset indices [11] will not be trained on again"],
        ["quarantine: dataset indices [165] will not be trained on again"],
    ]


# ------------------------------------------------------------------------------------ escalation


@pytest.mark.parametrize(
    ("scenario", "rule", "step"),
    [("max_events", "max_events=2", 3), ("consecutive", "max_consecutive_bad_steps=2", 3)],
)
def test_escalation_stops_every_rank_at_the_same_step_with_the_same_rule(
    run: Any, scenario: str, rule: str, step: int
) -> None:
    ranks = run(scenario)
    for data in ranks.values():
        error = data["error"]
        assert error is not None, f"rank {data['rank']} did not stop"
        assert error["type"] == "NonFiniteTrainingError"
        assert error["step"] == step
        assert rule in error["message"]
        assert data["finite"]
    _same_on_every_rank(ranks, "weights_sha256", "counters")
    assert [e["global_step"] for e in ranks[1]["events"]][-1] == step  # the last incident is rank 1's
    assert ranks[0]["events"] == []


# ------------------------------------------------------------------------------------ remedies


def test_remedies_are_applied_on_every_rank(run: Any) -> None:
    ranks = run("lr_backoff")
    assert ranks[0]["lr"] == ranks[1]["lr"] == pytest.approx(0.005)  # 0.01 x 0.5, on both ranks
    _same_on_every_rank(ranks, "weights_sha256", "skipped_steps", "counters")
    (event,) = ranks[1]["events"]
    assert event["remedies"] == ["lr_backoff: learning rate x0.5 (group 0: 0.01 -> 0.005)"]


# ------------------------------------------------------------------------------------ failure of the guard itself


def test_an_internal_failure_on_one_rank_disables_every_rank_together(run: Any) -> None:
    """Rank 1's spike watch fails at step 0 (that part only, rank 1 only), its core check at step 1 (every rank)."""
    ranks = run("failure")  # a hang would time out in _run
    for data in ranks.values():
        assert data["global_step"] == 4  # training went on
        assert not data["active"]
        assert data["active_per_step"] == [True, True, False, False]  # failed at step 1, off from step 2
        assert data["skipped_steps"] == [1]  # the step rank 1 could not vouch for is dropped on every rank
    _same_on_every_rank(ranks, "weights_sha256")
    errors = {
        rank: [(e["global_step"], e["details"]["part"], e["action"]) for e in data["events"]]
        for rank, data in ranks.items()
    }
    assert errors[1] == [(0, "spikes", "warned"), (1, "core", "skipped")]
    assert errors[0] == [(1, "core", "skipped")]  # rank zero tells its TensorBoard that rank 1's core failed
    assert "failed on rank(s) [1]" in ranks[0]["events"][0]["details"]["error"]


# ------------------------------------------------------------------------------------ sync-free steps


def test_sync_free_skips_on_every_rank_and_reports_one_step_later(run: Any) -> None:
    ranks = run("sync_free")
    for data in ranks.values():
        assert (data["global_step"], data["finite"], data["active"]) == (4, True, True)
        assert data["skipped_steps"] == [1]  # the fused Adam kernel skipped it on both ranks
    _same_on_every_rank(ranks, "weights_sha256", "counters")
    (event,) = ranks[1]["events"]
    assert (event["global_step"], event["action"], event["dataset_indices"]) == (1, "skipped", [11])


# ------------------------------------------------------------------------------------ ddp_spawn


def test_ddp_spawn_workers_decide_together_and_the_file_keeps_the_events(run: Any) -> None:
    """``strategy="ddp_spawn"``: the guard is pickled into two fresh workers, which decide together.

    The ``NanGuard`` of the process that called ``fit`` never ran (documented): the run is in ``events.jsonl``.
    """
    ranks = run("spawn")
    for data in ranks.values():
        assert data["strategy_class_during_fit"] == "NanGuardDDPStrategy"
        assert (data["global_step"], data["finite"], data["skipped_steps"]) == (4, True, [1])
    _same_on_every_rank(ranks, "weights_sha256", "counters")
    (event,) = ranks[1]["events"]
    assert (event["global_step"], event["rank"], event["dataset_indices"]) == (1, 1, [11])
    out = Path(ranks[0]["out_dir"])
    main = json.loads((out / "main.json").read_text(encoding="utf-8"))
    assert main["events"] == [] and main["bad_steps_total"] == 0
    assert main["weights_sha256"] == ranks[0]["weights_sha256"]  # Lightning sent the weights back
    saved = [json.loads(line) for line in (out / "nanguard" / "events.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [(e["global_step"], e["rank"], e["dataset_indices"]) for e in saved] == [(1, 1, [11])]


def test_dropped_steps_leave_the_synced_epoch_values_on_every_rank(run: Any) -> None:
    """``sync_dist=True`` epoch values over both ranks equal the aggregates of the applied steps, on both ranks."""
    ranks = run("logged")
    skipped = ranks[0]["skipped_steps"]
    assert skipped == ranks[1]["skipped_steps"] == [1, 20]  # rank 1's NaN step and its label typo (a spike)
    applied = [(loss, size) for r in (0, 1) for i, loss, size in ranks[r]["records"] if i not in skipped]
    expected = {
        "train_loss_epoch": sum(loss * size for loss, size in applied) / sum(size for _, size in applied),
        "loss_sum": sum(loss for loss, _ in applied),
        "loss_max": max(loss for loss, _ in applied),
    }
    for rank in (0, 1):
        values = {key: ranks[rank]["epoch_values"][key] for key in expected}
        assert values == pytest.approx(expected, rel=1e-5), (rank, ranks[rank]["epoch_values"])
