"""Check that a dataset index names the record really in a row of the batch, by re-reading it.

The dataset indices of a batch are recorded from its batch sampler, in the order the sampler yields
them. Row ``k`` of the batch is record ``indices[k]`` only while the collate keeps one row per record,
in that order. A collate that sorts rows by length (``pack_padded_sequence``), drops or deduplicates
rows, yields several rows per record (multi-crop), packs several records into one row (LLM
packing) or blends them (mixup) breaks that, and a quarantine by position would remove healthy
records. :func:`verify_rows` re-reads records (``read(index)`` gives a batch of that one record, as
the loader would collate it) and compares them with the rows:

- **verified**: the claimed record (the sampler's index at the row's position) matches the row;
- **corrected**: it does not, but exactly one distinct record of the batch does (the collate
  reorders rows): that index, verified;
- **unverified**: re-reading the same record twice gives different values (random augmentation or
  masking): no index is guessed; or a read failed;
- **unknown**: no record of the batch matches the row (rows built from several records, or changed
  after the collate).

When the batch has more or fewer rows than recorded indices (a dropping or deduplicating collate,
multi-crop, packing) no index is claimed: each row is matched by content among the batch's records.
The comparison is tolerant (:func:`~lightning_nanguard.diagnose.row_match.record_matches`: padding
left or right, NaN equals NaN, half precision). :class:`RecordCheck` says which rows hold which
records and which assumption of the pipeline broke (``"reorders"``, ``"rows_not_records"``,
``"random_reads"``, ``"unreadable"``), so the caller can tell the user once.

Example:
    >>> records = {10: torch.tensor([[1.0, 2.0]]), 11: torch.tensor([[3.0, 4.0]])}
    >>> batch = torch.tensor([[3.0, 4.0], [1.0, 2.0]])  # the collate swapped the two records
    >>> check = verify_rows(batch, rows=[0], claimed=[10], candidates=[10, 11], read=records.__getitem__)
    >>> check.indices, check.verified, check.broken, check.rows[0].corrected
    ((11,), True, 'reorders', True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch  # noqa: F401 (doctests)

from lightning_nanguard.diagnose.batching import BatchSlicer, batch_size, slice_batch
from lightning_nanguard.diagnose.row_match import record_matches, same_reads

__all__ = [
    "BROKEN_ASSUMPTIONS",
    "BrokenAssumption",
    "RecordCheck",
    "RowRecord",
    "verify_rows",
]

BrokenAssumption = Literal["reorders", "rows_not_records", "random_reads", "unreadable"]
"""Which assumption of the pipeline broke: rows in another order than the sampler's; rows that are not
one record each (dropped, split, packed, blended, or changed after the collate); reads that differ
each time (random augmentation, masking); reads that failed."""
BROKEN_ASSUMPTIONS: tuple[BrokenAssumption, ...] = get_args(BrokenAssumption)

RANDOM_READS = "re-reading a record gives different values (random augmentation or masking)"
SEVERAL_RECORDS = "rows are built from several records (packing, mixup) or changed after the collate"
STABLE_RECORD = (
    "records of the batch read differently each time, but this row matches the one record that reads the same twice"
)
FIX_ROWS = "pass index_key= (one index per row, or a 2-D field of the records of each row) or row_records="


@dataclass(frozen=True)
class RowRecord:
    """What re-reading found for one row.

    Attributes:
        row: the row's position in the batch.
        index: the dataset index of the record the row holds; ``None`` when unknown or unverified.
        verified: the record at ``index`` was re-read and matches the row.
        claimed: the sampler's index at the row's position (``None`` when rows are not one record each).
        reason: why the row is unverified or unknown, or a note (duplicate records).
        broke: the assumption this row showed broken (``"rows_not_records"``: the claimed index, if
            any, is not the row's record).
    """

    row: int
    index: int | None
    verified: bool
    claimed: int | None = None
    reason: str = ""
    broke: BrokenAssumption | None = None

    @property
    def corrected(self) -> bool:
        """The row holds another record of the batch than the one the sampler's order claimed."""
        return self.verified and self.claimed is not None and self.index != self.claimed


@dataclass(frozen=True)
class RecordCheck:
    """The rows checked by :func:`verify_rows`.

    Attributes:
        rows: one :class:`RowRecord` per named row, in the order asked.
        broken: the assumption of the pipeline that broke (``None``: none seen).
        batch_rows: rows in the batch (``None``: unknown).
        recorded: indices recorded for the batch.
        reads: records read (the cost of the check).
    """

    rows: tuple[RowRecord, ...]
    broken: BrokenAssumption | None = None
    batch_rows: int | None = None
    recorded: int = 0
    reads: int = 0

    @property
    def indices(self) -> tuple[int | None, ...]:
        """The dataset index of each named row (``None``: unknown or unverified)."""
        return tuple(row.index for row in self.rows)

    @property
    def verified(self) -> bool:
        """Every named row holds a record that was re-read and matches."""
        return bool(self.rows) and all(row.verified for row in self.rows)

    @property
    def reason(self) -> str:
        """Why some row is unverified or unknown (the first reason); empty when all are verified."""
        return next((row.reason for row in self.rows if not row.verified and row.reason), "")

    def only(self, rows: Sequence[int]) -> RecordCheck:
        """The check of some of its rows, with what *they* showed broken (warnings speak of the rows named).

        Example:
            >>> check = RecordCheck((RowRecord(1, 11, True), RowRecord(4, None, False, broke="random_reads")),
            ...                     "random_reads", 8, 8)
            >>> check.only([1]).broken, check.only([4]).broken
            (None, 'random_reads')
        """
        kept = tuple(row for row in self.rows if row.row in rows)
        broken: BrokenAssumption | None = None
        if self.batch_rows is not None and self.batch_rows != self.recorded:
            broken = "rows_not_records"
        for row in kept:
            broken = _worse(broken, row.broke)
        return RecordCheck(kept, broken, self.batch_rows, self.recorded, self.reads)

    def notice(self) -> str:
        """What broke and how to fix it, for a warning (empty when nothing broke).

        Example:
            >>> check = RecordCheck((RowRecord(1, 11, True, claimed=36),), "reorders", 4, 4)
            >>> check.notice()[:60]
            'the collate reorders rows: the dataset index read off the sa'
        """
        if self.broken == "reorders":
            row = next(r for r in self.rows if r.corrected)
            return (
                f"the collate reorders rows: the dataset index read off the sampler named record {row.claimed} for "
                f"row {row.row}, which holds record {row.index}; corrected by re-reading. Pass index_key= to name "
                "records directly."
            )
        if self.broken == "rows_not_records":
            found = [r for r in self.rows if r.verified]
            if self.batch_rows is not None and self.batch_rows != self.recorded:
                what = f"the batch has {self.batch_rows} rows for {self.recorded} recorded indices: rows are not one "
                what += "record each (the collate drops, merges or splits rows)"
            else:
                what = f"a row matches none of the batch's records: {SEVERAL_RECORDS}"
            done = (
                f"; row {found[0].row} was matched to record {found[0].index} by re-reading"
                if found
                else "; their dataset indices are unknown"
            )
            return f"{what}{done}. To name records directly, {FIX_ROWS}."
        if self.broken == "random_reads":
            return f"indices cannot be verified: {RANDOM_READS}; pass index_key=."
        if self.broken == "unreadable":
            return f"indices cannot be verified: {self.reason}; pass index_key=."
        return ""


class _Reads:
    """Reads records once each (``fresh`` reads again), counting them."""

    def __init__(self, read: Callable[[int], Any]) -> None:
        self._read = read
        self._cache: dict[int, Any] = {}
        self.count = 0

    def get(self, index: int) -> Any:
        if index not in self._cache:
            self._cache[index] = self.fresh(index)
        return self._cache[index]

    def fresh(self, index: int) -> Any:
        self.count += 1
        return self._read(index)


def _error(index: int, error: Exception) -> str:
    return f"re-reading record {index} failed ({type(error).__name__}: {error})"


_SEVERITY: dict[BrokenAssumption | None, int] = {
    None: 0,
    "reorders": 1,
    "rows_not_records": 2,
    "random_reads": 3,
    "unreadable": 4,
}


def _worse(a: BrokenAssumption | None, b: BrokenAssumption | None) -> BrokenAssumption | None:
    """The more telling of two broken assumptions (a failed read over random reads over rows over order)."""
    return a if _SEVERITY[a] >= _SEVERITY[b] else b


def verify_rows(
    batch: Any,
    rows: Sequence[int],
    claimed: Sequence[int | None],
    candidates: Sequence[int],
    read: Callable[[int], Any],
    slicer: BatchSlicer | None = None,
    batch_rows: int | None = None,
) -> RecordCheck:
    """Which record each named row of ``batch`` holds, checked by re-reading (see the module docs).

    A row whose claimed record matches costs one read; a row that does not, one more (is the read
    random?) and one per other record of the batch (each record is read once per call). A row matched
    by content while reads may be random (no claim, or random reads) costs one more read of its
    record: a match that the record's next read does not repeat is chance, and names no index.

    Args:
        batch: the batch as ``training_step`` received it.
        rows: the positions of the rows to name.
        claimed: per row, the dataset index the sampler's order gives it (``None``: none).
        candidates: every dataset index recorded for the batch (the records it may hold).
        read: ``read(index)`` -> a batch of that one record, built as the batch was (collate, hooks).
        slicer: cuts rows out of ``batch`` (default :func:`~lightning_nanguard.diagnose.batching.slice_batch`).
        batch_rows: rows in ``batch`` (default: read from the batch).

    Returns:
        A :class:`RecordCheck`. It never raises: a failed read or cut leaves its rows unverified, with the reason.

    Example:
        >>> records = {i: torch.tensor([[float(i)]]) for i in (3, 4, 5)}
        >>> dropped = torch.tensor([[3.0], [5.0]])  # the collate dropped record 4
        >>> check = verify_rows(dropped, [1], [None], [3, 4, 5], records.__getitem__)
        >>> check.indices, check.broken, check.reads  # each record once, then record 5 again (not random)
        ((5,), 'rows_not_records', 4)
    """
    cut = slicer or slice_batch
    reads = _Reads(read)
    if batch_rows is None:
        try:
            batch_rows = batch_size(batch)
        except TypeError:
            batch_rows = None
    one_each = batch_rows is not None and batch_rows == len(candidates)
    distinct = list(dict.fromkeys(int(i) for i in candidates))
    broken: BrokenAssumption | None = None if one_each else "rows_not_records"
    random: bool | None = None  # checked once, when a row does not hold the record expected
    out: list[RowRecord] = []
    for row, claim in zip(rows, claimed, strict=True):
        claim = claim if one_each else None
        try:
            got = cut(batch, [row])
        except Exception as error:
            out.append(RowRecord(row, None, False, claim, f"the row cannot be cut from the batch ({error})"))
            continue
        if claim is not None:
            try:
                if record_matches(got, reads.get(claim)):
                    out.append(RowRecord(row, claim, True, claim))
                    continue
                if random is None:
                    random = not same_reads(reads.get(claim), reads.fresh(claim))
            except Exception as error:
                out.append(RowRecord(row, None, False, claim, _error(claim, error), "unreadable"))
                broken = _worse(broken, "unreadable")
                continue
            if random:  # only a record that reads the same every time can still be told by its content
                found = _stable_match(got, distinct, reads, claim)
                if found is not None:
                    out.append(RowRecord(row, found, True, claim, STABLE_RECORD, "reorders"))
                    broken = _worse(broken, "reorders")
                else:
                    out.append(RowRecord(row, None, False, claim, RANDOM_READS, "random_reads"))
                    broken = _worse(broken, "random_reads")
                continue
        found, note, failed = _search(got, distinct, reads, claim)
        if found is not None and random is not False and not _reads_alike(found, reads):
            random, found = True, None  # a match by chance among random reads: no index is guessed
        if found is not None:
            moved = claim is not None and found != claim
            out.append(RowRecord(row, found, True, claim, note, "reorders" if moved else None))
            broken = _worse(broken, "reorders" if moved else None)
            continue
        why: BrokenAssumption
        if failed:
            reason, why = failed, "unreadable"
        elif (random is None and _random_reads(distinct, reads)) or random:
            random, reason, why = True, RANDOM_READS, "random_reads"
        elif not one_each and batch_rows is not None:
            reason = f"{batch_rows} rows for {len(candidates)} recorded indices: rows are not one record each, "
            reason += f"and this row matches none of them ({FIX_ROWS})"
            why = "rows_not_records"
        else:
            reason, why = SEVERAL_RECORDS, "rows_not_records"
        random = bool(random)
        out.append(RowRecord(row, None, False, claim, reason, why))
        broken = _worse(broken, why)
    return RecordCheck(tuple(out), broken, batch_rows, len(candidates), reads.count)


def _search(row: Any, distinct: Sequence[int], reads: _Reads, claim: int | None) -> tuple[int | None, str, str]:
    """The record of the batch ``row`` holds: ``(index, note, failure)``.

    The first of identical records, noted as duplicates; ``failure`` says why when no record could be read at all.
    """
    matches: list[int] = []
    errors: list[str] = []
    others = [index for index in distinct if index != claim]  # the claimed record was compared already
    for index in others:
        try:
            if record_matches(row, reads.get(index)):
                matches.append(index)
        except Exception as error:  # e.g. a collate that refuses a single record it would drop
            errors.append(_error(index, error))
    if not matches:
        return None, "", errors[0] if errors and len(errors) == len(others) else ""
    if len(matches) > 1:
        return matches[0], f"records {matches} hold the same values (duplicates): named the first", ""
    return matches[0], "", ""


def _stable_match(row: Any, distinct: Sequence[int], reads: _Reads, claim: int | None) -> int | None:
    """The one record of the batch that matches ``row`` and reads the same twice (reads are random); else ``None``."""
    found, note, _ = _search(row, distinct, reads, claim)
    if found is None or note:  # no match, or several records of the same values: no guess
        return None
    return found if _reads_alike(found, reads) else None


def _reads_alike(index: int, reads: _Reads) -> bool:
    """Whether record ``index`` reads the same again (a match by content among random reads may be chance)."""
    try:
        return same_reads(reads.get(index), reads.fresh(index))
    except Exception:
        return False


def _random_reads(distinct: Sequence[int], reads: _Reads) -> bool:
    """Whether re-reading the batch's first record gives different values."""
    if not distinct:
        return False
    try:
        return not same_reads(reads.get(distinct[0]), reads.fresh(distinct[0]))
    except Exception:
        return False
