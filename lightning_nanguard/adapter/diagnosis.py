"""The Lightning side of forensics: diagnose the micro-batches of a bad step and save a bundle.

Called by the guard on a bad step, before the step is discarded, with the BatchNorm buffers
already restored to their values before the step's first forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_nanguard.adapter.batch_samples import bundle_samples, context_samples, fill_event
from lightning_nanguard.adapter.window import MicroBatch
from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.diagnose.diagnosis import Diagnosis, diagnose
from lightning_nanguard.reporting.context import save_incident_context
from lightning_nanguard.reporting.repro import prune_bundles, save_bundle

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

__all__ = ["DiagnosisSettings", "diagnose_step", "training_step_of"]

log = logging.getLogger("lightning_nanguard")

Slicer = Callable[[Any, Sequence[int]], Any]


@dataclass(frozen=True)
class DiagnosisSettings:
    """What to do on a bad step (mirrors the ``NanGuard`` arguments of the same names).

    ``diagnose_here`` is False where re-running ``training_step`` on one rank is impossible (FSDP).
    """

    bisect: bool = True
    localize: bool = True
    max_bisect_passes: int = 128
    save_repro: bool = True
    max_repro_bundles: int = 5
    batch_slicer: Slicer | None = None
    diagnose_here: bool = True
    source_root: str | None = None

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


def diagnose_step(
    trainer: Trainer,
    pl_module: LightningModule,
    event: NanEvent,
    micro_batches: Sequence[MicroBatch],
    settings: DiagnosisSettings,
    bundle_dir: str | None,
    reference_batch: Any = None,
    loss_threshold: float | None = None,
    loss_scaled: bool = False,
) -> tuple[NanEvent, Diagnosis | None]:
    """Fill the event's forensic fields, save a repro bundle and the dashboard's context; never raises.

    Under gradient accumulation the micro-batches are diagnosed in order and the first that
    reproduces the incident is the one the event names.

    Args:
        trainer: the Trainer (precision context).
        pl_module: the model, with the BatchNorm state from before the step.
        event: the event of the bad step.
        micro_batches: the step's micro-batches.
        settings: what to diagnose.
        bundle_dir: ``<log_dir>/nanguard`` (``None``: nothing is written).
        reference_batch: a small known-good sub-batch of a recent healthy step (tells a state fault).
        loss_threshold: for a loss spike, the loss above which a (sub-)batch counts as bad.
        loss_scaled: a GradScaler scaled the step's loss. When the (unscaled) re-run of the batch is
            finite, the NaN/Inf came from the scaling: nothing is written, and the caller reads
            ``diagnosis.reproduced``.
    """
    if not micro_batches:
        return event, None
    slicer: Slicer | None = settings.batch_slicer or getattr(pl_module, "nanguard_slice_batch", None)
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
    if loss_scaled and loss_threshold is None and diagnosis is not None and not diagnosis.reproduced:
        return event, diagnosis  # the GradScaler's overflow, not an incident: no bundle, no context
    if diagnosis is not None:
        event = fill_event(event, diagnosis, chosen)
        event = event.replace(batch_idx=chosen.batch_idx)
        if len(micro_batches) > 1:
            event = event.replace(
                details={**event.details, "micro_batch": next(i for i, m in enumerate(micro_batches) if m is chosen)}
            )
    if bundle_dir is not None:
        localization = diagnosis.localization if diagnosis is not None else None
        context_batch, context_positions = context_samples(event, chosen)
        save_incident_context(
            bundle_dir, event, getattr(localization, "source_path", None), context_batch, context_positions
        )
    if settings.save_repro and bundle_dir is not None:
        event = _save(
            pl_module, event, chosen, slicer, bundle_dir, settings.max_repro_bundles, diagnosis, settings.source_root
        )
    return event, diagnosis


def _save(
    pl_module: LightningModule,
    event: NanEvent,
    micro: MicroBatch,
    slicer: Slicer | None,
    bundle_dir: str,
    max_bundles: int,
    diagnosis: Diagnosis | None = None,
    source_root: str | None = None,
) -> NanEvent:
    """Save the offending samples (or the whole batch) of ``micro``; never raises.

    Known-good samples are saved next to them (see
    :func:`~lightning_nanguard.adapter.batch_samples.bundle_samples`); with several training loaders
    the bundle records the layout and each saved sample's loader.
    """
    if max_bundles == 0:
        return event
    try:
        chosen = bundle_samples(event, micro, diagnosis, slicer)
        full = diagnosis.full_details if diagnosis is not None else None
        path = save_bundle(
            bundle_dir,
            event,
            pl_module,
            chosen.samples,
            micro.batch_idx,
            chosen.positions,
            chosen.dataset_indices,
            chosen.reference,
            full,
            source_root,
            layout=chosen.layout,
            sample_loaders=chosen.sample_loaders,
        )
        prune_bundles(bundle_dir, max_bundles)
    except Exception as error:  # a bundle must never kill training
        log.warning("NanGuard: could not save the repro bundle: %r", error)
        return event
    return event.replace(repro_path=str(path)) if Path(path).exists() else event
