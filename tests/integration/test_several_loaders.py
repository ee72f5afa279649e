"""Several training loaders (issue 18, item 1): every way ``fit`` accepts them, on a real Trainer.

The ground truth is computed without the guard: each loader's sampler logs the order it yields
(``multitask_models.OrderLog``), and the batches ``training_step`` received are kept
(``BatchKeeper``). An offending sample must be named by its loader, its position in that loader's
part of the batch and its index in that loader's dataset; quarantine must drop an index from its
own loader only.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fitting
import multitask_models as mm
import pytest
import torch
from fitting import build_trainer
from forensics_models import one_thread  # noqa: F401 (fixture)
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import CombinedLoader
from models import origin_line
from tensorboard_runs import read_tensorboard

from lightning_nanguard import NanEvent, NanGuard, read_events
from lightning_nanguard.reporting.text import event_text

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[2]
MM_FILE = mm.__file__


def fit(collection: Any, paths: list[tuple[Any, ...]], root: Path, epochs: int = 1, **guard_kwargs: Any) -> Any:
    guard = NanGuard(verbose=False, **guard_kwargs)
    keeper = mm.BatchKeeper()
    module = mm.MultiTaskModule(paths)
    trainer, _ = fitting.fit(
        module, collection, root=root, guard=guard, callbacks=[keeper], max_epochs=epochs, require_active=True
    )
    return guard, keeper, trainer


def expected_samples(
    loaders: dict[Any, tuple[Any, Any]], batch_sizes: dict[Any, int], steps: int, cycle: bool
) -> set[tuple[int, Any, int, int]]:
    """``(step, loader key, position, dataset index)`` of every blank item, from each sampler's logged order.

    Args:
        loaders: key -> (DataLoader with an ``OrderLog`` sampler, its dataset).
        batch_sizes: key -> batch size.
        steps: steps in the epoch.
        cycle: a shorter loader starts over (``max_size_cycle``); otherwise it gives nothing once exhausted.
    """
    found = set()
    for key, (data_loader, dataset) in loaders.items():
        size = batch_sizes[key]
        blank = {i for i in range(len(dataset)) if not dataset.tensors[0][i].any()}
        step = 0
        for order in data_loader.sampler.passes:
            batches = [order[i : i + size] for i in range(0, len(order), size)]
            for batch in batches:
                if step >= steps:
                    break
                found.update((step, key, position, index) for position, index in enumerate(batch) if index in blank)
                step += 1
            if not cycle:
                break
    return found


def named_samples(events: list[NanEvent]) -> set[tuple[int, Any, int, int]]:
    out = set()
    for event in events:
        assert event.sample_loaders is not None and event.dataset_indices is not None, event.headline()
        assert event.offending_samples is not None
        parts = zip(event.sample_loaders, event.offending_samples, event.dataset_indices, strict=True)
        out.update((event.batch_idx, key, position, index) for key, position, index in parts)
    return out


def check_against_batches(
    events: list[NanEvent], keeper: mm.BatchKeeper, datasets: dict[Any, Any], paths: dict
) -> None:
    """Each named sample is that loader's dataset item at that position of the batch the Trainer gave."""
    for event in events:
        batch = keeper.batches[(event.epoch, event.batch_idx)]
        for key, position, index in zip(
            event.sample_loaders or (), event.offending_samples or (), event.dataset_indices or (), strict=True
        ):
            x, _ = mm.get_part(batch, paths[key])
            assert torch.equal(x[position], datasets[key].tensors[0][index])
            assert not x[position].any()  # a blank item


# ------------------------------------------------------------------------------------ the collections fit accepts


def _dict_loaders() -> tuple[Any, dict, dict, dict, bool]:
    data = {"a": mm.blank_dataset(32, (13,), seed=1), "b": mm.blank_dataset(12, (6, 9), seed=2)}
    sizes = {"a": 8, "b": 4}
    loaders = {key: mm.loader(data[key], sizes[key], shuffle=False) for key in data}
    return loaders, {k: (loaders[k], data[k]) for k in data}, sizes, {"a": ("a",), "b": ("b",)}, True


