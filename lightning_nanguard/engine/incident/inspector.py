"""What one rank found on a step that was not healthy: the event, the diagnosis, the vote to share.

:class:`IncidentInspector` runs on every rank when some rank's check flagged the step. It confirms
this rank's own NaN/Inf element by element (a finite tensor can overflow a norm), tells an AMP
overflow (the GradScaler's business) from an incident, diagnoses its own incident (bisection,
localisation, repro bundle) from the BatchNorm state before the step, and returns a
:class:`~lightning_nanguard.decide.policy.RankVote` for the shared decision plus its own event.

The event is built from sections (:mod:`lightning_nanguard.core.event_builder`): ``Where`` (with
the optimizer's index a front-end passes as ``optimizer``) and ``Found`` here, ``Forensics`` and
``Rows`` from the diagnosis, ``Files`` from the incident's files; the step's decision adds
``Decided`` (:meth:`~lightning_nanguard.engine.step_actions.StepActions.act`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_nanguard.core.event_builder import (
    EventSections,
    Forensics,
    Found,
    Where,
    build_event,
    noted,
    with_sections,
)
from lightning_nanguard.core.events import EventKind, NanEvent
from lightning_nanguard.decide.policy import RankVote, StepHealth
from lightning_nanguard.detect.check import grouped_norms
from lightning_nanguard.detect.confirm import bad_batchnorm_names, nonfinite_names
from lightning_nanguard.engine.incident.files import save_incident_files
from lightning_nanguard.engine.incident.step_diagnosis import DiagnosisSettings, diagnose_micro_batches
from lightning_nanguard.engine.parts import GuardParts
from lightning_nanguard.engine.recording import IncidentRecorder
from lightning_nanguard.engine.step.spikes import SpikeWatch
from lightning_nanguard.engine.step.window import StepWindow

if TYPE_CHECKING:
    from lightning_nanguard.engine.frontend import FrontEnd

__all__ = [
    "IncidentInspector",
    "with_rerun_note",
    "event_cause",
    "loss_scale_event",
    "quarantine_items_of",
    "quarantine_of",
    "quarantine_refusal",
    "verified_records",
]


def _any_inf(tensors: Sequence[Tensor]) -> bool:
    """Whether some element is +/-Inf (bad path only: one host read)."""
    flags = [torch.isinf(t).any() for t in tensors]
    return bool(torch.stack(flags).any()) if flags else False


def event_cause(event: NanEvent | None) -> str | None:
    """The event's cause; samples named without a cause (an older diagnosis) count as ``"data"``."""
    if event is None:
        return None
    if event.cause is not None:
        return event.cause
    return "data" if event.offending_samples is not None else None


def verified_records(event: NanEvent | None) -> bool:
    """Whether the event's dataset indices may be quarantined: both their index and their blame verified.

    Example:
        >>> named = NanEvent(3, 0, 3, 0, ("loss",), "skipped", offending_samples=(1,), dataset_indices=(11,))
        >>> verified_records(named), verified_records(named.replace(indices_verified=True, blame_verified=True))
        (False, True)
    """
    return event is not None and event.indices_verified is True and event.blame_verified is True


def quarantine_of(event: NanEvent | None) -> tuple[int, ...]:
    """The dataset indices to quarantine (one training loader): only verified ones."""
    if event is None or event.sample_loaders is not None or not verified_records(event):
        return ()
    return tuple(event.dataset_indices or ())


def quarantine_items_of(event: NanEvent | None) -> tuple[tuple[str | int, int], ...]:
    """``(loader key, dataset index)`` to quarantine (several training loaders: each in its own loader)."""
    if event is None or event.sample_loaders is None or event.dataset_indices is None or not verified_records(event):
        return ()
    return tuple(zip(event.sample_loaders, event.dataset_indices, strict=True))


def quarantine_refusal(event: NanEvent | None) -> str | None:
    """Why the records an event names are not quarantined (``None``: nothing named, or verified).

    Example:
        >>> event = NanEvent(3, 0, 3, 0, ("loss",), "skipped", offending_samples=(1,), dataset_indices=(36,),
        ...                  indices_verified=False, blame_verified=True,
        ...                  details={"indices_unverified": "the collate reorders rows"})
        >>> quarantine_refusal(event)
        'dataset indices [36]: the index is not verified (the collate reorders rows)'
    """
    if event is None or event.offending_samples is None or event.cause not in (None, "data", "input"):
        return None
    named = list(event.dataset_indices or [i for row in event.sample_records or () for i in row])
    what = f"dataset indices {named}" if named else f"samples {list(event.offending_samples)}"
    if not named:
        return f"{what}: {event.details.get('indices_unverified', 'their dataset indices are unknown')}"
    if event.sample_records is not None:
        return f"{what}: their rows hold several records each, so no one record is shown to be at fault"
    if event.indices_verified is not True:
        return f"{what}: the index is not verified ({event.details.get('indices_unverified', 'not checked')})"
    if event.blame_verified is not True:
        return f"{what}: the blame is not verified ({event.details.get('blame_unverified', 'not checked')})"
    return None


