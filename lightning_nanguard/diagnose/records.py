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
The comparison is tolerant (:func:`record_matches`): tensors are compared with ``allclose`` on the
CPU (NaN equals NaN), integers and booleans exactly; a record padded into a longer row is compared
with the row's leading or trailing region (right or left padding), the rest of the row being one
padding value. :class:`RecordCheck` says which rows hold which records and which assumption of the
pipeline broke (``"reorders"``, ``"rows_not_records"``, ``"random_reads"``, ``"unreadable"``), so the
caller can tell the user once.

Example:
    >>> records = {10: torch.tensor([[1.0, 2.0]]), 11: torch.tensor([[3.0, 4.0]])}
    >>> batch = torch.tensor([[3.0, 4.0], [1.0, 2.0]])  # the collate swapped the two records
    >>> check = verify_rows(batch, rows=[0], claimed=[10], candidates=[10, 11], read=records.__getitem__)
    >>> check.indices, check.verified, check.broken, check.rows[0].corrected
    ((11,), True, 'reorders', True)
"""

from __future__ import annotations

import dataclasses
import math
from collections import UserDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from lightning_nanguard.diagnose.batching import BatchSlicer, batch_size, slice_batch

__all__ = [
    "BROKEN_ASSUMPTIONS",
    "BrokenAssumption",
    "RecordCheck",
    "RowRecord",
    "record_matches",
    "verify_rows",
]

BrokenAssumption = Literal["reorders", "rows_not_records", "random_reads", "unreadable"]
"""Which assumption of the pipeline broke: rows in another order than the sampler's; rows that are not
one record each (dropped, split, packed, blended, or changed after the collate); reads that differ
each time (random augmentation, masking); reads that failed."""
BROKEN_ASSUMPTIONS: tuple[BrokenAssumption, ...] = get_args(BrokenAssumption)

RANDOM_READS = "re-reading a record gives different values (random augmentation or masking)"
SEVERAL_RECORDS = "rows are built from several records (packing, mixup) or changed after the collate"
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
    """

    row: int
    index: int | None
    verified: bool
    claimed: int | None = None
    reason: str = ""

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


# ---------------------------------------------------------------------------------------- comparison