def _list_loaders() -> tuple[Any, dict, dict, dict, bool]:
    data = {0: mm.blank_dataset(24, (3,), seed=3), 1: mm.blank_dataset(24, (17,), seed=4)}
    sizes = {0: 6, 1: 8}
    loaders = [mm.loader(data[k], sizes[k], seed=10 + k) for k in data]
    return loaders, {k: (loaders[k], data[k]) for k in data}, sizes, {0: (0,), 1: (1,)}, True


def _nested_max_size() -> tuple[Any, dict, dict, dict, bool]:
    data = {
        "main": mm.blank_dataset(32, (21,), seed=5),
        "aux.0": mm.blank_dataset(16, (2,), seed=6),
        "aux.1": mm.blank_dataset(9, (8,), seed=7),
    }
    sizes = {"main": 8, "aux.0": 4, "aux.1": 3}
    loaders = {key: mm.loader(data[key], sizes[key], seed=20 + i) for i, key in enumerate(data)}
    collection = CombinedLoader({"main": loaders["main"], "aux": [loaders["aux.0"], loaders["aux.1"]]}, mode="max_size")
    paths = {"main": ("main",), "aux.0": ("aux", 0), "aux.1": ("aux", 1)}
    return collection, {k: (loaders[k], data[k]) for k in data}, sizes, paths, False


def _min_size() -> tuple[Any, dict, dict, dict, bool]:
    data = {"a": mm.blank_dataset(40, (1, 30), seed=8), "b": mm.blank_dataset(16, (11,), seed=9)}
    sizes = {"a": 8, "b": 4}
    loaders = {key: mm.loader(data[key], sizes[key], seed=30 + i) for i, key in enumerate(data)}
    return (
        CombinedLoader(loaders, mode="min_size"),
        {k: (loaders[k], data[k]) for k in data},
        sizes,
        {"a": ("a",), "b": ("b",)},
        False,
    )


def _equal_sizes() -> tuple[Any, dict, dict, dict, bool]:
    """Both loaders of 8: the old guard cut both parts at the same positions and named a's item for b's."""
    data = {"a": mm.blank_dataset(32, (), seed=10), "b": mm.blank_dataset(32, (13,), seed=11)}
    sizes = {"a": 8, "b": 8}
    loaders = {key: mm.loader(data[key], 8, seed=40 + i) for i, key in enumerate(data)}
    return loaders, {k: (loaders[k], data[k]) for k in data}, sizes, {"a": ("a",), "b": ("b",)}, True


COLLECTIONS: dict[str, Callable[[], tuple[Any, dict, dict, dict, bool]]] = {
    "dict": _dict_loaders,
    "list": _list_loaders,
    "nested-max_size": _nested_max_size,
    "min_size": _min_size,
    "equal-sizes": _equal_sizes,
}


