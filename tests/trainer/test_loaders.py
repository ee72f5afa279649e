"""The fit's training loaders: keys, indices popped per loader, per-loader quarantine (sampled or streamed), passes."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_nanguard.diagnose.combined import CombinedIndices
from lightning_nanguard.engine.data.indices import mark_epoch_end, record_batch_indices
from lightning_nanguard.engine.data.loaders import Exclusion, TrainingLoaders, loader_paths
from lightning_nanguard.recover.remedies import RemedyBook
from lightning_nanguard.reporting.notices import RankNotices
from lightning_nanguard.trainer.strategy import StrategyHooks


class Items(Dataset):
    """Item ``i`` is ``{"x": ..., "idx": offset + i}``: every batch says which items it holds."""

    def __init__(self, n: int, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.full((2,), float(i)), "idx": self.offset + i}


def test_loader_paths_follow_lightnings_flattening() -> None:
    a, b, c = (DataLoader(Items(4), batch_size=2) for _ in range(3))
    collection = {"main": a, "aux": [b, c]}
    assert [(path, leaf) for path, leaf in loader_paths(collection)] == [
        (("main",), a),
        (("aux", 0), b),
        (("aux", 1), c),
    ]
    assert [leaf for _, leaf in loader_paths(collection)] == CombinedLoader(collection).flattened
    assert loader_paths(a) == [((), a)]


def test_indices_are_popped_per_loader_and_only_when_it_gave_a_batch() -> None:
    """``max_size``: b (2 batches) is exhausted while a (3 batches) goes on; b's part is then None."""
    a, b = DataLoader(Items(6), batch_size=2), DataLoader(Items(3), batch_size=2)
    loaders = TrainingLoaders.of({"a": a, "b": b}, record_batch_indices)
    combined = CombinedLoader({"a": a, "b": b}, mode="max_size")
    seen = []
    for batch, _, _ in iter(combined):
        indices = loaders.batch_indices(batch)
        assert isinstance(indices, CombinedIndices) and not indices.mismatch
        seen.append(indices.indices)
        for key, recorded in zip(("a", "b"), indices.indices, strict=True):
            assert recorded == (batch[key]["idx"].tolist() if batch[key] is not None else None)
    assert seen == [([0, 1], [0, 1]), ([2, 3], [2]), ([4, 5], None)]


def test_index_key_is_read_from_each_loaders_part() -> None:
    a, b = DataLoader(Items(4), batch_size=2), DataLoader(Items(4, offset=50), batch_size=4)
    loaders = TrainingLoaders.of({"a": a, "b": b}, lambda loader: None)
    batch = {"a": next(iter(a)), "b": next(iter(b))}
    indices = loaders.batch_indices(batch, index_key="idx")
    assert isinstance(indices, CombinedIndices) and indices.indices == ([0, 1], [50, 51, 52, 53])


def test_a_batch_that_lost_the_layout_is_reported_and_the_fifos_stay_aligned() -> None:
    a, b = DataLoader(Items(4), batch_size=2), DataLoader(Items(6), batch_size=3)
    loaders = TrainingLoaders.of({"a": a, "b": b}, record_batch_indices)
    ia, ib = iter(a), iter(b)
    first = loaders.batch_indices((next(ia), next(ib)))  # a tuple: not the dict of the loaders
    assert isinstance(first, CombinedIndices) and "the loader of each sample is unknown" in first.mismatch
    second = loaders.batch_indices({"a": next(ia), "b": next(ib)})
    assert isinstance(second, CombinedIndices) and second.indices == ([2, 3], [3, 4, 5])


def test_quarantine_is_per_loader_and_the_shared_list_applies_to_every_loader() -> None:
    shared: set[int] = set()
    hooks = StrategyHooks(lambda optimizer: None, lambda: True, exclude=shared)
    a, b = DataLoader(Items(6), batch_size=3), DataLoader(Items(6), batch_size=3)
    hooks.start_epoch({"a": a, "b": b})
    hooks.exclude_by_loader["b"].add(4)  # what Recovery does for ("b", 4)
    assert [batch["idx"].tolist() for batch in a] == [[0, 1, 2], [3, 4, 5]]
    assert [batch["idx"].tolist() for batch in b] == [[0, 1, 2], [3, 5]]
    shared.add(1)  # an older checkpoint's flat list
    assert [batch["idx"].tolist() for batch in a] == [[0, 2], [3, 4, 5]]
    assert [batch["idx"].tolist() for batch in b] == [[0, 2], [3, 5]]
    assert 4 in Exclusion(shared, {4}) and not Exclusion(set(), set())


def test_one_loader_keeps_the_shared_quarantine_and_a_plain_index_list() -> None:
    shared = {2}
    hooks = StrategyHooks(lambda optimizer: None, lambda: True, exclude=shared)
    loader = DataLoader(Items(6), batch_size=3)
    hooks.start_epoch(loader)
    assert hooks.loaders is not None and hooks.loaders.layout is None
    batch = next(iter(loader))
    assert batch["idx"].tolist() == [0, 1] and hooks.batch_indices(batch, None) == [0, 1]
    assert hooks.exclude_by_loader == {}


# ------------------------------------------------------------------------------------ streams: no batch sampler


class Stream(IterableDataset):
    """``Items`` as an ``IterableDataset`` in ``order``: no batch sampler to drop records from."""

    def __init__(self, order: list[int]) -> None:
        self.order = order

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter([{"x": torch.full((2,), float(i)), "idx": i} for i in self.order])


