"""``engine/data/streams.py``: quarantined records cut out of the batches of a loader without a batch sampler.

Plain ``DataLoader`` iteration, no Trainer: with and without worker processes, persistent workers,
the user's slicer, what cannot be read or cut, pickling and undoing the swap.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data.dataloader import _BaseDataLoaderIter

from lightning_nanguard.engine.data.streams import (
    StreamProblem,
    StreamQuarantine,
    WhileTraining,
    at_each_pass,
    cut_quarantined_records,
    cut_rows,
    stop_cutting,
    stream_quarantine_of,
)


class Records(IterableDataset):
    """Yields ``{"x", "index"}`` records in ``order``; with workers, position ``k`` goes to worker ``k % n``."""

    def __init__(self, order: Sequence[int], field: str = "index") -> None:
        self.order, self.field = list(order), field

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        for position, index in enumerate(self.order):
            if info is None or position % info.num_workers == info.id:
                yield {"x": torch.full((2,), float(index)), self.field: index}


class _AnyTensor:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, torch.Tensor)


ANY_TENSOR = _AnyTensor()  # compares equal to any tensor


def _indices(loader: DataLoader) -> list[list[int]]:
    return [batch["index"].tolist() for batch in loader]


def test_cut_rows_keeps_the_other_rows_of_every_field() -> None:
    batch = {"x": torch.arange(8.0).view(4, 2), "index": torch.tensor([3, 5, 7, 5]), "names": ["a", "b", "c", "d"]}
    cut = cut_rows(batch, {5}, "index")
    assert cut.batch["index"].tolist() == [3, 7]
    assert cut.batch["x"].tolist() == [[0.0, 1.0], [4.0, 5.0]]
    assert cut.batch["names"] == ["a", "c"]
    assert cut.removed == (5, 5) and cut.problem is None
    assert cut_rows(batch, {9}, "index").batch is batch  # nothing quarantined here: the batch itself
    assert cut_rows(batch, {3, 5, 7}, "index").batch is None  # no row left: dropped


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_stream_yields_no_quarantined_record_once_quarantined(num_workers: int) -> None:
    order = [0, 1, 2, 3, 4, 5, 6, 7, 5, 5, 5, 5, 8, 5, 9, 10]
    loader = DataLoader(Records(order), batch_size=2, num_workers=num_workers)
    quarantined: set[int] = set()
    assert cut_quarantined_records(loader, StreamQuarantine("index", quarantined))
    assert sorted(i for b in _indices(loader) for i in b) == sorted(order)  # empty quarantine: every record
    quarantined.add(5)
    batches = _indices(loader)
    assert all(batches), "a batch left with no row is not yielded"
    assert sorted(i for b in batches for i in b) == sorted(i for i in order if i != 5)


def test_the_quarantine_acts_at_once_inside_a_pass() -> None:
    """Set shared with the guard: an index added mid-pass is cut from the very next batch drawn."""
    loader = DataLoader(Records([0, 1, 5, 2, 5, 3]), batch_size=2)
    quarantined: set[int] = set()
    cut_quarantined_records(loader, StreamQuarantine("index", quarantined))
    iterator = iter(loader)
    assert next(iterator)["index"].tolist() == [0, 1]
    assert next(iterator)["index"].tolist() == [5, 2]
    quarantined.add(5)
    assert next(iterator)["index"].tolist() == [3]


def test_persistent_workers_keep_cutting_every_pass() -> None:
    loader = DataLoader(Records([0, 5, 1, 2]), batch_size=2, num_workers=1, persistent_workers=True)
    cut_quarantined_records(loader, StreamQuarantine("index", {5}))
    assert _indices(loader) == _indices(loader) == [[0], [1, 2]]
    assert isinstance(loader._iterator, _BaseDataLoaderIter)  # what Lightning's checks see
    stop_cutting(loader)
    assert _indices(loader) == [[0, 5], [1, 2]]
    assert type(loader._iterator).__name__ == "_MultiProcessingDataLoaderIter"


def test_the_users_slicer_cuts_and_a_slicer_that_fails_drops_the_whole_batch() -> None:
    calls: list[list[int]] = []

    def slicer(batch: dict[str, Any], positions: Sequence[int]) -> dict[str, Any]:
        calls.append(list(positions))
        return {key: value[list(positions)] for key, value in batch.items()}

    problems: list[StreamProblem] = []
    quarantine = StreamQuarantine("index", {5}, slicer, report=problems.append)
    loader = DataLoader(Records([0, 5, 1, 2]), batch_size=2)
    cut_quarantined_records(loader, quarantine)
    assert _indices(loader) == [[0], [1, 2]] and calls == [[0]]
    assert problems == []

    def broken(batch: Any, positions: Sequence[int]) -> Any:
        raise ValueError("cannot cut this")

    quarantine.slicer = broken
    assert _indices(loader) == [[1, 2]]  # the batch [0, 5] is dropped whole: record 5 is not trained on
    assert problems == [StreamProblem("uncut", None, "the batch slicer failed (ValueError: cannot cut this)", 2)]


def test_a_slicer_that_leaves_the_index_field_uncut_drops_the_whole_batch() -> None:
    problems: list[StreamProblem] = []
    lazy = StreamQuarantine("index", {5}, lambda batch, positions: batch, report=problems.append)
    cut = lazy({"x": torch.zeros(2), "index": torch.tensor([0, 5])})
    assert cut == (False, None)
    assert problems[0].kind == "uncut" and "did not cut the index field 'index'" in problems[0].reason


def test_an_index_field_that_cannot_be_read_keeps_the_batch_and_says_so() -> None:
    problems: list[StreamProblem] = []
    quarantine = StreamQuarantine("index", {5}, key="b", report=problems.append)
    loader = DataLoader(Records([0, 5], field="uid"), batch_size=2)
    cut_quarantined_records(loader, quarantine)
    assert [batch["uid"].tolist() for batch in loader] == [[0, 5]]  # its records are NOT removed
    assert problems == [StreamProblem("unreadable", "b", "the batch has no index field 'index'")]
    assert quarantine({"index": torch.tensor([[1, 2], [3, 5]])}, quiet=True) == (True, {"index": ANY_TENSOR})
    assert len(problems) == 1  # quiet: not reported again
    keep, _ = quarantine({"index": torch.tensor([[1, 2], [3, 5]])})
    assert keep and "several records per row" in problems[-1].reason


def test_under_several_processes_a_batch_of_only_quarantined_records_is_kept_and_reported() -> None:
    """One rank alone must not skip a batch (the others would wait for it): kept, and said."""
    problems: list[StreamProblem] = []
    quarantine = StreamQuarantine("index", {5}, drop_empty=False, report=problems.append)
    loader = DataLoader(Records([5, 5, 0, 5]), batch_size=2)
    cut_quarantined_records(loader, quarantine)
    assert _indices(loader) == [[5, 5], [0]]
    assert [(p.kind, p.rows) for p in problems] == [("kept", 2)]


def test_while_the_quarantine_is_empty_no_index_field_is_read() -> None:
    class Unreadable(dict[str, Any]):
        def __getitem__(self, key: str) -> Any:
            raise AssertionError("read")

    quarantine = StreamQuarantine("index", set())
    batch = Unreadable()
    assert quarantine(batch) == (True, batch)


def test_the_index_field_is_read_only_once_something_is_quarantined(monkeypatch: Any) -> None:
    """On an accelerator a read is a device sync: none while the quarantine is empty."""
    reads: list[int] = []
    original = torch.Tensor.tolist

    def counting(self: torch.Tensor) -> Any:
        reads.append(1)
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    quarantined: set[int] = set()
    quarantine = StreamQuarantine("index", quarantined)
    batch = {"x": torch.zeros(2), "index": torch.tensor([0, 5])}
    for _ in range(3):
        quarantine(batch)
    assert reads == []
    quarantined.add(5)
    quarantine(batch)
    assert reads


def test_a_validation_batch_is_left_alone_by_a_fabric_quarantine() -> None:
    """Fabric's rule: a batch drawn while autograd is off is not a training batch."""
    from lightning_nanguard.engine.data.streams import training_batches_only

    loader = DataLoader(Records([0, 5, 1, 2]), batch_size=2)
    cut_quarantined_records(loader, StreamQuarantine("index", {5}, applies=training_batches_only))
    assert _indices(loader) == [[0], [1, 2]]
    with torch.no_grad():
        assert _indices(loader) == [[0, 5], [1, 2]]
    with torch.inference_mode():
        assert _indices(loader) == [[0, 5], [1, 2]]
    shared = {5}
    assert bool(WhileTraining(shared)) and 5 in WhileTraining(shared)
    with torch.no_grad():
        assert not WhileTraining(shared)