@pytest.mark.parametrize("name", list(COLLECTIONS))
def test_each_offending_sample_is_named_with_its_loader_and_its_index(name: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    collection, loaders, sizes, paths, cycle = COLLECTIONS[name]()
    guard, keeper, trainer = fit(collection, list(paths.values()), tmp_path)
    steps = trainer.num_training_batches
    expected = expected_samples(loaders, sizes, steps, cycle)
    assert expected, "the data put no blank item in the epoch"
    assert named_samples(guard.events) == expected
    check_against_batches(guard.events, keeper, {k: d for k, (_, d) in loaders.items()}, paths)
    for event in guard.events:
        assert event.cause == "data" and event.action == "skipped"
        assert (event.culprit_op, event.phase) == ("SqrtBackward0", "backward")
        assert event.source_line is not None and event.source_line.endswith(
            f"multitask_models.py:{origin_line('multitask_norm', MM_FILE)}"
        )
        active = [
            [key, sizes[key]]
            for key in paths
            if mm.get_part(keeper.batches[(0, event.batch_idx)], paths[key]) is not None
        ]
        assert event.details["loader_batch_sizes"] == active
        assert (
            event.details["bisect_passes"]
            <= 2 * len(event.offending_samples or ()) * math.ceil(math.log2(sum(s for _, s in active))) + 4
        )
    assert [e.to_dict() for e in read_events(tmp_path / "nanguard" / "events.jsonl")] == [
        e.to_dict() for e in guard.events
    ]


def test_the_same_step_names_samples_of_both_loaders(tmp_path: Path) -> None:
    """Unshuffled: a's item 13 (batch 1, position 5) and b's item 6 (batch 1, position 2) in one step."""
    collection, _, _, paths, _ = _dict_loaders()
    guard, _, _ = fit(collection, list(paths.values()), tmp_path)
    first = guard.events[0]
    assert (first.global_step, first.sample_loaders, first.offending_samples, first.dataset_indices) == (
        1,
        ("a", "b"),
        (5, 2),
        (13, 6),
    )
    assert first.to_dict()["sample_loaders"] == ["a", "b"]
    assert "loader 'a': [5] of 8 (dataset indices [13]); loader 'b': [2] of 4 (dataset indices [6])" in event_text(
        first
    )


def test_loader_shown_in_tensorboard_and_the_bundle_replays_it(tmp_path: Path) -> None:
    collection, _, _, paths, _ = _dict_loaders()
    guard = NanGuard(verbose=False)
    logger = TensorBoardLogger(str(tmp_path), name="run", version=0)
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard], logger=logger)
    trainer.fit(mm.MultiTaskModule(list(paths.values())), collection)
    event = guard.events[-1]  # step 2: b's item 9 at position 1
    assert (event.sample_loaders, event.offending_samples, event.dataset_indices) == (("b",), (1,), (9,))
    texts = [text for _, text in read_tensorboard(logger.log_dir).texts("nanguard/events/text_summary")]
    assert any("loader 'b': [1] of 4 (dataset indices [9])" in text for text in texts)

    assert event.repro_path is not None
    meta = json.loads((Path(event.repro_path) / "module.json").read_text(encoding="utf-8"))
    assert meta["loaders"] == [{"key": "a", "path": ["a"]}, {"key": "b", "path": ["b"]}]
    offending = [i for i, key in enumerate(meta["sample_loaders"]) if key == "b" and meta["positions"][i] == 1]
    assert [meta["sample_dataset_indices"][i] for i in offending] == [9]
    assert set(meta["sample_loaders"]) == {"a", "b"}  # loader a keeps healthy samples: its loss stays defined
    replayed = subprocess.run(
        [sys.executable, "-m", "lightning_nanguard", "replay", event.repro_path, "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": f"{REPO / 'tests' / 'helpers'}{os.pathsep}{REPO}"},
        timeout=300,
    )
    assert replayed.returncode == 0, replayed.stderr
    again = NanEvent.from_dict(json.loads(replayed.stdout.strip().splitlines()[-1]))
    assert (again.sample_loaders, again.offending_samples, again.dataset_indices) == (("b",), (1,), (9,))
    assert (again.culprit_op, again.source_line) == (event.culprit_op, event.source_line)
    assert again.details["loader_batch_sizes"] == event.details["loader_batch_sizes"]


# ------------------------------------------------------------------------------------ quarantine


def _quarantine_loaders() -> tuple[dict[str, Any], dict[str, Any]]:
    data = {"a": mm.blank_dataset(16, (), seed=12), "b": mm.blank_dataset(16, (5,), seed=13)}
    return {key: mm.loader(data[key], 4, seed=50 + i) for i, key in enumerate(data)}, data


def _steps_with(keeper: mm.BatchKeeper, key: str, row: torch.Tensor, epoch: int) -> list[tuple[int, bool]]:
    """``(batch_idx, weights changed)`` of the steps of ``epoch`` whose loader-``key`` part holds ``row``."""
    out = []
    for (e, batch_idx), batch in sorted(keeper.batches.items()):
        x, _ = batch[key]
        if e == epoch and any(torch.equal(r, row) for r in x):
            out.append((batch_idx, keeper.changed[(e, batch_idx)]))
    return out


