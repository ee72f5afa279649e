"""One optimizer step under the guard: check, agree, decide, act. The Trainer-facing half of the policy.

:class:`StepController` is what ``NanGuard``'s hooks call. Per optimizer step, on every rank:

1. the :class:`~lightning_nanguard.adapter.window.StepWindow` collects the micro-batches and losses;
2. :meth:`StepController.check_step` runs the fused check, reduces its flags over ranks and reads
   them to the host once (:class:`~lightning_nanguard.decide.policy.StepHealth`);
3. a step that is healthy everywhere ends there; otherwise each rank describes what it found
   (:class:`~lightning_nanguard.adapter.incidents.IncidentInspector`), the reports are gathered, and
   :func:`~lightning_nanguard.decide.policy.decide` gives one decision for every rank, which this class
   carries out: drop the update, remedies, rollback, the event, raising;
4. after the optimizer step, :meth:`StepController.after_optimizer_step` rolls back when due,
   checks the weights and refreshes the last good snapshot.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_nanguard.adapter.after_step import AfterStep
from lightning_nanguard.adapter.config import GuardSettings
from lightning_nanguard.adapter.diagnosis import DiagnosisSettings
from lightning_nanguard.adapter.incidents import IncidentInspector, check_module
from lightning_nanguard.adapter.reporting import IncidentRecorder
from lightning_nanguard.adapter.spikes import SpikeWatch
from lightning_nanguard.adapter.state import GuardState
from lightning_nanguard.adapter.syncfree import DeferredStep, StepView, SyncFreeSteps
from lightning_nanguard.adapter.window import StepWindow
from lightning_nanguard.core.events import EventAction, NanEvent, NonFiniteTrainingError
from lightning_nanguard.decide.agreement import RankAgreement
from lightning_nanguard.decide.messages import stop_history, stop_message
from lightning_nanguard.decide.policy import (
    LOCAL_FIELDS,
    Counters,
    Policy,
    RankReport,
    StepDecision,
    StepHealth,
    decide,
    local_vector,
    shared_part,
)
from lightning_nanguard.detect.check import fused_health_check
from lightning_nanguard.detect.syncfree import scaler_found_inf
from lightning_nanguard.recover.recovery import Recovery, grad_scaler
from lightning_nanguard.recover.remedies import clip_gradients_
from lightning_nanguard.reporting.scalars import scalar_tags

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer
    from torch.optim import Optimizer

__all__ = ["StepController"]

log = logging.getLogger("lightning_nanguard")

DONE: dict[str, EventAction] = {"skip": "skipped", "raise": "raised", "warn": "warned", "rollback": "skipped"}
REFERENCE_EVERY_N_STEPS = 100
EVENTS_KEPT_IN_CHECKPOINT = 100


class StepController:
    """Carries out the guard's per-step policy on one rank (see module docs).

    Args:
        policy: the decision rules.
        diagnosis: what to diagnose on a bad step.
        recovery: snapshots, rollback and remedies.
        recorder: events, sinks and scalars.
        track_batchnorm: check BatchNorm statistics.
        with_norm: compute the gradient norm every step (``clip_grad`` needs it).
    """

    def __init__(
        self,
        policy: Policy,
        diagnosis: DiagnosisSettings,
        recovery: Recovery,
        recorder: IncidentRecorder,
        track_batchnorm: bool = True,
        with_norm: bool = False,
    ) -> None:
        self.policy = policy
        self.diagnosis = diagnosis
        self.recovery = recovery
        self.recorder = recorder
        self.track_batchnorm = track_batchnorm
        self.with_norm = with_norm
        self.window = StepWindow()
        self.state = GuardState()
        self.spikes: SpikeWatch | None = None
        self.sync_free = False
        self.sync = SyncFreeSteps()
        self._resolving: DeferredStep | None = None
        self._spike_state: dict[str, Any] = {}  # loaded before the detectors exist
        self.agreement = RankAgreement(None, 1)
        self.after_step = AfterStep(self.state, self.recovery, self.recorder, self.window)
        self.named_params: list[tuple[str, nn.Parameter]] = []
        self.params: list[nn.Parameter] = []

    # ------------------------------------------------------------------ setup

    def configure(self, settings: GuardSettings) -> None:
        """Take the configuration (at ``setup``); a spike detector whose settings did not change keeps its history."""
        if not settings.diagnosis.diagnose_here:
            self.recorder.notices.warn(
                "fsdp",
                "NanGuard: under FSDP bad steps are detected and skipped on all ranks, but "
                "bisection and localisation are off (they would re-run sharded forwards on one rank).",
            )
        self.policy, self.diagnosis = settings.policy, settings.diagnosis
        self.after_step.settings = settings.param_checks
        self.track_batchnorm, self.with_norm, self.sync_free = (
            settings.track_batchnorm,
            settings.with_norm,
            settings.sync_free,
        )
        current = self.spikes
        unchanged = current is not None and current.settings == settings.spikes
        if settings.spikes is None:
            self.spikes = None
        elif not unchanged or current is None or (current.grad_norm is not None) != self.with_norm:
            state = current.state_dict() if current is not None else self._spike_state
            self.spikes = SpikeWatch(settings.spikes, watch_grad_norm=self.with_norm)
            self.spikes.load_state_dict(state)

    def attach(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Bind to the Trainer's strategy and the model's parameters (``on_train_start``)."""
        self.agreement = RankAgreement(trainer.strategy, trainer.world_size)
        self.named_params = list(pl_module.named_parameters())
        self.params = [p for _, p in self.named_params]
        self.window.attach(pl_module, self.track_batchnorm)
        self.after_step.agreement, self.after_step.named_params = self.agreement, self.named_params
        if self.sync_free:
            self.sync.attach([t for _, t in self.window.batchnorm_buffers])
            for optimizer in trainer.optimizers:
                reason = self.sync.unsupported(optimizer, grad_scaler(trainer))
                if reason is not None:
                    self.recorder.notices.warn("sync_free", f"NanGuard(sync_free=True): {reason}")
        self.recorder.rank = trainer.global_rank

    def scalar_tags(self, trainer: Trainer) -> list[str]:
        """The ``nanguard/`` scalar tags this run can log."""
        remedies = self.recovery.book.enabled
        spikes = self.policy.spike_action != "off"
        return scalar_tags(self.policy.action, remedies, grad_scaler(trainer) is not None, spikes=spikes)

    def warn_what_cannot_be_skipped(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """One warning each for manual optimisation and LBFGS: their steps are reported, not skipped."""
        if not pl_module.automatic_optimization and self.policy.action in ("skip", "rollback"):
            self.recorder.notices.warn(
                "manual",
                "NanGuard: manual optimisation; bad steps are detected and reported but not "
                "skipped, bisected or rolled back automatically. Call `guard.check(self)` in your "
                "training_step before `optimizer.step()` to act on them.",
            )
        if any(isinstance(opt, torch.optim.LBFGS) for opt in trainer.optimizers):
            self.recorder.notices.warn(
                "lbfgs",
                "NanGuard: LBFGS evaluates its closure many times per step, so a step cannot "
                "be skipped halfway; bad steps are detected and reported only.",
            )

    def begin_step(self, trainer: Trainer, pl_module: LightningModule, every_n_steps: int) -> None:
        """The first micro-batch of an optimizer step: resolve a sync-free step still pending, open the window."""
        self.resolve_pending(trainer, pl_module)
        checking = self.checking(trainer, every_n_steps)
        self.window.begin(checking=checking)
        if checking and self.sync_free:
            self.sync.capture()

    def checking(self, trainer: Trainer, every_n_steps: int) -> bool:
        """Whether the optimizer step about to run is checked (the same answer on every rank)."""
        return trainer.global_step % every_n_steps == 0

    # ------------------------------------------------------------------ the check

    def check_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        """Check the step, agree with the other ranks, and carry out the decision."""
        inner = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        if isinstance(inner, torch.optim.LBFGS) and self.state.reported_step == trainer.global_step:
            return  # LBFGS evaluates its closure (and this hook) many times per step: one event per step
        # manual optimisation steps optimizers one by one: the gradients this step applies are its own
        params = self.params if pl_module.automatic_optimization else _optimizer_params(inner)
        grads = [g for p in params if (g := p.grad) is not None]
        vector = self._agreed_vector(trainer, pl_module, grads, optimizer)
        sync_free = self.sync_free and pl_module.automatic_optimization and not self.state.failing
        if sync_free and self._defer(trainer, pl_module, optimizer, grads, vector):
            return  # skipped on the device if bad; resolved before the next step's forward
        self._resolve(trainer, pl_module, optimizer, grads, vector.tolist())  # the one host read of a step
        if not pl_module.automatic_optimization:  # the next optimizer's check: only the losses backpropagated after
            self.window.losses = []

    def _resolve(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        optimizer: Optimizer,
        grads: list[Tensor],
        values: list[float],
    ) -> None:
        """Decide the step from its flags (read to the host) together with the other ranks, and act."""
        health = StepHealth.from_values(values)
        if health.grad_norm >= 0 or math.isnan(health.grad_norm):
            self.state.last_grad_norm = health.grad_norm
        if health.healthy:
            self._healthy(trainer, pl_module, grads, health)
            return
        report, event = self._inspect(trainer, pl_module, optimizer, health, grads)
        reports = self.agreement.gather(report) if self._collective(pl_module) else [report]
        policy = self._policy(pl_module, optimizer)
        decision, after = decide(reports, self.state.counters, policy, self._next_scale(trainer))
        self._carry_out(trainer, pl_module, optimizer, decision, after, event, grads, health)

    def _collective(self, pl_module: LightningModule) -> bool:
        # manual optimisation may call optimizer.step() a different number of times per rank: no collectives
        return self.agreement.distributed and pl_module.automatic_optimization

    def _agreed_vector(
        self, trainer: Trainer, pl_module: LightningModule, grads: list[Tensor], optimizer: Optimizer
    ) -> Tensor:
        """The step's flags with their sums over ranks, on the device. A rank whose check fails still takes part."""
        vector: Tensor | None = None
        if not self.state.failing:
            try:
                vector = self._local_vector(trainer, pl_module, grads, optimizer)
            except Exception as error:  # a bug in the guard: this rank says so in the reduce instead of hanging it
                self.fail(error, "the per-step check")
        if vector is None:
            vector = local_vector(torch.tensor([0.0, -1.0, 0.0], device=pl_module.device), failed=True)
        if self._collective(pl_module):
            vector = torch.cat((vector, self.agreement.sum(shared_part(vector))))
        return vector

    # ------------------------------------------------------------------ sync-free steps

    def _defer(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer, grads: list[Tensor], vector: Tensor
    ) -> bool:
        """Skip on the device if the flags say so and read them later; ``False``: decide now instead."""
        shared = vector[len(LOCAL_FIELDS) :] if vector.numel() > len(LOCAL_FIELDS) else shared_part(vector)
        nonfinite, spike = shared[0:1], shared[2:3]
        skip = torch.zeros_like(nonfinite)
        if self.policy.action != "warn":
            skip = skip + nonfinite
        if self.policy.spike_action == "skip":
            skip = skip + spike
        if not self.sync.skip_on_device(optimizer, grad_scaler(trainer), skip):
            return False
        threshold = self.recovery.book.clip_threshold
        if threshold is not None and self.with_norm:
            clip_gradients_(grads, vector[1], threshold)
        step = DeferredStep(
            global_step=trainer.global_step,
            epoch=trainer.current_epoch,
            batch_idx=self.window.batch_idx,
            micro_batches=self.window.micro_batches,
            losses=self.window.losses,
            optimizer=optimizer,
            logging_due=self.recorder.logging_due(trainer),
            grads=grads,
        )
        self.window.forget_batches()
        self.sync.defer(step, vector)
        return True

    def resolve_pending(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Read and act on the flags of a step checked sync-free (before the next forward, or at the end)."""
        taken = self.sync.take()
        if taken is None:
            return
        step, values = taken
        if not StepHealth.from_values(values).healthy:
            self.sync.show_step_batchnorm()  # as at the check: the diagnosis sees what the default mode sees
        self.window.micro_batches, self.window.losses, self.window.batch_idx = (
            step.micro_batches,
            step.losses,
            step.batch_idx,
        )
        self._resolving = step
        try:
            view: Any = StepView(trainer, step.global_step, step.epoch)
            self._resolve(view, pl_module, step.optimizer, step.grads, values)
        finally:
            self._resolving = None
            self.window.forget_batches()
            self.window.losses = []

    def _local_vector(
        self, trainer: Trainer, pl_module: LightningModule, grads: list[Tensor], optimizer: Optimizer
    ) -> Tensor:
        """This rank's flags from the fused check (no host read).

        Under a GradScaler that has unscaled this optimizer's gradients (Lightning does so before
        ``on_before_optimizer_step`` for optimizers that are not fused) the scaler has just tested
        every gradient for NaN/Inf: its flag is used, and the gradients are not read a second time
        (unless the norm is due).
        """
        bn = self.window.batchnorm_buffers
        with_norm = self.with_norm or self.recorder.logging_due(trainer)
        scaler_flag = None if with_norm else scaler_found_inf(grad_scaler(trainer), optimizer)
        summary = fused_health_check(
            grads if scaler_flag is None else [],
            others=[*self.window.losses, *(t for _, t in bn if t.is_floating_point())],
            nonnegative=self.window.running_vars,
            device=pl_module.device,
            with_norm=with_norm,
        )
        if scaler_flag is not None:
            flag = scaler_flag.reshape(1).to(device=summary.device, dtype=summary.dtype)
            summary = torch.cat((summary[0:1] + flag, summary[1:]))
        spike = loss = None
        if self.spikes is not None and pl_module.automatic_optimization:
            loss = self.window.step_loss(_loss_scale(trainer))
            spike = self.spikes.check(loss, summary[1:2] if self.with_norm else None)
        return local_vector(summary, spike, loss=loss)

    def _healthy(self, trainer: Trainer, pl_module: LightningModule, grads: list[Tensor], health: StepHealth) -> None:
        self.state.counters = self.state.counters.healthy()
        self.state.step_was_bad = False
        deferred = self._resolving
        grad_norm = health.grad_norm
        if self.spikes is not None:  # the values came with the step's one read: nothing more is read
            self.spikes.accept(True, loss=health.loss, grad_norm=grad_norm)
        if math.isfinite(grad_norm) and grad_norm >= 0:  # -1: not computed this step
            self.recovery.remember_healthy_norm(grad_norm)
            threshold = self.recovery.book.clip_threshold
            if threshold is not None and deferred is None:  # sync-free: clipped on the device already
                clip_gradients_(grads, grad_norm, threshold)
        self.window.refresh_reference(trainer.global_step, REFERENCE_EVERY_N_STEPS, self.diagnosis.batch_slicer)
        self.window.forget_batches()
        due = deferred.logging_due if deferred is not None else None
        self.recorder.scalars(trainer, self.metrics(self.state.counters), due=due)

    # ------------------------------------------------------------------ a step that is bad somewhere

    def _policy(self, pl_module: LightningModule, optimizer: Optimizer) -> Policy:
        inner = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        can_skip = pl_module.automatic_optimization and not isinstance(inner, torch.optim.LBFGS)
        return self.policy if can_skip == self.policy.can_skip else _with(self.policy, can_skip=can_skip)

    def _inspect(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        optimizer: Optimizer,
        health: StepHealth,
        grads: list[Tensor],
    ) -> tuple[RankReport, NanEvent | None]:
        """What this rank found; never raises (a failure becomes a ``failed`` report)."""
        rank = trainer.global_rank
        if self.state.failing:
            return RankReport(rank, failed=True), None
        try:
            inspector = IncidentInspector(self.diagnosis, self.window, self.named_params, self.recorder, self.spikes)
            return inspector.inspect(trainer, pl_module, health, grads)
        except NonFiniteTrainingError:
            raise
        except Exception as error:
            self.fail(error, "the check of a bad step")
            return RankReport(rank, failed=True), None

    def _next_scale(self, trainer: Trainer) -> float | None:
        scaler = grad_scaler(trainer)
        if scaler is None or not scaler.is_enabled():
            return None
        if self._resolving is not None:  # a step resolved late: the scaler has updated since
            return float(scaler.get_scale())
        return float(scaler.get_scale()) * scaler.get_backoff_factor()  # what update() sets after an overflow

    def _carry_out(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        optimizer: Optimizer,
        decision: StepDecision,
        counters: Counters,
        event: NanEvent | None,
        grads: list[Tensor],
        health: StepHealth,
    ) -> None:
        before, self.state.counters = self.state.counters, counters
        if decision.disable:
            self.disable_everywhere()
        if decision.outcome == "healthy":  # a finite tensor whose norm overflowed: not an incident
            self._healthy(trainer, pl_module, grads, health)
            return
        if self.spikes is not None:
            self.spikes.accept(False)
            if decision.rebaseline:
                self.spikes.rebaseline()
                self.recorder.notices.warn(
                    f"rebaseline-{trainer.global_step}",
                    f"NanGuard: {self.policy.spike_rebaseline_after} loss spikes in a row at step "
                    f"{trainer.global_step}: the loss level shifted for good (a curriculum change?); the spike "
                    "statistic starts over from the coming steps.",
                )
        if decision.outcome == "overflow":  # the GradScaler skips this step by itself
            self.recorder.scalars(trainer, self.metrics(self.state.counters), previous=self.metrics(before))
            return
        self.state.step_was_bad = True
        self.state.reported_step = trainer.global_step
        if decision.discard:
            self.window.discard_update(optimizer)
        self.window.forget_batches()
        if decision.rollback_due:
            self.state.pending_rollback = True  # done after the optimizer step, when the scaler has updated
        remedies = self.recovery.apply(
            trainer,
            pl_module,
            cause=decision.cause,
            quarantine=decision.quarantine,
            culprit_module=decision.culprit_module,
            rolled_back=decision.rollback_due,
            quarantine_items=decision.quarantine_items,
        )
        event = self._shared_event(trainer, decision, event)
        if event is not None:
            action = DONE[decision.action or "warn"]
            if decision.rollback_due and self.recovery.snapshot.available:
                action = "rolled_back"
            event = event.replace(action=action, cause=decision.cause or event.cause)
            if remedies:
                event = event.replace(remedies=(*event.remedies, *remedies))
            self.recorder.record(trainer, event)
        self.recorder.scalars(trainer, self.metrics(self.state.counters), previous=self.metrics(before))
        self.recorder.progress(trainer, self.state.counters.skipped_total)
        if decision.action == "raise":
            counters, events = self.state.counters, self.recorder.events
            raise NonFiniteTrainingError(
                stop_message(decision, counters, self.policy, event, self.recorder.events_path),
                stop_history(decision, events, self.policy, event),
            )

    def _shared_event(self, trainer: Trainer, decision: StepDecision, event: NanEvent | None) -> NanEvent | None:
        """This rank's event; a collapsed loss scale (no rank's own NaN/Inf) is recorded by rank zero."""
        if event is not None or decision.outcome != "loss_scale" or trainer.global_rank != 0:
            return event
        return NanEvent.at_step(
            trainer,
            self.window.batch_idx,
            ("loss_scale",),
            grad_norm=self.state.last_grad_norm,
            details={
                "loss_scale": self._next_scale(trainer),
                "consecutive_overflows": self.state.counters.consecutive_overflows,
                "hint": "the loss scale collapsed: the model overflows fp16 even unscaled; use bf16-mixed, lower "
                "the learning rate, or find the op producing huge values",
            },
        )

    def metrics(self, counters: Counters) -> dict[str, float | None]:
        """The ``nanguard/`` scalar values for ``counters``."""
        return self.after_step.values(counters)

    def after_optimizer_step(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The after-step work (rollback, weight check, snapshot), on every rank."""
        self.after_step.run(trainer, pl_module, self._collective(pl_module))

    def state_dict(self) -> dict[str, Any]:
        """Counters, the last gradient norm, the spike statistic, remedy state and the last 100 events."""
        return {
            **dataclasses.asdict(self.state.counters),
            "last_grad_norm": self.state.last_grad_norm,
            "spikes": self.spikes.state_dict() if self.spikes is not None else self._spike_state,
            "events": [event.to_dict() for event in self.recorder.events[-EVENTS_KEPT_IN_CHECKPOINT:]],
            "recovery": self.recovery.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output; keys added in later versions default sensibly."""
        self.state.counters = Counters(**{name: int(state.get(name, 0)) for name in Counters.__dataclass_fields__})
        norm = state.get("last_grad_norm")
        self.state.last_grad_norm = float(norm) if norm is not None else None
        self.recorder.events[:] = [NanEvent.from_dict(summary) for summary in state.get("events", [])]
        self._spike_state = dict(state.get("spikes", {}))
        if self.spikes is not None:
            self.spikes.load_state_dict(self._spike_state)
        self.recovery.load_state_dict(state.get("recovery", {}))

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["agreement"] = RankAgreement(None, 1)  # never pickle the strategy or the batches
        state["window"] = StepWindow()
        state["after_step"] = AfterStep(self.state, self.recovery, self.recorder, state["window"])
        state["sync"] = SyncFreeSteps()
        state["named_params"], state["params"] = [], []
        return state

    # ------------------------------------------------------------------ manual loops

    def manual_check(self, trainer: Trainer | None, module: nn.Module, loss: Tensor | None) -> NanEvent | None:
        """``NanGuard.check``: gradients, BatchNorm statistics, weights and ``loss`` of ``module``, now."""
        event = check_module(trainer, module, loss, self.window.batch_idx)
        self.window.losses = []  # checked: an optimizer step hooked after this sees only the losses to come
        if event is not None:
            self.state.counters = self.state.counters.replace(bad_steps_total=self.state.counters.bad_steps_total + 1)
            self.recorder.record(trainer, event)
        return event

    # ------------------------------------------------------------------ failure of the guard itself

    def fail(self, error: BaseException, where: str) -> None:
        """An internal error: disable now (one process) or at the next agreement (every rank together)."""
        if self.state.failing or self.state.disabled:
            return
        log.warning(
            "NanGuard disabled itself after an internal error in %s: %r. Training continues unguarded; "
            "please report this with the traceback.",
            where,
            error,
            exc_info=(type(error), error, error.__traceback__),
        )
        if self.agreement.distributed:
            self.state.failing = True  # still takes part in the per-step reduce, which disables every rank
        else:
            self.state.disabled = True

    def disable_everywhere(self) -> None:
        """Every rank saw some rank's failure in the same reduce: all stop guarding (and joining collectives) now."""
        self.state.disabled = True
        self.state.failing = False


def _optimizer_params(optimizer: Optimizer) -> list[Tensor]:
    """The parameters ``optimizer`` updates, in its order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _loss_scale(trainer: Trainer) -> Tensor | None:
    """The GradScaler's scale as a device tensor (no host read), ``None`` without one."""
    scaler = grad_scaler(trainer)
    if scaler is None or not scaler.is_enabled():
        return None
    scale = getattr(scaler, "_scale", None)  # the device tensor behind get_scale(), which reads it to the host
    return scale if isinstance(scale, Tensor) else None


def _with(policy: Policy, **changes: Any) -> Policy:
    return dataclasses.replace(policy, **changes)
