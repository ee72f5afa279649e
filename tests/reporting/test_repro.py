"""Repro bundles written and read back (``lightning_nanguard.reporting.repro``), with a tiny module."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from event_factory import make_event
from torch import nn

from lightning_nanguard.__main__ import main
from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.reporting.repro import (
    BUNDLE_FILES,
    BundleMissingError,
    import_class,
    load_bundle,
    prune_bundles,
    save_bundle,
    update_bundle_event,
)

HERE = str(Path(__file__).resolve())
EVENT = make_event(global_step=12, rank=0, loss=2.5, grad_norm=1e3, repro_path=None, details={"source_path": HERE})


class Tiny(nn.Module):
    def __init__(self, width: int = 3) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 1)
        self.register_buffer("seen", torch.zeros(()))


class TinyWithHparams(Tiny):
    """Like a LightningModule after ``save_hyperparameters()``: ``hparams`` holds the init arguments."""

    def __init__(self, width: int = 3) -> None:
        super().__init__(width)
        self.hparams = {"width": width, "_instantiator": "cli", "unused": 1}


def _save(tmp_path: Path, module: nn.Module, **kwargs: Any) -> Path:
    event = kwargs.pop("event", EVENT)
    batch = kwargs.pop("batch", (torch.randn(2, 3), torch.tensor([1, 4])))
    return save_bundle(
        tmp_path, event, module, batch, kwargs.pop("batch_idx", 4), kwargs.pop("positions", [3, 5]), **kwargs
    )


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    module = Tiny()
    with torch.no_grad():
        module.fc.weight.fill_(0.25)
        module.seen.fill_(7.0)
    x, y = torch.randn(2, 3), torch.tensor([1, 4])
    path = _save(tmp_path, module, batch=(x, y), sample_dataset_indices=[27, 29], source_root=str(tmp_path))
    assert path == tmp_path / "step-12"
    assert {p.name for p in path.iterdir()} == {*BUNDLE_FILES, "details_full.json"}  # no hparams.pt

    bundle = load_bundle(path)
    assert type(bundle.module).__name__ == "Tiny" and bundle.module.training
    assert torch.equal(bundle.module.fc.weight, module.fc.weight) and float(bundle.module.seen) == 7.0
    assert torch.equal(bundle.batch[0], x) and torch.equal(bundle.batch[1], y)
    assert bundle.batch_idx == 4 and bundle.path == path
    assert bundle.event.repro_path == str(path)
    assert bundle.event.replace(repro_path=None) == EVENT
    meta = bundle.meta
    assert meta["class_path"].endswith(":Tiny") and meta["module_file"] == HERE
    assert (meta["positions"], meta["sample_dataset_indices"], meta["reference_positions"]) == ([3, 5], [27, 29], [])
    assert meta["source_root"] == str(tmp_path)
    assert meta["source"] == {"line": "tests/models.py:98", "path": HERE}
    assert meta["torch_version"] == torch.__version__ and meta["has_hparams"] is False


def test_tensors_are_saved_detached_on_the_cpu(tmp_path: Path) -> None:
    leaf = torch.ones(2, 3, requires_grad=True)
    path = _save(tmp_path, Tiny(), batch={"x": leaf * 2, "label": "text"})
    batch = torch.load(path / "batch.pt", weights_only=False)
    assert not batch["x"].requires_grad and batch["x"].device.type == "cpu" and batch["label"] == "text"


def test_hyperparameters_rebuild_the_module(tmp_path: Path) -> None:
    path = _save(tmp_path, TinyWithHparams(width=5), batch=torch.zeros(1, 5))
    assert (path / "hparams.pt").is_file()
    bundle = load_bundle(path)
    assert bundle.module.fc.in_features == 5  # "_instantiator" and "unused" are not passed


def test_a_module_class_overrides_the_recorded_one(tmp_path: Path) -> None:
    path = _save(tmp_path, Tiny())
    meta = json.loads((path / "module.json").read_text(encoding="utf-8"))
    meta["class_path"], meta["module_file"] = "no_such_module_for_nanguard:Tiny", None  # moved since
    (path / "module.json").write_text(json.dumps(meta), encoding="utf-8")
    with pytest.raises(ImportError):
        load_bundle(path)
    bundle = load_bundle(path, module_class=f"{TinyWithHparams.__module__}:TinyWithHparams")
    assert type(bundle.module).__name__ == "TinyWithHparams"


def test_other_ranks_get_their_own_directory_and_a_rerun_replaces_the_old_one(tmp_path: Path) -> None:
    other = _save(tmp_path, Tiny(), event=make_event(global_step=12, rank=2, repro_path=None))
    assert other.name == "step-12-rank2"
    first = _save(tmp_path, TinyWithHparams())
    assert (first / "hparams.pt").exists()
    again = _save(tmp_path, Tiny())
    assert again == first and not (again / "hparams.pt").exists()  # no file of the earlier run is mixed in


def test_details_full_holds_the_full_details(tmp_path: Path) -> None:
    event = make_event(details={"bn_channels": {"bn": [0]}, "hint": "h"}, repro_path=None)
    path = _save(tmp_path, Tiny(), event=event, full_details={"bn_channels": {"bn": list(range(100))}})
    full = json.loads((path / "details_full.json").read_text(encoding="utf-8"))
    assert full == {"bn_channels": {"bn": list(range(100))}, "hint": "h"}


def test_update_bundle_event_rewrites_the_saved_event(tmp_path: Path) -> None:
    path = _save(tmp_path, Tiny())
    saved = load_bundle(path).event
    decided = saved.replace(action="rolled_back", remedies=("rolled back",), cause="state")
    assert update_bundle_event(decided)
    assert load_bundle(path).event == decided


def test_update_bundle_event_without_a_bundle(tmp_path: Path) -> None:
    assert not update_bundle_event(make_event(repro_path=None))
    assert not update_bundle_event(make_event(repro_path=str(tmp_path / "pruned")))
    assert not (tmp_path / "pruned").exists()


def test_load_bundle_of_a_missing_or_incomplete_bundle(tmp_path: Path) -> None:
    with pytest.raises(BundleMissingError, match="does not exist"):
        load_bundle(tmp_path / "step-99")
    path = _save(tmp_path, Tiny())
    (path / "batch.pt").unlink()
    with pytest.raises(BundleMissingError, match=r"batch\.pt missing"):
        load_bundle(path)
    assert issubclass(BundleMissingError, FileNotFoundError)


def test_prune_keeps_the_newest_bundles(tmp_path: Path) -> None:
    for step in range(5):
        bundle = tmp_path / f"step-{step}"
        bundle.mkdir()
        os.utime(bundle, (1_000_000 + step, 1_000_000 + step))
    (tmp_path / "events.jsonl").write_text("", encoding="utf-8")
    (tmp_path / "incidents").mkdir()
    deleted = prune_bundles(tmp_path, keep=2)
    assert [p.name for p in deleted] == ["step-0", "step-1", "step-2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.jsonl", "incidents", "step-3", "step-4"]
    assert prune_bundles(tmp_path, keep=5) == []
    assert prune_bundles(tmp_path / "missing", keep=1) == []


def test_import_class_forms() -> None:
    assert import_class("torch.nn:Linear") is nn.Linear
    assert import_class("torch.nn.Linear") is nn.Linear
    assert import_class("torch.nn:Module") is nn.Module
    with pytest.raises(TypeError, match="is not a class"):
        import_class("torch:zeros")
    with pytest.raises(ImportError):
        import_class("no_such_package_for_nanguard:Thing")


def test_import_class_from_a_script_falls_back_to_its_file(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import torch\n\nclass Net(torch.nn.Linear):\n    pass\n", encoding="utf-8")
    cls = import_class("__main__:Net", str(script), trust=True)  # executing the file needs trust
    assert cls.__name__ == "Net" and issubclass(cls, nn.Linear)
    with pytest.raises(ImportError):
        import_class("__main__:Net", str(tmp_path / "missing.py"))


# ------------------------------------------------------------------------------------ sharded models

SHARDED_EVENT = NanEvent(4, 0, 1, 1, ("loss",), "skipped", offending_samples=(1,), dataset_indices=(9,))


def test_a_gathered_state_is_saved_instead_of_the_modules_shards(tmp_path: Path) -> None:
    net = nn.Linear(2, 1)
    full = {"weight": torch.full((1, 2), 3.0), "bias": torch.zeros(1)}
    path = save_bundle(tmp_path, SHARDED_EVENT, net, torch.ones(2, 2), 1, [1], [9], module_state=full)
    assert json.loads((path / "module.json").read_text(encoding="utf-8"))["module_state"] == "gathered"
    assert torch.equal(torch.load(path / "module_state.pt", weights_only=True)["weight"], full["weight"])


def test_a_bundle_without_state_says_why_and_replay_refuses_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    reason = "the sharded model holds 40.0 GiB in full, above the 2 GiB a bundle gathers"
    path = save_bundle(tmp_path, SHARDED_EVENT, nn.Linear(2, 1), torch.ones(2, 2), 1, [1], [9], module_state=reason)
    assert not (path / "module_state.pt").exists() and (path / "batch.pt").exists()
    assert json.loads((path / "module.json").read_text(encoding="utf-8"))["module_state"] == reason
    with pytest.raises(BundleMissingError, match=r"no model state: the sharded model holds 40\.0 GiB"):
        load_bundle(path)
    assert main(["replay", str(path)]) == 2
    assert reason in capsys.readouterr().err


def test_an_ordinary_bundle_says_its_state_was_saved(tmp_path: Path) -> None:
    path = save_bundle(tmp_path, SHARDED_EVENT, nn.Linear(2, 1), torch.ones(2, 2), 1, None)
    assert json.loads((path / "module.json").read_text(encoding="utf-8"))["module_state"] == "saved"
