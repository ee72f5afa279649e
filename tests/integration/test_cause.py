"""The cause a diagnosis concludes, on a real Trainer: the guard's events, remedies and bundles.

A diverging run is the model state (no sample blamed, nothing quarantined); a data or input fault
names its samples and gets its remedies at the first incident; BatchNorm channel lists are
summarised in the event and kept whole in the bundle. The Trainer-free tests of the cause are in
``tests/diagnose/test_cause.py``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import fitting
import forensics_models as fm
import pytest
import torch
from forensics_models import one_thread  # noqa: F401 (fixture)
from models import make_case, make_loader, make_module
from torch.utils.data import DataLoader

from lightning_nanguard import NanEvent, NanGuard

pytestmark = pytest.mark.usefixtures("one_thread")


def fit(module: Any, loader: Any, root: Path, **guard_kwargs: Any) -> NanGuard:
    guard = NanGuard(verbose=False, **guard_kwargs)
    fitting.fit(module, loader, root=root, guard=guard)
    return guard


def test_diverging_run_blames_no_sample_and_quarantines_nothing(tmp_path: Path) -> None:
    """Issue 9, item 1 on a Trainer: cause "state", no samples, at most 4 passes, nothing quarantined."""
    loader = DataLoader(fm.diverging_data(), batch_size=8)
    guard = fit(fm.DivergingMLP(), loader, tmp_path, remedies=["quarantine"], max_consecutive_bad_steps=100)
    assert guard.events, "the run did not diverge"
    first = guard.events[0]
    assert first.cause == "state" and first.offending_samples is None and first.dataset_indices is None
    assert first.details["state_passes"] <= 4 and first.details["bisect_passes"] <= 4
    assert "not the data" in first.details["not_attributable"]
    assert not any(r.startswith("quarantine") for e in guard.events for r in e.remedies)


def test_data_fault_on_a_trainer_is_data(tmp_path: Path) -> None:
    case = make_case("cosine_norm", bad=(11,))
    guard = fit(make_module("lightning", "cosine_norm"), make_loader(case.dataset), tmp_path)
    assert [(e.cause, e.offending_samples) for e in guard.events] == [("data", (3,))]


def test_trainer_state_cause_uses_the_reference_sample(tmp_path: Path) -> None:
    loader = DataLoader(fm.diverging_data(), batch_size=8)
    guard = fit(fm.DivergingMLP(), loader, tmp_path, max_consecutive_bad_steps=100)
    assert guard.events[0].cause == "state" and guard.events[0].details["state_passes"] == 1


def test_trainer_whole_corrupt_batch_is_data_with_the_reference(tmp_path: Path) -> None:
    case = make_case("cosine_norm", bad=tuple(range(8, 16)))
    guard = fit(make_module("lightning", "cosine_norm"), make_loader(case.dataset), tmp_path)
    assert [(e.cause, e.offending_samples) for e in guard.events] == [("data", tuple(range(8)))]


def test_trainer_state_applies_clip_grad_and_lr_backoff_at_the_first_incident(tmp_path: Path) -> None:
    loader = DataLoader(fm.diverging_data(), batch_size=8)
    guard = fit(
        fm.DivergingMLP(), loader, tmp_path, remedies=["clip_grad", "lr_backoff"], max_consecutive_bad_steps=100
    )
    first = guard.events[0]
    assert first.cause == "state"
    assert any(r.startswith("clip_grad") for r in first.remedies)
    assert any(r.startswith("lr_backoff") for r in first.remedies)


def test_trainer_input_fault_is_quarantined_at_the_first_incident(tmp_path: Path) -> None:
    case = make_case("input_data", value=math.nan, bad=(11,))
    guard = fit(make_module("lightning", "input_data"), make_loader(case.dataset), tmp_path, remedies=["quarantine"])
    first = guard.events[0]
    assert (first.cause, first.dataset_indices) == ("input", (11,))
    assert any(r.startswith("quarantine") for r in first.remedies)


def wide_batchnorm_run(root: Path) -> NanEvent:
    """Step 1 is not checked, so its NaN input reaches the weights; at step 2 every BatchNorm channel is NaN."""
    loader = DataLoader(fm.nan_sample_data(bad=(11,)), batch_size=8)
    guard = fit(fm.WideBatchNormModule(layers=6, width=16), loader, root, check_every_n_steps=2)
    assert guard.events and guard.events[0].global_step == 2
    return guard.events[0]


def test_many_batchnorm_channels_are_summarised_in_the_event(tmp_path: Path) -> None:
    event = wide_batchnorm_run(tmp_path)
    assert event.cause == "state"  # the weights are NaN: no sample is to blame
    assert event.details["bn_channels"] == {f"net.{1 + 3 * i}": list(range(8)) for i in range(4)}
    assert event.details["bn_channels_summary"] == {
        "layers": 6,
        "channels": 96,
        "counts": {f"net.{1 + 3 * i}": 16 for i in range(4)},
    }
    assert len(event.nonfinite_buffers) == 12  # the documented list fields stay complete
    line = (Path(event.repro_path).parents[0] / "events.jsonl").read_text().splitlines()[0]
    assert len(line) < 6000


def test_trainer_bundle_keeps_the_full_channel_lists(tmp_path: Path) -> None:
    """The event's bn_channels are short; the bundle's details_full.json has every channel."""
    import json

    event = wide_batchnorm_run(tmp_path)
    full = json.loads((Path(event.repro_path) / "details_full.json").read_text())
    assert full["bn_channels"] == {f"net.{1 + 3 * i}": list(range(16)) for i in range(6)}


def test_trainer_source_paths_are_relative_to_the_directory_at_fit_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A callback moves the working directory during training; paths stay relative to where fit started."""
    import os

    from lightning.pytorch import Callback

    class MoveAway(Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            os.chdir(tmp_path / "elsewhere")

    (tmp_path / "elsewhere").mkdir()
    helpers_dir = Path(fm.__file__).resolve().parent
    monkeypatch.chdir(helpers_dir.parents[1])  # the repository: tests/helpers/models.py
    case = make_case("cosine_norm", bad=(11,))
    guard = NanGuard(verbose=False)
    module = make_module("lightning", "cosine_norm")
    fitting.fit(module, make_loader(case.dataset), root=tmp_path, guard=guard, callbacks=[MoveAway()])
    assert guard.events[0].source_line is not None and guard.events[0].source_line.startswith(
        "tests/helpers/models.py:"
    )


def test_trainer_bundle_replays_the_origin_in_the_real_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bundle keeps a healthy sample of the batch next to the offending ones (not only with BatchNorm).

    Without it, the replayed sub-batch holds only empty documents, where Hugging Face's LM loss is
    NaN too, and replay names that loss instead of the user's division that training named.
    """
    import json

    import third_party_models as tp

    from lightning_nanguard.__main__ import main

    torch.manual_seed(0)
    loader = DataLoader(tp.documents(24, 12, empty=(10, 13)), batch_size=8)
    event = fit(tp.GPT2WithMaskedMean(), loader, tmp_path).events[0]
    assert event.culprit_op == "DivBackward0" and event.repro_path is not None
    assert main(["replay", event.repro_path, "--json"]) == 0
    replayed = json.loads(next(line for line in capsys.readouterr().out.splitlines() if line.startswith("{")))
    assert (replayed["culprit_op"], replayed["source_line"]) == (event.culprit_op, event.source_line)
