"""Which samples of a bad (micro-)batch an event names, the dashboard shows and a bundle saves.

With one training loader a sample is a position in the batch. With several
(:mod:`~lightning_nanguard.diagnose.combined`) the diagnosis numbers the samples flat over the
loaders' parts; here they become each sample's loader, its position in that loader's part and its
index in that loader's dataset (:func:`fill_sections`: the event's forensics and rows), the one
loader's part the dashboard cuts its thumbnails from (:func:`context_samples`), and a bundle in which
every loader keeps samples (:func:`bundle_samples`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch  # noqa: F401 (doctests)

from lightning_nanguard.core.event_builder import EventSections, Forensics, Rows, noted, with_sections
from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.diagnose.batch_diagnosis import Diagnosis
from lightning_nanguard.diagnose.batching import slice_batch
from lightning_nanguard.diagnose.combined import CombinedBatch, CombinedLayout, LoaderKey, LoaderSplit
from lightning_nanguard.diagnose.event_fields import diagnosis_sections
from lightning_nanguard.engine.rows.record_names import RowNamer
from lightning_nanguard.engine.step.window import MicroBatch

__all__ = ["BundleSamples", "bundle_samples", "context_samples", "fill_event", "fill_sections"]

Slicer = Callable[[Any, Sequence[int]], Any]


def fill_sections(
    diagnosis: Diagnosis,
    micro: MicroBatch,
    naming: RowNamer | None = None,
    forensics: Forensics | None = None,
    rows: Rows | None = None,
) -> tuple[Forensics, Rows]:
    """The forensics and rows of the diagnosis of ``micro``: with several loaders, each sample's loader and index.

    With ``naming`` the records of the offending rows are checked (and corrected) and
    ``indices_verified`` set (:class:`~lightning_nanguard.engine.rows.record_names.RowNamer`); the rows the repro
    bundle saves beside them are named too (``micro.row_indices``). Without it the indices are the
    recorded ones, by position, unchecked. ``forensics`` and ``rows``: the sections so far (default: empty).

    Example:
        >>> micro = MicroBatch(batch=None, batch_idx=3, dataset_indices=list(range(10, 18)))
        >>> fill_sections(Diagnosis(8, [2], cause="data"), micro)[1].dataset_indices
        (12,)
    """
    if micro.loaders is None or diagnosis.loaders is None:
        forensics, rows = diagnosis_sections(
            diagnosis, dataset_indices=micro.dataset_indices, forensics=forensics, rows=rows
        )
        if micro.loaders_note:
            rows = noted(rows, sample_loaders_unknown=micro.loaders_note)
    else:
        flat = micro.loaders.flat(diagnosis.loaders)
        offending_keys = [diagnosis.loaders.locate(p)[0] for p in diagnosis.offending or ()]
        note = micro.loaders.why_unknown(offending_keys)
        forensics, rows = diagnosis_sections(
            diagnosis, dataset_indices=flat, indices_note=note, forensics=forensics, rows=rows
        )
    if naming is None or diagnosis.offending is None:
        return forensics, rows
    saved, _ = _selection(rows.offending_samples, diagnosis)
    return forensics, naming.name_rows(rows, diagnosis, micro, extra=saved or ())


def fill_event(event: NanEvent, diagnosis: Diagnosis, micro: MicroBatch, naming: RowNamer | None = None) -> NanEvent:
    """``event`` with the sections of :func:`fill_sections` added to its own.

    Example:
        >>> micro = MicroBatch(batch=None, batch_idx=3, dataset_indices=list(range(10, 18)))
        >>> event = NanEvent(3, 0, 3, 0, ("grad",), "skipped")
        >>> fill_event(event, Diagnosis(8, [2], cause="data"), micro).dataset_indices
        (12,)
    """
    own = EventSections.of(event)
    forensics, rows = fill_sections(diagnosis, micro, naming, own.forensics, own.rows)
    return with_sections(event, forensics=forensics, rows=rows)


def context_samples(event: NanEvent, micro: MicroBatch) -> tuple[Any, list[int] | None]:
    """The batch and positions the dashboard's thumbnails are cut from: one loader's part with several.

    Samples of several loaders have no one image batch to be shown from: ``(None, positions)``.
    """
    positions = list(event.offending_samples) if event.offending_samples is not None else None
    if micro.loaders is None:
        return micro.batch, positions
    keys = set(event.sample_loaders or ())
    if len(keys) != 1:
        return None, positions
    layout = micro.loaders.layout
    return layout.part(micro.batch, layout.keys.index(keys.pop())), positions


@dataclass(frozen=True)
class BundleSamples:
    """What a repro bundle saves of a batch.

    Attributes:
        samples: the saved (sub-)batch.
        positions: positions of the saved samples in the original batch (in their own loader's part
            with several loaders); ``None``: the whole batch.
        dataset_indices: dataset index of each saved sample, when all are known.
        reference: positions, in ``samples``, of known-good samples saved next to the offending ones.
        layout: with several training loaders, where each loader's part sits in ``samples``.
        sample_loaders: with several training loaders, the loader of each saved sample.
    """

    samples: Any
    positions: list[int] | None
    dataset_indices: list[int] | None
    reference: list[int] = field(default_factory=list)
    layout: CombinedLayout | None = None
    sample_loaders: list[LoaderKey] | None = None


def _selection(
    offending_samples: Sequence[int] | None, diagnosis: Diagnosis | None
) -> tuple[list[int] | None, list[int]]:
    """Positions to save (``None``: the whole batch) and the known-good ones among them (by position in the list)."""
    if offending_samples is None or diagnosis is None or diagnosis.offending is None:
        return None, []
    if diagnosis.loaders is None:
        positions = list(offending_samples)
        good = [p for p in diagnosis.known_good if p not in positions]
        return ([good[0], *positions], [0]) if good else (positions, [])
    return _loaders_selection(diagnosis.loaders, list(diagnosis.offending), diagnosis.known_good)


def _loaders_selection(split: LoaderSplit, chosen: list[int], known_good: Sequence[int]) -> tuple[list[int], list[int]]:
    """Flat positions: the offending samples, and known-good ones so that every loader's part keeps samples.

    A loader with offending samples gets one known-good sample more, one without gets two (BatchNorm
    in train mode needs two); a loader with no known-good sample keeps its first sample.
    """
    fillers: list[int] = []
    for part in range(len(split.keys)):
        mine = [p for p in chosen if split.part_of(p) == part]
        good = [g for g in known_good if split.part_of(g) == part and g not in chosen]
        fillers += good[: 1 if mine else 2] or ([] if mine else [split.start(part)])
    ordered = sorted([*chosen, *fillers])
    return ordered, [ordered.index(f) for f in fillers if f in known_good]


def _named(row_indices: dict[int, int | None], positions: Sequence[int]) -> list[int] | None:
    """The named index of each position, when every one is known."""
    named = [row_indices.get(p) for p in positions]
    return [int(i) for i in named if i is not None] if all(i is not None for i in named) else None


def bundle_samples(
    event: NanEvent, micro: MicroBatch, diagnosis: Diagnosis | None, slicer: Slicer | None
) -> BundleSamples:
    """The offending samples of ``micro`` (or the whole batch) and known-good ones next to them.

    Example:
        >>> from lightning_nanguard.diagnose.combined import CombinedIndices
        >>> layout = CombinedLayout.from_paths([("a",), ("b",)])
        >>> batch = {"a": torch.arange(4), "b": torch.arange(10, 13)}
        >>> micro = MicroBatch(batch, 0, None, loaders=CombinedIndices(layout, ([0, 1, 2, 3], [7, 8, 9])))
        >>> found = Diagnosis(7, [5], cause="data", known_good=[0, 1, 4], loaders=LoaderSplit(("a", "b"), (4, 3)))
        >>> event = NanEvent(3, 0, 3, 0, ("grad",), "skipped", offending_samples=(1,), sample_loaders=("b",))
        >>> saved = bundle_samples(event, micro, found, None)
        >>> saved.samples, saved.sample_loaders, saved.positions, saved.dataset_indices, saved.reference
        ({'a': tensor([0, 1]), 'b': tensor([10, 11])}, ['a', 'a', 'b', 'b'], [0, 1, 0, 1], [0, 1, 7, 8], [0, 1, 2])

    The dataset indices are those the event's check named (``micro.row_indices``: corrected when the
    collate reorders rows), else the recorded ones by position.

    A known-good sample of the same batch is saved first: the origin was localised in the context of
    healthy samples (an op can be non-finite only on a batch of offending samples alone, e.g. a mean
    over zero tokens), and with BatchNorm in train mode a single sample only reproduces next to
    another one. With several training loaders every loader's part keeps samples.

    Raises:
        Exception: whatever the slicer raises (the caller never lets it stop training).
    """
    positions, reference = _selection(event.offending_samples, diagnosis)
    if micro.loaders is None or diagnosis is None or diagnosis.loaders is None:
        samples = micro.batch if positions is None else (slicer or slice_batch)(micro.batch, positions)
        indices = micro.dataset_indices
        if positions is not None and micro.row_indices is not None:  # named at the incident (checked, corrected)
            indices = _named(micro.row_indices, positions)
        elif positions is not None:
            indices = [indices[p] for p in positions] if indices is not None and len(indices) > max(positions) else None
        return BundleSamples(samples, positions, indices, reference)
    layout = micro.loaders.layout
    if positions is None:
        return BundleSamples(micro.batch, None, None, [], layout, None)
    flat = micro.loaders.flat(diagnosis.loaders)
    places = [diagnosis.loaders.locate(p) for p in positions]
    if micro.row_indices is not None:  # named at the incident (checked, corrected)
        indices = _named(micro.row_indices, positions)
    else:
        known = [flat[p] for p in positions]
        indices = [int(i) for i in known if i is not None] if all(i is not None for i in known) else None
    samples = CombinedBatch(micro.batch, layout, slicer).cut(positions)
    return BundleSamples(samples, [p for _, p in places], indices, reference, layout, [key for key, _ in places])
