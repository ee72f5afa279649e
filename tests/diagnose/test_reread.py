"""A named dataset index is checked against the row by re-reading the record, without a Trainer.

Each dataset here is a dict of records; ``collate`` stands for the loader's ``collate_fn`` and the
batches are built by hand the way the pipelines build them (sorted, dropped, padded, packed, mixed).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from record_pipelines import RECORDS, collate, reader
from torch import Tensor

from lightning_nanguard.diagnose.reread import (
    RANDOM_READS,
    SEVERAL_RECORDS,
    STABLE_RECORD,
    RecordCheck,
    RowRecord,
    verify_rows,
)

SAMPLED = [20, 21, 22, 23, 24, 25, 26, 27]


def test_rows_in_sampler_order_are_verified_with_one_read_each() -> None:
    batch = collate([RECORDS[i] for i in SAMPLED])
    reads: list[int] = []
    check = verify_rows(batch, [1, 6], [21, 26], SAMPLED, reader(counter=reads))
    assert check.indices == (21, 26) and check.verified and check.broken is None
    assert reads == [21, 26] and check.reads == 2
    assert not any(row.corrected for row in check.rows) and check.notice() == ""


@pytest.mark.parametrize("left", [False, True])
def test_a_sorting_collate_is_corrected_from_padded_rows(left: bool) -> None:
    by_length = sorted(SAMPLED, key=lambda i: -len(RECORDS[i]))  # pack_padded_sequence wants longest first
    batch = collate([RECORDS[i] for i in by_length], left=left)
    bad_row = by_length.index(21)  # the row really holding record 21
    check = verify_rows(batch, [bad_row], [SAMPLED[bad_row]], SAMPLED, reader(left=left))
    assert check.indices == (21,) and check.verified and check.broken == "reorders"
    row = check.rows[0]
    assert row.corrected and row.claimed == SAMPLED[bad_row] == 24
    assert check.notice().startswith(
        f"the collate reorders rows: the dataset index read off the sampler named record 24 for "
        f"row {bad_row}, which holds record 21; corrected by re-reading."
    )
    # claimed once, again to see that reads are not random, then the other records once each
    assert check.reads == len(SAMPLED) + 1


def test_a_dropping_collate_matches_rows_by_content() -> None:
    kept = [i for i in SAMPLED if i != 23]  # e.g. a length filter
    batch = collate([RECORDS[i] for i in kept])
    check = verify_rows(batch, [3], [kept[3]], SAMPLED, reader())
    assert check.indices == (24,) and check.verified and check.broken == "rows_not_records"
    assert check.rows[0].claimed is None  # rows are not one record each: the sampler's order claims nothing
    assert check.notice().startswith("the batch has 7 rows for 8 recorded indices")
    assert "row 3 was matched to record 24 by re-reading" in check.notice()
    assert "index_key=" in check.notice() and "row_records=" in check.notice()


def test_a_deduplicating_collate_names_the_first_of_identical_records() -> None:
    records = {**RECORDS, 30: RECORDS[21].clone()}  # record 30 is a copy of 21
    sampled = [20, 21, 30, 22]
    batch = collate([records[i] for i in (20, 21, 22)])  # the duplicate dropped

    check = verify_rows(batch, [1], [None], sampled, lambda i: collate([records[i]]))
    assert check.indices == (21,) and check.verified
    assert "duplicates" in check.rows[0].reason and "[21, 30]" in check.rows[0].reason


def test_identical_records_prefer_the_claimed_one() -> None:
    records = {**RECORDS, 30: RECORDS[21].clone()}
    batch = collate([records[i] for i in (20, 30, 21)])
    check = verify_rows(batch, [1], [30], [20, 30, 21], lambda i: collate([records[i]]))
    assert check.indices == (30,) and check.broken is None


def test_packed_rows_match_no_record() -> None:
    sampled = [20, 21, 22, 23]
    packed = [torch.cat([RECORDS[20], RECORDS[21]]), torch.cat([RECORDS[22], RECORDS[23]])]
    batch = collate(packed)
    check = verify_rows(batch, [1], [None], sampled, reader())
    assert check.indices == (None,) and not check.verified and check.broken == "rows_not_records"
    assert check.reason.startswith("2 rows for 4 recorded indices: rows are not one record each")
    assert check.notice().endswith(
        "their dataset indices are unknown. To name records directly, pass index_key= "
        "(one index per row, or a 2-D field of the records of each row) or row_records=."
    )


def test_mixed_rows_are_unknown_not_claimed() -> None:
    x = {i: torch.full((1, 3), float(i)) for i in range(4)}
    lam, perm = 0.7, [2, 3, 0, 1]
    batch = torch.cat([lam * x[i] + (1 - lam) * x[perm[i]] for i in range(4)])
    check = verify_rows(batch, [2], [2], [0, 1, 2, 3], x.__getitem__)
    assert check.indices == (None,) and check.rows[0].reason == SEVERAL_RECORDS
    assert check.broken == "rows_not_records" and check.reads == 5


def test_random_reads_leave_the_row_unverified() -> None:
    generator = torch.Generator().manual_seed(0)

    def noisy(index: int) -> Tensor:
        return torch.full((1, 3), float(index)) + torch.rand(1, 3, generator=generator)

    batch = torch.cat([noisy(i) for i in range(4)])
    check = verify_rows(batch, [1], [1], [0, 1, 2, 3], noisy)
    assert check.indices == (None,) and not check.verified and check.broken == "random_reads"
    assert check.rows[0].claimed == 1 and check.reason == RANDOM_READS
    assert check.reads == 2 + 3  # the claimed record twice, then the others once: none reads the same twice
    assert check.notice().startswith("indices cannot be verified: re-reading a record gives different values")


def test_a_row_reordered_among_random_reads_is_named_by_the_one_record_that_reads_the_same_twice() -> None:
    """A silent record (zeros) under a random gain: the others differ at each read, it does not."""
    generator = torch.Generator().manual_seed(0)

    def gained(index: int) -> Tensor:
        values = torch.zeros(1, 3) if index == 7 else torch.full((1, 3), float(index))
        return values * (1 + torch.rand(1, generator=generator))

    batch = torch.cat([gained(i) for i in (7, 5, 6)])  # the collate put record 7 first; the sampler said 5, 6, 7
    check = verify_rows(batch, [0], [5], [5, 6, 7], gained)
    assert check.indices == (7,) and check.verified and check.broken == "reorders"
    assert check.rows[0].reason == STABLE_RECORD


def test_random_multi_crop_rows_say_so() -> None:
    generator = torch.Generator().manual_seed(0)

    def two_crops(index: int) -> Tensor:
        return torch.full((2, 3), float(index)) + torch.rand(2, 3, generator=generator)

    batch = torch.cat([two_crops(i) for i in range(3)])  # 6 rows for 3 records
    check = verify_rows(batch, [3], [None], [0, 1, 2], two_crops)
    assert check.indices == (None,) and check.broken == "random_reads"


def test_deterministic_multi_crop_rows_match_one_of_the_records_rows() -> None:
    def two_crops(index: int) -> Tensor:
        return torch.tensor([[index, 0], [index, 1]])

    batch = torch.cat([two_crops(i) for i in (5, 6, 7)])
    check = verify_rows(batch, [3], [None], [5, 6, 7], two_crops)
    assert check.indices == (6,) and check.verified


def test_failures_never_raise() -> None:
    def broken(index: int) -> Any:
        raise OSError(f"file {index} is gone")

    check = verify_rows(torch.zeros(4, 2), [0], [7], [7, 8, 9, 10], broken)
    assert check.indices == (None,) and check.broken == "unreadable"
    assert check.reason == "re-reading record 7 failed (OSError: file 7 is gone)"
    assert check.notice() == f"indices cannot be verified: {check.reason}; pass index_key=."

    def no_slicer(batch: Any, positions: Sequence[int]) -> Any:
        raise TypeError("cannot cut")

    cut = verify_rows(torch.zeros(4, 2), [0], [7], [7, 8, 9, 10], reader(), slicer=no_slicer)
    assert cut.indices == (None,) and "cannot be cut" in cut.reason and cut.reads == 0


def test_a_collate_that_refuses_some_single_records_still_matches_the_others() -> None:
    def picky(index: int) -> Any:
        if index == 22:
            raise ValueError("too short")
        return collate([RECORDS[index]])

    batch = collate([RECORDS[i] for i in (20, 21, 23)])
    check = verify_rows(batch, [2], [None], [20, 21, 22, 23], picky)
    assert check.indices == (23,) and check.verified


def test_the_result_is_frozen_and_says_which_rows() -> None:
    check = RecordCheck((RowRecord(1, 11, True, claimed=36), RowRecord(2, None, False, 7, "why")), "reorders", 4, 4)
    assert check.indices == (11, None) and not check.verified and check.reason == "why"
    with pytest.raises(AttributeError):
        check.broken = None  # type: ignore[misc]


@pytest.mark.parametrize("order", list(itertools.permutations(range(4)))[:6])
def test_any_order_of_a_batch_is_undone(order: tuple[int, ...]) -> None:
    sampled = [20, 21, 22, 23]
    batch = collate([RECORDS[sampled[k]] for k in order])
    check = verify_rows(batch, [0, 1, 2, 3], sampled, sampled, reader())
    assert check.indices == tuple(sampled[k] for k in order) and check.verified


@pytest.mark.parametrize("left", [False, True])
def test_rows_padded_with_nan_are_matched_to_their_records_by_value(left: bool) -> None:
    """A sorting collate pads float records with NaN: each named row gets the record it holds, not its position's."""

    def read(index: int) -> Tensor:
        return RECORDS[index].float()[None]

    def nan_collate(indices: Sequence[int]) -> Tensor:
        width = max(len(RECORDS[i]) for i in indices)
        rows = torch.full((len(indices), width), float("nan"))
        for k, i in enumerate(indices):
            rows[k, slice(width - len(RECORDS[i]), width) if left else slice(0, len(RECORDS[i]))] = RECORDS[i].float()
        return rows

    by_length = sorted(SAMPLED, key=lambda i: -len(RECORDS[i]))  # the rows no longer in the sampler's order
    batch = nan_collate(by_length)
    rows = list(range(len(SAMPLED)))
    check = verify_rows(batch, rows, SAMPLED, SAMPLED, read)
    assert check.indices == tuple(by_length) and check.verified and check.broken == "reorders"
    in_place = verify_rows(nan_collate(SAMPLED), rows, SAMPLED, SAMPLED, read)  # the sampler's order kept
    assert in_place.indices == tuple(SAMPLED) and in_place.verified and in_place.broken is None
    assert in_place.reads == len(SAMPLED)  # each row matched its claimed record at the first read


