"""One optimizer step under the guard: check, agree, decide, act. The policy carried out, for any front-end.

:class:`StepController` is what the engine's moments (:mod:`.moments`) drive. Per optimizer step, on every rank:

1. the :class:`~lightning_nanguard.engine.step.window.StepWindow` collects the micro-batches and losses;
2. :meth:`StepController.check_step` runs the fused check, reduces its flags over ranks and reads
   them to the host once (:class:`~lightning_nanguard.decide.policy.StepHealth`);
3. a step that is healthy everywhere ends there; otherwise each rank describes what it found
   (:class:`~lightning_nanguard.engine.incident.inspector.IncidentInspector`), the reports are gathered, and
   :func:`~lightning_nanguard.decide.policy.decide` gives one decision for every rank, which
   :class:`~lightning_nanguard.engine.step_actions.StepActions` carries out;
4. after the optimizer step, :meth:`StepController.after_optimizer_step` rolls back when due,
   checks the weights and refreshes the last good snapshot.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_nanguard.core.events import GuardInternalError, NanEvent, NonFiniteTrainingError
from lightning_nanguard.decide.agreement import RankAgreement
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
from lightning_nanguard.engine.incident.sharded_inspector import inspect_rank, inspector_for
from lightning_nanguard.engine.parts import GuardParts
from lightning_nanguard.engine.precursor_part import PrecursorPart
from lightning_nanguard.engine.recording import IncidentRecorder
from lightning_nanguard.engine.settings import GuardSettings
from lightning_nanguard.engine.shard_layout import ShardingLayout, announce_sharding, sharding_notice
from lightning_nanguard.engine.state import GuardState, composed_state, load_composed_state
from lightning_nanguard.engine.step.check import (
    decided_health,
    decided_on_host,
    host_step_health,
    next_loss_scale,
    staged_step_read,
    step_flags,
)
from lightning_nanguard.engine.step.closure_undo import is_closure_optimizer
from lightning_nanguard.engine.step.params import StepParams
from lightning_nanguard.engine.step.spikes import SpikeWatch
from lightning_nanguard.engine.step.syncfree import SyncFreeSteps
from lightning_nanguard.engine.step.window import StepWindow
from lightning_nanguard.engine.step_actions import StepActions
from lightning_nanguard.recover.recovery import Recovery
from lightning_nanguard.reporting import notice_texts as say
from lightning_nanguard.reporting.scalars import scalar_tags

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from lightning_nanguard.engine.frontend import FrontEnd

__all__ = ["StepController"]


class StepController:
    """Carries out the guard's per-step policy on one rank (see module docs); configured by :meth:`configure`.

    Args:
        recovery: snapshots, rollback and remedies.
        recorder: events, sinks and scalars.
    """

    def __init__(self, recovery: Recovery, recorder: IncidentRecorder) -> None:
        self.recovery = recovery
        self.recorder = recorder
        self.parts = GuardParts()  # the optional parts, each off alone at its first error (engine/parts.py)
        recorder.parts = self.parts
        self.window = StepWindow(self.parts)
        self.state = GuardState()
        self.spikes: SpikeWatch | None = None
        self.attention = PrecursorPart(self.parts, recorder)  # attention collapse ahead, QK-clip
        self.sync = SyncFreeSteps()
        self.spike_state: dict[str, Any] = {}  # loaded before the detectors exist
        self.agreement = RankAgreement(None, 1)
        self.after_step = AfterStep(self.state, self.recovery, self.recorder, self.window)
        self.actions = StepActions(self.state, self.window, self.recovery, self.recorder, self.parts)
        self.step_params = StepParams()  # the tensors each optimizer updates, named
        self.per_optimizer = self.actions.per_optimizer  # streaks, spike statistics, held schedulers
        self._index: int | None = None  # the position of the optimizer being checked, with several
        self.params: list[nn.Parameter] = []
        self.sharding: ShardingLayout | None = None  # ModelParallelStrategy (engine/shard_layout.py)
        self._voted = False  # this step's check reached the ranks' reduce

    @property
    def named_params(self) -> list[tuple[str, nn.Parameter]]:
        """Every tensor a step may update, named (the model's, then optimizer tensors the model lacks)."""
        return self.step_params.named

    precursors = property(lambda self: self.attention.watch, doc="The precursor watch (``None`` when off).")

    # ------------------------------------------------------------------ setup

    def configure(self, settings: GuardSettings) -> None:
        """Take the configuration (construction, ``setup``); unchanged spike settings keep their history."""
        if not settings.diagnosis.diagnose_here:
            self.recorder.notices.warn("fsdp", sharding_notice("fsdp")[1])  # type: ignore[index]
        self.policy, self.diagnosis = settings.policy, settings.diagnosis
        self.parts.mode = settings.on_internal_error
        self.after_step.settings = settings.param_checks
        self.recovery.configure(settings.recovery)
        self.track_batchnorm, self.with_norm = settings.track_batchnorm, settings.with_norm
        self.sync_free = settings.sync_free
        self.attention.configure(settings.precursors, settings.precursors_refused)
        self.parts.when_off("spikes", self._drop_spikes)
        self.spikes = SpikeWatch.reconfigured(self.spikes, settings.spikes, self.with_norm, self.spike_state)

    def attach(self, front: FrontEnd) -> None:
        """Bind to the front-end's strategy and the model's parameters (once the model sits on its device)."""
        self.agreement = RankAgreement(front.strategy, front.world_size)
        self.step_params.attach(front.module)
        self.params = [p for _, p in self.named_params]
        self.window.attach(front.module, self.track_batchnorm)
        self.parts.run("precursors", self.attention.attach, front.module, self.agreement.distributed)
        unsupported = self.window.metrics.describe_unsupported() if self.window.metrics is not None else None
        if unsupported:
            self.recorder.notices.warn("metrics", say.metrics_unsupported(unsupported))
        self.after_step.agreement, self.after_step.named_params = self.agreement, self.step_params.model_named
        self.sharding = ShardingLayout.detect(front, self.params)
        announce_sharding(self.sharding, front.is_global_zero)
        self.follow_batchnorm()
        for optimizer in front.optimizers:
            self.optimizer_added(front, optimizer)
        self.recorder.rank = front.global_rank

    def _drop_spikes(self) -> None:
        """The spike watch failed: no spike is checked from now on (its history is kept for the checkpoint)."""
        watch, self.spikes = self.spikes, None
        if watch is not None:
            self.spike_state = watch.state_dict()

    def optimizer_added(self, front: FrontEnd, optimizer: Optimizer) -> None:
        """An optimizer to guard (at ``attach``, or a Fabric loop's as it first steps)."""
        if self.sync_free:
            reason = self.sync.unsupported(optimizer, front.grad_scaler)
            if reason is not None:
                self.recorder.notices.warn("sync_free", say.sync_free_unsupported(reason))

    # ------------------------------------------------------------------ tensors other code replaces

    def follow(self) -> None:
        """Follow BatchNorm buffers that other code assigned anew (an identity check per buffer, no read)."""
        if self.window.follow():
            self.follow_batchnorm()

    def follow_batchnorm(self) -> None:
        """The BatchNorm buffers were found anew: sync-free restores these."""
        if self.sync_free:
            self.sync.attach([t for _, t in self.window.batchnorm_buffers])

    def scalar_tags(self, front: FrontEnd) -> list[str]:
        """The ``nanguard/`` scalar tags this run can log."""
        remedies = self.recovery.book.enabled
        spikes = self.policy.spike_action != "off"
        return scalar_tags(self.policy.action, remedies, front.grad_scaler is not None, spikes=spikes)

    def begin_step(self, front: FrontEnd, every_n_steps: int) -> None:
        """The first micro-batch of an optimizer step: resolve a sync-free step still pending, open the window."""
        self.parts.step = step = front.global_step
        if self.parts.unreported:  # parts that failed since the last check (e.g. at the epoch's end)
            self.report_failures(front)
        self.resolve_pending(front)
        front.resume_clipping()  # in case no after-step hook ran since a discarded step
        checking = self.checking(front, every_n_steps)
        self.follow()  # before the BatchNorm buffers are captured
        self.window.begin(checking=checking, front=front)
        if self.window.metrics_changed and self.window.metrics is not None:
            self.window.metrics_changed = False
            description = self.window.metrics.describe_unsupported()
            self.recorder.notices.warn("metrics", say.metrics_unsupported(str(description)))
        if self.window.logged_unsupported is not None:
            self.recorder.notices.warn("logged", say.logged_unsupported(self.window.logged_unsupported))
        if checking and self.sync_free:
            self.sync.capture()
        self.attention.arm(step)  # a sampled step: measure its attention (before its forward)

    def checking(self, front: FrontEnd, every_n_steps: int) -> bool:
        """Whether the optimizer step about to run is checked (the same answer on every rank)."""
        return every_n_steps == 1 or front.global_step % every_n_steps == 0  # 1, the default: no step read

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
                self._resolve_values(front, optimizer, [], self._agreed_vector(front, [], optimizer).tolist())
            elif not self.agreement.distributed:
                self.actions.stop_guarding(front, optimizer, drop=True)
        finally:
            if self.parts.unreported:
                self.report_failures(front)

    def _check_step(self, front: FrontEnd, optimizer: Optimizer) -> None:
        inner = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        if is_closure_optimizer(inner) and self.state.reported_step == front.global_step:  # no step read otherwise
            for param in self.step_params.of(front.module, inner):  # LBFGS evaluates its closure again: the step
                param.grad = None  # is undone at its end; no gradient moves it meanwhile, one event per step
            return
        self._index = self.per_optimizer.index(optimizers, inner) if len(optimizers := front.optimizers) > 1 else None
        first = self.spikes
        if self._index:  # each optimizer's losses have their own statistic
            self.spikes = self.per_optimizer.spike_watch(self._index, first)
        try:
            self._check_optimizer_step(front, optimizer, inner)
        finally:
            if self._index and self.spikes is not None:
                self.spikes = first

    def _check_optimizer_step(self, front: FrontEnd, optimizer: Optimizer, inner: Optimizer) -> None:
        self.attention.check(front)
        # manual optimisation steps optimizers one by one: the gradients this step applies are its own
        self.follow()  # BatchNorm buffers replaced during the step are checked as they are
        params = self.step_params.of(front.module, inner)  # the tensors this step really updates
        grads = [g for p in params if (g := p.grad) is not None]
        layout = params if len(grads) == len(params) else None  # the gradients are laid out as their tensors
        health = self._host_health(front, grads, layout)
        if health is None and self._defer_one_read(front, optimizer, grads, layout):
            return  # sync-free, one process: skipped on the device if bad; resolved before the next step's forward
        if health is None:  # flags on the device: reduced over ranks, or handed to a fused optimizer
            vector = self._agreed_vector(front, grads, optimizer, layout)
            sync_free = self.sync_free and front.automatic_optimization and not self.state.failing
            if sync_free and self._defer(front, optimizer, grads, vector):
                return  # skipped on the device if bad; resolved before the next step's forward
            health = StepHealth.from_values(vector.tolist())  # the one host read of a step
        self._resolve(front, optimizer, grads, health)
        if not front.automatic_optimization:  # the next optimizer's step: its own losses and BatchNorm updates
            self.window.next_optimizer_step()

    def _resolve_values(self, front: FrontEnd, optimizer: Optimizer, grads: list[Tensor], values: list[float]) -> None:
        """:meth:`_resolve` from the flags read to the host as a list (a vector's ``tolist()``)."""
        deferred = self.sync.resolving
        if deferred is not None and deferred.one_read:
            health = self._one_read_health(front, grads, values)
        else:
            health = StepHealth.from_values(values)
        self._resolve(front, optimizer, grads, health)

    def _resolve(self, front: FrontEnd, optimizer: Optimizer, grads: list[Tensor], health: StepHealth) -> None:
        """Decide the step from its flags (read to the host) together with the other ranks, and act."""
        if health.ranks_part_failed:
            self.attention.clip_failed_elsewhere()  # no rank joins QK-clip's collective now
        if health.grad_norm >= 0 or math.isnan(health.grad_norm):
            self.state.last_grad_norm = health.grad_norm
        index, per = self._index, self.per_optimizer
        if health.healthy:
            self._healthy(front, grads, health)
            if index is not None:
                self.state.counters = per.settle(self.state.counters, index)
            return
        report, event = self._inspect(front, health, grads)
        # one reduce per optimizer step, manual optimisation too: DDP's backward already needs every rank in step
        reports = self.agreement.gather(report) if self.agreement.distributed else [report]
        policy = self._policy(optimizer)
        loss_scale = next_loss_scale(front.grad_scaler, updated=self.sync.resolving is not None)
        counters = self.state.counters if index is None else per.counters_for(self.state.counters, index)
        decision, after = decide(reports, counters, policy, loss_scale)
        if index is not None:
            after = per.settle(after, index)
        if event is not None:  # the optimizer whose step it was; reported here, not again by guard.check's
            self.state.unreported_checks.clear()
            event = event.replace(optimizer=per.index(front.optimizers, optimizer) if index is None else index)
        self._carry_out(front, optimizer, decision, after, event, grads, health)

    def _host_health(self, front: FrontEnd, grads: list[Tensor], layout: list[Tensor] | None) -> StepHealth | None:
        """The step decided on the host from raw totals (one process, no GradScaler); ``None``: on the device."""
        device_flags = self.agreement.distributed or self.sharding is not None or self.state.failing
        if device_flags or (self.sync_free and front.automatic_optimization) or not decided_on_host(front):
            return None
        self._voted = True  # no reduce to take part in: a failure below is this rank's alone
        try:
            return host_step_health(front, grads, self.window, self.spikes, self.with_norm, self.parts, layout)
        except GuardInternalError:
            raise
        except Exception as error:  # a bug in the guard: the step is not vouched for
            self.fail(error, "the per-step check")
            return StepHealth.local(failed=True)

    def _agreed_vector(
        self, front: FrontEnd, grads: list[Tensor], optimizer: Optimizer, layout: list[Tensor] | None = None
    ) -> Tensor:
        """The step's flags with their sums over ranks, on the device. A rank whose check fails still takes part."""
        vector: Tensor | None = None
        part_failed = self.attention.collective and self.attention.clip_failed_here()
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
                    part_failed=part_failed,
                    layout=layout,
                )
            except GuardInternalError:
                raise
            except Exception as error:  # a bug in the guard: this rank says so in the reduce instead of hanging it
                self.fail(error, "the per-step check")
        if vector is None:
            summary = torch.tensor([0.0, -1.0, 0.0], device=front.device)
            vector = local_vector(summary, failed=True, part_failed=part_failed)
        self._voted = True  # from here on this rank takes part in the step's reduce
        if self.sharding is not None:  # the norm's shares travel with the flags: still one reduce
            return self.sharding.agree(vector, self.agreement, self.agreement.distributed)
        if self.agreement.distributed:
            vector = torch.cat((vector, self.agreement.sum(shared_part(vector))))
        return vector

    # ------------------------------------------------------------------ sync-free steps

    def _defer(self, front: FrontEnd, optimizer: Optimizer, grads: list[Tensor], vector: Tensor) -> bool:
        """Skip on the device if the flags say so and read them later; ``False``: decide now instead."""
        clip, due = self.recovery.book.clip_threshold if self.with_norm else None, front.logging_due()
        return self.sync.defer_step(front, optimizer, grads, vector, self.policy, self.window, clip, due)

    def _defer_one_read(
        self, front: FrontEnd, optimizer: Optimizer, grads: list[Tensor], layout: list[Tensor] | None
    ) -> bool:
        """The common sync-free step of one process: checked as the default mode checks it, flag left on the device.

        The default's one buffer (:func:`~lightning_nanguard.detect.one_read.staged_loss_and_total`),
        a skip flag made from its total (and the loss-spike flag) on the device, and the buffer's
        ``[loss, total]`` read a step later: a few kernels more than the default instead of the general
        flags' two dozen. ``False`` (nothing done) where the step needs more: the gradient norm (clipping,
        a logging step), several micro-batches, ranks to agree with, a GradScaler, ``action="warn"``,
        a BatchNorm layout the buffer cannot take, or an optimizer that cannot skip on the device.
        """
        policy = self.policy
        if not (self.sync_free and front.automatic_optimization) or self.state.failing or self.with_norm:
            return False
        if self.agreement.distributed or self.sharding is not None or not decided_on_host(front) or front.logging_due():
            return False
        if policy.action == "warn" or self.sync.unsupported(optimizer, None) is not None:
            return False
        read = staged_step_read(grads, self.window, layout)
        if read is None:
            return False
        spike = None
        if self.spikes is not None and policy.spike_action == "skip":  # the comparison the host repeats later
            spike = self.parts.run("spikes", self.spikes.loss.above, read[0:1])
        self._voted = True  # no reduce to take part in: a failure from here on is this rank's alone
        return self.sync.defer_one_read(front, optimizer, grads, read, spike, self.window)

    def _one_read_health(self, front: FrontEnd, grads: list[Tensor], values: list[float]) -> StepHealth:
        """A deferred one read's ``[loss, total]`` decided as :func:`host_step_health` decides it (see there).

        A non-finite total is only a candidate: the step is checked in full, as it was (its gradients,
        losses and BatchNorm buffers as it left them).
        """
        loss, total = values
        spikes, parts = self.spikes, self.parts
        if math.isfinite(total):
            health = decided_health(spikes, parts, loss if spikes is not None else None, -1.0, self.with_norm)
        else:  # skipped on the device already
            self.sync.show_step_batchnorm()
            try:
                health = host_step_health(front, grads, self.window, spikes, self.with_norm, parts)
            except GuardInternalError:
                raise
            except Exception as error:  # a bug in the guard: the step is not vouched for
                self.fail(error, "the per-step check")
                return StepHealth.local(failed=True)
        if not health.healthy:  # the diagnosis sees the BatchNorm buffers as the step left them
            self.sync.show_step_batchnorm()
        return health

    def resolve_pending(self, front: FrontEnd) -> None:
        """Read and act on the flags of a step checked sync-free (before the next forward, or at the end)."""
        if self.sync.pending is not None:  # none in the default mode: every step asks
            self.sync.resolve_pending(front, self.window, self._resolve_values)

    # ------------------------------------------------------------------ a step that is bad somewhere

    def _policy(self, optimizer: Optimizer) -> Policy:
        # a closure optimizer's step is undone at its end when the front-end announced it (closure_undo.before)
        can_skip = not is_closure_optimizer(optimizer) or self.actions.closure_undo.holds(optimizer)
        return self.policy if can_skip == self.policy.can_skip else dataclasses.replace(self.policy, can_skip=can_skip)

    def _inspect(self, front: FrontEnd, health: StepHealth, grads: list[Tensor]) -> tuple[RankVote, NanEvent | None]:
        """What this rank found; never raises (a failure of the confirmation is a ``failed`` report)."""
        if self.state.failing:
            return RankVote(front.global_rank, failed=True), None
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
        return inspect_rank(inspector, front, health, grads, self.fail)

    def _healthy(self, front: FrontEnd, grads: list[Tensor], health: StepHealth) -> None:
        deferred = self.sync.resolving
        due = deferred.logging_due if deferred is not None else None
        clip = deferred is None  # sync-free clipped it on the device
        self.actions.healthy(front, grads, health, self.spikes, self.diagnosis.batch_slicer, self.metrics, clip, due)

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
            if decision.discard:
                self.actions.closure_undo.mark_bad()
            self.actions.stop_guarding(front, optimizer, drop=decision.discard, decision=decision)
            self.recorder.scalars(front, self.metrics(self.state.counters), previous=self.metrics(before))
            return
        try:
            if decision.outcome == "healthy":  # a finite tensor whose norm overflowed: not an incident
                self._healthy(front, grads, health)
                return
            self.actions.act(
                front,
                optimizer,
                decision,
                before,
                event,
                self.policy,
                self.spikes,
                self.metrics,
                updated_scale=self.sync.resolving is not None,
            )
        finally:
            if decision.discard:
                self.actions.dropped(front, optimizer)
            if decision.disable:  # an incident somewhere, and a failed core on some rank
                self.actions.stop_guarding(front, optimizer, drop=False, decision=decision)

    def metrics(self, counters: Counters) -> dict[str, float | None]:
        """The ``nanguard/`` scalar values for ``counters``."""
        return self.after_step.values(counters)

    # ------------------------------------------------------------------ after the update

    def after_optimizer_step(self, front: FrontEnd) -> None:
        """The after-step work (rollback, weight check, snapshot, QK-clip), on every rank."""
        front.resume_clipping()
        try:
            distributed = self.agreement.distributed  # every rank takes part in the after-step collectives
            self.after_step.run(front, distributed)
            self.attention.clip(distributed, distributed, self.agreement.max)
        finally:
            if self.parts.unreported:
                self.report_failures(front)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["agreement"] = RankAgreement(None, 1)  # never pickle the strategy or the batches
        state["window"] = window = StepWindow(self.parts)
        state["after_step"] = AfterStep(self.state, self.recovery, self.recorder, window)
        state["after_step"].settings = self.after_step.settings
        state["actions"] = actions = StepActions(self.state, window, self.recovery, self.recorder, self.parts)
        state["per_optimizer"] = actions.per_optimizer
        state["sync"] = SyncFreeSteps()
        state["step_params"], state["params"] = StepParams(), []
        return state

    # ------------------------------------------------------------------ failure of the guard itself

    def fail(self, error: BaseException, where: str) -> None:
        """An error of the core: the next check drops its step and turns the guard off (every rank together)."""
        fail(self.state, self.parts, self.agreement.distributed, error, where)

    def report_failures(self, front: FrontEnd) -> None:
        """Record the ``guard_error`` event of each optional part that failed since the last call."""
        self.actions.report_failures(front)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The guard's checkpoint state, composed from its parts' (:func:`~.state.composed_state`)."""
        return composed_state(self.state, self.spikes, self.spike_state, self.recorder, self.recovery)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; keys added in later versions read as their defaults."""
        self.spike_state = load_composed_state(state, self.state, self.spikes, self.recorder, self.recovery)
