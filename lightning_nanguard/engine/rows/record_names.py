"""Which records the offending rows hold: :mod:`~lightning_nanguard.diagnose.reread` at an incident.

At an incident, once the diagnosis named offending rows, :class:`RowNamer` names the dataset records
they hold, and says whether that is verified (``NanEvent.indices_verified``): it returns the event's
:class:`~lightning_nanguard.core.event_builder.Rows` with them (:meth:`RowNamer.name_rows`). Per loader (one, or
each of several training loaders, each checked against its own loader), the first source that
applies:

1. ``NanGuard(row_records=...)``, else the LightningModule's ``nanguard_row_records(batch, indices)``:
   ``(batch, the recorded indices of that batch or None) -> the dataset indices each row holds``,
   for pipelines the guard cannot see into (packing, mixup, multi-crop). Verified: the user maps
   them. A hook that raises or returns a row count other than the batch's leaves the rows unknown,
   with the reason.
2. ``NanGuard(index_key=...)``: the batch's own index field, one index per row (repeated for several
   rows of one record) or a 2-D field of the records of each row (negative entries are padding).
   Verified: the batch carries them.
3. The batch sampler's recorded indices, in the order it yielded them. Checked by re-reading each
   named record with the loader's own ``dataset[i]`` and ``collate_fn([item])``, transformed by the
   same batch hooks (:mod:`~lightning_nanguard.engine.data.readers`), and comparing it with the row
   (:func:`~lightning_nanguard.diagnose.reread.verify_rows`): verified, corrected (the collate
   reorders rows), matched by content (rows are not one record each), or unknown (no record matches
   the row, reads are random, a read failed: no index is guessed, ``indices_verified=False`` with the
   reason). A loader that cannot be read again (``nanguard_reread = False``) and
   ``verify_indices=False`` keep the sampler's index, with ``indices_verified=False`` and the reason.

The re-reads run only here, at an incident, with every random number generator saved and restored.
Each broken assumption of the pipeline is told once per run, on every rank that sees it
(:class:`RecordNotices`), with the fix.

Example:
    >>> from lightning_nanguard.engine.step.window import MicroBatch
    >>> from lightning_nanguard.diagnose.batch_diagnosis import Diagnosis
    >>> micro = MicroBatch({"x": torch.zeros(3, 2), "idx": torch.tensor([[4, 5], [6, -1], [7, -1]])}, 0, None)
    >>> namer = RowNamer(RecordSettings(index_key="idx", row_records=None, verify=True))
    >>> event = namer.name(NanEvent(3, 0, 3, 0, ("loss",), "skipped"), Diagnosis(3, [0], cause="data"), micro)
    >>> event.sample_records, event.dataset_indices, event.indices_verified
    (((4, 5),), None, True)
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from lightning_nanguard.core.event_builder import EventSections, Rows, with_sections
from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.core.rng import RngState
from lightning_nanguard.diagnose.batch_diagnosis import Diagnosis
from lightning_nanguard.diagnose.combined import CombinedLayout, LoaderKey
from lightning_nanguard.diagnose.reread import RecordCheck, RowRecord, verify_rows
from lightning_nanguard.engine.data.indices import records_from_batch
from lightning_nanguard.engine.data.readers import RecordReader
from lightning_nanguard.engine.step.window import MicroBatch

__all__ = ["RecordNotices", "RecordSettings", "RowNamer", "RowRecordsHook"]

RowRecordsHook = Callable[[Any, "list[int] | None"], Sequence[Sequence[int]]]
"""``row_records(batch, indices) -> the dataset indices each row of batch holds`` (``indices``: the
batch's recorded indices, the sampler's or those of ``index_key``; ``None`` when unknown)."""
Slicer = Callable[[Any, Sequence[int]], Any]


class RecordNotices:
    """Warn once per run and key, on every rank (``warnings.warn``, the rank in the message).

    Example:
        >>> notices = RecordNotices()
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     notices.warn("reorders", 1, "the collate reorders rows"), notices.warn("reorders", 1, "again")
        (True, False)
        >>> str(caught[0].message)
        'NanGuard (rank 1): the collate reorders rows'
    """

    def __init__(self) -> None:
        self.given: set[str] = set()

    def warn(self, key: str, rank: int, message: str) -> bool:
        """Warn ``message`` unless ``key`` was warned about in this run; True if warned."""
        if key in self.given:
            return False
        self.given.add(key)
        warnings.warn(f"NanGuard (rank {rank}): {message}", UserWarning, stacklevel=2)
        return True


@dataclass(frozen=True)
class RecordSettings:
    """How the records of rows are named (the ``NanGuard`` arguments; a new cache of warnings each fit).

    Attributes:
        index_key: the batch's index field (``None``: the batch sampler's recorded indices).
        row_records: the user's ``row_records`` hook (``None``: the module's ``nanguard_row_records``, if any).
        verify: re-read the sampler's indices to check them (``verify_indices``).
        notices: what was told this run.
    """

    index_key: int | str | None
    row_records: RowRecordsHook | None
    verify: bool
    notices: RecordNotices = field(default_factory=RecordNotices, compare=False, repr=False)


@dataclass(frozen=True)
class _Named:
    """The records one row holds (``None``: unknown), whether verified, and why not (or a note)."""

    records: tuple[int, ...] | None
    verified: bool
    reason: str = ""


@dataclass(frozen=True, eq=False)
class _Part:
    """One loader's part of the batch: its rows, recorded indices and reader."""

    key: LoaderKey | None
    position: int
    batch: Any
    indices: list[int] | None
    reader: RecordReader | None
    size: int | None  # None: unknown (one loader only)
    start: int
    unknown: str = ""
    layout: CombinedLayout | None = None
    whole: Any = None  # with several loaders: the step's combined batch

    def holds(self, position: int) -> bool:
        """Whether flat position ``position`` is a row of this part."""
        return position >= self.start and (self.size is None or position < self.start + self.size)


