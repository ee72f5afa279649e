"""``ModelParallelStrategy`` on CPU (gloo): FSDP2 (2 ranks, BatchNorm), tensor parallel (2 ranks), 2-D (4 ranks).

Each mesh runs ``tests/helpers/sharded_script.py MESH all`` once, in one process per rank
(``launcher.launch``): four fits in the same processes (see that script), every fault on
data-parallel rank 1. What is checked, for every mesh:

- ``main``: no error and the guard stays active; the steps of the forward NaN, the backward-only
  NaN, the loss spike and the divergence are skipped on every rank; the full weights are finite and
  equal on every rank; each event names the dataset index and nothing else, the cause, the op and
  the user's line, and is recorded by the lowest rank of the batch that holds it only; the
  divergence is a ``"state"`` cause rolled back bitwise, with the same learning-rate back-off on
  every rank; one host read per healthy step;
- ``sync_free``: the bad steps are skipped inside the fused Adam kernel on every rank, reported one
  step late, with no host read on healthy steps;
- ``abort``: a diagnosis that cannot finish on one rank ends on every rank, with the reason in the event;
- ``save`` / ``resume``: a checkpoint taken with NaN weights holds the last good snapshot's shards;
  the guard's counters, quarantine and each rank's own spike statistic come back from the sharded
  checkpoint, and a rollback after the resume restores the state bitwise.

Plus a repro bundle of the FSDP2 run replayed in a fresh process (the model state gathered from
the shards). Marked ``slow`` but part of the default run: about 3-4 minutes on two cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from launcher import HELPERS, REPO, launch

SCRIPT = HELPERS / "sharded_script.py"
TIMEOUT_S = 600  # a rank waiting alone in a collective would hang: this turns it into a failure
MESHES = {"fsdp2": 2, "tp": 2, "2d": 4, "one": 1}  # processes ("one": FSDP2 on a single process, nothing to wait for)
MAIN_SKIPPED = [1, 3, 6, 8]  # forward NaN, backward-only NaN, loss spike, divergence (rolled back)

pytestmark = pytest.mark.slow

Fits = dict[str, dict[int, dict[str, Any]]]  # fit -> rank -> result


def _env() -> dict[str, str]:
    """The environment of the replay's fresh process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for var in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"):
        env.pop(var, None)  # a clean launch, whatever the calling environment holds
    return env