def _streaming_hooks(index_key: str | None) -> tuple[StrategyHooks, RemedyBook, RankNotices]:
    book, notices = RemedyBook(enabled=("quarantine",)), RankNotices()
    hooks = StrategyHooks(
        lambda optimizer: None, lambda: True, exclude=book.quarantined, exclude_by_loader=book.quarantined_by_loader
    )
    hooks.enforce_quarantine(book, index_key, None, notices)
    return hooks, book, notices


def test_each_stream_of_several_cuts_its_own_quarantine_and_the_book_knows_which_loaders_act() -> None:
    hooks, book, _ = _streaming_hooks("idx")
    a, b = DataLoader(Stream([0, 4, 1, 2]), batch_size=2), DataLoader(Stream([4, 5, 6, 4]), batch_size=2)
    mapped = DataLoader(Items(4), batch_size=2)
    for loader in (a, b, mapped):
        hooks.record(loader)  # what process_dataloader does for each training loader
        hooks.cut_streams(loader, None, world_size=1)
    assert hooks.streams == [a, b]  # the map-style loader keeps its batch sampler path
    hooks.start_epoch({"a": a, "b": b, "m": mapped})
    assert hooks.loaders is not None and hooks.loaders.unreachable == [None, None, None]
    assert book.reach.acting == {"a", "b", "m"}
    assert (
        book.quarantine(items=[("b", 4)])
        == "quarantine: dataset indices [4] of loader 'b' will not be trained on again"
    )
    assert [batch["idx"].tolist() for batch in a] == [[0, 4], [1, 2]]  # loader a's record 4 is another record
    assert [batch["idx"].tolist() for batch in b] == [[5], [6]]  # each batch cut down to its other rows
    book.quarantined.add(1)  # an older checkpoint's flat list: every loader
    assert [batch["idx"].tolist() for batch in a] == [[0, 4], [2]]


def test_a_batch_fetched_before_the_quarantine_is_cut_when_it_is_about_to_be_trained_on() -> None:
    hooks, book, _ = _streaming_hooks("idx")
    a, b = DataLoader(Stream([0, 1]), batch_size=2), DataLoader(Stream([3, 4]), batch_size=2)
    for loader in (a, b):
        hooks.cut_streams(loader, None, world_size=1)
    hooks.start_epoch({"a": a, "b": b})
    fetched = {"a": next(iter(a)), "b": next(iter(b))}
    assert hooks.cut_fetched_batch(fetched) is fetched  # nothing quarantined: the batch itself
    book.quarantine(items=[("b", 4)])
    cut = hooks.cut_fetched_batch(fetched)
    assert cut["a"]["idx"].tolist() == [0, 1] and cut["b"]["idx"].tolist() == [3]
    book.quarantine(items=[("b", 3)])
    assert hooks.cut_fetched_batch(fetched) is None  # loader b's part has no row left: Lightning skips the batch
    hooks.start_epoch(a)
    book.quarantined.add(0)
    assert hooks.cut_fetched_batch(next(iter(a)))["idx"].tolist() == [1]


def test_a_stream_without_index_key_is_left_alone_and_the_book_and_a_notice_say_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hooks, book, _ = _streaming_hooks(None)
    stream = DataLoader(Stream([0, 1]), batch_size=2)
    hooks.cut_streams(stream, None, world_size=1)
    assert hooks.streams == [] and type(stream) is DataLoader
    with caplog.at_level(logging.WARNING, logger="lightning_nanguard"):
        hooks.start_epoch(stream)
    why = book.reach.why_not(None)
    assert why is not None and "IterableDataset" in why and "index_key=" in why
    assert book.quarantine([0]) == f"quarantine: dataset indices [0] will NOT be removed from training: {why}"
    assert [r.getMessage() for r in caplog.records] == [
        f"NanGuard: quarantine cannot act here: {why}. Records it names at an incident will NOT be removed from "
        "training (each event says so)."
    ]


# ------------------------------------------------------------------------------------ passes of a recording sampler


def test_a_pass_run_to_its_end_keeps_what_is_still_to_be_trained_on() -> None:
    """``max_size_cycle`` starts the next pass of a shorter loader while its last batch may still wait."""
    loader = DataLoader(Items(4), batch_size=2)
    sampler = record_batch_indices(loader)
    assert sampler is not None
    assert len(list(loader)) == 2  # a whole pass; the last batch not popped yet
    sampler.nanguard_fifo.popleft()
    next(iter(loader))  # the next pass starts
    assert list(sampler.nanguard_fifo) == [[2, 3], [0, 1]]


def test_a_pass_cut_short_or_an_epochs_leftovers_are_dropped() -> None:
    loader = DataLoader(Items(6), batch_size=2)
    sampler = record_batch_indices(loader)
    assert sampler is not None
    iterator = iter(loader)
    next(iterator)  # a pass cut short (limit_train_batches, min_size)
    next(iter(loader))
    assert list(sampler.nanguard_fifo) == [[0, 1]]
    list(iter(loader))  # a whole pass never trained on (workers read ahead, then the epoch stopped)
    mark_epoch_end(sampler)
    next(iter(loader))
    assert list(sampler.nanguard_fifo) == [[0, 1]]


def test_a_pass_already_started_when_the_epoch_starts_is_kept() -> None:
    """Lightning creates the first epoch's iterator (workers prefetch) before ``on_train_epoch_start``."""
    loader = DataLoader(Items(6), batch_size=2)
    sampler = record_batch_indices(loader)
    iterator = iter(loader)
    next(iterator)
    mark_epoch_end(sampler)  # mid-pass: not marked
    next(iterator)
    assert list(sampler.nanguard_fifo) == [[0, 1], [2, 3]]