@pytest.mark.parametrize("dropped", [False, True], ids=["reordered", "dropped"])
def test_a_random_read_that_matches_the_row_by_chance_is_not_verified(dropped: bool) -> None:
    """Modality dropout: a record reads as zeros at random. Row 0 holds record 5 dropped out (zeros); the re-read of
    record 7 happens to be dropped out too, so it matches row 0 by chance, but its next read differs: no index.

    ``reordered``: the sampler's order claims record 6 for row 0; ``dropped``: the collate dropped record 6, so
    the rows are matched by content alone (no claim).
    """
    scripted = {  # each record's reads, in order: 7 is dropped out at its first read only
        5: [torch.full((1, 3), 5.0), torch.full((1, 3), 5.1)],
        6: [torch.full((1, 3), 6.0), torch.full((1, 3), 6.1)],
        7: [torch.zeros(1, 3), torch.full((1, 3), 7.1)],
    }
    reads: list[int] = []

    def dropout(index: int) -> Tensor:
        reads.append(index)
        return scripted[index].pop(0)

    rows = [torch.zeros(1, 3), *([] if dropped else [torch.full((1, 3), 6.3)]), torch.full((1, 3), 7.3)]
    check = verify_rows(torch.cat(rows), [0], [None if dropped else 6], [6, 5, 7], dropout)
    assert check.indices == (None,) and not check.verified
    assert check.rows[0].broke == "random_reads" and check.reason == RANDOM_READS
    # reordered: the claim twice (random), then the others once, then the chance match again;
    # dropped: every record once, then the chance match again
    assert reads == ([6, 5, 7, 7] if dropped else [6, 6, 5, 7, 7])
