"""Diagnose the micro-batches of a bad step: :mod:`lightning_nanguard.diagnose.batch_diagnosis` driven by the engine.

Called on a bad step, before the step is discarded, with the BatchNorm buffers already restored
to their values before the step's first forward; one routine for one process, DDP and sharding
(:func:`diagnose_micro_batches`). It writes nothing: the incident's files (repro bundle, dashboard
context) are :mod:`~lightning_nanguard.engine.incident.files`'.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from lightning_nanguard.core.event_builder import EventSections, noted, with_sections
from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.diagnose.batch_diagnosis import Diagnosis, diagnose
from lightning_nanguard.diagnose.lockstep import LockstepRunner
from lightning_nanguard.engine.rows.record_names import RecordSettings, RowNamer
from lightning_nanguard.engine.rows.samples import fill_sections
from lightning_nanguard.engine.step.window import MicroBatch

if TYPE_CHECKING:
    from lightning_nanguard.diagnose.lockstep import Lockstep
    from lightning_nanguard.engine.frontend import FrontEnd

__all__ = ["DiagnosisSettings", "StepDiagnosis", "diagnose_micro_batches"]

log = logging.getLogger("lightning_nanguard")

Slicer = Callable[[Any, Sequence[int]], Any]


@dataclass(frozen=True)
class DiagnosisSettings:
    """What to do on a bad step (the ``NanGuard`` arguments of the same names; no defaults here).

    ``diagnose_here`` is False where re-running ``training_step`` on one rank is impossible (FSDP).
    ``records``: how the records of the offending rows are named and checked (``index_key``,
    ``row_records``, ``verify_indices``); ``None``: the recorded indices by position, unchecked.
    """

    bisect: bool
    localize: bool
    max_bisect_passes: int
    save_repro: bool
    max_repro_bundles: int
    batch_slicer: Slicer | None
    diagnose_here: bool
    source_root: str | None
    records: RecordSettings | None = None

    def slicer_for(self, pl_module: Any) -> Slicer | None:
        """The batch slicer: the user's, else the module's ``nanguard_slice_batch``, else ``None`` (built-in)."""
        return self.batch_slicer or getattr(pl_module, "nanguard_slice_batch", None)

    def row_namer(self, front: FrontEnd, slicer: Slicer | None) -> RowNamer | None:
        """Who names the records of the offending rows at this fit (``None`` without :attr:`records`)."""
        return RowNamer.for_module(self.records, slicer, front) if self.records is not None else None

    @property
    def diagnoses(self) -> bool:
        """Whether a bad step is re-run or saved at all."""
        return self.bisect or self.localize or self.save_repro


def _localized(diagnosis: Diagnosis) -> bool:
    return diagnosis.localization is not None and diagnosis.localization.phase is not None


@dataclass(frozen=True)
class StepDiagnosis:
    """What the diagnosis of one bad step found.

    Attributes:
        event: the event with its forensic fields filled.
        diagnosis: the diagnosis of the micro-batch the event names (``None``: not re-run).
        micro_batch: that micro-batch (``None`` when the step kept none).
        slicer: the batch slicer used (the user's, the module's ``nanguard_slice_batch``, or ``None``).
        reference_batch: the reference sub-batch of a healthy step the diagnosis ran beside (``None``: none).
    """

    event: NanEvent
    diagnosis: Diagnosis | None = None
    micro_batch: MicroBatch | None = None
    slicer: Slicer | None = None
    reference_batch: Any = None

    @property
    def reproduced(self) -> bool:
        """Whether the re-run of the batch was bad too (``True`` when it was not re-run)."""
        return self.diagnosis is None or self.diagnosis.reproduced


def diagnose_micro_batches(
    front: FrontEnd,
    event: NanEvent,
    micro_batches: Sequence[MicroBatch],
    settings: DiagnosisSettings,
    reference_batch: Any = None,
    loss_threshold: float | None = None,
    lockstep: Lockstep | None = None,
    nonfinite_weights: Sequence[str] | None = None,
) -> StepDiagnosis:
    """Diagnose the step's micro-batches and add their forensics and rows to the event: the one routine of every path.

    The micro-batches are diagnosed in order and the first that holds the incident is the one the
    event names (under gradient accumulation). One process or DDP: each rank alone, and a micro-batch
    holds it when samples are named or the origin is found. Under sharding every peer of a
    tensor-parallel group runs the same passes in ``lockstep``: it holds it when samples are named or
    a cause is found, results every peer shares (the origin is found on one shard only), so the peers
    stop at the same micro-batch. Runs with the BatchNorm state from before the step; writes nothing
    (:func:`~lightning_nanguard.engine.incident.files.save_incident_files` does). Never raises.

    Args:
        front: the front-end (the model, its training step and precision context).
        event: the event of the bad step (built again with the diagnosis's forensics and rows, and the
            diagnosed micro-batch's ``batch_idx``, in the result).
        micro_batches: the step's micro-batches.
        settings: what to diagnose.
        reference_batch: a small known-good sub-batch of a recent healthy step (tells a state fault).
        loss_threshold: for a loss spike, the loss above which a (sub-)batch counts as bad.
        lockstep: under sharding, the ticks that keep the peers' passes in step.
        nonfinite_weights: under sharding, the weights any rank found non-finite (``None``: found here).
    """
    if not micro_batches:
        return StepDiagnosis(event)
    slicer: Slicer | None = settings.slicer_for(front.module)
    diagnosis: Diagnosis | None = None
    chosen = micro_batches[-1]
    if settings.bisect or settings.localize:
        step_fn = front.step_fn()
        factory = functools.partial(LockstepRunner, lockstep=lockstep) if lockstep is not None else None
        for micro in micro_batches:
            found = diagnose(
                front.module,
                micro.batch,
                step_fn=step_fn,
                batch_idx=micro.batch_idx,
                slicer=slicer,
                context=front.step_context,
                bisect=settings.bisect,
                localize_origin=settings.localize,
                max_passes=settings.max_bisect_passes,
                reference_batch=reference_batch,
                loss_threshold=loss_threshold,
                source_root=settings.source_root,
                layout=micro.loaders.layout if micro.loaders is not None else None,
                runner_factory=factory,
                nonfinite_weights=nonfinite_weights,
            )
            holds = found.offending is not None or (found.cause is not None if lockstep else _localized(found))
            if diagnosis is None or holds:
                diagnosis, chosen = found, micro
            if holds or found.error:
                break
    if diagnosis is not None:
        own = EventSections.of(event)
        forensics, rows = fill_sections(diagnosis, chosen, settings.row_namer(front, slicer), own.forensics, own.rows)
        if len(micro_batches) > 1:
            forensics = noted(forensics, micro_batch=next(i for i, m in enumerate(micro_batches) if m is chosen))
        where = replace(own.where, batch_idx=chosen.batch_idx)  # the micro-batch the event names
        event = with_sections(event, where=where, forensics=forensics, rows=rows)
    return StepDiagnosis(event, diagnosis, chosen, slicer, reference_batch)
