"""Repro bundles of a sharded model: the gathered full state, or none and why (``replay`` says it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_nanguard.__main__ import main
from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.reporting.repro import BundleMissingError, load_bundle, save_bundle

EVENT = NanEvent(4, 0, 1, 1, ("loss",), "skipped", offending_samples=(1,), dataset_indices=(9,))


def test_a_gathered_state_is_saved_instead_of_the_modules_shards(tmp_path: Path) -> None:
    net = nn.Linear(2, 1)
    full = {"weight": torch.full((1, 2), 3.0), "bias": torch.zeros(1)}
    path = save_bundle(tmp_path, EVENT, net, torch.ones(2, 2), 1, [1], [9], module_state=full)
    assert json.loads((path / "module.json").read_text(encoding="utf-8"))["module_state"] == "gathered"
    assert torch.equal(torch.load(path / "module_state.pt", weights_only=True)["weight"], full["weight"])


def test_a_bundle_without_state_says_why_and_replay_refuses_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    reason = "the sharded model holds 40.0 GiB in full, above the 2 GiB a bundle gathers"
    path = save_bundle(tmp_path, EVENT, nn.Linear(2, 1), torch.ones(2, 2), 1, [1], [9], module_state=reason)
    assert not (path / "module_state.pt").exists() and (path / "batch.pt").exists()
    assert json.loads((path / "module.json").read_text(encoding="utf-8"))["module_state"] == reason
    with pytest.raises(BundleMissingError, match=r"no model state: the sharded model holds 40\.0 GiB"):
        load_bundle(path)
    assert main(["replay", str(path)]) == 2
    assert reason in capsys.readouterr().err


def test_an_ordinary_bundle_says_its_state_was_saved(tmp_path: Path) -> None:
    path = save_bundle(tmp_path, EVENT, nn.Linear(2, 1), torch.ones(2, 2), 1, None)
    assert json.loads((path / "module.json").read_text(encoding="utf-8"))["module_state"] == "saved"
