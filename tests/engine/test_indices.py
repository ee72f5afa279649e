"""Dataset indices of each batch: recording batch sampler (shuffled, prefetching workers) and index fields."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, SequentialSampler

from lightning_nanguard.engine.data.indices import indices_from_batch, record_batch_indices, records_from_batch


class IndexDataset(Dataset):
    """Item ``i`` is ``{"x": ..., "idx": i}``: every batch says which indices it holds."""

    def __len__(self) -> int:
        return 37

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.full((2,), float(i)), "idx": i}


def loader(**kwargs: Any) -> DataLoader:
    return DataLoader(IndexDataset(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3), **kwargs)


@pytest.mark.parametrize("workers", [0, 2])
def test_fifo_follows_shuffled_batches_with_prefetching_workers(workers: int) -> None:
    data = loader(num_workers=workers, prefetch_factor=4 if workers else None)
    sampler = record_batch_indices(data)
    assert sampler is not None
    seen = 0
    for epoch in range(2):
        for batch in data:
            if workers and seen == 2:  # the sampler runs batches ahead of training
                assert len(sampler.nanguard_fifo) > 1
            assert sampler.nanguard_fifo.popleft() == batch["idx"].tolist()
            seen += 1
        assert not sampler.nanguard_fifo, f"epoch {epoch}: FIFO not drained"
    assert seen == 2 * 10


def test_a_new_pass_clears_the_record_and_recording_is_idempotent() -> None:
    data = loader()
    sampler = record_batch_indices(data)
    assert record_batch_indices(data) is sampler
    iterator = iter(data)
    next(iterator)
    next(iterator)
    assert len(sampler.nanguard_fifo) == 2
    first = next(iter(data))  # a new pass (e.g. the next epoch) starts a new record
    assert list(sampler.nanguard_fifo) == [first["idx"].tolist()]
    assert type(data.batch_sampler).__name__ == "NanGuardRecordingBatchSampler"
    assert isinstance(data.batch_sampler, BatchSampler)


def test_excluded_indices_are_never_yielded() -> None:
    data = DataLoader(IndexDataset(), batch_size=4)
    sampler = record_batch_indices(data)
    sampler.nanguard_exclude = {1, 4, 5, 6, 7}  # batch [4, 5, 6, 7] disappears entirely
    batches = [batch["idx"].tolist() for batch in data]
    assert batches[:2] == [[0, 2, 3], [8, 9, 10, 11]]
    assert all(i not in sampler.nanguard_exclude for batch in batches for i in batch)
    assert list(sampler.nanguard_fifo) == batches


def test_custom_batch_sampler_class_is_recorded_too() -> None:
    class EveryOther(BatchSampler):
        def __iter__(self) -> Any:
            for batch in super().__iter__():
                yield batch[::2]

    data = DataLoader(IndexDataset(), batch_sampler=EveryOther(SequentialSampler(range(8)), 4, False))
    sampler = record_batch_indices(data)
    assert [b["idx"].tolist() for b in data] == [[0, 2], [4, 6]] == list(sampler.nanguard_fifo)


def test_unrecordable_loaders() -> None:
    class Stream(IterableDataset):
        def __iter__(self) -> Any:
            return iter(torch.arange(10.0))

    stream = DataLoader(Stream(), batch_size=4)
    assert record_batch_indices(stream) is None
    assert next(b.tolist() for b in stream) == [0.0, 1.0, 2.0, 3.0]  # and it still iterates
    assert record_batch_indices(DataLoader(IndexDataset(), batch_size=None)) is None
    assert record_batch_indices([torch.zeros(2)]) is None


def test_non_integer_indices_keep_the_fifo_aligned() -> None:
    class Keys(Dataset):
        def __getitem__(self, key: str) -> torch.Tensor:
            return torch.tensor(float(len(key)))

    keys = BatchSampler(["a", "bb", "ccc"], batch_size=2, drop_last=False)
    data = DataLoader(Keys(), batch_sampler=keys)
    sampler = record_batch_indices(data)
    assert [b.tolist() for b in data] == [[1.0, 2.0], [3.0]]
    assert list(sampler.nanguard_fifo) == [None, None]


def test_indices_from_batch() -> None:
    Batch = namedtuple("Batch", ["x", "ids"])
    assert indices_from_batch({"x": torch.zeros(2), "idx": torch.tensor([7, 9])}, "idx") == [7, 9]
    assert indices_from_batch((torch.zeros(2), [3, 4]), 1) == [3, 4]
    assert indices_from_batch(Batch(torch.zeros(2), (5, 6)), "ids") == [5, 6]
    assert indices_from_batch({"x": torch.zeros(2)}, "idx") is None
    assert indices_from_batch((torch.zeros(2),), 3) is None
    assert indices_from_batch({"idx": "not indices"}, "idx") is None


def test_a_2d_index_field_holds_the_records_of_each_row() -> None:
    packed = {"idx": torch.tensor([[3, 4], [5, -1]])}  # -1: padding (a row of one record)
    assert indices_from_batch(packed, "idx") is None  # not one index per row
    assert records_from_batch(packed, "idx") == ((3, 4), (5,))
    assert records_from_batch({"idx": [[1, 2], (3,)]}, "idx") == ((1, 2), (3,))
    assert records_from_batch({"idx": torch.tensor([7, 7, 9])}, "idx") == ((7,), (7,), (9,))  # multi-crop
    assert indices_from_batch({"idx": torch.tensor([7, 7, 9])}, "idx") == [7, 7, 9]
    assert indices_from_batch({"idx": torch.tensor([[7], [9]])}, "idx") == [7, 9]  # one column: one per row
    assert records_from_batch({"x": torch.zeros(2)}, "idx") is None
    assert records_from_batch({"idx": ["a", "b"]}, "idx") is None
    assert records_from_batch({"idx": torch.zeros(2, 2, 2)}, "idx") is None
