"""``python -m lightning_nanguard replay <bundle>`` in a fresh process reproduces the training diagnosis.

Bundles are written by real training runs (module scope, once); the fresh processes run in
parallel to keep the wall time low. The models live in ``tests/helpers/forensics_models.py`` and
``tests/helpers/models.py``, importable in the child through ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import forensics_models as fm
import pipeline_models as pp
import pytest
import torch
from fitting import build_trainer, fit
from forensics_models import one_thread  # noqa: F401 (fixture)
from models import make_case, make_loader
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NanEvent, NanGuard
from lightning_nanguard.__main__ import main
from lightning_nanguard.reporting.repro import load_bundle, prune_bundles

pytestmark = pytest.mark.usefixtures("one_thread")

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
HELPERS = TESTS / "helpers"
FIELDS = ("offending_samples", "dataset_indices", "culprit_module", "culprit_op", "source_line", "phase", "cause")


def train(module: Any, loader: Any, root: Path) -> NanEvent:
    guard = NanGuard(verbose=False)
    fit(module, loader, root=root, guard=guard)
    assert len(guard.events) == 1
    event = guard.events[0]
    assert event.repro_path is not None
    return event


def interaction_loader() -> DataLoader:
    values = torch.cat([torch.arange(1.0, 9.0), torch.tensor(fm.interaction_values(8))])
    return DataLoader(TensorDataset(values), batch_size=8)


def nested_loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    gate = torch.ones(16)
    gate[12] = 0.0
    return DataLoader(TensorDataset(torch.randn(16, 4, generator=g), gate, torch.randn(16, generator=g)), batch_size=8)


def case_loader(kind: str, bad: tuple[int, ...] = (11,)) -> DataLoader:
    return make_loader(make_case(kind, bad=bad).dataset)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, NanEvent]:
    root = tmp_path_factory.mktemp("replay")
    torch.manual_seed(0)
    threads = torch.get_num_threads()  # module scope: set up before the function-scoped one_thread
    torch.set_num_threads(1)
    events = {
        "cosine_norm": train(fm.ReplayModule("cosine_norm"), case_loader("cosine_norm", (9, 14)), root / "a"),
        "bn_overflow": train(fm.ReplayModule("bn_overflow"), case_loader("bn_overflow"), root / "b"),
        "acos": train(fm.ReplayModule("acos", seed=3), case_loader("acos"), root / "c"),
        "log_zero": train(fm.ReplayModule("log_zero"), case_loader("log_zero"), root / "d"),
        "interaction": train(fm.InteractionModule(), interaction_loader(), root / "e"),
        "nested": train(fm.NestedModule(), nested_loader(), root / "f"),
    }
    # a bundle whose recorded class cannot be imported any more (e.g. it was defined in a script)
    moved = Path(events["acos"].repro_path).parent / "step-moved"
    shutil.copytree(events["acos"].repro_path, moved)
    meta = json.loads((moved / "module.json").read_text())
    meta.update(class_path="__main__:ReplayModule", module_file=None)
    (moved / "module.json").write_text(json.dumps(meta))
    events["moved"] = events["acos"].replace(repro_path=str(moved))
    torch.set_num_threads(threads)
    return events


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HELPERS), str(REPO), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"  # tiny models (see forensics_models.one_thread)
    return env


FRESH = {  # name -> extra arguments (each child imports torch and Lightning: ~5 s of CPU)
    "cosine_norm": [],
    "bn_overflow": [],
    "moved": ["--module", "forensics_models:ReplayModule"],
}


@pytest.fixture(scope="module")
def fresh(trained: dict[str, NanEvent]) -> dict[str, subprocess.CompletedProcess[str]]:
    """Run every replay in its own fresh interpreter, all at once."""
    running = {}
    for name, extra in FRESH.items():
        bundle = trained[name].repro_path
        command = [sys.executable, "-m", "lightning_nanguard", "replay", str(bundle), "--json", *extra]
        running[name] = (
            command,
            subprocess.Popen(
                command, env=child_env(), cwd=os.getcwd(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            ),
        )
    done = {}
    for name, (command, process) in running.items():
        stdout, stderr = process.communicate(timeout=240)
        done[name] = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    return done


def printed_event(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, (result.stdout, result.stderr)
    return json.loads(lines[0])


@pytest.mark.parametrize("name", list(FRESH))
def test_fresh_process_replay_prints_the_training_diagnosis(
    name: str, trained: dict[str, NanEvent], fresh: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    result = fresh[name]
    assert result.returncode == 0, result.stderr
    replayed = printed_event(result)
    expected = trained[name].to_dict()
    for field in FIELDS:
        assert replayed[field] == expected[field], field
    assert replayed["global_step"] == expected["global_step"]
    assert replayed["details"]["batch_size"] == 8
    for key in ("source_text", "hint", "module_type", "not_attributable", "bn_channels", "function", "source_path"):
        assert replayed["details"].get(key) == expected["details"].get(key), key
    assert "NanGuard" in result.stdout + result.stderr  # the terminal report is printed too


def test_fresh_process_expectations(trained: dict[str, NanEvent]) -> None:
    """What the replays above must agree with (so that agreement means something)."""
    assert trained["cosine_norm"].offending_samples == (1, 6)
    assert trained["cosine_norm"].dataset_indices == (9, 14)
    assert trained["cosine_norm"].culprit_op == "SqrtBackward0"
    assert (trained["bn_overflow"].culprit_module, trained["bn_overflow"].culprit_op) == ("net.input_bn", "running_var")
    assert trained["bn_overflow"].source_line is not None
    assert trained["interaction"].offending_samples is None
    assert "batch interaction" in trained["interaction"].details["not_attributable"]
    assert trained["nested"].culprit_module == "blocks.1.inner.norm"
    assert trained["nested"].offending_samples == (4,) and trained["nested"].dataset_indices == (12,)


# ------------------------------------------------------------------------------------ in-process replay


def test_unimportable_class_needs_module_override(
    trained: dict[str, NanEvent], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", str(trained["moved"].repro_path), "--json"]) == 2
    err = capsys.readouterr().err
    assert "could not rebuild the module" in err and "--module pkg.mod:Class" in err


@pytest.mark.parametrize("name", ["acos", "log_zero", "interaction", "nested"])
def test_in_process_replay(name: str, trained: dict[str, NanEvent], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(trained[name].repro_path), "--json"]) == 0
    replayed = json.loads(next(line for line in capsys.readouterr().out.splitlines() if line.startswith("{")))
    expected = trained[name].to_dict()
    assert {f: replayed[f] for f in FIELDS} == {f: expected[f] for f in FIELDS}
    assert replayed["details"].get("not_attributable") == expected["details"].get("not_attributable")
    op = {
        "acos": "AcosBackward0",
        "log_zero": "LogBackward0",
        "interaction": "SqrtBackward0",
        "nested": "SqrtBackward0",
    }
    assert replayed["culprit_op"] == op[name]


def test_replay_prints_only_what_it_reproduced(
    trained: dict[str, NanEvent], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Healthy samples in the bundle: nothing reproduced, and nothing of the saved diagnosis is printed."""
    bundle = tmp_path / "step-1"
    shutil.copytree(trained["log_zero"].repro_path, bundle)
    x, y = torch.load(bundle / "batch.pt", weights_only=True)
    torch.save((x / 1e4, y), bundle / "batch.pt")  # the un-normalised sample, normalised: healthy
    assert main(["replay", str(bundle), "--json"]) == 1
    out = capsys.readouterr()
    replayed = json.loads(next(line for line in out.out.splitlines() if line.startswith("{")))
    assert "did not reproduce" in out.err
    assert all(replayed[f] is None for f in FIELDS)
    assert "source_text" not in replayed["details"] and "hint" not in replayed["details"]


