"""What becomes of a checked step: the ranks' one decision carried out on this rank.

A step healthy on every rank updates the counters and the statistics (``StepActions.healthy``).
Otherwise :func:`~lightning_nanguard.decide.policy.decide` gives every rank the same
:class:`~lightning_nanguard.decide.policy.StepDecision`, and ``StepActions.act`` carries it
out: drop the update, roll back (after the optimizer step), apply remedies, finish and record the
event, raise. A ``failed`` decision (some rank's core failed) drops the step in hand and turns the
guard off on every rank, with a ``guard_error`` event (``StepActions.stop_guarding``).

Example:
    >>> from lightning_nanguard.engine.parts import GuardParts
    >>> from lightning_nanguard.engine.recording import IncidentRecorder
    >>> from lightning_nanguard.engine.state import GuardState
    >>> from lightning_nanguard.engine.step.window import StepWindow
    >>> from lightning_nanguard.recover.recovery import Recovery
    >>> parts = GuardParts()
    >>> actions = StepActions(GuardState(), StepWindow(parts), Recovery(), IncidentRecorder(verbose=False), parts)
    >>> actions.state.disabled
    False
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import Tensor

from lightning_nanguard.core.event_builder import Decided, with_sections
from lightning_nanguard.core.events import EventAction, GuardInternalError, NanEvent, NonFiniteTrainingError
from lightning_nanguard.decide.messages import stop_history, stop_message
from lightning_nanguard.decide.policy import Counters, Policy, StepDecision, StepHealth
from lightning_nanguard.engine.frontend import training_parts
from lightning_nanguard.engine.incident.inspector import loss_scale_event, quarantine_refusal
from lightning_nanguard.engine.parts import CORE, GuardParts, PartFailure
from lightning_nanguard.engine.recording import IncidentRecorder
from lightning_nanguard.engine.state import GuardState
from lightning_nanguard.engine.step.check import next_loss_scale
from lightning_nanguard.engine.step.closure_undo import ClosureUndo
from lightning_nanguard.engine.step.optimizers import PerOptimizer
from lightning_nanguard.engine.step.spikes import SpikeWatch
from lightning_nanguard.engine.step.window import StepWindow
from lightning_nanguard.recover.recovery import Recovery
from lightning_nanguard.recover.remedies import clip_gradients_
from lightning_nanguard.reporting.notice_texts import quarantine_unverified, rebaseline

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from lightning_nanguard.engine.frontend import FrontEnd

__all__ = ["DONE", "StepActions"]

REFERENCE_EVERY_N_STEPS = 100  # a healthy step's rows are kept as the reference this often
DONE: dict[str, EventAction] = {"skip": "skipped", "raise": "raised", "warn": "warned", "rollback": "skipped"}

Metrics = Callable[[Counters], "dict[str, float | None]"]


class StepActions:
    """Carries out a decision that is not healthy (see module docs).

    Args:
        state: the guard's shared state (counters, flags).
        window: the step's window (its update is what a drop discards).
        recovery: snapshots, rollback and remedies.
        recorder: events, sinks and scalars.
        parts: the guard's core and optional parts.
    """

    def __init__(
        self, state: GuardState, window: StepWindow, recovery: Recovery, recorder: IncidentRecorder, parts: GuardParts
    ) -> None:
        self.state, self.window, self.recovery, self.recorder, self.parts = state, window, recovery, recorder, parts
        self.closure_undo = ClosureUndo()  # LBFGS: a bad step undone at its end
        self.per_optimizer = PerOptimizer()  # streaks, spike statistics, held schedulers (several optimizers)

    def healthy(
        self,
        front: FrontEnd,
        grads: list[Tensor],
        health: StepHealth,
        spikes: SpikeWatch | None,
        slicer: Any,
        metrics: Metrics,
        clip: bool,
        due: bool | None,
    ) -> None:
        """A step healthy on every rank: counters, the spike statistic, ``clip_grad``'s norm, the reference rows."""
        self.state.counters = self.state.counters.healthy()
        self.state.step_was_bad = False
        grad_norm = health.grad_norm
        if spikes is not None:  # the values came with the step's one read: nothing more is read
            self.parts.run("spikes", spikes.accept, True, health.loss, grad_norm)  # (healthy, loss, grad_norm)
        if math.isfinite(grad_norm) and grad_norm >= 0:  # -1: not computed this step
            self.parts.run("remedies", self._healthy_norm, grads, grad_norm, clip=clip)
        step = front.global_step
        if self.window.reference_due(step, REFERENCE_EVERY_N_STEPS):  # no call through the part on most steps
            self.parts.run("diagnosis", self.window.refresh_reference, step, REFERENCE_EVERY_N_STEPS, slicer)
        if front.automatic_optimization:  # manual: another optimizer of the batch may step on them next
            self.window.forget_batches()
        if self.recorder.scalars_due(front, due):  # the values are made only when they are logged
            self.recorder.write_scalars(front, metrics(self.state.counters))

    def _healthy_norm(self, grads: list[Tensor], grad_norm: float, clip: bool) -> None:
        """A healthy step's norm for ``clip_grad``; clipped now unless sync-free clipped it on the device."""
        self.recovery.remember_healthy_norm(grad_norm)
        threshold = self.recovery.book.clip_threshold
        if threshold is not None and clip:
            clip_gradients_(grads, grad_norm, threshold)

    def act(
        self,
        front: FrontEnd,
        optimizer: Optimizer,
        decision: StepDecision,
        before: Counters,
        event: NanEvent | None,
        policy: Policy,
        spikes: SpikeWatch | None,
        metrics: Metrics,
        updated_scale: bool = False,
    ) -> None:
        """Carry out a decision other than ``healthy`` and ``failed``: drop, roll back, remedies, the event, raising."""
        if spikes is not None:
            self.parts.run("spikes", self._spike_seen, front, spikes, decision.rebaseline, policy)
        if decision.outcome == "overflow":  # the GradScaler skips this step by itself
            self.recorder.scalars(front, metrics(self.state.counters), previous=metrics(before))
            return
        self.state.step_was_bad = True
        self.state.reported_step = front.global_step
        if decision.discard:
            self.window.discard_update(optimizer, front)
        if front.automatic_optimization:  # manual: another optimizer of the batch may step on them next
            self.window.forget_batches()
        if decision.rollback_due:
            self.state.pending_rollback = True  # done after the optimizer step, when the scaler has updated
        remedies = self.parts.run(
            "remedies",
            self.recovery.apply,
            training_parts(front),
            cause=decision.cause,
            quarantine=decision.quarantine,
            culprit_module=decision.culprit_module,
            rolled_back=decision.rollback_due,
            quarantine_items=decision.quarantine_items,
        )
        if event is None and decision.outcome == "loss_scale" and front.global_rank == 0:
            event = self.parts.run("diagnosis", self._loss_scale_event, front, updated_scale)  # no rank's own NaN/Inf
        if event is not None and self.recovery.book.can_apply("quarantine"):
            self.parts.run("remedies", self._tell_quarantine_refusal, event)
        if event is not None:
            action = DONE[decision.action or "warn"]
            if decision.rollback_due and self.recovery.snapshot.available:
                action = "rolled_back"
            applied = (*event.remedies, *(remedies or ()))
            cause = decision.cause  # the ranks' shared cause (one of their votes' EventCause), else None
            decided = Decided(action, cause=cause, remedies=applied)  # type: ignore[arg-type]
            event = with_sections(event, decided=decided)  # the shared cause, when there is one, is the event's
            self.recorder.record(front, event)
        self.recorder.scalars(front, metrics(self.state.counters), previous=metrics(before))
        self.recorder.progress(front, self.state.counters.skipped_total)
        if decision.action == "raise":
            counters, events = self.state.counters, self.recorder.events
            raise NonFiniteTrainingError(
                stop_message(decision, counters, policy, event, self.recorder.events_path),
                stop_history(decision, events, policy, event),
            )

    def _loss_scale_event(self, front: FrontEnd, updated: bool) -> NanEvent:
        """A collapsed loss scale (no rank's own NaN/Inf): the event rank zero records."""
        overflows = self.state.counters.consecutive_overflows
        scale = next_loss_scale(front.grad_scaler, updated=updated)
        return loss_scale_event(front, self.window.batch_idx, scale, overflows, self.state.last_grad_norm)

    def dropped(self, front: FrontEnd, optimizer: Any) -> None:
        """A dropped step: a closure optimizer's is undone at its end; a manual loop's schedulers skip a step."""
        self.closure_undo.mark_bad()
        if not front.automatic_optimization:
            self.per_optimizer.hold_schedulers(front.lr_schedulers, optimizer)

    def _spike_seen(self, front: FrontEnd, spikes: SpikeWatch, rebaselining: bool, policy: Policy) -> None:
        """A step that was not healthy: its values stay out of the statistic; several spikes in a row re-baseline."""
        spikes.accept(False)
        if rebaselining:
            spikes.rebaseline()
            message = rebaseline(policy.spike_rebaseline_after, front.global_step)
            self.recorder.notices.warn(f"rebaseline-{front.global_step}", message)

    def _tell_quarantine_refusal(self, event: NanEvent) -> None:
        """Say once per run that quarantine skipped records it could not verify (it acts only on verified ones)."""
        why = quarantine_refusal(event)
        if why is not None:
            self.recorder.notices.warn("quarantine-unverified", quarantine_unverified(why))

    # ------------------------------------------------------------------ failure of the guard itself

    def disable_everywhere(self) -> None:
        """Every rank saw some rank's failure in the same reduce: all stop guarding (and joining collectives) now."""
        self.state.disabled, self.state.failing = True, False

    def stop_guarding(self, front: FrontEnd, optimizer: Any, drop: bool, decision: StepDecision | None = None) -> None:
        """The core failed (here or on another rank): drop the step in hand, record why, turn the guard off.

        The ``guard_error`` event is this rank's own failure; rank zero also records one naming the
        other ranks whose core failed (its TensorBoard is the run's). ``on_internal_error="raise"``:
        every rank raises :class:`~lightning_nanguard.core.events.GuardInternalError` here, together.
        """
        try:
            if drop:
                self.window.discard_update(optimizer, front)
        finally:
            self.disable_everywhere()
        action: EventAction = "skipped" if drop else "warned"
        if self.parts.mode == "raise":
            action = "raised"
        own = self.parts.off.get(CORE)
        failed_ranks = [r.rank for r in decision.reports if r.failed] if decision is not None else []
        others = [rank for rank in failed_ranks if rank != front.global_rank]
        if own is None and others and front.global_rank == 0:
            own = PartFailure(CORE, f"the guard's core failed on rank(s) {others}", "another rank", front.global_step)
        if own is not None:
            other = own.where == "another rank"
            # failed in an earlier hook: the event is the dropped step's (``failed_at_step`` says when it failed)
            at_step = front.global_step
            event = own.event(front.current_epoch, self.window.batch_idx, front.global_rank, action, other, at_step)
            self.recorder.record(front, event)
        if self.parts.mode == "raise":
            failure = own or PartFailure(CORE, f"on rank(s) {failed_ranks}", "another rank", front.global_step)
            raise GuardInternalError(CORE, failure.error, failure.where)

    def report_failures(self, front: FrontEnd) -> None:
        """Record the ``guard_error`` event of each optional part that failed since the last call."""
        for failure in self.parts.take_unreported():
            self.recorder.record(front, failure.event(front.current_epoch, self.window.batch_idx, front.global_rank))
        if self.parts.off:
            self.recorder.progress_parts_off(front, len(self.parts.off))