def with_rerun_note(front: Any, event: NanEvent | None) -> NanEvent | None:
    """``event`` saying why no samples are named, when the front-end cannot re-run a step (``samples_not_named``).

    Example:
        >>> class NoRerun:
        ...     def cannot_rerun(self): return "naming samples needs NanGuard(loss_fn=...)"
        >>> event = NanEvent(3, 0, 3, 0, ("loss",), "skipped")
        >>> with_rerun_note(NoRerun(), event).details
        {'samples_not_named': 'naming samples needs NanGuard(loss_fn=...)'}
    """
    note = front.cannot_rerun() if event is not None else None
    if event is None or note is None or event.offending_samples is not None:
        return event
    return with_sections(event, rows=noted(EventSections.of(event).rows, samples_not_named=note))


def loss_scale_event(
    front: Any,
    batch_idx: int,
    loss_scale: float | None,
    consecutive_overflows: int,
    grad_norm: float | None,
    optimizer: int | None = None,
) -> NanEvent:
    """The event of a GradScaler whose scale collapsed under repeated overflow (no rank's own NaN/Inf).

    Example:
        >>> loss_scale_event(None, 4, 0.5, 20, None).kinds
        ('loss_scale',)
    """
    found = Found(
        ("loss_scale",),
        grad_norm=grad_norm,
        details={"loss_scale": loss_scale, "consecutive_overflows": consecutive_overflows},
    )
    hint = (
        "the loss scale collapsed: the model overflows fp16 even unscaled; use bf16-mixed, lower the learning "
        "rate, or find the op producing huge values"
    )
    return build_event(Where.at(front, batch_idx, optimizer), found, Forensics(details={"hint": hint}))


