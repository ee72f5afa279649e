"""What a diagnosis says in an event: the forensic fields of a :class:`~lightning_nanguard.core.events.NanEvent`.

:func:`event_with_diagnosis` fills ``cause``, ``offending_samples``, ``dataset_indices``, the origin
(``culprit_module``, ``culprit_op``, ``source_line``, ``phase``) and the details (pass counts, hint,
source text, short stack, BatchNorm channels kept short by :mod:`~lightning_nanguard.diagnose.compact`)
from a :class:`~lightning_nanguard.diagnose.diagnosis.Diagnosis`. Training and ``replay`` use it alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.diagnose.compact import compact_channels

if TYPE_CHECKING:
    from lightning_nanguard.diagnose.diagnosis import Diagnosis
    from lightning_nanguard.diagnose.localization import Localization

__all__ = ["event_with_diagnosis"]


def event_with_diagnosis(
    event: NanEvent,
    diagnosis: Diagnosis,
    positions: Sequence[int] | None = None,
    dataset_indices: Sequence[int] | None = None,
    batch_size: int | None = None,
) -> NanEvent:
    """Fill the forensic fields of ``event`` (and its ``cause``) from ``diagnosis``.

    Per-channel details are kept short (:mod:`~lightning_nanguard.diagnose.compact`); the full lists are in
    ``diagnosis.full_details``, for the repro bundle.

    Args:
        event: the event of the bad step.
        diagnosis: what :func:`diagnose` found.
        positions: maps the diagnosed batch's positions to positions of the original batch
            (replay diagnoses a saved sub-batch); identity when ``None``.
        dataset_indices: dataset index of every sample of the diagnosed batch, when known.
        batch_size: size of the original batch (default: the diagnosed batch's size).

    Example:
        >>> from lightning_nanguard.diagnose.diagnosis import Diagnosis
        >>> event = NanEvent(3, 0, 3, 0, ("loss",), "skipped")
        >>> filled = event_with_diagnosis(event, Diagnosis(8, [2], cause="data"), dataset_indices=range(10, 18))
        >>> filled.cause, filled.offending_samples, filled.dataset_indices
        ('data', (2,), (12,))
    """
    details = dict(event.details)
    details["batch_size"] = batch_size if batch_size is not None else diagnosis.batch_size
    details["bisect_passes"] = diagnosis.passes
    if diagnosis.cause is not None or diagnosis.state_passes:
        details["state_passes"] = diagnosis.state_passes
    offending: tuple[int, ...] | None = None
    indices: tuple[int, ...] | None = None
    if diagnosis.offending is not None:
        offending = tuple(positions[p] if positions is not None else p for p in diagnosis.offending)
        if dataset_indices is not None and all(p < len(dataset_indices) for p in diagnosis.offending):
            indices = tuple(int(dataset_indices[p]) for p in diagnosis.offending)
    elif diagnosis.reason:
        details["not_attributable"] = diagnosis.reason
    if diagnosis.offending is not None and diagnosis.reason:
        details["bisect_note"] = diagnosis.reason  # partial result or interacting groups next to the samples
    if diagnosis.error:
        details["diagnosis_error"] = diagnosis.error
    if diagnosis.input_fields:
        details["input_fields"] = list(diagnosis.input_fields)
    if diagnosis.loss_threshold is not None:
        details["loss_threshold"] = diagnosis.loss_threshold
    changes: dict[str, Any] = {"offending_samples": offending, "dataset_indices": indices, "cause": diagnosis.cause}
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
