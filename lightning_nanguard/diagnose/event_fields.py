"""What a diagnosis says in an event: the forensic fields of a :class:`~lightning_nanguard.core.events.NanEvent`.

:func:`event_with_diagnosis` fills ``cause``, ``offending_samples``, ``blame_verified``, ``dataset_indices``, the origin
(``culprit_module``, ``culprit_op``, ``source_line``, ``phase``) and the details (pass counts, hint,
source text, short stack, BatchNorm channels kept short by :mod:`~lightning_nanguard.diagnose.compact`)
from a :class:`~lightning_nanguard.diagnose.batch_diagnosis.Diagnosis`. Training and ``replay`` use it alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.diagnose.combined import LoaderKey
from lightning_nanguard.diagnose.compact import compact_channels

if TYPE_CHECKING:
    from lightning_nanguard.diagnose.batch_diagnosis import Diagnosis
    from lightning_nanguard.diagnose.localization import Localization

__all__ = ["event_with_diagnosis"]


def event_with_diagnosis(
    event: NanEvent,
    diagnosis: Diagnosis,
    positions: Sequence[int] | None = None,
    dataset_indices: Sequence[int | None] | None = None,
    batch_size: int | None = None,
    indices_note: str | None = None,
) -> NanEvent:
    """Fill the forensic fields of ``event`` (and its ``cause``) from ``diagnosis``.

    Per-channel details are kept short (:mod:`~lightning_nanguard.diagnose.compact`); the full lists are in
    ``diagnosis.full_details``, for the repro bundle. With several training loaders
    (``diagnosis.loaders``) each offending sample is named by its loader (``sample_loaders``) and its
    position in that loader's part (``offending_samples``), and ``dataset_indices`` are indices in
    each sample's own loader's dataset, or ``None`` with ``details["dataset_indices_unknown"]``
    saying why when one of them is unknown.

    Args:
        event: the event of the bad step.
        diagnosis: what :func:`diagnose` found.
        positions: maps the diagnosed batch's positions to positions of the original batch
            (replay diagnoses a saved sub-batch; with several loaders, to positions in the sample's
            loader's part); identity when ``None``.
        dataset_indices: dataset index of every sample of the diagnosed batch (flat over the loaders'
            parts with several loaders; ``None`` entries: unknown), when known.
        batch_size: size of the original batch (default: the diagnosed batch's size).
        indices_note: why the dataset indices of the batch are unknown, when they are.

    Example:
        >>> from lightning_nanguard.diagnose.batch_diagnosis import Diagnosis
        >>> event = NanEvent(3, 0, 3, 0, ("loss",), "skipped")
        >>> filled = event_with_diagnosis(event, Diagnosis(8, [2], cause="data"), dataset_indices=range(10, 18))
        >>> filled.cause, filled.offending_samples, filled.dataset_indices
        ('data', (2,), (12,))
        >>> from lightning_nanguard.diagnose.combined import LoaderSplit
        >>> two = Diagnosis(7, [5], cause="data", loaders=LoaderSplit(("a", "b"), (4, 3)))
        >>> filled = event_with_diagnosis(event, two, dataset_indices=[0, 1, 2, 3, 40, 41, 42])
        >>> filled.offending_samples, filled.sample_loaders, filled.dataset_indices
        ((1,), ('b',), (41,))
    """
    details = dict(event.details)
    details["batch_size"] = batch_size if batch_size is not None else diagnosis.batch_size
    details["bisect_passes"] = diagnosis.passes
    if diagnosis.cause is not None or diagnosis.state_passes:
        details["state_passes"] = diagnosis.state_passes
    loaders = diagnosis.loaders
    if loaders is not None:
        details["loader_batch_sizes"] = [[key, size] for key, size in zip(loaders.keys, loaders.sizes, strict=True)]
    offending: tuple[int, ...] | None = None
    indices: tuple[int, ...] | None = None
    sample_loaders: tuple[LoaderKey, ...] | None = None
    if diagnosis.offending is not None:
        found = list(diagnosis.offending)
        if loaders is None:
            offending = tuple(positions[p] if positions is not None else p for p in found)
        else:
            places = [loaders.locate(p) for p in found]
            offending = tuple(
                positions[p] if positions is not None else local for p, (_, local) in zip(found, places, strict=True)
            )
            sample_loaders = tuple(key for key, _ in places)
        known = dataset_indices is not None and all(
            p < len(dataset_indices) and dataset_indices[p] is not None for p in found
        )
        if known and dataset_indices is not None:
            indices = tuple(int(dataset_indices[p]) for p in found)  # type: ignore[arg-type]
        elif loaders is not None and (indices_note or dataset_indices is not None):
            details["dataset_indices_unknown"] = indices_note or "not recorded for some of these loaders"
    elif diagnosis.reason:
        details["not_attributable"] = diagnosis.reason
    if diagnosis.offending is not None and diagnosis.reason:
        details["bisect_note"] = diagnosis.reason  # partial result or interacting groups next to the samples
    if diagnosis.blame_verified is False:
        details["blame_unverified"] = diagnosis.blame_note
    elif diagnosis.blame_note:
        details["blame_note"] = diagnosis.blame_note
    if diagnosis.blame_verified is not None or diagnosis.cause == "batch":
        details["verify_passes"] = diagnosis.verify_passes
    if diagnosis.error:
        details["diagnosis_error"] = diagnosis.error
    if diagnosis.input_fields:
        details["input_fields"] = list(diagnosis.input_fields)
    if diagnosis.loss_threshold is not None:
        details["loss_threshold"] = diagnosis.loss_threshold
    changes: dict[str, Any] = {
        "offending_samples": offending,
        "dataset_indices": indices,
        "cause": diagnosis.cause,
        "blame_verified": diagnosis.blame_verified if offending is not None else None,
    }
    if loaders is not None:
        changes["sample_loaders"] = sample_loaders
    loc = diagnosis.localization
    if loc is not None and loc.phase is not None:
        changes.update(culprit_module=loc.module, culprit_op=loc.op, source_line=loc.source_line, phase=loc.phase)
        details.update(_origin_details(loc))
    changes["details"] = details
    return event.replace(**changes)


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