def test_quarantine_drops_an_index_from_its_own_loader_only(tmp_path: Path) -> None:
    """b's item 5 is blank; a's item 5 is healthy: after the incident a's item 5 is still trained on."""
    torch.manual_seed(0)
    loaders, data = _quarantine_loaders()
    guard, keeper, trainer = fit(loaders, [("a",), ("b",)], tmp_path, epochs=2, remedies=["quarantine"])
    (event,) = guard.events
    assert (event.epoch, event.sample_loaders, event.dataset_indices) == (0, ("b",), (5,))
    assert event.remedies == ("quarantine: dataset indices [5] of loader 'b' will not be trained on again",)
    assert guard.remedy_book.quarantined == set() and guard.remedy_book.quarantined_by_loader == {"a": set(), "b": {5}}
    assert _steps_with(keeper, "b", data["b"].tensors[0][5], epoch=1) == []  # never yielded again
    trained = _steps_with(keeper, "a", data["a"].tensors[0][5], epoch=1)
    assert len(trained) == 1 and trained[0][1], "a's healthy item 5 must still be trained on"
    assert all(len(batch["b"][0]) + len(batch["a"][0]) > 0 for batch in keeper.batches.values())

    # the per-loader quarantine survives a checkpoint and a resume
    checkpoint = tmp_path / "epoch2.ckpt"
    trainer.save_checkpoint(checkpoint)
    saved = torch.load(checkpoint, weights_only=True)
    state = next(v for k, v in saved["callbacks"].items() if "NanGuard" in k)
    assert state["recovery"]["remedies"]["quarantined_by_loader"] == [["b", [5]]]
    resumed = NanGuard(verbose=False, remedies=["quarantine"])
    keeper = mm.BatchKeeper()
    loaders, _ = _quarantine_loaders()
    trainer = build_trainer("lightning", tmp_path, callbacks=[resumed, keeper], max_epochs=3)
    trainer.fit(mm.MultiTaskModule([("a",), ("b",)]), loaders, ckpt_path=str(checkpoint))
    assert resumed.remedy_book.quarantined_by_loader["b"] == {5} and len(resumed.events) == 1
    assert _steps_with(keeper, "b", data["b"].tensors[0][5], epoch=2) == []
    assert [changed for _, changed in _steps_with(keeper, "a", data["a"].tensors[0][5], epoch=2)] == [True]


def test_an_old_flat_quarantine_list_applies_to_every_loader(tmp_path: Path) -> None:
    """A checkpoint of the guard before per-loader quarantine: its indices were dropped from every loader."""
    loaders, data = _quarantine_loaders()
    guard = NanGuard(verbose=False, remedies=["quarantine"])
    guard.load_state_dict({"recovery": {"remedies": {"applied": {"quarantine": 1}, "quarantined": [5]}}})
    keeper = mm.BatchKeeper()
    build_trainer("lightning", tmp_path, callbacks=[guard, keeper]).fit(mm.MultiTaskModule([("a",), ("b",)]), loaders)
    assert guard.events == []  # b's blank item 5 is never yielded
    assert _steps_with(keeper, "a", data["a"].tensors[0][5], epoch=0) == []
    assert _steps_with(keeper, "b", data["b"].tensors[0][5], epoch=0) == []


# ------------------------------------------------------------------------------------ when the mapping is unknown


def test_a_loader_without_recorded_indices_is_named_and_its_indices_said_unknown(tmp_path: Path) -> None:
    data_a, data_b = mm.blank_dataset(32, (), seed=14), mm.blank_dataset(12, (6,), seed=15)
    collection = {"a": mm.loader(data_a, 8, shuffle=False), "b": mm.stream_loader(data_b, 4)}
    guard, keeper, _ = fit(collection, [("a",), ("b",)], tmp_path)
    (event,) = guard.events
    assert (event.batch_idx, event.sample_loaders, event.offending_samples) == (1, ("b",), (2,))
    assert event.dataset_indices is None  # not guessed
    assert "loader 'b'" in event.details["dataset_indices_unknown"]
    assert "IterableDataset" in event.details["dataset_indices_unknown"]
    assert not keeper.batches[(0, 1)]["b"][0][2].any()


class Flattening(mm.MultiTaskModule):
    """Turns the dict of the loaders' batches into a tuple before ``training_step``: the layout is gone."""

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return (batch["a"], batch["b"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step({"a": batch[0], "b": batch[1]}, batch_idx)


def test_a_batch_that_is_not_the_loaders_collection_says_so(tmp_path: Path) -> None:
    data_a, data_b = mm.blank_dataset(16, (), seed=16), mm.blank_dataset(16, (6,), seed=17)
    guard = NanGuard(verbose=False)
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard])
    trainer.fit(Flattening(), {"a": mm.loader(data_a, 4, shuffle=False), "b": mm.loader(data_b, 4, shuffle=False)})
    (event,) = guard.events
    assert event.sample_loaders is None and event.dataset_indices is None
    assert "the loader of each sample is unknown" in event.details["sample_loaders_unknown"]
    assert "training loaders: the batch is not the collection of the training loaders ['a', 'b']" in event_text(event)
