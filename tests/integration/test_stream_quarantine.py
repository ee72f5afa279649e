"""Quarantine on streamed records (issue 32, item 4): what the guard announces is checked by its effect.

A real Trainer (and a real Fabric loop) over an ``IterableDataset`` yielding ``{"x", "y", "index"}``
records, record 5 holding a NaN. With ``NanGuard(index_key="index", remedies=["quarantine"])`` the
event says record 5 "will not be trained on again", and it is not: the stream yields it again later
in the epoch (in the very next batch, which Lightning has already fetched ahead, in a batch of its
own, and mixed with healthy records) and in the next epoch, with and without worker processes; the
batches that held it train on their other rows. Without ``index_key`` the event and a notice say
the records will NOT be removed. What is trained on is read in ``on_train_batch_start`` (the batch
``training_step`` receives; the diagnosis's own re-runs do not go through it).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import lightning.pytorch as pl
import pytest
import torch
from fitting import build_trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate, get_worker_info

from lightning_nanguard import NanGuard

BAD = 5
QUARANTINED = (f"quarantine: dataset indices [{BAD}] will not be trained on again",)
# record 5 first in batch 1; again at once in batch 2 (fetched ahead of the step that quarantines it),
# in a batch of its own (3), and among healthy records (5); each epoch replays the whole stream
ORDER = [0, 1, 2, 3, 4, BAD, 6, 7, BAD, 8, 9, 10, BAD, BAD, BAD, BAD, 11, 12, 13, 14, 15, BAD, 16, 17]


def record(i: int, index: bool = True, bad: int | None = BAD) -> dict[str, Any]:
    """Record ``i``: ``{"x", "y", "index"}`` (``"uid"`` for ``index=False``); record ``bad`` has a NaN feature."""
    g = torch.Generator().manual_seed(i)
    x = torch.randn(4, generator=g)
    if i == bad:
        x[1] = math.nan
    return {"x": x, "y": torch.randn((), generator=g), "index" if index else "uid": i}


class Records(IterableDataset):
    """The records in ``order``; with workers, position ``k`` goes to worker ``k % num_workers``, which batches it."""

    def __init__(self, order: Sequence[int], index: bool = True, bad: int | None = BAD) -> None:
        self.order, self.index, self.bad = list(order), index, bad

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        for position, i in enumerate(self.order):
            if info is None or position % info.num_workers == info.id:
                yield record(i, self.index, self.bad)


class Collated(IterableDataset):
    """Ready-made batches of the records ``batches`` lists (for ``batch_size=None``)."""

    def __init__(self, batches: Sequence[Sequence[int]]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for ids in self.batches:
            yield default_collate([record(i) for i in ids])


class Indexed(Dataset):
    """Records 0..15 of a map-style dataset."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, Any]:
        return record(i)


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch["x"]).squeeze(-1), batch["y"])