def test_load_bundle_rebuilds_module_and_samples(trained: dict[str, NanEvent]) -> None:
    bundle = load_bundle(trained["cosine_norm"].repro_path)
    assert isinstance(bundle.module, fm.ReplayModule) and bundle.module.hparams["kind"] == "cosine_norm"
    reference = bundle.meta["reference_positions"]  # at most one healthy sample saved next to the offending ones
    assert len(reference) <= 1
    offending = [p for i, p in enumerate(bundle.meta["positions"]) if i not in reference]
    assert offending == [1, 6] and bundle.meta["sample_dataset_indices"][len(reference) :] == [9, 14]
    assert bundle.batch_idx == 1 and bundle.event.offending_samples == (1, 6)
    x, _ = bundle.batch
    assert x.shape == (2 + len(reference), 8) and not x[len(reference) :].any()  # the two blank samples

    with_bn = load_bundle(trained["bn_overflow"].repro_path)
    assert with_bn.meta["reference_positions"] == [0] and with_bn.batch[0].shape[0] == 2


def test_prune_bundles_keeps_the_newest(tmp_path: Path) -> None:
    for step in range(5):
        (tmp_path / f"step-{step}").mkdir()
        os.utime(tmp_path / f"step-{step}", (1000 + step, 1000 + step))
    (tmp_path / "events.jsonl").write_text("")
    deleted = prune_bundles(tmp_path, keep=2)
    assert sorted(p.name for p in deleted) == ["step-0", "step-1", "step-2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.jsonl", "step-3", "step-4"]
    assert prune_bundles(tmp_path / "missing", keep=1) == []


