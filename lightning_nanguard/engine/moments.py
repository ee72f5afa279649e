"""The step engine as a front-end sees it: one object, a handful of moments of a training loop.

:class:`GuardEngine` composes the guard's parts (the step controller, the incident recorder, the
recovery, the clock) and is the one thing a front-end (the Trainer callback, the Fabric guard)
calls. Each loop maps its own hooks onto these moments, in this order:

==================  ===========================================================================
``configure``       the arguments, validated into each part's settings (again at set-up, once
                    the strategy is known)
``open_logs``       where events, bundles and scalars go (a collective: every rank calls it)
``start``           the model on its device: parameters, BatchNorm buffers, the first snapshot
``epoch_start``     find again what the model holds (modules, buffers, metrics may change)
``batch``           a (micro-)batch: the first of an optimizer step opens the step's window
                    (``open_step`` alone where the loop shows no batch)
``loss``            a loss about to be backpropagated (kept for the check, no host read)
``step``            before ``optimizer.step()``: check, agree over ranks, decide, act
``begin_update``    ``optimizer.step()`` begins (a closure optimizer's state is copied: LBFGS)
``after_step``      after ``optimizer.step()``: rollback, weight check, snapshot, QK-clip
``batch_end``       the end of a batch (manual optimisation: held schedulers released)
``epoch_end``       settle a step checked sync-free before the epoch's values are read
``end``             the same at the end of training
``state_dict``      the guard's checkpoint state (and ``load_state_dict``)
==================  ===========================================================================

The Fabric guard (:class:`~lightning_nanguard.fabric.guard.FabricGuard`) maps Fabric's moments onto
these in :mod:`lightning_nanguard.fabric.steps`; the Trainer callback
(:class:`~lightning_nanguard.trainer.callback.NanGuard`) maps Lightning's hooks in a few lines each.

Example:
    >>> engine = GuardEngine(verbose=False)
    >>> engine.every_n_steps, engine.action, engine.controller.state.disabled
    (1, 'skip', False)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.core.timing import GuardClock
from lightning_nanguard.engine.controller import StepController
from lightning_nanguard.engine.recording import IncidentRecorder
from lightning_nanguard.engine.settings import GuardSettings
from lightning_nanguard.engine.step.check import check_module
from lightning_nanguard.engine.step.closure_undo import is_closure_optimizer
from lightning_nanguard.recover.recovery import Recovery, apply_module_eps
from lightning_nanguard.reporting.notice_texts import stray_params

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from lightning_nanguard.engine.data.readers import RecordReader
    from lightning_nanguard.engine.frontend import FrontEnd

__all__ = ["GuardEngine"]


class GuardEngine:
    """The guard's parts, composed, and the moments of a step (see module docs).

    Args:
        verbose: print a report of each event to the terminal.

    Attributes:
        controller: the per-step policy (check, agree, decide, act).
        recorder: events, sinks and scalars.
        recovery: snapshots, rollback and remedies.
        clock: the time spent inside the guard (``clock.enabled = True`` measures it).
    """

    def __init__(self, verbose: bool = True) -> None:
        self.clock = GuardClock()
        self.recorder = IncidentRecorder(verbose)
        self.recovery = Recovery()
        self.controller = StepController(self.recovery, self.recorder)
        self.every_n_steps = 1
        self.action = "skip"

    # ------------------------------------------------------------------ set up

    def configure(self, arguments: Mapping[str, Any], strategy_kind: str = "single") -> None:
        """Take the ``NanGuard`` arguments (validated) as each part's settings; again once the strategy is known."""
        self.controller.configure(GuardSettings.from_arguments(arguments, strategy_kind=strategy_kind))
        self.recorder.sinks.verbose = bool(arguments["verbose"])
        self.every_n_steps = int(arguments["check_every_n_steps"])
        self.action = str(arguments["action"])

    def open_logs(self, front: FrontEnd) -> None:
        """Resolve where events, bundles and scalars go (every rank calls it)."""
        self.recorder.attach(front, self.controller.scalar_tags(front))

    def start(self, front: FrontEnd, snapshot: bool = True) -> None:
        """The model sits on its device: find parameters and BatchNorm buffers; the first good snapshot."""
        controller = self.controller
        controller.attach(front)
        controller.parts.run("remedies", apply_module_eps, front.module, self.recovery.book.module_eps)  # resumed
        if snapshot and self.action == "rollback":
            controller.after_step.initial_snapshot(front)

    # ------------------------------------------------------------------ epochs

    def epoch_start(self, front: FrontEnd) -> None:
        """Find again what the model holds (modules, buffers, metrics may have changed since the last epoch)."""
        controller = self.controller
        controller.step_params.attach(front.module)  # named again at the next check, with what optimizers update
        controller.after_step.named_params = controller.step_params.model_named
        controller.after_step.weights.find(front.module)
        controller.window.rediscover(front.module)
        controller.follow_batchnorm()
        stray = controller.step_params.stray(front.optimizers)
        if stray:
            self.recorder.notices.warn("stray-params", stray_params(stray))

    def epoch_end(self, front: FrontEnd) -> None:
        """Settle a step checked sync-free (its flags are read one step late) before the epoch's values are read."""
        self.controller.resolve_pending(front)

    def end(self, front: FrontEnd) -> None:
        """The end of training: settle the last step when it was checked sync-free."""
        self.controller.resolve_pending(front)

    # ------------------------------------------------------------------ a step

    def batch(
        self,
        front: FrontEnd,
        batch: Any,
        batch_idx: int,
        indices: Any = None,
        readers: Sequence[RecordReader] = (),
        new_step: bool = True,
        keep: bool | None = None,
    ) -> None:
        """A (micro-)batch of the step; ``new_step``: the first of an optimizer step (the window opens).

        ``indices``: its dataset indices (``None``: unknown); ``readers``: how to read a record again;
        ``keep``: keep the batch for a diagnosis (default: whenever the guard diagnoses).
        """
        controller = self.controller
        if new_step:
            self.open_step(front)
        keep = controller.diagnosis.diagnoses if keep is None else keep
        controller.window.add_batch(batch, batch_idx, indices, keep=keep, readers=tuple(readers))

    def open_step(self, front: FrontEnd) -> None:
        """An optimizer step begins (its first batch, or its first backward when the loop shows no batch)."""
        self.controller.begin_step(front, self.every_n_steps)

    def loss(self, loss: Tensor) -> None:
        """A loss about to be backpropagated: kept for the check (no host read)."""
        self.controller.window.add_loss(loss)

    def begin_update(self, optimizer: Optimizer) -> None:
        """``optimizer.step()`` begins, before its closure runs: a closure optimizer's state is copied (LBFGS)."""
        if is_closure_optimizer(optimizer):
            self.controller.actions.closure_undo.before(optimizer)

    def step(self, front: FrontEnd, optimizer: Optimizer) -> None:
        """Before ``optimizer.step()`` updates: check the step, agree with the other ranks, carry out the decision."""
        controller = self.controller
        controller.window.close()
        if controller.checking(front, self.every_n_steps):
            controller.check_step(front, optimizer)

    def after_step(self, front: FrontEnd, optimizer: Optimizer | None = None) -> None:
        """After ``optimizer.step()``: a bad closure step undone, rollback when due, weight check, snapshot, QK-clip."""
        if optimizer is not None:
            self.controller.actions.closure_undo.after(optimizer)
        self.controller.after_optimizer_step(front)

    @property
    def batch_end_due(self) -> bool:
        """Whether :meth:`batch_end` has anything to do: a held scheduler, or a check to report (rarely)."""
        controller = self.controller
        return bool(controller.state.unreported_checks) or controller.per_optimizer.holding

    def batch_end(self, front: FrontEnd) -> None:
        """The batch is over: held schedulers step again; a step ``check`` found bad and the caller skipped is reported.

        Its event says ``skipped``: its update was not made.
        """
        controller = self.controller
        controller.per_optimizer.release_schedulers()
        state = controller.state
        for event in state.unreported_checks:
            counters = state.counters
            state.counters = counters.replace(
                bad_steps_total=counters.bad_steps_total + 1, skipped_total=counters.skipped_total + 1
            )
            self.recorder.record(front, event.replace(action="skipped"))
        state.unreported_checks.clear()

    def check(self, front: FrontEnd | None, module: nn.Module, loss: Tensor | None) -> NanEvent | None:
        """``NanGuard.check``: ``module``'s gradients, BatchNorm statistics, weights and ``loss``, now."""
        controller = self.controller
        event = check_module(front, module, loss, controller.window.batch_idx)
        controller.window.losses = []  # checked: an optimizer step hooked after this sees only the losses to come
        if event is None:
            return None
        state = controller.state
        if front is None:  # outside a fit: recorded now
            state.counters = state.counters.replace(bad_steps_total=state.counters.bad_steps_total + 1)
            self.recorder.record(front, event)
            return event
        # in a fit: the optimizer.step() that follows, if the caller takes it, is dropped and reported by the
        # step's own check; a step the caller skips is reported at the batch's end (one event per bad step)
        state.dropped_by_check = True  # its logs go at the batch's end
        state.unreported_checks.append(event)
        return event

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The guard's checkpoint state (primitives)."""
        return self.controller.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.controller.load_state_dict(state)
