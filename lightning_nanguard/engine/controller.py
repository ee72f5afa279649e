"""One optimizer step under the guard: check, agree, decide, act. The policy carried out, for any front-end.

:class:`StepController` is what ``NanGuard``'s hooks call. Per optimizer step, on every rank:

1. the :class:`~lightning_nanguard.engine.step.window.StepWindow` collects the micro-batches and losses;
2. :meth:`StepController.check_step` runs the fused check, reduces its flags over ranks and reads
   them to the host once (:class:`~lightning_nanguard.decide.policy.StepHealth`);
3. a step that is healthy everywhere ends there; otherwise each rank describes what it found
   (:class:`~lightning_nanguard.engine.incident.inspector.IncidentInspector`), the reports are gathered, and
   :func:`~lightning_nanguard.decide.policy.decide` gives one decision for every rank, which this class
   carries out: drop the update, remedies, rollback, the event, raising;
4. after the optimizer step, :meth:`StepController.after_optimizer_step` rolls back when due,
   checks the weights and refreshes the last good snapshot.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_nanguard.core.events import EventAction, GuardInternalError, NanEvent, NonFiniteTrainingError
from lightning_nanguard.decide.agreement import RankAgreement
from lightning_nanguard.decide.messages import stop_history, stop_message
from lightning_nanguard.decide.policy import (
    Counters,
    Policy,
    RankVote,
    StepDecision,
    StepHealth,
    decide,
    local_vector,
    shared_part,
)
from lightning_nanguard.engine.after_step import AfterStep
from lightning_nanguard.engine.failure import fail
from lightning_nanguard.engine.frontend import StepView, training_parts
from lightning_nanguard.engine.incident.inspector import loss_scale_event, quarantine_refusal
from lightning_nanguard.engine.incident.sharded_inspector import inspector_for
from lightning_nanguard.engine.parts import CORE, GuardParts, PartFailure
from lightning_nanguard.engine.recording import IncidentRecorder
from lightning_nanguard.engine.settings import GuardSettings
from lightning_nanguard.engine.shard_layout import ShardingLayout, announce_sharding, sharding_notice
from lightning_nanguard.engine.state import GuardState
from lightning_nanguard.engine.step.check import check_module, next_loss_scale, step_flags
from lightning_nanguard.engine.step.precursors import PrecursorWatch, precursor_event
from lightning_nanguard.engine.step.spikes import SpikeWatch
from lightning_nanguard.engine.step.syncfree import DeferredStep, SyncFreeSteps
from lightning_nanguard.engine.step.window import StepWindow
from lightning_nanguard.recover.recovery import Recovery
from lightning_nanguard.recover.remedies import clip_gradients_
from lightning_nanguard.reporting.scalars import scalar_tags

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from lightning_nanguard.engine.frontend import FrontEnd

__all__ = ["StepController"]

DONE: dict[str, EventAction] = {"skip": "skipped", "raise": "raised", "warn": "warned", "rollback": "skipped"}
REFERENCE_EVERY_N_STEPS = 100
NO_QK_PROJECTIONS = (
    "NanGuard(qk_clip=...): no attention module of the model has query and key projections the guard "
    "knows, so nothing will be rescaled (known: nn.MultiheadAttention, Linear children named q_proj/k_proj, "
    "query/key, q/k, wq/wk, q_lin/k_lin or to_q/to_k, Hugging Face GPT-2's c_attn, and modules with a "
    "`nanguard_qk_projections()` method: see the precursor guide)."
)


class StepController:
    """Carries out the guard's per-step policy on one rank (see module docs).

    Args:
        recovery: snapshots, rollback and remedies.
        recorder: events, sinks and scalars.

    Everything configurable arrives through :meth:`configure` (the guard's one configuration path).
    """

    def __init__(self, recovery: Recovery, recorder: IncidentRecorder) -> None:
        self.recovery = recovery
        self.recorder = recorder
        self.parts = GuardParts()  # the optional parts, each off alone at its first error (engine/parts.py)
        recorder.parts = self.parts
        self.window = StepWindow(self.parts)
        self.state = GuardState()
        self.spikes: SpikeWatch | None = None
        self.precursors: PrecursorWatch | None = None  # attention collapse ahead (engine/step/precursors.py)
        self.sync = SyncFreeSteps()
        self._resolving: DeferredStep | None = None
        self.spike_state: dict[str, Any] = {}  # loaded before the detectors exist
        self.agreement = RankAgreement(None, 1)
        self.after_step = AfterStep(self.state, self.recovery, self.recorder, self.window)
        self.named_params: list[tuple[str, nn.Parameter]] = []
        self.params: list[nn.Parameter] = []
        # per optimizer: the signature of its parameter groups and the parameters it updates
        self._step_params: dict[int, tuple[tuple[tuple[int, int], ...], list[Tensor]]] = {}
        self.sharding: ShardingLayout | None = None  # ModelParallelStrategy (engine/shard_layout.py)
        self._qk_collective = False  # QK-clip takes a max over ranks after each sampled step (DDP)
        self._voted = False  # this step's check reached the ranks' reduce

    # ------------------------------------------------------------------ setup

    def configure(self, settings: GuardSettings) -> None:
        """Take the configuration (construction, ``setup``); unchanged spike settings keep their history."""
        if not settings.diagnosis.diagnose_here:
            self.recorder.notices.warn("fsdp", sharding_notice("fsdp")[1])  # type: ignore[index]
        self.policy, self.diagnosis = settings.policy, settings.diagnosis
        self.parts.mode = settings.on_internal_error
        self.after_step.settings = settings.param_checks
        self.recovery.configure(settings.recovery)
        self.track_batchnorm, self.with_norm, self.sync_free = (
            settings.track_batchnorm,
            settings.with_norm,
            settings.sync_free,
        )
        if settings.precursors_refused is not None:
            self.recorder.notices.warn("precursors-refused", settings.precursors_refused)
        if settings.precursors is None:
            if self.precursors is not None:
                self.precursors.disarm()
            self.precursors = None
        elif self.precursors is None or self.precursors.settings != settings.precursors:
            self.precursors = PrecursorWatch(settings.precursors)
        if self.precursors is not None:
            self.parts.when_off("precursors", self._drop_precursors)
        current = self.spikes
        self.parts.when_off("spikes", self._drop_spikes)
        unchanged = current is not None and current.settings == settings.spikes
        if settings.spikes is None:
            self.spikes = None
        elif not unchanged or current is None or (current.grad_norm is not None) != self.with_norm:
            state = current.state_dict() if current is not None else self.spike_state
            self.spikes = SpikeWatch(settings.spikes, watch_grad_norm=self.with_norm)
            self.spikes.load_state_dict(state)

    def attach(self, front: FrontEnd) -> None:
        """Bind to the front-end's strategy and the model's parameters (once the model sits on its device)."""
        self.agreement = RankAgreement(front.strategy, front.world_size)
        self.named_params = list(front.module.named_parameters())
        self.params = [p for _, p in self.named_params]
        self._step_params = {}
        self.window.attach(front.module, self.track_batchnorm)
        self.parts.run("precursors", self._attach_precursors, front.module)
        unsupported = self.window.metrics.describe_unsupported() if self.window.metrics is not None else None
        if unsupported is not None:
            self.recorder.notices.warn("metrics", f"NanGuard: {unsupported}.")
        self.after_step.agreement, self.after_step.named_params = self.agreement, self.named_params
        self.sharding = ShardingLayout.detect(front, self.params)
        announce_sharding(self.sharding, front.is_global_zero)
        if self.sync_free:
            self.sync.attach([t for _, t in self.window.batchnorm_buffers])
            for optimizer in front.optimizers:
                reason = self.sync.unsupported(optimizer, front.grad_scaler)
                if reason is not None:
                    self.recorder.notices.warn("sync_free", f"NanGuard(sync_free=True): {reason}")
        self.recorder.rank = front.global_rank

    def _attach_precursors(self, module: nn.Module) -> None:
        if self.precursors is None:
            return
        self.precursors.attach(module)
        if self.precursors.settings.qk_clip is not None and not self.precursors.projections:
            self.recorder.notices.warn("qk_clip", NO_QK_PROJECTIONS)
        if self.precursors.projections and self.agreement.distributed:
            self.precursors.governed = False  # QK-clip's collective needs the same sampled steps on every rank
            self._qk_collective = True

    def _collective_part_failed(self) -> bool:
        """QK-clip joins a collective on every rank (DDP) and is off here: the step's reduce says so."""
        return self._qk_collective and (self.precursors is None or not self.parts.on("qk_clip"))

    def _drop_spikes(self) -> None:
        """The spike watch failed: no spike is checked from now on (its history is kept for the checkpoint)."""
        watch, self.spikes = self.spikes, None
        if watch is not None:
            self.spike_state = watch.state_dict()

    def _drop_precursors(self) -> None:
        """The precursor watch failed: remove its hooks from the model (QK-clip goes with it)."""
        watch, self.precursors = self.precursors, None
        if watch is not None:
            watch.disarm()

    def optimizer_added(self, front: FrontEnd, optimizer: Optimizer) -> None:
        """An optimizer the front-end learned of after ``attach`` (a Fabric loop's, as it first steps)."""
        if self.sync_free:
            reason = self.sync.unsupported(optimizer, front.grad_scaler)
            if reason is not None:
                self.recorder.notices.warn("sync_free", f"NanGuard(sync_free=True): {reason}")

    # ------------------------------------------------------------------ tensors other code replaces

    def follow(self) -> None:
        """Follow BatchNorm buffers that other code assigned anew (an identity check per buffer, no read)."""
        if self.window.follow() and self.sync_free:
            self.sync.attach([t for _, t in self.window.batchnorm_buffers])

    def rediscover(self, front: FrontEnd) -> None:
        """Find parameters, BatchNorm buffers and metrics again (an epoch starts: modules may have changed)."""
        self._name_params(front.module)
        self._step_params = {}  # named again at the next check, with the tensors the optimizers update
        self.window.rediscover(front.module)
        if self.sync_free:
            self.sync.attach([t for _, t in self.window.batchnorm_buffers])
        model = {id(p) for _, p in self.named_params}
        stray = sum(id(p) not in model for optimizer in front.optimizers for p in _optimizer_params(optimizer))
        if stray:
            self.recorder.notices.warn(
                "stray-params",
                f"NanGuard: the optimizer updates {stray} tensor(s) that are no longer the model's parameters "
                "(replaced by load_state_dict(..., assign=True) or by assigning new Parameters?): training no longer "
                "changes those weights of the model. Load with assign=False, or build the optimizer after replacing "
                "them.",
            )

    def _name_params(self, module: nn.Module, extra: Sequence[Tensor] = ()) -> None:
        """The model's named parameters, and a name for each tensor an optimizer updates that the model lacks."""
        model = list(module.named_parameters())
        known = {id(p) for _, p in model}
        lacking = [(f"<optimizer tensor {i} not in the model>", p) for i, p in enumerate(extra) if id(p) not in known]
        self.named_params = [*model, *lacking]  # type: ignore[list-item]
        self.after_step.named_params = model

    def step_params(self, module: nn.Module, optimizer: Optimizer) -> list[Tensor]:
        """The tensors ``optimizer`` updates, the ones its step is checked on.

        Cached per optimizer and found again when its parameter groups change (a group added by
        ``BackboneFinetuning``, groups replaced): the signature is one ``id`` and one length per group.
        """
        signature = tuple((id(group["params"]), len(group["params"])) for group in optimizer.param_groups)
        cached = self._step_params.get(id(optimizer))
        if cached is not None and cached[0] == signature:
            return cached[1]
        params = _optimizer_params(optimizer)
        named = {id(p) for _, p in self.named_params}
        if cached is not None or any(id(p) not in named for p in params):
            self._name_params(module, params)  # new or replaced tensors: name them
        self._step_params[id(optimizer)] = (signature, params)
        return params

    def scalar_tags(self, front: FrontEnd) -> list[str]:
        """The ``nanguard/`` scalar tags this run can log."""
        remedies = self.recovery.book.enabled
        spikes = self.policy.spike_action != "off"
        return scalar_tags(self.policy.action, remedies, front.grad_scaler is not None, spikes=spikes)

    def begin_step(self, front: FrontEnd, every_n_steps: int) -> None:
        """The first micro-batch of an optimizer step: resolve a sync-free step still pending, open the window."""
        self.parts.step = front.global_step
        if self.parts.unreported:  # parts that failed since the last check (e.g. at the epoch's end)
            self.report_failures(front)
        self.resolve_pending(front)
        front.resume_clipping()  # in case no after-step hook ran since a discarded step
        checking = self.checking(front, every_n_steps)
        self.follow()  # before the BatchNorm buffers are captured
        self.window.begin(checking=checking, front=front)
        if self.window.metrics_changed and self.window.metrics is not None:
            self.window.metrics_changed = False
            self.recorder.notices.warn("metrics", f"NanGuard: {self.window.metrics.describe_unsupported()}.")
        if self.window.logged_unsupported is not None:
            self.recorder.notices.warn(
                "logged",
                f"NanGuard: {self.window.logged_unsupported} on this Lightning version: a skipped step's "
                "self.log values stay in the epoch aggregates (checked on Lightning 2.6).",
            )
        if checking and self.sync_free:
            self.sync.capture()
        self.arm_precursors(front)

    def arm_precursors(self, front: FrontEnd) -> None:
        """The step about to run: measure its attention when it is a sampled step (before its forward)."""
        if self.precursors is not None:
            self.parts.run("precursors", self.precursors.arm, front.global_step)

    def _precursor_check(self, front: FrontEnd) -> None:
        """The step is checked: stop measuring; judge the samples already on the host (no wait)."""
        watch = self.precursors
        if watch is None:
            return
        watch.finish(front.global_step)
        if watch.notice is not None:
            self.recorder.notices.warn(f"precursor-cost-{watch.every}", watch.notice)
            watch.notice = None
        samples = watch.ready()
        if not samples or not front.is_global_zero:  # one rank warns (each rank measures its own rows)
            return
        for step in sorted({sample.step for sample in samples}):
            values = {}
            for sample in (s for s in samples if s.step == step):
                values[f"nanguard/attention_max_logit/{sample.module}"] = sample.max_logit
                values[f"nanguard/attention_entropy/{sample.module}"] = sample.entropy
                cap = watch.settings.qk_clip
                if cap is not None and sample.module in watch.projections:  # the factor QK-clip applied (this rank's)
                    values[f"nanguard/qk_clip/{sample.module}"] = (
                        cap / sample.max_logit if sample.max_logit > cap else 1.0
                    )
            self.recorder.sinks.write_scalars(front, values, step)
        for warning, sample in watch.judge(samples):
            event = precursor_event(warning, sample, watch.settings, front.current_epoch, front.global_rank)
            self.recorder.record(front, event)

    def checking(self, front: FrontEnd, every_n_steps: int) -> bool:
        """Whether the optimizer step about to run is checked (the same answer on every rank)."""
        return front.global_step % every_n_steps == 0

    # ------------------------------------------------------------------ the check

    def check_step(self, front: FrontEnd, optimizer: Optimizer) -> None:
        """Check the step, agree with the other ranks, and carry out the decision.

        An error of the core here drops the step in hand and turns the guard off. Before the step's
        reduce, this rank still takes part in it, voting "failed", so every rank drops this step
        together; after it, one process drops the step at once, and under DDP the rank votes "failed"
        at its next check.
        """
        self.parts.step = front.global_step
        self._voted = False
        try:
            self._check_step(front, optimizer)
        except (NonFiniteTrainingError, GuardInternalError):
            raise
        except Exception as error:
            self.fail(error, "the check of a step")
            if not self._voted:  # vote "failed" in this step's reduce: every rank drops it and stops
                self._resolve(front, optimizer, [], self._agreed_vector(front, [], optimizer).tolist())
            elif not self.agreement.distributed:
                self._stop_guarding(front, optimizer, drop=True)
        finally:
            if self.parts.unreported:
                self.report_failures(front)

    def _check_step(self, front: FrontEnd, optimizer: Optimizer) -> None:
        inner = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        if isinstance(inner, torch.optim.LBFGS) and self.state.reported_step == front.global_step:
            return  # LBFGS evaluates its closure (and this hook) many times per step: one event per step
        self.parts.run("precursors", self._precursor_check, front)
        # manual optimisation steps optimizers one by one: the gradients this step applies are its own
        self.follow()  # BatchNorm buffers replaced during the step are checked as they are
        params = self.step_params(front.module, inner)  # the tensors this step really updates
        grads = [g for p in params if (g := p.grad) is not None]
        vector = self._agreed_vector(front, grads, optimizer)
        sync_free = self.sync_free and front.automatic_optimization and not self.state.failing
        if sync_free and self._defer(front, optimizer, grads, vector):
            return  # skipped on the device if bad; resolved before the next step's forward
        self._resolve(front, optimizer, grads, vector.tolist())  # the one host read of a step
        if not front.automatic_optimization:  # the next optimizer's check: only the losses backpropagated after
            self.window.losses = []

    def _resolve(
        self,
        front: FrontEnd,
        optimizer: Optimizer,
        grads: list[Tensor],
        values: list[float],
    ) -> None:
        """Decide the step from its flags (read to the host) together with the other ranks, and act."""
        health = StepHealth.from_values(values)
        if health.ranks_part_failed and self.precursors is not None and self.parts.on("qk_clip"):
            self.parts.off_elsewhere("qk_clip")  # another rank's QK-clip is off: no rank joins its collective now
        if health.grad_norm >= 0 or math.isnan(health.grad_norm):
            self.state.last_grad_norm = health.grad_norm
        if health.healthy:
            self._healthy(front, grads, health)
            return
        report, event = self._inspect(front, optimizer, health, grads)
        reports = self.agreement.gather(report) if self._collective(front) else [report]
        policy = self._policy(front, optimizer)
        decision, after = decide(
            reports,
            self.state.counters,
            policy,
            next_loss_scale(front.grad_scaler, updated=self._resolving is not None),
        )
        self._carry_out(front, optimizer, decision, after, event, grads, health)

    def _collective(self, front: FrontEnd) -> bool:
        # manual optimisation may call optimizer.step() a different number of times per rank: no collectives
        return self.agreement.distributed and front.automatic_optimization

    def _agreed_vector(self, front: FrontEnd, grads: list[Tensor], optimizer: Optimizer) -> Tensor:
        """The step's flags with their sums over ranks, on the device. A rank whose check fails still takes part."""
        vector: Tensor | None = None
        if not self.state.failing:
            try:
                vector = step_flags(
                    front,
                    optimizer,
                    grads,
                    self.window,
                    self.spikes,  # None once its part is off
                    self.with_norm,
                    self.sharding,
                    parts=self.parts,
                    part_failed=self._qk_collective and self._collective_part_failed(),
                )
            except GuardInternalError:
                raise
            except Exception as error:  # a bug in the guard: this rank says so in the reduce instead of hanging it
                self.fail(error, "the per-step check")
        if vector is None:
            summary = torch.tensor([0.0, -1.0, 0.0], device=front.device)
            part_failed = self._qk_collective and self._collective_part_failed()
            vector = local_vector(summary, failed=True, part_failed=part_failed)
        self._voted = True  # from here on this rank takes part in the step's reduce
        if self.sharding is not None:  # the norm's shares travel with the flags: still one reduce
            return self.sharding.agree(vector, self.agreement, self._collective(front))
        if self._collective(front):
            vector = torch.cat((vector, self.agreement.sum(shared_part(vector))))
        return vector

    # ------------------------------------------------------------------ sync-free steps

    def _defer(self, front: FrontEnd, optimizer: Optimizer, grads: list[Tensor], vector: Tensor) -> bool:
        """Skip on the device if the flags say so and read them later; ``False``: decide now instead."""
        clip = self.recovery.book.clip_threshold if self.with_norm else None
        due = front.logging_due()
        deferred = self.sync.defer_step(front, optimizer, grads, vector, self.policy, self.window, clip, due)
        if deferred:
            self.window.forget_batches()
        return deferred

    def resolve_pending(self, front: FrontEnd) -> None:
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
            view: Any = StepView(front, step.global_step, step.epoch)
            self._resolve(view, step.optimizer, step.grads, values)
        finally:
            self._resolving = None
            self.window.forget_batches()
            self.window.losses = []

    def _healthy(self, front: FrontEnd, grads: list[Tensor], health: StepHealth) -> None:
        self.state.counters = self.state.counters.healthy()
        self.state.step_was_bad = False
        deferred = self._resolving
        grad_norm = health.grad_norm
        if self.spikes is not None:  # the values came with the step's one read: nothing more is read
            self.parts.run("spikes", self.spikes.accept, True, loss=health.loss, grad_norm=grad_norm)
        if math.isfinite(grad_norm) and grad_norm >= 0:  # -1: not computed this step
            self.parts.run("remedies", self._healthy_norm, grads, grad_norm, clip=deferred is None)
        step, slicer = front.global_step, self.diagnosis.batch_slicer
        self.parts.run("diagnosis", self.window.refresh_reference, step, REFERENCE_EVERY_N_STEPS, slicer)
        self.window.forget_batches()
        due = deferred.logging_due if deferred is not None else None
        self.recorder.scalars(front, self.metrics(self.state.counters), due=due)

    def _healthy_norm(self, grads: list[Tensor], grad_norm: float, clip: bool) -> None:
        """A healthy step's norm for ``clip_grad``; clipped now unless sync-free clipped it on the device."""
        self.recovery.remember_healthy_norm(grad_norm)
        threshold = self.recovery.book.clip_threshold
        if threshold is not None and clip:
            clip_gradients_(grads, grad_norm, threshold)

    # ------------------------------------------------------------------ a step that is bad somewhere

    def _policy(self, front: FrontEnd, optimizer: Optimizer) -> Policy:
        inner = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        can_skip = front.automatic_optimization and not isinstance(inner, torch.optim.LBFGS)
        return self.policy if can_skip == self.policy.can_skip else dataclasses.replace(self.policy, can_skip=can_skip)

    def _inspect(
        self,
        front: FrontEnd,
        optimizer: Optimizer,
        health: StepHealth,
        grads: list[Tensor],
    ) -> tuple[RankVote, NanEvent | None]:
        """What this rank found; never raises (a failure becomes a ``failed`` report)."""
        rank = front.global_rank
        if self.state.failing:
            return RankVote(rank, failed=True), None
        try:
            inspector = inspector_for(
                self.diagnosis,
                self.window,
                self.named_params,
                self.recorder,
                self.spikes,
                sharding=self.sharding,
                agreement=self.agreement,
                parts=self.parts,
            )
            return inspector.inspect(front, health, grads)
        except (NonFiniteTrainingError, GuardInternalError):
            raise
        except Exception as error:  # the confirmation of the flags (core): the step is not vouched for
            self.fail(error, "the check of a bad step")
            return RankVote(rank, failed=True), None

    def _carry_out(
        self,
        front: FrontEnd,
        optimizer: Optimizer,
        decision: StepDecision,
        counters: Counters,
        event: NanEvent | None,
        grads: list[Tensor],
        health: StepHealth,
    ) -> None:
        before, self.state.counters = self.state.counters, counters
        if decision.outcome == "failed":  # some rank's core failed: the step is not vouched for
            self._stop_guarding(front, optimizer, drop=decision.discard, decision=decision)
            self.recorder.scalars(front, self.metrics(self.state.counters), previous=self.metrics(before))
            return
        try:
            self._act(front, optimizer, decision, before, event, grads, health)
        finally:
            if decision.disable:  # an incident somewhere, and a failed core on some rank
                self._stop_guarding(front, optimizer, drop=False, decision=decision)

    def _act(
        self,
        front: FrontEnd,
        optimizer: Optimizer,
        decision: StepDecision,
        before: Counters,
        event: NanEvent | None,
        grads: list[Tensor],
        health: StepHealth,
    ) -> None:
        """Carry out a decision that is not ``failed``: drop, roll back, remedies, the event, raising."""
        if decision.outcome == "healthy":  # a finite tensor whose norm overflowed: not an incident
            self._healthy(front, grads, health)
            return
        if self.spikes is not None:
            self.parts.run("spikes", self._spike_seen, front, decision.rebaseline)
        if decision.outcome == "overflow":  # the GradScaler skips this step by itself
            self.recorder.scalars(front, self.metrics(self.state.counters), previous=self.metrics(before))
            return
        self.state.step_was_bad = True
        self.state.reported_step = front.global_step
        if decision.discard:
            self.window.discard_update(optimizer, front)
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
        event = self._shared_event(front, decision, event)
        if event is not None and self.recovery.book.can_apply("quarantine"):
            self.parts.run("remedies", self._tell_quarantine_refusal, event)
        if event is not None:
            action = DONE[decision.action or "warn"]
            if decision.rollback_due and self.recovery.snapshot.available:
                action = "rolled_back"
            event = event.replace(action=action, cause=decision.cause or event.cause)
            if remedies:
                event = event.replace(remedies=(*event.remedies, *remedies))
            self.recorder.record(front, event)
        self.recorder.scalars(front, self.metrics(self.state.counters), previous=self.metrics(before))
        self.recorder.progress(front, self.state.counters.skipped_total)
        if decision.action == "raise":
            counters, events = self.state.counters, self.recorder.events
            raise NonFiniteTrainingError(
                stop_message(decision, counters, self.policy, event, self.recorder.events_path),
                stop_history(decision, events, self.policy, event),
            )

    def _spike_seen(self, front: FrontEnd, rebaseline: bool) -> None:
        """A step that was not healthy: its values stay out of the statistic; several spikes in a row re-baseline."""
        assert self.spikes is not None
        self.spikes.accept(False)
        if rebaseline:
            self.spikes.rebaseline()
            self.recorder.notices.warn(
                f"rebaseline-{front.global_step}",
                f"NanGuard: {self.policy.spike_rebaseline_after} loss spikes in a row at step "
                f"{front.global_step}: the loss level shifted for good (a curriculum change?); the spike "
                "statistic starts over from the coming steps.",
            )

    def _tell_quarantine_refusal(self, event: NanEvent) -> None:
        """Say once per run that quarantine skipped records it could not verify (it acts only on verified ones)."""
        why = quarantine_refusal(event)
        if why is not None:
            self.recorder.notices.warn(
                "quarantine-unverified",
                f"NanGuard: quarantine skipped {why}. Quarantine removes only records whose dataset index and "
                "blame are both verified (see the event's indices_verified and blame_verified); this notice is "
                "given once.",
            )

    def _shared_event(self, front: FrontEnd, decision: StepDecision, event: NanEvent | None) -> NanEvent | None:
        """This rank's event; a collapsed loss scale (no rank's own NaN/Inf) is recorded by rank zero."""
        if event is not None or decision.outcome != "loss_scale" or front.global_rank != 0:
            return event
        return self.parts.run("diagnosis", self._loss_scale_event, front)

    def _loss_scale_event(self, front: FrontEnd) -> NanEvent:
        overflows = self.state.counters.consecutive_overflows
        return loss_scale_event(
            front,
            self.window.batch_idx,
            next_loss_scale(front.grad_scaler, updated=self._resolving is not None),
            overflows,
            self.state.last_grad_norm,
        )

    def metrics(self, counters: Counters) -> dict[str, float | None]:
        """The ``nanguard/`` scalar values for ``counters``."""
        return self.after_step.values(counters)

    def after_optimizer_step(self, front: FrontEnd) -> None:
        """The after-step work (rollback, weight check, snapshot, QK-clip), on every rank."""
        front.resume_clipping()
        try:
            self.after_step.run(front, self._collective(front))
            self._qk_clip(front)
        finally:
            if self.parts.unreported:
                self.report_failures(front)

    def _qk_clip(self, front: FrontEnd) -> None:
        watch = self.precursors
        if watch is not None and watch.projections:
            if not self.parts.on("qk_clip"):
                watch.forget_clip()
            elif self._collective(front) or not self.agreement.distributed:
                self.parts.run("qk_clip", watch.clip, self.agreement.max if self.agreement.distributed else None)
            else:  # manual optimisation on several ranks: no collectives, so no rank may rescale alone
                watch.forget_clip()
                self.recorder.notices.warn(
                    "qk_clip",
                    "NanGuard(qk_clip=...): off under manual optimisation with several processes (the ranks "
                    "could not agree on the rescaling without a collective per optimizer step).",
                )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["agreement"] = RankAgreement(None, 1)  # never pickle the strategy or the batches
        state["window"] = StepWindow(self.parts)
        state["after_step"] = AfterStep(self.state, self.recovery, self.recorder, state["window"])
        state["after_step"].settings = self.after_step.settings
        state["sync"] = SyncFreeSteps()
        state["named_params"], state["params"] = [], []
        return state

    # ------------------------------------------------------------------ manual loops

    def manual_check(self, front: FrontEnd | None, module: nn.Module, loss: Tensor | None) -> NanEvent | None:
        """``NanGuard.check``: gradients, BatchNorm statistics, weights and ``loss`` of ``module``, now."""
        event = check_module(front, module, loss, self.window.batch_idx)
        self.window.losses = []  # checked: an optimizer step hooked after this sees only the losses to come
        if event is not None and front is not None:
            self.state.dropped_by_check = True  # the caller skips the step: its logs go at the batch's end
        if event is not None:
            self.state.counters = self.state.counters.replace(bad_steps_total=self.state.counters.bad_steps_total + 1)
            self.recorder.record(front, event)
        return event

    # ------------------------------------------------------------------ failure of the guard itself

    def fail(self, error: BaseException, where: str) -> None:
        """An error of the core: the next check drops its step and turns the guard off (every rank together)."""
        fail(self.state, self.parts, self.agreement.distributed, error, where)

    def disable_everywhere(self) -> None:
        """Every rank saw some rank's failure in the same reduce: all stop guarding (and joining collectives) now."""
        self.state.disabled, self.state.failing = True, False

    def _stop_guarding(
        self, front: FrontEnd, optimizer: Optimizer, drop: bool, decision: StepDecision | None = None
    ) -> None:
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
        action = "skipped" if drop else "warned"
        if self.parts.mode == "raise":
            action = "raised"
        own = self.parts.off.get(CORE)
        failed_ranks = [r.rank for r in decision.reports if r.failed] if decision is not None else []
        others = [rank for rank in failed_ranks if rank != front.global_rank]
        if own is None and others and front.global_rank == 0:
            own = PartFailure(CORE, f"the guard's core failed on rank(s) {others}", "another rank", front.global_step)
        if own is not None:
            other = own.where == "another rank"
            event = own.event(front.current_epoch, self.window.batch_idx, front.global_rank, action, other=other)
            if own.step != front.global_step:  # failed in an earlier hook: the event is the dropped step's
                details = {**event.details, "failed_at_step": own.step}
                event = event.replace(global_step=front.global_step, details=details)
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

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The guard's checkpoint state, composed from its parts' (primitives; the layout of 0.2.0 and 0.3).

        The counters (flat) and ``last_grad_norm`` (:class:`GuardState`), ``spikes`` (the spike
        statistic; the state loaded before the detectors exist while they do not), ``events`` (the
        recorder's last ones) and ``recovery`` (remedy state and rollback count).
        """
        spikes = self.spikes.state_dict() if self.spikes is not None else self.spike_state
        recovery = self.recovery.state_dict()
        return {**self.state.state_dict(), "spikes": spikes, **self.recorder.state_dict(), "recovery": recovery}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; keys added in later versions read as their defaults."""
        self.state.load_state_dict(state)
        self.recorder.load_state_dict(state)
        self.spike_state = dict(state.get("spikes", {}))
        if self.spikes is not None:
            self.spikes.load_state_dict(self.spike_state)
        self.recovery.load_state_dict(state.get("recovery", {}))


def _optimizer_params(optimizer: Optimizer) -> list[Tensor]:
    """The parameters ``optimizer`` updates, in its order."""
    return [p for group in optimizer.param_groups for p in group["params"]]