class Regressor(pl.LightningModule):
    """``Linear(4, 1)``; ``trained`` holds ``(epoch, record ids)`` of every batch its training step received."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 1)
        self.trained: list[tuple[int, list[int]]] = []

    def on_train_batch_start(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        ids = batch["index"] if "index" in batch else batch["uid"]
        self.trained.append((self.current_epoch, ids.tolist()))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return loss_fn(self.linear, batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path: Path, guard: NanGuard, num_workers: int = 0, order: Sequence[int] = ORDER, **data: Any) -> Regressor:
    module = Regressor()
    loader = DataLoader(Records(order, **data), batch_size=4, num_workers=num_workers)
    build_trainer("lightning", tmp_path, callbacks=[guard], max_epochs=2).fit(module, loader)
    return module


def _quarantining(**kwargs: Any) -> NanGuard:
    return NanGuard(index_key="index", remedies=["quarantine"], verbose=False, save_repro=False, **kwargs)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lightning_nanguard" and r.levelno == logging.WARNING]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_quarantined_record_of_a_stream_is_never_trained_on_again(num_workers: int, tmp_path: Path) -> None:
    guard = _quarantining()
    module = _fit(tmp_path, guard, num_workers)

    (event,) = guard.events  # the NaN record never reached a step again: no second incident
    assert event.dataset_indices == (BAD,) and event.remedies == QUARANTINED
    holding = [(epoch, ids) for epoch, ids in module.trained if BAD in ids]
    assert holding == [(0, holding[0][1])]  # only the batch of the incident (skipped)
    healthy = Counter(i for _, ids in module.trained for i in ids if i != BAD)
    assert healthy == Counter(i for i in ORDER * 2 if i != BAD)  # every other record, once per epoch
    assert all(ids for _, ids in module.trained)  # a batch left with no row is not trained on
    assert guard.remedy_book.quarantined == {BAD}


def test_the_batches_that_held_the_record_train_on_their_other_rows(tmp_path: Path) -> None:
    module = _fit(tmp_path, _quarantining())
    assert module.trained == [
        (0, [0, 1, 2, 3]),
        (0, [4, BAD, 6, 7]),  # the incident: its update was skipped
        (0, [8, 9, 10]),  # fetched ahead before the quarantine: cut right before it was trained on
        (0, [11, 12, 13, 14]),  # the batch of record 5 alone was not yielded
        (0, [15, 16, 17]),
        (1, [0, 1, 2, 3]),
        (1, [4, 6, 7]),
        (1, [8, 9, 10]),
        (1, [11, 12, 13, 14]),
        (1, [15, 16, 17]),
    ]


def test_a_batch_fetched_ahead_with_only_quarantined_records_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="lightning_nanguard"):
        module = _fit(tmp_path, _quarantining(), order=[0, 1, 2, 3, 4, BAD, 6, 7, BAD, BAD, BAD, BAD, 8, 9, 10, 11])
    assert [ids for epoch, ids in module.trained if epoch == 0] == [[0, 1, 2, 3], [4, BAD, 6, 7], [8, 9, 10, 11]]
    assert any("fetched ahead held only records quarantined since" in m for m in _warnings(caplog))


def test_the_weights_are_those_of_training_on_the_healthy_rows_alone(tmp_path: Path) -> None:
    """By the weights: bitwise those of plain SGD over the batches cut down by hand (the incident's update skipped)."""
    guarded = _fit(tmp_path / "guarded", _quarantining())
    by_hand = [[0, 1, 2, 3], [8, 9, 10], [11, 12, 13, 14], [15, 16, 17]]
    by_hand += [[0, 1, 2, 3], [4, 6, 7], [8, 9, 10], [11, 12, 13, 14], [15, 16, 17]]
    reference = Regressor()
    batches = DataLoader(Collated(by_hand), batch_size=None)
    build_trainer("lightning", tmp_path / "reference", max_epochs=1).fit(reference, batches)
    assert [ids for _, ids in reference.trained] == by_hand
    for mine, theirs in zip(guarded.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_without_index_key_the_event_and_a_notice_say_the_records_are_not_removed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The stream's records are named through ``row_records`` (no index field the guard could cut by)."""
    guard = NanGuard(
        remedies=["quarantine"],
        row_records=lambda batch, indices: [[int(i)] for i in batch["uid"]],
        verbose=False,
        save_repro=False,
    )
    with caplog.at_level(logging.WARNING, logger="lightning_nanguard"):
        module = _fit(tmp_path, guard, index=False)
    first = guard.events[0]
    assert first.dataset_indices == (BAD,)
    (remedy,) = first.remedies
    assert remedy.startswith(f"quarantine: dataset indices [{BAD}] will NOT be removed from training: ")
    assert "IterableDataset" in remedy and "index_key=" in remedy and "will not be trained on again" not in remedy
    assert any(BAD in ids for epoch, ids in module.trained if epoch == 1)  # indeed trained on again
    (notice,) = [m for m in _warnings(caplog) if "quarantine cannot act here" in m]
    assert "IterableDataset" in notice and "will NOT be removed from training" in notice


def test_a_map_style_loader_keeps_dropping_records_in_its_batch_sampler(tmp_path: Path) -> None:
    """``index_key`` on a map-style dataset: the batch sampler drops the record; the loader is not made to cut."""

    class Probe(L.pytorch.Callback):
        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            self.loader_class = type(trainer.train_dataloader).__name__
            self.sampler_class = type(trainer.train_dataloader.batch_sampler).__name__

    guard, probe, module = _quarantining(), Probe(), Regressor()
    loader = DataLoader(Indexed(), batch_size=4)
    build_trainer("lightning", tmp_path, callbacks=[guard, probe], max_epochs=2).fit(module, loader)
    assert (probe.loader_class, probe.sampler_class) == ("DataLoader", "NanGuardRecordingBatchSampler")
    assert guard.events[0].remedies == QUARANTINED and len(guard.events) == 1
    assert [ids for epoch, ids in module.trained if epoch == 1] == [
        [0, 1, 2, 3],
        [4, 6, 7],
        [8, 9, 10, 11],
        [12, 13, 14, 15],
    ]


class TwoStreams(Regressor):
    """Trains on two loaders' batches at once, ``{"a": ..., "b": ...}``; ``trained`` holds each part's records."""

    def __init__(self) -> None:
        super().__init__()
        self.by_loader: list[tuple[int, list[int], list[int]]] = []

    def on_train_batch_start(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.by_loader.append((self.current_epoch, batch["a"]["index"].tolist(), batch["b"]["index"].tolist()))

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return loss_fn(self.linear, batch["a"]) + loss_fn(self.linear, batch["b"])


def test_with_several_streams_the_record_is_cut_from_its_own_loader_only(tmp_path: Path) -> None:
    """Record 5 of loader b is NaN; record 5 of loader a is another, healthy record: it keeps being trained on."""
    guard, module = _quarantining(), TwoStreams()
    a = DataLoader(Records([0, 1, 2, 3, 4, BAD, 6, 7, BAD, 8, 9, 10], bad=None), batch_size=4)
    b = DataLoader(Records([20, 21, 22, 23, 24, BAD, 26, 27, 28, BAD, 29, 30]), batch_size=4)
    build_trainer("lightning", tmp_path, callbacks=[guard], max_epochs=2).fit(module, {"a": a, "b": b})
    (event,) = guard.events
    assert event.sample_loaders == ("b",) and event.dataset_indices == (BAD,)
    assert event.remedies == (f"quarantine: dataset indices [{BAD}] of loader 'b' will not be trained on again",)
    assert module.by_loader == [
        (0, [0, 1, 2, 3], [20, 21, 22, 23]),
        (0, [4, BAD, 6, 7], [24, BAD, 26, 27]),  # the incident
        (0, [BAD, 8, 9, 10], [28, 29, 30]),  # fetched ahead: only b's part is cut
        (1, [0, 1, 2, 3], [20, 21, 22, 23]),
        (1, [4, BAD, 6, 7], [24, 26, 27]),
        (1, [BAD, 8, 9, 10], [28, 29, 30]),
    ]


# ------------------------------------------------------------------------------------ a Fabric loop


def _fabric_loop(guard: NanGuard, loader: DataLoader, epochs: int = 2) -> tuple[list[tuple[int, list[int]]], list[int]]:
    """Trains ``epochs`` passes and validates every record under ``torch.no_grad()``; (trained, validated) ids."""
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[guard])
    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    train = fabric.setup_dataloaders(loader)
    val = fabric.setup_dataloaders(DataLoader(Records(ORDER), batch_size=4))
    trained, validated = [], []
    for epoch in range(epochs):
        for batch in train:
            trained.append((epoch, batch["index"].tolist()))
            fabric.backward(loss_fn(model, batch))
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():
            validated += [i for batch in val for i in batch["index"].tolist()]
    return trained, validated


@pytest.fixture
def _events_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NANGUARD_DIR", str(tmp_path))


@pytest.mark.usefixtures("_events_here")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_fabric_loop_cuts_quarantined_records_out_of_its_stream(num_workers: int) -> None:
    guard = _quarantining(loss_fn=loss_fn)
    trained, validated = _fabric_loop(guard, DataLoader(Records(ORDER), batch_size=4, num_workers=num_workers))
    (event,) = guard.events
    assert event.dataset_indices == (BAD,) and event.remedies == QUARANTINED
    assert [epoch for epoch, ids in trained if BAD in ids] == [0]  # only the batch of the incident
    assert Counter(i for _, ids in trained for i in ids if i != BAD) == Counter(i for i in ORDER * 2 if i != BAD)
    assert sorted(validated) == sorted(ORDER * 2)  # validation (autograd off) keeps every record


@pytest.mark.usefixtures("_events_here")
def test_a_fabric_loop_drops_quarantined_records_of_a_map_style_loader() -> None:
    """Before: the event said "will not be trained on again" and the next epoch trained on record 5 again."""
    guard = NanGuard(remedies=["quarantine"], loss_fn=loss_fn, verbose=False, save_repro=False)
    trained, validated = _fabric_loop(guard, DataLoader(Indexed(), batch_size=4, shuffle=True))
    (event,) = guard.events
    assert event.dataset_indices == (BAD,) and event.remedies == QUARANTINED
    assert [epoch for epoch, ids in trained if BAD in ids] == [0]
    assert sorted(validated) == sorted(ORDER * 2)


@pytest.mark.usefixtures("_events_here")
def test_a_fabric_stream_without_index_key_is_said_to_keep_its_records(caplog: pytest.LogCaptureFixture) -> None:
    guard = NanGuard(remedies=["quarantine"], loss_fn=loss_fn, verbose=False, save_repro=False)
    with caplog.at_level(logging.WARNING, logger="lightning_nanguard"):
        _fabric_loop(guard, DataLoader(Records(ORDER), batch_size=4), epochs=1)
    (notice,) = [m for m in _warnings(caplog) if "quarantine cannot act here" in m]
    assert "IterableDataset" in notice and "index_key=" in notice
    assert guard.remedy_book.reach.why_not(None) is not None