def _leaves(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every leaf of a batch with its path (dict keys, fields, positions)."""
    if isinstance(obj, Tensor):
        yield path, obj
    elif isinstance(obj, UserDict | Mapping):
        for key, value in (obj.data if isinstance(obj, UserDict) else obj).items():
            yield from _leaves(value, (*path, ("key", key)))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _leaves(getattr(obj, f.name), (*path, ("field", f.name)))
    elif isinstance(obj, list | tuple):
        for position, value in enumerate(obj):
            yield from _leaves(value, (*path, position))
    else:
        yield path, obj


def _tolerance(*dtypes: torch.dtype) -> float:
    """Relative tolerance of the least precise floating dtype (a row cast to half still matches)."""
    eps = max((torch.finfo(d).eps for d in dtypes if d.is_floating_point), default=0.0)
    return max(1e-5, 2.0 * eps)


def _values_match(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape:
        return False
    if a.is_complex() or b.is_complex():
        return bool(torch.allclose(a.to(torch.complex128), b.to(torch.complex128), equal_nan=True))
    if a.is_floating_point() or b.is_floating_point():
        rtol = _tolerance(a.dtype, b.dtype)
        return bool(torch.allclose(a.double(), b.double(), rtol=rtol, atol=rtol * 1e-3, equal_nan=True))
    return bool(torch.equal(a.to(torch.int64), b.to(torch.int64)))


def _one_value(t: Tensor) -> bool:
    """All elements equal (NaN counts as equal to NaN): a padding region."""
    if t.numel() == 0:
        return True
    first = t.flatten()[0]
    if t.is_floating_point() and bool(torch.isnan(first)):
        return bool(torch.isnan(t).all())
    return bool((t == first).all())


def _region_matches(row: Tensor, record: Tensor, trailing: bool) -> bool:
    """The record in the row's leading (``trailing``: trailing) region, the rest of the row one padding value."""
    region = tuple(
        slice(size - kept, size) if trailing else slice(0, kept)
        for kept, size in zip(record.shape, row.shape, strict=True)
    )
    if not _values_match(row[region], record):
        return False
    padding = torch.ones(row.shape, dtype=torch.bool)
    padding[region] = False
    return _one_value(row[padding])


def _tensors_match(row: Tensor, record: Tensor) -> bool:
    row, record = row.detach().cpu(), record.detach().cpu()
    if row.shape == record.shape:
        return _values_match(row, record)
    if row.dim() != record.dim() or any(s > r for r, s in zip(row.shape, record.shape, strict=True)):
        return False  # not the record padded into a longer row
    return _region_matches(row, record, trailing=False) or _region_matches(row, record, trailing=True)


def _leaf_matches(row: Any, record: Any) -> bool:
    if isinstance(row, Tensor) or isinstance(record, Tensor):
        return isinstance(row, Tensor) and isinstance(record, Tensor) and _tensors_match(row, record)
    if isinstance(row, float) and isinstance(record, float) and math.isnan(row) and math.isnan(record):
        return True
    if isinstance(row, float) and isinstance(record, int | float):
        return math.isclose(row, record, rel_tol=1e-6)
    try:
        return bool(row == record)  # ints and bools exactly, strings, None
    except Exception:  # objects whose equality is not a bool (arrays): no match
        return False


def _whole_matches(row: Any, record: Any) -> bool:
    row_leaves, record_leaves = dict(_leaves(row)), dict(_leaves(record))
    if row_leaves.keys() != record_leaves.keys():
        return False
    return all(_leaf_matches(row_leaves[path], record_leaves[path]) for path in row_leaves)


def record_matches(row: Any, record: Any) -> bool:
    """Whether a batch of one ``row`` holds the record of ``record`` (a batch of that one record).

    Same structure; every leaf equal within tolerance (see the module docs). A record that collates
    into several rows (multi-crop) matches when one of its rows does.

    Example:
        >>> row = {"ids": torch.tensor([[0, 0, 5, 6]]), "name": ["b"]}  # left-padded to 4
        >>> record_matches(row, {"ids": torch.tensor([[5, 6]]), "name": ["b"]})
        True
        >>> record_matches(row, {"ids": torch.tensor([[5, 7]]), "name": ["b"]})
        False
    """
    if _whole_matches(row, record):
        return True
    try:
        count = batch_size(record)
    except TypeError:
        return False
    if count <= 1:
        return False
    return any(_whole_matches(row, slice_batch(record, [k], size=count)) for k in range(count))


def _same_reads(first: Any, second: Any) -> bool:
    """Two reads of one record are the same (exact structure and shapes; tolerant values)."""
    a, b = dict(_leaves(first)), dict(_leaves(second))
    if a.keys() != b.keys():
        return False
    for path, left in a.items():
        right = b[path]
        if isinstance(left, Tensor) and isinstance(right, Tensor):
            if left.shape != right.shape or not _values_match(left.detach().cpu(), right.detach().cpu()):
                return False
        elif not _leaf_matches(left, right):
            return False
    return True


# ---------------------------------------------------------------------------------------- the check


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
    random?) and one per other record of the batch (each record is read once per call).

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
        >>> check.indices, check.broken, check.reads
        ((5,), 'rows_not_records', 3)
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
                    random = not _same_reads(reads.get(claim), reads.fresh(claim))
            except Exception as error:
                out.append(RowRecord(row, None, False, claim, _error(claim, error)))
                broken = _worse(broken, "unreadable")
                continue
            if random:
                out.append(RowRecord(row, None, False, claim, RANDOM_READS))
                broken = _worse(broken, "random_reads")
                continue
        found, note, failed = _search(got, distinct, reads, claim)
        if found is not None:
            out.append(RowRecord(row, found, True, claim, note))
            if claim is not None and found != claim:
                broken = _worse(broken, "reorders")
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
        out.append(RowRecord(row, None, False, claim, reason))
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


def _random_reads(distinct: Sequence[int], reads: _Reads) -> bool:
    """Whether re-reading the batch's first record gives different values."""
    if not distinct:
        return False
    try:
        return not _same_reads(reads.get(distinct[0]), reads.fresh(distinct[0]))
    except Exception:
        return False