def test_at_each_pass_is_called_when_a_pass_starts() -> None:
    loader = DataLoader(Records([0, 1, 2]), batch_size=2)
    passes: list[bool] = []
    assert at_each_pass(loader, lambda: passes.append(torch.is_grad_enabled()))
    _indices(loader)
    with torch.no_grad():
        _indices(loader)
    assert passes == [True, False]
    assert not at_each_pass([{"index": torch.tensor([0])}], lambda: None)  # not a DataLoader: left alone


def test_a_loader_made_to_cut_pickles_as_a_plain_dataloader_and_the_swap_is_undone() -> None:
    loader = DataLoader(Records([0, 5]), batch_size=2)
    quarantine = StreamQuarantine("index", {5})
    assert cut_quarantined_records(loader, quarantine) and cut_quarantined_records(loader, quarantine)  # idempotent
    assert stream_quarantine_of(loader) is quarantine
    copy = pickle.loads(pickle.dumps(loader))
    assert type(copy) is DataLoader and stream_quarantine_of(copy) is None
    assert _indices(copy) == [[0, 5]]
    stop_cutting(loader)
    assert type(loader) is DataLoader and stream_quarantine_of(loader) is None
    assert _indices(loader) == [[0, 5]]
    assert not cut_quarantined_records([{"index": [0]}], quarantine)  # not a DataLoader


def test_a_nan_record_is_cut_without_touching_the_values_of_the_others() -> None:
    batch = {"x": torch.tensor([[1.0, 2.0], [math.nan, 0.0], [3.0, 4.0]]), "index": [10, 11, 12]}
    cut = cut_rows(batch, {11}, "index")
    assert cut.batch == {"x": ANY_TENSOR, "index": [10, 12]}
    assert torch.equal(cut.batch["x"], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))


def test_a_failure_of_the_quarantine_itself_keeps_the_batch_and_says_the_records_are_not_removed() -> None:
    class Broken(set[int]):
        def __contains__(self, index: object) -> bool:
            raise RuntimeError("broken set")

    problems: list[StreamProblem] = []
    batch = {"x": torch.zeros(2), "index": torch.tensor([0, 5])}
    assert StreamQuarantine("index", Broken({5}), report=problems.append)(batch) == (True, batch)  # never the loop's
    assert problems == [StreamProblem("unreadable", None, "the quarantine failed (RuntimeError: broken set)")]
