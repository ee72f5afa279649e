"""A bad step's files: the dashboard's incident context and the repro bundle.

Written on the rank that records the incident, after its diagnosis (:mod:`.step_diagnosis`), into the
recorder's ``nanguard/`` directory (:class:`~lightning_nanguard.engine.recording.EventSinks`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from lightning_nanguard.core.event_builder import Files
from lightning_nanguard.engine.incident.step_diagnosis import DiagnosisSettings, StepDiagnosis
from lightning_nanguard.engine.recording import IncidentRecorder
from lightning_nanguard.engine.rows.samples import bundle_samples, context_samples
from lightning_nanguard.reporting.context import save_incident_context
from lightning_nanguard.reporting.repro import prune_bundles, save_bundle

__all__ = ["save_incident_files"]


def save_incident_files(
    recorder: IncidentRecorder,
    pl_module: nn.Module,
    found: StepDiagnosis,
    settings: DiagnosisSettings,
    module_state: Mapping[str, Any] | str | None = None,
) -> Files:
    """Write a bad step's dashboard context and (with ``save_repro``) its repro bundle; never raises.

    ``module_state``: the state to save instead of ``pl_module.state_dict()`` (a sharded model's
    gathered state), or why there is none. Returns the event's
    :class:`~lightning_nanguard.core.event_builder.Files`: ``repro_path`` when a bundle was saved.
    The files are an optional part of the guard (``bundles``): a disk that refuses them switches
    that part off, with a ``guard_error`` event, and the event goes on without them.
    """
    event, micro = found.event, found.micro_batch
    directory = recorder.sinks.nanguard_dir
    files = Files()
    if directory is None or micro is None or not recorder.parts.on("bundles"):
        return files
    try:
        localization = found.diagnosis.localization if found.diagnosis is not None else None
        source_path = getattr(localization, "source_path", None)
        context_batch, context_positions = context_samples(event, micro)  # one loader's part with several
        save_incident_context(directory, event, source_path, context_batch, context_positions)
        if settings.save_repro and settings.max_repro_bundles > 0:
            max_bundles, root = settings.max_repro_bundles, settings.source_root
            files = _save_bundle(pl_module, found, directory, max_bundles, root, module_state)
    except Exception as error:
        recorder.parts.failed("bundles", error)
        return Files()
    return files


def _save_bundle(
    pl_module: nn.Module,
    found: StepDiagnosis,
    directory: str,
    max_bundles: int,
    source_root: str | None,
    module_state: Mapping[str, Any] | str | None = None,
) -> Files:
    """Save the offending samples (or the whole batch) of the step's diagnosed micro-batch.

    Known-good samples are saved next to them (see
    :func:`~lightning_nanguard.engine.rows.samples.bundle_samples`); with several training loaders
    the bundle records the layout and each saved sample's loader.
    """
    event, micro = found.event, found.micro_batch
    assert micro is not None
    chosen = bundle_samples(event, micro, found.diagnosis, found.slicer)
    full = found.diagnosis.full_details if found.diagnosis is not None else None
    path = save_bundle(
        directory,
        event,
        pl_module,
        chosen.samples,
        micro.batch_idx,
        chosen.positions,
        chosen.dataset_indices,
        chosen.reference,
        full,
        source_root,
        module_state=module_state,
        layout=chosen.layout,
        sample_loaders=chosen.sample_loaders,
        reference_batch=found.reference_batch if event.cause == "batch" else None,  # the cause's evidence
    )
    prune_bundles(directory, max_bundles)
    return Files(str(path)) if Path(path).exists() else Files()
