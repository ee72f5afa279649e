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

from lightning_nanguard.adapter.window import MicroBatch
from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.diagnose.batching import slice_batch
from lightning_nanguard.diagnose.combined import CombinedBatch
from lightning_nanguard.diagnose.diagnosis import Diagnosis, diagnose, event_with_diagnosis
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
        event = _with_diagnosis(event, diagnosis, chosen)
        event = event.replace(batch_idx=chosen.batch_idx)
        if len(micro_batches) > 1:
            event = event.replace(
                details={**event.details, "micro_batch": next(i for i, m in enumerate(micro_batches) if m is chosen)}
            )
    if bundle_dir is not None:
        localization = diagnosis.localization if diagnosis is not None else None
        context_batch, context_positions = _context_samples(event, chosen)
        save_incident_context(
            bundle_dir, event, getattr(localization, "source_path", None), context_batch, context_positions
        )
    if settings.save_repro and bundle_dir is not None:
        event = _save(
            pl_module, event, chosen, slicer, bundle_dir, settings.max_repro_bundles, diagnosis, settings.source_root
        )
    return event, diagnosis


def _with_diagnosis(event: NanEvent, diagnosis: Diagnosis, micro: MicroBatch) -> NanEvent:
    """The event filled from the diagnosis of ``micro``: with several loaders, each sample's loader and index."""
    if micro.loaders is None or diagnosis.loaders is None:
        event = event_with_diagnosis(event, diagnosis, dataset_indices=micro.dataset_indices)
        if micro.loaders_note:
            event = event.replace(details={**event.details, "sample_loaders_unknown": micro.loaders_note})
        return event
    flat = micro.loaders.flat(diagnosis.loaders)
    offending_keys = [diagnosis.loaders.locate(p)[0] for p in diagnosis.offending or ()]
    note = micro.loaders.why_unknown(offending_keys)
    return event_with_diagnosis(event, diagnosis, dataset_indices=flat, indices_note=note)


def _context_samples(event: NanEvent, micro: MicroBatch) -> tuple[Any, list[int] | None]:
    """The batch and positions the dashboard's thumbnails are cut from: one loader's part with several."""
    positions = list(event.offending_samples) if event.offending_samples is not None else None
    if micro.loaders is None:
        return micro.batch, positions
    keys = set(event.sample_loaders or ())
    if len(keys) != 1:  # samples of several loaders (or none named): no one image batch to show them from
        return None, positions
    layout = micro.loaders.layout
    return layout.part(micro.batch, layout.keys.index(keys.pop())), positions


def _saved_selection(event: NanEvent, diagnosis: Diagnosis | None) -> tuple[list[int] | None, list[int]]:
    """Positions of the samples to save (``None``: the whole batch) and which of them are known good."""
    if event.offending_samples is None or diagnosis is None or diagnosis.offending is None:
        return None, []
    if diagnosis.loaders is None:
        positions = list(event.offending_samples)
        good = [p for p in diagnosis.known_good if p not in positions]
        return ([good[0], *positions], [0]) if good else (positions, [])
    # several loaders, flat positions: every loader's part needs samples (two under BatchNorm: a good one more)
    split = diagnosis.loaders
    chosen = list(diagnosis.offending)
    fillers: list[int] = []
    for part in range(len(split.keys)):
        mine = [p for p in chosen if split.part_of(p) == part]
        good = [g for g in diagnosis.known_good if split.part_of(g) == part and g not in chosen]
        fillers += good[: 1 if mine else 2] or ([] if mine else [split.start(part)])
    ordered = sorted([*chosen, *fillers])
    return ordered, [ordered.index(f) for f in fillers if f in diagnosis.known_good]


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

    A known-good sample of the same batch is saved first and named in the bundle: the origin was
    localised in the context of healthy samples (an op can be non-finite only on a batch of
    offending samples alone, e.g. a mean over zero tokens), and with BatchNorm in train mode a
    single sample only reproduces next to another one. With several training loaders every
    loader's part keeps samples (known-good ones where it has no offending sample), and the
    bundle records the layout and each saved sample's loader.
    """
    if max_bundles == 0:
        return event
    positions, reference = _saved_selection(event, diagnosis)
    try:
        layout, sample_loaders = None, None
        if micro.loaders is not None and diagnosis is not None and diagnosis.loaders is not None:
            layout = micro.loaders.layout
            combined = CombinedBatch(micro.batch, layout, slicer)
            samples = micro.batch if positions is None else combined.cut(positions)
            flat = micro.loaders.flat(diagnosis.loaders)
            places = [diagnosis.loaders.locate(p) for p in positions] if positions is not None else None
            sample_loaders = [key for key, _ in places] if places is not None else None
            local = [p for _, p in places] if places is not None else None
            indices: list[int] | None = None
            if positions is not None and all(flat[p] is not None for p in positions):
                indices = [int(flat[p]) for p in positions]  # type: ignore[arg-type]
            saved_positions = local
        else:
            samples = micro.batch if positions is None else (slicer or slice_batch)(micro.batch, positions)
            indices = micro.dataset_indices
            if positions is not None:
                indices = (
                    [indices[p] for p in positions] if indices is not None and len(indices) > max(positions) else None
                )
            saved_positions = positions
        full = diagnosis.full_details if diagnosis is not None else None
        path = save_bundle(
            bundle_dir,
            event,
            pl_module,
            samples,
            micro.batch_idx,
            saved_positions,
            indices,
            reference,
            full,
            source_root,
            layout=layout,
            sample_loaders=sample_loaders,
        )
        prune_bundles(bundle_dir, max_bundles)
    except Exception as error:  # a bundle must never kill training
        log.warning("NanGuard: could not save the repro bundle: %r", error)
        return event
    return event.replace(repro_path=str(path)) if Path(path).exists() else event