def _run(mesh: str, out: Path) -> Fits:
    launch(SCRIPT, mesh, "all", out, nprocs=MESHES[mesh], out_dir=out, timeout=TIMEOUT_S)
    fits: Fits = {}
    for path in sorted(out.glob("*-rank*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        fits.setdefault(path.name.split("-rank")[0], {})[data["rank"]] = data
    for fit in ("main", "sync_free", "save", "resume", "abort"):
        assert sorted(fits.get(fit, {})) == list(range(MESHES[mesh])), f"not every rank finished {fit}"
    return fits


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    done: dict[str, Fits] = {}

    def runner(mesh: str) -> Fits:  # each mesh runs once per module
        if mesh not in done:
            done[mesh] = _run(mesh, tmp_path_factory.mktemp(mesh))
        return done[mesh]

    return runner


def _marker_line(marker: str) -> int:
    lines = SCRIPT.read_text(encoding="utf-8").splitlines()
    return next(i for i, line in enumerate(lines, start=1) if line.rstrip().endswith(f"# {marker}"))


def _events(ranks: dict[int, dict[str, Any]], step: int) -> list[dict[str, Any]]:
    return [event for data in ranks.values() for event in data["events"] if event["global_step"] == step]


def _same(ranks: dict[int, dict[str, Any]], key: str) -> Any:
    values = [data[key] for data in ranks.values()]
    assert all(value == values[0] for value in values), f"{key} differs across ranks: {values}"
    return values[0]


def _bad_group_leader(ranks: dict[int, dict[str, Any]]) -> int:
    """The lowest rank of data-parallel rank 1's batch (the only data-parallel rank of a tensor-parallel run)."""
    bad_dp = max(data["dp_rank"] for data in ranks.values())
    return min(rank for rank, data in ranks.items() if data["dp_rank"] == bad_dp)


MESH_PARAMS = pytest.mark.parametrize("mesh", list(MESHES))


# ------------------------------------------------------------------------------------ main: every fault, every mesh


@MESH_PARAMS
def test_no_error_the_guard_stays_active_and_every_rank_skips_the_same_steps(run: Any, mesh: str) -> None:
    ranks = run(mesh)["main"]
    for data in ranks.values():
        assert (data["error"], data["active"], data["global_step"]) == (None, True, 11)
        assert data["skipped_steps"] == MAIN_SKIPPED
        assert data["finite"] and data["buffers_finite"]
    _same(ranks, "counters")
    assert ranks[0]["counters"] == {"bad_steps_total": 3, "skipped_total": 4, "spikes_total": 1}


@MESH_PARAMS
def test_the_full_weights_are_equal_on_every_rank(run: Any, mesh: str) -> None:
    """Gathered at the end on every rank: data-parallel and tensor-parallel ranks hold the same model."""
    for fit in ("main", "sync_free", "resume"):
        _same(run(mesh)[fit], "full_hashes")


@MESH_PARAMS
def test_a_nan_record_is_named_with_its_op_and_line(run: Any, mesh: str) -> None:
    ranks = run(mesh)["main"]
    (event,) = _events(ranks, 1)  # one event in the whole world, by the batch's lowest rank
    assert event["rank"] == _bad_group_leader(ranks)
    assert event["dataset_indices"] == [ranks[0]["dataset_index"]["zero"]]
    assert (event["cause"], event["phase"], event["culprit_op"]) == ("data", "forward", "div")
    assert event["source_line"].endswith(f"sharded_script.py:{_marker_line('FORWARD ORIGIN')}")
    assert "loss" in event["kinds"]
    assert event["action"] == "rolled_back"


@MESH_PARAMS
def test_a_nan_born_only_in_backward_is_found_on_the_rank_whose_data_holds_it(run: Any, mesh: str) -> None:
    """The NaN lands in the shard of ``gate.weight`` that data-parallel rank 0 holds; rank 1's record is at fault.

    Every data-parallel rank re-runs its batch (gradients of the unsharded parameters, its own); only
    the batch that reproduces it is reported.
    """
    ranks = run(mesh)["main"]
    (event,) = _events(ranks, 3)
    assert event["rank"] == _bad_group_leader(ranks)
    assert event["dataset_indices"] == [ranks[0]["dataset_index"]["backward"]]
    assert (event["cause"], event["phase"], event["culprit_op"]) == ("data", "backward", "SqrtBackward0")
    assert event["culprit_module"] == "net.gate"
    assert event["source_line"].endswith(f"sharded_script.py:{_marker_line('BACKWARD ORIGIN')}")
    assert event["kinds"] == ["grad"] and event["nonfinite_grads"] == ["net.gate.weight"]
    searched = event["details"]["sharding"]["searched_ranks"]
    assert searched == sorted(ranks)  # gradients only: every batch was searched


@MESH_PARAMS
def test_a_loss_spike_is_skipped_and_its_record_named(run: Any, mesh: str) -> None:
    ranks = run(mesh)["main"]
    (event,) = _events(ranks, 6)
    assert (event["kinds"], event["action"], event["cause"]) == (["loss_spike"], "skipped", "data")
    assert event["dataset_indices"] == [ranks[0]["dataset_index"]["typo"]]


@MESH_PARAMS
def test_a_divergence_is_the_state_rolled_back_bitwise_with_remedies_on_every_rank(run: Any, mesh: str) -> None:
    ranks = run(mesh)["main"]
    events = _events(ranks, 8)
    leaders = {min(r for r, d in ranks.items() if d["dp_rank"] == dp) for dp in {d["dp_rank"] for d in ranks.values()}}
    assert sorted(e["rank"] for e in events) == sorted(leaders)  # every batch fails: each batch's lowest rank
    for event in events:
        assert (event["cause"], event["action"]) == ("state", "rolled_back")
        assert event["dataset_indices"] is None
        assert any(r.startswith("lr_backoff") for r in event["remedies"])
    for data in ranks.values():
        assert data["rollback_bitwise"] is True  # weights and Adam state shards as before the injection
        assert data["rollbacks_total"] == 3
    assert _same(ranks, "lr")[-1] == pytest.approx(0.01 / 8)  # three back-offs, the same on every rank
    assert _same(ranks, "quarantined") == sorted(ranks[0]["dataset_index"].values())


@MESH_PARAMS
def test_clip_grad_uses_the_true_global_norm_on_every_rank(run: Any, mesh: str) -> None:
    """The guard's norm (shares of local shards, one reduce) against the norm of the gathered gradients."""
    ranks = run(mesh)["main"]
    reference = _same(ranks, "reference_norms")
    for data in ranks.values():
        for step, (expected, used) in enumerate(zip(reference, data["guard_norms"], strict=True)):
            if step not in MAIN_SKIPPED:
                assert used == pytest.approx(expected, rel=1e-5), f"step {step}"
    (first,) = _events(ranks, 1)
    assert any(r.startswith("clip_grad: gradient norm clipped at") for r in first["remedies"])


@MESH_PARAMS
def test_events_jsonl_tensorboard_and_the_dashboard_files_hold_every_ranks_incidents(run: Any, mesh: str) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_nanguard import read_events

    ranks = run(mesh)["main"]
    log_dir = Path(_same(ranks, "log_dir"))
    recorded = sorted((e["global_step"], e["rank"]) for data in ranks.values() for e in data["events"])
    written = sorted((e.global_step, e.rank) for e in read_events(log_dir / "nanguard" / "events.jsonl"))
    assert written == recorded
    for step, rank in recorded:  # the dashboard's files of each incident
        name = f"step-{step}" + (f"-rank{rank}" if rank else "")
        assert (log_dir / "nanguard" / "incidents" / name / "context.json").is_file()
    scalars = EventAccumulator(str(log_dir)).Reload()
    assert scalars.Scalars("nanguard/skipped_total")[-1].value == 4.0


@MESH_PARAMS
def test_one_host_read_per_healthy_step(run: Any, mesh: str) -> None:
    for data in run(mesh)["main"].values():
        healthy = [reads for step, reads in enumerate(data["reads_per_step"]) if step not in MAIN_SKIPPED]
        assert healthy and set(healthy) == {1}


# ------------------------------------------------------------------------------------ sync-free


@MESH_PARAMS
def test_sync_free_skips_inside_the_fused_optimizer_and_reports_one_step_late(run: Any, mesh: str) -> None:
    ranks = run(mesh)["sync_free"]
    for data in ranks.values():
        assert (data["error"], data["active"], data["finite"]) == (None, True, True)
        assert data["skipped_steps"] == [1, 3]
        after_bad = {2, 4}  # their first hook resolves the previous step: the diagnosis reads
        assert {reads for step, reads in enumerate(data["reads_per_step"]) if step not in after_bad} == {0}
    leader = ranks[_bad_group_leader(ranks)]
    assert [(e["global_step"], e["dataset_indices"]) for e in leader["events"]] == [
        (1, [leader["dataset_index"]["zero"]]),
        (3, [leader["dataset_index"]["backward"]]),
    ]
    assert leader["events_at_batch_end"] == [0, 0, 1, 1, 2, 2]  # each event one step after its step
    assert sum(len(d["events"]) for d in ranks.values()) == 2


# ------------------------------------------------------------------------------------ checkpoints


@MESH_PARAMS
def test_a_checkpoint_of_nan_weights_holds_the_last_good_shards(run: Any, mesh: str) -> None:
    ranks = run(mesh)["save"]
    for data in ranks.values():
        (saved,) = data["checkpoints"]
        assert (saved["step"], saved["finite"], saved["substituted_step"]) == (6, True, 5)
        assert saved["per_rank_states"] == ([MESHES[mesh]] if MESHES[mesh] > 1 else [])
    for data in run(mesh)["resume"].values():
        assert data["first_weights_finite"]  # the resumed weights are the substituted ones


@MESH_PARAMS
def test_the_guard_state_round_trips_through_the_sharded_checkpoint(run: Any, mesh: str) -> None:
    fits = run(mesh)
    for rank, data in fits["resume"].items():
        saved, loaded = fits["save"][rank]["saved_state"], data["loaded"]
        for key in ("bad_steps_total", "skipped_total", "recovery"):
            assert loaded[key] == saved[key], key
        assert loaded["spikes"] == saved["spikes"]  # this rank's own statistic, not rank zero's
        assert loaded["events"] == saved["events"]  # and its own events
        assert loaded["recovery"]["remedies"]["quarantined"] == [fits["save"][rank]["dataset_index"]["zero"]]


@MESH_PARAMS
def test_rollback_works_again_after_a_resume(run: Any, mesh: str) -> None:
    ranks = run(mesh)["resume"]
    for data in ranks.values():
        assert (data["error"], data["global_step"], data["skipped_steps"]) == (None, 10, [8])
        assert data["rollback_bitwise"] is True
        assert data["counters"]["bad_steps_total"] == 2  # one from before the checkpoint
    assert all(e["cause"] == "state" for data in ranks.values() for e in data["events"] if e["global_step"] >= 6)


# ------------------------------------------------------------------------------------ a diagnosis that cannot finish


@MESH_PARAMS
def test_a_diagnosis_that_cannot_finish_on_one_rank_ends_on_all_with_the_reason(run: Any, mesh: str) -> None:
    """The last rank cannot cut half its batch: every rank stops before that pass (no hang), training goes on."""
    ranks = run(mesh)["abort"]
    for data in ranks.values():
        assert (data["error"], data["active"], data["global_step"], data["skipped_steps"]) == (None, True, 3, [1])
    (event,) = _events(ranks, 1)
    reason = event["details"]["diagnosis_error"]
    assert f"rank {max(ranks)} could not run its pass" in reason
    assert "the last rank cannot cut half a batch" in reason
    assert event["dataset_indices"] is None and event["action"] == "skipped"


# ------------------------------------------------------------------------------------ repro bundle


def test_the_fsdp2_bundle_holds_the_gathered_state_and_replays(run: Any) -> None:
    ranks = run("fsdp2")["main"]
    (event,) = _events(ranks, 1)
    bundle = Path(event["repro_path"])
    meta = json.loads((bundle / "module.json").read_text(encoding="utf-8"))
    assert meta["module_state"] == "gathered"
    assert meta["replay_needs_trust"] is True  # so the panel and the dashboard show the command with --trust
    # --trust: the model class is defined in sharded_script.py, run as __main__; only that module file
    # (named by the bundle) defines it, and replay imports a file from a bundle only when trusted
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_nanguard", "replay", str(bundle), "--json", "--trust"],
        cwd=str(bundle.parent),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    replayed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert replayed["dataset_indices"] == event["dataset_indices"]
    assert (replayed["cause"], replayed["culprit_op"]) == ("data", "div")
    assert replayed["source_line"] == event["source_line"]