@contextlib.contextmanager
def _kept_rng() -> Iterator[None]:
    state = RngState.capture()
    try:
        with torch.no_grad():
            yield
    finally:
        state.restore()


@dataclass
class RowNamer:
    """Names the records of a micro-batch's offending rows (see the module docs).

    Attributes:
        settings: the configuration.
        slicer: cuts rows out of a loader's part (the user's or the module's, else the built-in one).
        hook: the ``row_records`` hook in use (default: the settings' one).
        front: the front-end, whose batch chain transforms a re-read record (``None``: as collated).
        rank: this process's global rank (in warnings).
    """

    settings: RecordSettings
    slicer: Slicer | None = None
    hook: RowRecordsHook | None = None
    front: Any = None
    rank: int = 0

    @classmethod
    def for_module(cls, settings: RecordSettings, slicer: Slicer | None, front: Any) -> RowNamer:
        """The namer of a fit: the hook given, else the module's ``nanguard_row_records``; the loop's batch chain."""
        hook = settings.row_records or getattr(front.module, "nanguard_row_records", None)
        return cls(settings, slicer, hook, front, int(getattr(front, "global_rank", 0)))

    def name_rows(self, rows: Rows, diagnosis: Diagnosis, micro: MicroBatch, extra: Sequence[int] = ()) -> Rows:
        """``rows`` with the records of its offending rows, verified or not; ``micro.row_indices`` set.

        Args:
            rows: the rows ``diagnosis`` names (:func:`~lightning_nanguard.diagnose.event_fields.diagnosis_sections`).
            diagnosis: names the offending rows (flat over the loaders' parts with several loaders).
            micro: the diagnosed micro-batch.
            extra: more rows to name for the repro bundle (known-good samples saved beside them).
        """
        offending = list(diagnosis.offending or ())
        parts = self._parts(diagnosis, micro)
        if not offending or parts is None:
            return rows
        wanted = list(dict.fromkeys([*offending, *extra]))  # the offending rows first: warnings name them
        named: dict[int, _Named] = {}
        with _kept_rng():
            for part in parts:
                wanted_here = [p - part.start for p in wanted if part.holds(p)]
                told = [p - part.start for p in offending if part.holds(p)]  # warnings speak of the offending rows
                if wanted_here:
                    found_rows = self._name_part(part, wanted_here, told)
                    named.update({part.start + row: found for row, found in found_rows.items()})
        micro.row_indices = {
            p: n.records[0] if n.records is not None and len(n.records) == 1 else None for p, n in named.items()
        }
        keys = [next((part.key for part in parts if part.holds(p)), None) for p in offending]
        return _filled(rows, [named[p] for p in offending], keys)

    def name(self, event: NanEvent, diagnosis: Diagnosis, micro: MicroBatch, extra: Sequence[int] = ()) -> NanEvent:
        """``event`` with its rows named by :meth:`name_rows`."""
        return with_sections(event, rows=self.name_rows(EventSections.of(event).rows, diagnosis, micro, extra))

    # ------------------------------------------------------------------ the parts of the batch

    def _parts(self, diagnosis: Diagnosis, micro: MicroBatch) -> list[_Part] | None:
        if micro.loaders_note:
            return None  # the batch lost its loaders' layout: the loader of each row is unknown
        if micro.loaders is None:
            reader = micro.readers[0] if len(micro.readers) == 1 else None
            return [_Part(None, 0, micro.batch, micro.dataset_indices, reader, diagnosis.batch_size, 0)]
        split = diagnosis.loaders
        if split is None:
            return None
        layout, parts = micro.loaders.layout, []
        for index, (key, size) in enumerate(zip(split.keys, split.sizes, strict=True)):
            position = layout.keys.index(key)
            unknown = micro.loaders.unknown[position] if position < len(micro.loaders.unknown) else ""
            reader = micro.readers[position] if position < len(micro.readers) else None
            batch = layout.part(micro.batch, position)
            indices = micro.loaders.indices[position]
            start = split.start(index)
            parts.append(_Part(key, position, batch, indices, reader, size, start, unknown, layout, micro.batch))
        return parts

    # ------------------------------------------------------------------ one loader's rows

    def _name_part(self, part: _Part, rows: list[int], told: list[int]) -> dict[int, _Named]:
        hook = self.hook or self.settings.row_records
        if hook is not None:
            return self._from_hook(hook, part, rows)
        if self.settings.index_key is not None:
            return self._from_field(part, rows, self.settings.index_key)
        if part.indices is None:
            return {row: _Named(None, False, part.unknown) for row in rows}
        indices = part.indices
        one_each = part.size is None or len(indices) == part.size  # an unknown size: verify_rows counts the rows
        claimed = {row: indices[row] if one_each and row < len(indices) else None for row in rows}
        kept = {row: (claim,) if claim is not None else None for row, claim in claimed.items()}
        reader = part.reader
        if not self.settings.verify:
            return {row: _Named(kept[row], False, "verify_indices=False") for row in rows}
        if reader is None or reader.reason:
            why = reader.reason if reader is not None else "the loader's records cannot be read again"
            return {row: _Named(kept[row], False, f"not re-readable: {why}") for row in rows}
        check = verify_rows(
            part.batch,
            rows,
            [claimed[row] for row in rows],
            indices,
            lambda index: self._read(reader, index, part),
            self.slicer,
            part.size,
        )
        self._tell(check.only(told), part)
        return {found.row: _from_check(found) for found in check.rows}

    def _read(self, reader: RecordReader, index: int, part: _Part) -> Any:
        record = reader.read(index)
        if self.front is None:
            return record
        return self.front.as_training_batch(record, part.layout, part.position, part.whole)

    def _from_hook(self, hook: RowRecordsHook, part: _Part, rows: list[int]) -> dict[int, _Named]:
        try:
            returned = hook(part.batch, list(part.indices) if part.indices is not None else None)
            per_row = [_records(value) for value in returned]
        except Exception as error:
            reason = f"row_records failed ({type(error).__name__}: {error})"
            self._warn("row_records", part, f"{reason}: the dataset indices of the rows are unknown.")
            return {row: _Named(None, False, reason) for row in rows}
        if len(per_row) != (part.size if part.size is not None else len(per_row)) or max(rows) >= len(per_row):
            reason = f"row_records returned {len(per_row)} rows for a batch of {part.size} (one entry per row)"
            self._warn("row_records", part, f"{reason}: the dataset indices of the rows are unknown.")
            return {row: _Named(None, False, reason) for row in rows}
        return {row: _Named(per_row[row], True) for row in rows}

    def _from_field(self, part: _Part, rows: list[int], key: int | str) -> dict[int, _Named]:
        per_row = records_from_batch(part.batch, key)
        if per_row is None:
            return {row: _Named(None, False, part.unknown or f"no index field {key!r} in the batch") for row in rows}
        if (part.size is not None and len(per_row) != part.size) or max(rows) >= len(per_row):
            reason = f"the index field {key!r} has {len(per_row)} rows for a batch of {part.size}"
            return {row: _Named(None, False, reason) for row in rows}
        return {row: _Named(per_row[row], True) for row in rows}

    # ------------------------------------------------------------------ telling the user

    def _tell(self, check: RecordCheck, part: _Part) -> None:
        if check.broken is not None:
            self._warn(check.broken, part, check.notice())

    def _warn(self, key: str, part: _Part, message: str) -> None:
        where = f"training loader {part.key!r}: " if part.key is not None else ""
        self.settings.notices.warn(f"{key}:{part.key}", self.rank, where + message)