def test_a_new_bundle_replaces_a_stale_one(trained: dict[str, NanEvent], tmp_path: Path) -> None:
    """Same step in the same directory (a second run without logger): no file of the old bundle survives."""
    from lightning_nanguard.reporting.repro import save_bundle

    event = trained["cosine_norm"]
    first = save_bundle(tmp_path, event, fm.ReplayModule("cosine_norm"), (torch.zeros(2, 8), torch.zeros(2)), 1, [1, 6])
    assert (first / "hparams.pt").exists()
    second = save_bundle(tmp_path, event, fm.StepOriginModule(), (torch.zeros(1, 3), torch.ones(1)), 1, [0])
    assert second == first and not (second / "hparams.pt").exists()
    assert isinstance(load_bundle(second).module, fm.StepOriginModule)


# ------------------------------------------------------------------------------------ bundles that are gone, paths


def test_replay_of_a_deleted_bundle_says_it_does_not_exist(
    trained: dict[str, NanEvent], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An older event's repro_path after pruning: the bundle is gone, the module is not the problem."""
    gone = tmp_path / "nanguard" / "step-3"
    assert main(["replay", str(gone)]) == 2
    err = capsys.readouterr().err
    assert f"the bundle {gone} does not exist" in err and "max_repro_bundles" in err
    assert "could not rebuild the module" not in err and "--module" not in err

    incomplete = tmp_path / "step-4"
    shutil.copytree(trained["acos"].repro_path, incomplete)
    (incomplete / "module_state.pt").unlink()
    assert main(["replay", str(incomplete)]) == 2
    assert "not a complete repro bundle: module_state.pt missing" in capsys.readouterr().err


def test_replay_from_another_directory_prints_the_same_source_line(
    trained: dict[str, NanEvent], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    event = trained["nested"]
    meta = json.loads((Path(event.repro_path) / "module.json").read_text())
    assert meta["source_root"] == os.getcwd()  # the diagnosis displayed paths relative to the working directory
    assert meta["source"] == {"line": event.source_line, "path": event.details["source_path"]}
    assert Path(event.details["source_path"]).is_absolute() and not Path(event.source_line).is_absolute()
    monkeypatch.chdir(tmp_path)
    assert main(["replay", str(event.repro_path), "--json"]) == 0
    replayed = json.loads(next(line for line in capsys.readouterr().out.splitlines() if line.startswith("{")))
    assert replayed["source_line"] == event.source_line
    assert replayed["details"]["source_path"] == event.details["source_path"]


def test_bundle_details_full_holds_the_event_details(trained: dict[str, NanEvent]) -> None:
    event = trained["bn_overflow"]
    full = json.loads((Path(event.repro_path) / "details_full.json").read_text())
    assert full["bn_channels"] == {"net.input_bn": [2]} and full["hint"] == event.details["hint"]


def test_save_bundle_writes_the_full_lists(trained: dict[str, NanEvent], tmp_path: Path) -> None:
    from lightning_nanguard.reporting.repro import save_bundle

    event = trained["cosine_norm"].replace(details={"bn_channels": {"bn": [0]}, "bn_channels_summary": {"layers": 9}})
    full = {"bn_channels": {f"bn{i}": list(range(64)) for i in range(9)}}
    path = save_bundle(
        tmp_path, event, fm.ReplayModule(), (torch.zeros(2, 8), torch.zeros(2)), 1, [1, 6], full_details=full
    )
    saved = json.loads((path / "details_full.json").read_text())
    assert saved["bn_channels"] == full["bn_channels"] and saved["bn_channels_summary"] == {"layers": 9}
    assert json.loads((path / "event.json").read_text())["details"]["bn_channels"] == {"bn": [0]}


@pytest.mark.parametrize("name", ["cosine_norm", "bn_overflow", "interaction"])
def test_the_bundle_holds_the_event_as_recorded(name: str, trained: dict[str, NanEvent]) -> None:
    """The bundle is saved during the diagnosis, before the decision: its event.json gets the decision too."""
    event = trained[name]
    saved = json.loads((Path(event.repro_path) / "event.json").read_text(encoding="utf-8"))
    assert saved["action"] == "skipped" and saved == event.to_dict()


def test_the_bundle_holds_the_remedies_applied(tmp_path: Path) -> None:
    guard = NanGuard(verbose=False, remedies=["lr_backoff"])
    build_trainer("lightning", tmp_path, callbacks=[guard]).fit(fm.InteractionModule(), interaction_loader())
    [event] = guard.events
    assert event.cause == "interaction" and "lr_backoff" in " ".join(event.remedies)
    saved = json.loads((Path(event.repro_path) / "event.json").read_text(encoding="utf-8"))
    assert saved["remedies"] == list(event.remedies) and saved["action"] == "skipped"
    lines = (Path(event.repro_path).parent / "events.jsonl").read_text(encoding="utf-8").splitlines()
    assert json.loads(lines[-1]) == saved


def test_a_batch_fault_replays_as_the_batch_beside_its_saved_reference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bundle of a "batch" cause keeps the healthy samples it rests on; replay reaches the same cause."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(17, 4, generator=g), torch.randn(17, generator=g))  # 8, 8, then 1 sample
    with pytest.warns(UserWarning, match="degrees of freedom"):
        event = train(pp.BatchStd(), DataLoader(data, batch_size=8), tmp_path)
    assert (event.cause, event.offending_samples) == ("batch", None)
    bundle = Path(event.repro_path or "")
    reference = torch.load(bundle / "reference.pt", weights_only=True)
    assert [t.shape[0] for t in reference] == [2, 2]  # the 2 reference samples of a healthy step
    assert load_bundle(bundle).reference_batch is not None
    with pytest.warns(UserWarning, match="degrees of freedom"):
        assert main(["replay", str(bundle), "--json"]) == 0
    replayed = json.loads(next(line for line in capsys.readouterr().out.splitlines() if line.startswith("{")))
    assert {f: replayed[f] for f in FIELDS} == {f: event.to_dict()[f] for f in FIELDS}
    assert replayed["details"]["verify_passes"] == 1


def test_only_a_batch_cause_keeps_reference_samples(trained: dict[str, NanEvent]) -> None:
    for name in ("cosine_norm", "log_zero", "interaction"):
        assert not (Path(trained[name].repro_path or "") / "reference.pt").exists()
