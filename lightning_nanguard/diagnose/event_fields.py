"""What a diagnosis says in an event: its forensics and rows (:mod:`~lightning_nanguard.core.event_builder`).

:func:`diagnosis_sections` makes, from a :class:`~lightning_nanguard.diagnose.batch_diagnosis.Diagnosis`,
the forensics (``cause``, the origin: ``culprit_module``, ``culprit_op``, ``source_line``, ``phase``;
pass counts, hint, source text, short stack, BatchNorm channels kept short by
:mod:`~lightning_nanguard.diagnose.compact`) and the rows (``offending_samples``, ``blame_verified``,
``dataset_indices`` by position, ``sample_loaders``; why no sample or index is named). Training and
``replay`` use it alike; :func:`event_with_diagnosis` is the same for an event in hand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lightning_nanguard.core.event_builder import EventSections, Forensics, Rows, with_sections
from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.diagnose.combined import LoaderKey
from lightning_nanguard.diagnose.compact import compact_channels

if TYPE_CHECKING:
    from lightning_nanguard.diagnose.batch_diagnosis import Diagnosis
    from lightning_nanguard.diagnose.localization import Localization

__all__ = ["diagnosis_sections", "event_with_diagnosis"]


def diagnosis_sections(
    diagnosis: Diagnosis,
    positions: Sequence[int] | None = None,
    dataset_indices: Sequence[int | None] | None = None,
    batch_size: int | None = None,
    indices_note: str | None = None,
    forensics: Forensics | None = None,
    rows: Rows | None = None,
) -> tuple[Forensics, Rows]:
    """The forensics and rows ``diagnosis`` gives, added to ``forensics`` and ``rows`` (default: empty).

    Per-channel details are kept short (:mod:`~lightning_nanguard.diagnose.compact`); the full lists are in
    ``diagnosis.full_details``, for the repro bundle. With several training loaders
    (``diagnosis.loaders``) each offending sample is named by its loader (``sample_loaders``) and its
    position in that loader's part (``offending_samples``), and ``dataset_indices`` are indices in
    each sample's own loader's dataset, or ``None`` with ``details["dataset_indices_unknown"]``
    saying why when one of them is unknown.

    Args:
        diagnosis: what :func:`diagnose` found.
        positions: maps the diagnosed batch's positions to positions of the original batch
            (replay diagnoses a saved sub-batch; with several loaders, to positions in the sample's
            loader's part); identity when ``None``.
        dataset_indices: dataset index of every sample of the diagnosed batch (flat over the loaders'
            parts with several loaders; ``None`` entries: unknown), when known.
        batch_size: size of the original batch (default: the diagnosed batch's size).
        indices_note: why the dataset indices of the batch are unknown, when they are.
        forensics: the forensics so far (their details are kept unless the diagnosis writes them again).
        rows: the rows so far (``sample_records`` and ``indices_verified`` are kept).

    Example:
        >>> from lightning_nanguard.diagnose.batch_diagnosis import Diagnosis
        >>> forensics, rows = diagnosis_sections(Diagnosis(8, [2], cause="data"), dataset_indices=range(10, 18))
        >>> forensics.cause, rows.offending_samples, rows.dataset_indices
        ('data', (2,), (12,))
        >>> from lightning_nanguard.diagnose.combined import LoaderSplit
        >>> two = Diagnosis(7, [5], cause="data", loaders=LoaderSplit(("a", "b"), (4, 3)))
        >>> _, rows = diagnosis_sections(two, dataset_indices=[0, 1, 2, 3, 40, 41, 42])
        >>> rows.offending_samples, rows.sample_loaders, rows.dataset_indices
        ((1,), ('b',), (41,))
    """
    forensics = forensics if forensics is not None else Forensics()
    rows = rows if rows is not None else Rows()
    concluded, named = dict(forensics.details), dict(rows.details)  # the details of each section
    named["batch_size"] = batch_size if batch_size is not None else diagnosis.batch_size
    concluded["bisect_passes"] = diagnosis.passes
    if diagnosis.cause is not None or diagnosis.state_passes:
        concluded["state_passes"] = diagnosis.state_passes
    loaders = diagnosis.loaders
    if loaders is not None:
        named["loader_batch_sizes"] = [[key, size] for key, size in zip(loaders.keys, loaders.sizes, strict=True)]
    offending: tuple[int, ...] | None = None
    indices: tuple[int, ...] | None = None
    sample_loaders: tuple[LoaderKey, ...] | None = None
    if diagnosis.offending is not None:
        chosen = list(diagnosis.offending)
        if loaders is None:
            offending = tuple(positions[p] if positions is not None else p for p in chosen)
        else:
            places = [loaders.locate(p) for p in chosen]
            offending = tuple(
                positions[p] if positions is not None else local for p, (_, local) in zip(chosen, places, strict=True)
            )
            sample_loaders = tuple(key for key, _ in places)
        known = dataset_indices is not None and all(
            p < len(dataset_indices) and dataset_indices[p] is not None for p in chosen
        )
        if known and dataset_indices is not None:
            indices = tuple(int(dataset_indices[p]) for p in chosen)  # type: ignore[arg-type]
        elif loaders is not None and (indices_note or dataset_indices is not None):
            named["dataset_indices_unknown"] = indices_note or "not recorded for some of these loaders"
    elif diagnosis.reason:
        named["not_attributable"] = diagnosis.reason
    if diagnosis.offending is not None and diagnosis.reason:
        named["bisect_note"] = diagnosis.reason  # partial result or interacting groups next to the samples
    if diagnosis.blame_verified is False:
        named["blame_unverified"] = diagnosis.blame_note
    elif diagnosis.blame_note:
        named["blame_note"] = diagnosis.blame_note
    if diagnosis.blame_verified is not None or diagnosis.cause == "batch":
        named["verify_passes"] = diagnosis.verify_passes
    if diagnosis.error:
        concluded["diagnosis_error"] = diagnosis.error
    if diagnosis.input_fields:
        concluded["input_fields"] = list(diagnosis.input_fields)
    if diagnosis.loss_threshold is not None:
        concluded["loss_threshold"] = diagnosis.loss_threshold
    rows = dataclasses.replace(
        rows,
        offending_samples=offending,
        dataset_indices=indices,
        blame_verified=diagnosis.blame_verified if offending is not None else None,
        sample_loaders=sample_loaders if loaders is not None else rows.sample_loaders,
        details=named,
    )
    loc = diagnosis.localization
    if loc is not None and loc.phase is not None:
        forensics = dataclasses.replace(
            forensics, culprit_module=loc.module, culprit_op=loc.op, source_line=loc.source_line, phase=loc.phase
        )
        concluded.update(_origin_details(loc))
    return dataclasses.replace(forensics, cause=diagnosis.cause, details=concluded), rows


def event_with_diagnosis(
    event: NanEvent,
    diagnosis: Diagnosis,
    positions: Sequence[int] | None = None,
    dataset_indices: Sequence[int | None] | None = None,
    batch_size: int | None = None,
    indices_note: str | None = None,
) -> NanEvent:
    """``event`` with the sections of :func:`diagnosis_sections` (the same arguments) added to its own.

    Example:
        >>> from lightning_nanguard.diagnose.batch_diagnosis import Diagnosis
        >>> event = NanEvent(3, 0, 3, 0, ("loss",), "skipped")
        >>> filled = event_with_diagnosis(event, Diagnosis(8, [2], cause="data"), dataset_indices=range(10, 18))
        >>> filled.cause, filled.offending_samples, filled.dataset_indices
        ('data', (2,), (12,))
    """
    own = EventSections.of(event)
    forensics, rows = diagnosis_sections(
        diagnosis, positions, dataset_indices, batch_size, indices_note, own.forensics, own.rows
    )
    return with_sections(event, forensics=forensics, rows=rows)


def _origin_details(loc: Localization) -> dict[str, Any]:
    details: dict[str, Any] = {}
    for key, value in (
        ("module_type", loc.module_type),
        ("source_text", loc.source_text),
        ("hint", loc.hint),
        ("function", loc.function),
        ("source_path", loc.source_path),
    ):
        if value:
            details[key] = value
    if loc.stack:
        details["stack"] = [{"file": path, "line": line, "function": name} for path, line, name in loc.stack]
    if loc.input_nonfinite:
        details["input_nonfinite"] = True
    if loc.bn_channels:
        shown, summary = compact_channels(loc.bn_channels)
        details["bn_channels"] = shown
        if summary is not None:
            details["bn_channels_summary"] = summary
    return details