def _records(value: Any) -> tuple[int, ...]:
    """One row's entry of a ``row_records`` result: its dataset indices (one int: one record)."""
    if isinstance(value, torch.Tensor):
        value = value.flatten().tolist()
    if isinstance(value, int):
        return (value,) if value >= 0 else ()
    return tuple(int(v) for v in value if int(v) >= 0)


def _from_check(found: RowRecord) -> _Named:
    """A checked row: its verified record, else unknown with the reason (no index is guessed)."""
    if found.verified and found.index is not None:
        note = found.reason
        if found.corrected:
            note = f"row {found.row} holds record {found.index}, not {found.claimed} (the collate reorders rows)"
        return _Named((found.index,), True, note)
    return _Named(None, False, found.reason)


def _filled(rows: Rows, named: list[_Named], keys: list[LoaderKey | None]) -> Rows:
    """The rows' ``dataset_indices`` or ``sample_records``, ``indices_verified`` and the reasons."""
    details = dict(rows.details)

    def said(found: _Named, key: LoaderKey | None) -> str:
        return f"loader {key!r}: {found.reason}" if key is not None else found.reason

    if any(found.records is None for found in named):  # unknown: not verified when there is a reason to say
        reasons = [said(f, k) for f, k in zip(named, keys, strict=True) if f.records is None and f.reason]
        if reasons:
            details["dataset_indices_unknown"] = details["indices_unverified"] = "; ".join(dict.fromkeys(reasons))
        verified = False if reasons else None
        return replace(rows, dataset_indices=None, sample_records=None, indices_verified=verified, details=details)
    details.pop("dataset_indices_unknown", None)
    verified = all(found.verified for found in named)
    if not verified:
        reasons = [said(f, k) for f, k in zip(named, keys, strict=True) if not f.verified and f.reason]
        details["indices_unverified"] = "; ".join(dict.fromkeys(reasons)) or "not verified"
    notes = [said(f, k) for f, k in zip(named, keys, strict=True) if f.verified and f.reason]
    if notes:
        details["indices_note"] = "; ".join(dict.fromkeys(notes))
    records = [found.records for found in named if found.records is not None]
    if all(len(r) == 1 for r in records):
        indices = tuple(r[0] for r in records)
        return replace(rows, dataset_indices=indices, sample_records=None, indices_verified=verified, details=details)
    return replace(
        rows, dataset_indices=None, sample_records=tuple(records), indices_verified=verified, details=details
    )