class IncidentInspector:
    """This rank's side of a step that some rank flagged (see module docs).

    Args:
        settings: what to diagnose.
        window: the step's micro-batches, losses and BatchNorm state.
        named_params: the model's named parameters.
        recorder: for warnings and the bundle directory.
        spikes: the spike watch (``None``: off).
        parts: the guard's optional parts: the spike event, the diagnosis and the bundle each fail alone
            (the confirmation of the flags is the core's: its error reaches the caller).
        optimizer: the index of the optimizer whose step is checked (``NanEvent.optimizer``; ``None``: unknown).
    """

    def __init__(
        self,
        settings: DiagnosisSettings,
        window: StepWindow,
        named_params: Sequence[tuple[str, nn.Parameter]],
        recorder: IncidentRecorder,
        spikes: SpikeWatch | None = None,
        parts: GuardParts | None = None,
        optimizer: int | None = None,
    ) -> None:
        self.settings = settings
        self.optimizer = optimizer
        self.window = window
        self.named_params = named_params
        self.recorder = recorder
        self.spikes = spikes
        self.parts = parts if parts is not None else recorder.parts

    def inspect(self, front: FrontEnd, health: StepHealth, grads: list[Tensor]) -> tuple[RankVote, NanEvent | None]:
        """This rank's vote and its own event (``None`` when the NaN/Inf is not its own)."""
        rank = front.global_rank
        grad_norm = health.grad_norm
        if health.bad and grad_norm < 0:  # not computed on this step: the norm tells NaN (nan) from overflow (inf)
            grad_norm = float(torch.linalg.vector_norm(grouped_norms(grads))) if grads else 0.0
        event: NanEvent | None = None
        overflow = False
        # DDP averages gradients: NaN/Inf born in another rank's loss or BatchNorm statistics reaches this
        # rank's gradients through the all-reduce. That incident is the other rank's.
        someone_elses = front.world_size > 1 and health.ranks_others_bad > 0 and not health.others_bad
        # An fp16 overflow gives Inf (and, through Inf * 0 or Inf - Inf, NaN) gradients with a finite loss and
        # finite BatchNorm statistics: the GradScaler's to skip. With some Inf that is decided here; NaN alone
        # only when the unscaled re-run of the batch (the diagnosis) is finite.
        scaler = front.grad_scaler
        scaled = scaler is not None and scaler.is_enabled() and not health.others_bad
        if health.bad and not someone_elses:
            event = self._nonfinite_event(front, grads, grad_norm)
            if event is not None and scaled and not math.isfinite(grad_norm) and _any_inf(grads):
                event, overflow = None, True
        spiked = False
        threshold: float | None = None
        if event is None and not overflow and health.spike and self.spikes is not None:
            found_spike = self.parts.run("spikes", self._spike_event, front, grad_norm)
            if found_spike is not None:
                event, threshold = found_spike
                spiked = True
        if event is not None and self._may_diagnose(front) and (threshold is not None or not spiked):
            scaled = scaled and not spiked
            diagnosed = self.parts.run("diagnosis", self._diagnose, front, event, threshold, scaled)
            if diagnosed is not None:  # the diagnosis failed: the event as confirmed, without samples
                event, reproduced = diagnosed
                if scaled and not reproduced:  # NaN-only gradients the unscaled re-run does not give
                    event, overflow = None, True
        event = with_rerun_note(front, event)
        report = RankVote(
            rank,
            incident=event is not None and not spiked,
            overflow=overflow,
            spike=spiked,
            cause=event_cause(event),
            quarantine=quarantine_of(event),
            culprit_module=event.culprit_module if event is not None and event.phase is not None else None,
            quarantine_items=quarantine_items_of(event),
        )
        return report, event

    # ------------------------------------------------------------------ the event

    def _nonfinite_event(self, front: FrontEnd, grads: list[Tensor], grad_norm: float) -> NanEvent | None:
        """Confirm element-wise and name the tensors of ``grads``; ``None`` when everything is finite after all."""
        checked = {id(g) for g in grads}  # the optimizer's own under manual optimisation
        bad_grads = nonfinite_names(
            (n, grad) for n, p in self.named_params if (grad := p.grad) is not None and id(grad) in checked
        )
        bn_buffers = self.window.batchnorm_buffers
        bad_buffers = bad_batchnorm_names(bn_buffers)
        losses = [float(loss.double().sum()) for loss in self.window.losses]  # a float64 loss may exceed float32
        kinds: list[EventKind] = []
        if any(not math.isfinite(v) for v in losses):
            kinds.append("loss")
        if bad_grads:
            kinds.append("grad")
        if bad_buffers:
            kinds.append("bn_stats")
        if not kinds:
            return None
        scaler = front.grad_scaler
        scale = float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else None
        loss = next((v for v in losses if not math.isfinite(v)), losses[-1] if losses else None)
        if loss is not None and scale is not None and math.isfinite(loss):
            loss /= scale  # on_before_backward saw the scaled loss
        found = Found(
            tuple(kinds),
            nonfinite_grads=tuple(bad_grads),
            nonfinite_buffers=tuple(bad_buffers),
            loss=loss,
            grad_norm=grad_norm,
            details={
                "grads_checked": len(grads),
                "buffers_checked": sum(t.is_floating_point() for _, t in bn_buffers),
            },
        )
        return build_event(self._where(front), found)

    def _where(self, front: FrontEnd) -> Where:
        return Where.at(front, self.window.batch_idx, self.optimizer)

    def _spike_event(self, front: FrontEnd, grad_norm: float) -> tuple[NanEvent, float | None] | None:
        """The event of a finite loss (or gradient-norm) spike and the loss threshold; ``None``: no spike after all."""
        assert self.spikes is not None
        kinds = self.spikes.spike_kinds()
        if not kinds:
            return None
        details = self.spikes.details()
        found = Found(
            kinds, loss=details.get("value"), grad_norm=grad_norm if grad_norm >= 0 else None, details=details
        )
        return build_event(self._where(front), found), self.spikes.loss_threshold()

    # ------------------------------------------------------------------ the diagnosis

    def _may_diagnose(self, front: FrontEnd) -> bool:
        if not (self.settings.diagnose_here and self.settings.diagnoses) or front.cannot_rerun() is not None:
            return False
        if front.world_size > 1 and any(isinstance(m, nn.SyncBatchNorm) for m in front.module.modules()):
            self.recorder.notices.warn(
                "syncbn",
                "NanGuard: SyncBatchNorm synchronises every forward across ranks, so the offending rank cannot "
                "re-run sub-batches alone; bisection and localisation are off.",
            )
            return False
        return True

    def _diagnose(
        self,
        front: FrontEnd,
        event: NanEvent,
        loss_threshold: float | None = None,
        scaled: bool = False,
    ) -> tuple[NanEvent, bool]:
        """Bisect and localise from the BatchNorm state before the step (the step's state after); save its files.

        Returns the event and whether the batch's re-run reproduced it (``True`` when not re-run).
        Under a GradScaler (``scaled``) a batch whose unscaled re-run is finite is the scaler's
        overflow: nothing is written.
        """
        with self.window.before_step_batchnorm(keep_after=True):  # the bundle saves the state before the step too
            found = diagnose_micro_batches(
                front,
                event,
                self.window.micro_batches,
                self.settings,
                reference_batch=self.window.reference,
                loss_threshold=loss_threshold,
            )
            if scaled and loss_threshold is None and not found.reproduced:
                return found.event, False  # the GradScaler's overflow, not an incident: no bundle, no context
            files = self.parts.run("bundles", save_incident_files, self.recorder, front.module, found, self.settings)
            event = with_sections(found.event, files=files) if files is not None else found.event
        diagnosis = found.diagnosis
        if diagnosis is not None and diagnosis.error:
            self.recorder.notices.warn(
                "diagnosis",
                f"NanGuard: diagnosis failed ({diagnosis.error}); bad steps are still detected and skipped.",
            )
        return event, found.reproduced
