"""The Lightning side of :mod:`lightning_nanguard.diagnose.diagnosis`: diagnose the micro-batches of a bad step.

Called by the guard on a bad step, before the step is discarded, with the BatchNorm buffers
already restored to their values before the step's first forward. It writes nothing: the
incident's files (repro bundle, dashboard context) are the reporting adapter's
(:meth:`~lightning_nanguard.engine.recording.IncidentRecorder.save_incident_files`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.diagnose.diagnosis import Diagnosis, diagnose
from lightning_nanguard.engine.rows.records import RecordSettings, RowNamer
from lightning_nanguard.engine.rows.samples import fill_event
from lightning_nanguard.engine.step.window import MicroBatch

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

__all__ = ["DiagnosisSettings", "StepDiagnosis", "diagnose_step", "training_step_of"]

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

    def row_namer(self, trainer: Any, pl_module: Any, slicer: Slicer | None) -> RowNamer | None:
        """Who names the records of the offending rows at this fit (``None`` without :attr:`records`)."""
        return RowNamer.for_module(self.records, slicer, trainer, pl_module) if self.records is not None else None

    @property
    def diagnoses(self) -> bool:
        """Whether a bad step is re-run or saved at all."""
        return self.bisect or self.localize or self.save_repro


def training_step_of(pl_module: LightningModule) -> Callable[[Any, int], Any]:
    """The module's own ``training_step`` (the original one under ``torch.compile``)."""
    compiler_ctx = getattr(pl_module, "_compiler_ctx", None)
    if compiler_ctx and compiler_ctx.get("original_training_step") is not None:
        original = compiler_ctx["original_training_step"]
        return lambda batch, batch_idx: original(batch, batch_idx)
    return pl_module.training_step


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


def diagnose_step(
    trainer: Trainer,
    pl_module: LightningModule,
    event: NanEvent,
    micro_batches: Sequence[MicroBatch],
    settings: DiagnosisSettings,
    reference_batch: Any = None,
    loss_threshold: float | None = None,
) -> StepDiagnosis:
    """Diagnose the step's micro-batches and fill the event's forensic fields; never raises.

    Under gradient accumulation the micro-batches are diagnosed in order and the first that
    reproduces the incident is the one the event names.

    Args:
        trainer: the Trainer (precision context).
        pl_module: the model, with the BatchNorm state from before the step.
        event: the event of the bad step.
        micro_batches: the step's micro-batches.
        settings: what to diagnose.
        reference_batch: a small known-good sub-batch of a recent healthy step (tells a state fault).
        loss_threshold: for a loss spike, the loss above which a (sub-)batch counts as bad.
    """
    if not micro_batches:
        return StepDiagnosis(event)
    slicer: Slicer | None = settings.slicer_for(pl_module)
    diagnosis: Diagnosis | None = None
    chosen = micro_batches[-1]
    if settings.bisect or settings.localize:
        step_fn = training_step_of(pl_module)
        for micro in micro_batches:
            found = diagnose(
                pl_module,
                micro.batch,
                step_fn=step_fn,
                batch_idx=micro.batch_idx,
                slicer=slicer,
                context=trainer.precision_plugin.train_step_context,
                bisect=settings.bisect,
                localize_origin=settings.localize,
                max_passes=settings.max_bisect_passes,
                reference_batch=reference_batch,
                loss_threshold=loss_threshold,
                source_root=settings.source_root,
                layout=micro.loaders.layout if micro.loaders is not None else None,
            )
            if diagnosis is None or found.offending is not None or _localized(found):
                diagnosis, chosen = found, micro
            if found.offending is not None or _localized(found) or found.error:
                break
    if diagnosis is not None:
        event = fill_event(event, diagnosis, chosen, settings.row_namer(trainer, pl_module, slicer))
        event = event.replace(batch_idx=chosen.batch_idx)
        if len(micro_batches) > 1:
            event = event.replace(
                details={**event.details, "micro_batch": next(i for i, m in enumerate(micro_batches) if m is chosen)}
            )
    return StepDiagnosis(event, diagnosis, chosen, slicer, reference_batch)
