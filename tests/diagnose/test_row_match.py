"""A row of a batch is compared with a re-read record: padding either side, dtypes, NaN, strings, multi-crop."""

from __future__ import annotations

import pytest
import torch
from record_pipelines import RECORDS, collate, reader

from lightning_nanguard.diagnose.row_match import record_matches, same_reads


@pytest.mark.parametrize("left", [False, True])
def test_a_record_padded_either_side_matches_its_row_only(left: bool) -> None:
    batch = collate([RECORDS[23], RECORDS[20]], left=left)  # record 20 (2 tokens) padded to 5
    row = {key: value[1:] for key, value in batch.items()}
    assert record_matches(row, reader()(20)) and not record_matches(row, reader()(24))


def test_a_padding_region_must_hold_one_value() -> None:
    record = torch.tensor([[5, 6]])
    assert record_matches(torch.tensor([[5, 6, 0, 0]]), record)
    assert not record_matches(torch.tensor([[5, 6, 0, 9]]), record)  # a longer record, not padding
    assert not record_matches(torch.tensor([[5]]), record)  # a row shorter than the record


def test_strings_numbers_and_dtypes_are_compared_leniently_but_exactly_where_they_must() -> None:
    row = {"x": torch.tensor([[1.0, float("nan")]], dtype=torch.bfloat16), "k": torch.tensor([3]), "s": ["a"]}
    assert record_matches(row, {"x": torch.tensor([[1.001, float("nan")]]), "k": torch.tensor([3]), "s": ["a"]})
    assert not record_matches(row, {"x": torch.tensor([[1.0, float("nan")]]), "k": torch.tensor([4]), "s": ["a"]})
    assert not record_matches(row, {"x": torch.tensor([[1.0, float("nan")]]), "k": torch.tensor([3]), "s": ["b"]})
    assert not record_matches(row, {"x": torch.tensor([[1.0, float("nan")]]), "k": torch.tensor([3])})
    assert record_matches((torch.ones(1, 2), 0.5, 3), (torch.ones(1, 2), 0.5, 3))
    assert not record_matches((torch.ones(1, 2), 0.5, 3), (torch.ones(1, 2), 0.5, 4))


def test_a_record_of_several_rows_matches_one_of_them() -> None:
    crops = torch.tensor([[4, 0], [4, 1]])
    assert record_matches(torch.tensor([[4, 1]]), crops) and not record_matches(torch.tensor([[4, 2]]), crops)


def test_two_reads_are_the_same_only_with_the_same_shapes_and_values() -> None:
    assert same_reads({"x": torch.tensor([[1.0, float("nan")]])}, {"x": torch.tensor([[1.0, float("nan")]])})
    assert not same_reads(torch.ones(1, 3), torch.ones(1, 4))  # a random crop size
    assert not same_reads({"x": torch.ones(1)}, {"y": torch.ones(1)})


def test_numpy_leaves_are_compared_as_tensors() -> None:
    import numpy as np

    row = {"x": np.array([[1.0, 2.0, 0.0]]), "k": np.int64(3)}
    assert record_matches(row, {"x": np.array([[1.0, 2.0]]), "k": np.int64(3)})
    assert not record_matches(row, {"x": np.array([[1.0, 2.5]]), "k": np.int64(3)})


def nan_padded(records: list[torch.Tensor], left: bool = False) -> torch.Tensor:
    """Float records padded with NaN to the longest (a time series whose model masks NaN), right or ``left``."""
    width = max(len(r) for r in records)
    rows = torch.full((len(records), width), float("nan"))
    for k, r in enumerate(records):
        rows[k, slice(width - len(r), width) if left else slice(0, len(r))] = r
    return rows


@pytest.mark.parametrize("left", [False, True])
def test_a_record_padded_with_nan_matches_its_row_only(left: bool) -> None:
    records = {i: RECORDS[i].float() for i in (20, 21, 24, 23)}  # 20 and 24 have 2 tokens, 21 has 3, 23 has 5
    records[21] = torch.tensor([210.0, float("nan"), 212.0])  # a bad record: NaN among its own values
    rows = nan_padded(list(records.values()), left=left)
    for k, (index, record) in enumerate(records.items()):
        row = rows[k : k + 1]
        assert record_matches(row, record[None]), index  # NaN padding is one padding value
        others = [i for i in records if i != index]
        assert not any(record_matches(row, records[i][None]) for i in others), index  # by value, not by position
    mixed = rows[0:1].clone()
    mixed[0, -1 if not left else 0] = 0.0  # a padding region of NaN and 0 is not padding
    assert not record_matches(mixed, records[20][None])
