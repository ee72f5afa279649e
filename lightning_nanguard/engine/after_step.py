"""Work after the optimizer step, on every rank: a due rollback, the check of the weights, the last good snapshot.

It runs from the strategy wrapper once ``optimizer.step`` returned (the GradScaler has updated by
then), next to the snapshot it restores and refreshes (:class:`~lightning_nanguard.recover.recovery.Recovery`):

- a rollback decided at this step (``rollback_after_consecutive`` bad steps) is carried out;
- every ``check_params_every_n_steps`` steps, and before every snapshot, the weights and buffers
  are checked; under DDP the flags are reduced, so every rank rolls back, warns or raises together;
- with ``action="rollback"``, every ``snapshot_every_n_steps`` healthy steps the snapshot is refreshed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from lightning_nanguard.core.event_builder import Decided, Forensics, Found, Where, build_event
from lightning_nanguard.core.events import NonFiniteTrainingError
from lightning_nanguard.decide.agreement import RankAgreement
from lightning_nanguard.decide.policy import Counters, decide_weights
from lightning_nanguard.detect.batchnorm import batchnorm_buffers
from lightning_nanguard.detect.confirm import all_finite, nonfinite_names
from lightning_nanguard.detect.weights import ModuleWeights
from lightning_nanguard.engine.frontend import training_parts
from lightning_nanguard.engine.recording import IncidentRecorder
from lightning_nanguard.engine.state import GuardState
from lightning_nanguard.engine.step.window import StepWindow
from lightning_nanguard.recover.recovery import Recovery
from lightning_nanguard.reporting.scalars import scalar_values

if TYPE_CHECKING:
    from lightning_nanguard.engine.frontend import FrontEnd

__all__ = ["AfterStep", "ParamCheckSettings"]

log = logging.getLogger("lightning_nanguard")

_WEIGHTS_FORENSICS = Forensics(  # no sample is at fault: the weights are
    cause="state", details={"hint": "NaN/Inf reached the weights through an update with finite gradients (overflow)"}
)


@dataclass(frozen=True)
class ParamCheckSettings:
    """When the weights are checked and snapshots taken (the ``NanGuard`` arguments; no defaults here)."""

    check_params_every_n_steps: int
    snapshot_every_n_steps: int
    action: str


class AfterStep:
    """The after-step work of one rank (see module docs).

    Args:
        state: the guard's shared state (counters, the pending rollback).
        recovery: the snapshot, rollback and remedies.
        recorder: events and scalars.
        window: the step's window (for the batch index of an event).
    """

    def __init__(self, state: GuardState, recovery: Recovery, recorder: IncidentRecorder, window: StepWindow) -> None:
        self.state = state
        self.recovery = recovery
        self.recorder = recorder
        self.window = window
        self.settings: ParamCheckSettings | None = None  # set by StepController.configure
        self.agreement = RankAgreement(None, 1)
        self.named_params: Sequence[tuple[str, nn.Parameter]] = ()
        self.weights = ModuleWeights()  # what state_dict holds, found once (and again at each epoch's start)

    def run(self, front: FrontEnd, collective: bool) -> None:
        """Roll back when due; check the weights and refresh the snapshot every few steps (every rank)."""
        state, settings = self.state, self.settings
        if settings is None:
            return
        if state.pending_rollback and not state.failing:
            state.pending_rollback = False
            self.rollback(front, reason="consecutive bad steps")
            return
        step = front.global_step + 1  # global_step increments after this call
        every = settings.check_params_every_n_steps
        check_params = bool(every) and step % every == 0
        snapshot_due = (
            settings.action == "rollback" and not state.step_was_bad and step % settings.snapshot_every_n_steps == 0
        )
        if not (check_params or snapshot_due):
            return
        finite_here = True if state.failing else self.weights.all_finite(front.module)
        nonfinite_anywhere = self.agreement.any(not finite_here) if collective else not finite_here
        if state.failing:
            return
        if not nonfinite_anywhere:
            if snapshot_due:
                self.capture(front)
            return
        self._nonfinite_weights(front, finite_here, settings.action)

    def _nonfinite_weights(self, front: FrontEnd, finite_here: bool, action: str) -> None:
        before = self.state.counters
        action, self.state.counters = decide_weights(before, action, self.recovery.snapshot.available)
        where = Where.at(front, self.window.batch_idx)
        found = None if finite_here else self._found(front)  # named before a rollback restores the weights
        decided = Decided()  # warned
        if action == "rollback":
            description = self.rollback(front, reason="non-finite weights")
            remedies = self.recovery.apply(training_parts(front), cause="state", rolled_back=True)
            decided = Decided("rolled_back", remedies=(description, *remedies))
        elif action == "raise":
            decided = Decided("raised")
        event = None
        if found is not None:
            event = build_event(where, found, _WEIGHTS_FORENSICS, decided=decided)
            self.recorder.record(front, event)
        self.recorder.scalars(front, self.values(self.state.counters), previous=self.values(before))
        if action == "raise":
            shown = event.nonfinite_params[:3] if event is not None else "on another rank"
            raise NonFiniteTrainingError(
                f"NanGuard: NaN/Inf reached the weights ({shown}) at step {front.global_step}; skipping steps "
                "cannot undo that. Use action='rollback' (keeps a last good snapshot) or restart from the last "
                "checkpoint with a lower learning rate.",
                [event] if event is not None else [],
            )

    def _found(self, front: FrontEnd) -> Found:
        names = tuple(nonfinite_names(self.named_params) + nonfinite_names(batchnorm_buffers(front.module)))
        return Found(("param",), nonfinite_params=names)

    def rollback(self, front: FrontEnd, reason: str) -> str:
        """Restore the last good snapshot (every rank at the same step); raise when there is none."""
        description = self.recovery.rollback(training_parts(front))
        if description is None:
            raise NonFiniteTrainingError(
                f"NanGuard: a rollback is due ({reason}) but no last good snapshot exists yet.", self.recorder.events
            )
        self.state.counters = self.state.counters.replace(consecutive_bad_steps=0)
        log.warning("[rank %d] NanGuard: %s (%s)", front.global_rank, description, reason)
        self.recorder.scalars(front, self.values(self.state.counters), force=True)
        return description

    def capture(self, front: FrontEnd) -> None:
        """Take a last good snapshot (the weights were checked finite on every rank)."""
        first = not self.recovery.snapshot.available
        self.recovery.capture(training_parts(front))
        if first:
            snapshot = self.recovery.snapshot
            log.info(
                "NanGuard: rollback snapshot of %.1f MiB on the host, %.1f ms to take",
                snapshot.nbytes / 2**20,
                snapshot.seconds * 1e3,
            )

    def initial_snapshot(self, front: FrontEnd) -> None:
        """The first last-good snapshot, at the start of training, when the weights are finite on every rank.

        Every rank calls it: with sharded weights one rank's shards can be non-finite alone, and every
        rank must have a snapshot, or none.
        """
        finite = all_finite(list(front.module.state_dict(keep_vars=True).values()))
        if self.agreement.distributed:
            finite = not self.agreement.any(not finite)
        if finite:
            self.capture(front)

    def values(self, counters: Counters) -> dict[str, float | None]:
        """The ``nanguard/`` scalar values for ``counters``."""
        recovery = self.recovery
        return scalar_values(counters, self.state.last_grad_norm, recovery.rollbacks_total, recovery.book.total)
