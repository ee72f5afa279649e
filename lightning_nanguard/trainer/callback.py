"""``NanGuard``: the Lightning Trainer callback, the Fabric guard with the Trainer's hooks.

:class:`~lightning_nanguard.fabric.guard.FabricGuard` holds the arguments, the state and the engine
(and guards Fabric loops); this class adds what only a ``Trainer`` has: its hooks, each handed on
to one moment of :class:`~lightning_nanguard.engine.moments.GuardEngine`, the strategy wrapper,
epochs without a training step, ``self.log`` values withdrawn, and checkpoints. The pattern of
Lightning's own ``callbacks/spike.py``.

=====================================  ==============================================
Lightning hook                         engine moment
=====================================  ==============================================
``setup``                              ``configure`` (the strategy is known)
``on_fit_start``                       ``open_logs``
``on_train_start``                     ``start``
``on_train_epoch_start``/``_end``      ``epoch_start`` / ``epoch_end``
``on_train_batch_start``               ``batch``
``on_before_backward``                 ``loss``
``on_before_optimizer_step``           ``step``
after ``optimizer.step()`` (strategy)  ``after_step``
``on_train_end``                       ``end``
``state_dict``/``load_state_dict``     the engine's state
=====================================  ==============================================

Examples:
    >>> from lightning.pytorch import Trainer
    >>> trainer = Trainer(callbacks=[NanGuard()], logger=False, enable_checkpointing=False)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor
from typing_extensions import override

from lightning_nanguard.core.events import NonFiniteTrainingError
from lightning_nanguard.diagnose.combined import CombinedIndices
from lightning_nanguard.engine.data.indices import indices_from_batch
from lightning_nanguard.engine.failure import failsafe
from lightning_nanguard.engine.shard_layout import own_rank_state
from lightning_nanguard.fabric.guard import Action, FabricGuard, SpikeAction
from lightning_nanguard.trainer._compat import CALLBACK_BASES
from lightning_nanguard.trainer.checkpoint import guard_state, load_guard_state, make_checkpoint_finite
from lightning_nanguard.trainer.config import refuse_what_cannot_be_guarded
from lightning_nanguard.trainer.forward_only import ForwardOnlyEpoch, forward_only
from lightning_nanguard.trainer.frontend import TrainerFrontEnd
from lightning_nanguard.trainer.strategy import (
    StrategyHooks,
    apply_nanguard_strategy,
    remove_nanguard_strategy,
    supported_strategy_kind,
)

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer
    from torch.optim import Optimizer

__all__ = ["Action", "NanGuard", "SpikeAction"]


class NanGuard(FabricGuard, *CALLBACK_BASES):  # type: ignore[misc]
    """Stops NaN/Inf from reaching the weights and reports where it came from: the Lightning callback.

    After every backward pass (in ``on_before_optimizer_step``, where gradients are complete and
    unscaled) the loss, every gradient and every BatchNorm running statistic are checked in one
    fused pass on the device, with a single host read. On a bad step the optimizer update is made
    a true no-op, the BatchNorm buffers the bad forward touched are restored, the offending
    samples, module, op and source line are found, and an event is recorded in ``guard.events``,
    ``<log_dir>/nanguard/events.jsonl``, TensorBoard (through the Trainer's own
    ``TensorBoardLogger``) and the terminal. Under DDP every decision is made once for all ranks.
    The same object guards a Lightning Fabric loop (``L.Fabric(callbacks=[NanGuard()])``).

    The arguments (every one also a public attribute) are :class:`~lightning_nanguard.FabricGuard`'s,
    documented there and in the configuration guide.

    Examples:
        >>> guard = NanGuard(action="skip", max_consecutive_bad_steps=5)
        >>> guard.events
        []
        >>> NanGuard(action="skp")
        Traceback (most recent call last):
        ...
        ValueError: NanGuard: `action` must be one of ['skip', 'raise', 'warn', 'rollback'], got 'skp'.
    """

    _front: TrainerFrontEnd | None  # the engine's view of the fit in progress (made at the first hook)
    _hooks: StrategyHooks | None = None  # the strategy wrapper's hooks (made at setup)
    _forward_only_epoch: ForwardOnlyEpoch | None = None
    _batch_forward_only = False  # whether the batch in progress runs forward only (read at its start)

    @property
    def _forward_only(self) -> ForwardOnlyEpoch:
        """Epochs without a training step (SWA's BatchNorm epoch): made at first use."""
        if self._forward_only_epoch is None:
            self._forward_only_epoch = ForwardOnlyEpoch()
        return self._forward_only_epoch

    # ------------------------------------------------------------------ fit

    @override
    @failsafe
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Wrap the strategy (every process, before ``strategy.setup``) and refuse what cannot be guarded."""
        if stage != "fit":
            return
        refuse_what_cannot_be_guarded(trainer)
        self.engine.configure(self._arguments(), supported_strategy_kind(trainer.strategy))
        self._hooks = StrategyHooks(
            self._after_optimizer_step,
            self._strategy_active,
            self.records_indices,
            self.recovery.book.quarantined,
            self.clock,
            exclude_by_loader=self.recovery.book.quarantined_by_loader,
            before_optimizer_step=self._before_optimizer_step,
        )
        self._hooks.enforce_quarantine(self.recovery.book, self.index_key, self.batch_slicer, self.recorder.notices)
        apply_nanguard_strategy(trainer.strategy, self._hooks)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Give the Trainer its own strategy class (and the loaders their samplers) back."""
        self.controller.attention.disarm()
        remove_nanguard_strategy(trainer.strategy)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """The fit stops on an error (Lightning calls no ``teardown`` then): take the probe's hooks off the model."""
        self.controller.attention.disarm()

    @override
    @failsafe
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Resolve the log directory (a collective: every rank calls it) and the writers."""
        self.engine.open_logs(self._front_of(trainer, pl_module))

    @override
    @failsafe
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Find parameters and BatchNorm buffers once the model sits on its device; first snapshot."""
        self.engine.start(self._front_of(trainer, pl_module))

    @override
    @failsafe
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Resolve the last step when it was checked sync-free (its flags are read one step late)."""
        self.engine.end(self._front_of(trainer, pl_module))

    @override
    @failsafe
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Before the monitors read the epoch values: settle a sync-free step and what dropped steps logged."""
        front = self._front_of(trainer, pl_module)
        self.engine.epoch_end(front)
        self.controller.parts.run("logged_values", self._settle_logged, front)

    def _settle_logged(self, front: TrainerFrontEnd) -> None:
        front.logged.finish_withdrawals()
        front.logged.settle_monitors(front.trainer, last_step_dropped=self.controller.state.step_was_bad)

    @override
    @failsafe
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Find what the model holds again (modules, buffers, metrics may have changed); record this epoch's indices."""
        self.engine.epoch_start(self._front_of(trainer, pl_module))
        if self._hooks is not None:  # one loader or several (their keys, quarantines)
            self.controller.parts.run("dataset_indices", self._hooks.start_epoch, trainer.train_dataloader)

    # ------------------------------------------------------------------ per batch

    @override
    @failsafe
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """Open the step's window at its first micro-batch (manual optimisation: the first after an update)."""
        # SWA's BatchNorm epoch (set at the epoch's start): no training step, only statistics to keep finite;
        # read once per batch, for this batch's three hooks
        self._batch_forward_only = skip = forward_only(trainer)
        window = self.controller.window
        indices = self.controller.parts.run("dataset_indices", self._batch_indices, batch)
        if skip:
            self._forward_only.before_batch(window, indices)
            return
        # a new optimizer step: the first micro-batch, or a window left open by a step Lightning never took
        # (training_step returned None); in manual optimisation the first batch after an optimizer.step()
        # (a loop that steps every k batches accumulates k batches). The window closes at each check: most
        # batches stop at `not window.open`
        new_step = not window.open or (
            batch_idx % max(1, getattr(trainer, "accumulate_grad_batches", 1)) == 0 and pl_module.automatic_optimization
        )
        readers = self._hooks.readers() if self._hooks is not None else ()  # to check the indices at an incident
        front = self._front_of(trainer, pl_module)
        keep = None if front.cannot_rerun() is None else False  # manual optimisation without a loss to re-run
        self.engine.batch(front, batch, batch_idx, indices, readers, new_step, keep=keep)

    def _batch_indices(self, batch: Any) -> list[int] | CombinedIndices | None:
        if self._hooks is not None:  # per loader with several training loaders
            return self._hooks.batch_indices(batch, self.index_key)
        return indices_from_batch(batch, self.index_key) if self.index_key is not None else None

    @override
    @failsafe
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Manual optimisation: held schedulers step again; a batch ``guard.check`` found bad leaves no logs."""
        if self._batch_forward_only:
            event = self._forward_only.after_batch(trainer, self.controller.window, batch_idx)
            if event is not None:
                self.controller.recorder.record(self._front_of(trainer, pl_module), event)
            return
        if self.engine.batch_end_due:  # most batches: nothing held, nothing to report
            self.engine.batch_end(self._front_of(trainer, pl_module))
        state = self.controller.state
        if state.dropped_by_check:
            state.dropped_by_check = False
            front = self._front_of(trainer, pl_module)
            self.controller.parts.run("logged_values", self.controller.window.drop_logged, front)

    @override
    @failsafe
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Tensor) -> None:
        """Keep the loss of each (micro-)batch for the check; no host read here."""
        self.engine.loss(loss)

    @override
    @failsafe
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        """Check loss, gradients and BatchNorm statistics; make the one decision of the step on every rank."""
        if self._batch_forward_only:  # no backward ran: there is no step to check (each batch was, after its forward)
            self.controller.window.close()
            return
        front = self._front_of(trainer, pl_module)
        front.optimizer_in_step = optimizer  # a manual loop's loss_fn/nanguard_loss receives it
        self.engine.step(front, optimizer)

    @failsafe
    def _before_optimizer_step(self, optimizer: Optimizer) -> None:
        """Called by the strategy wrapper as a closure optimizer's step begins (LBFGS), before its closure runs."""
        self.engine.begin_update(optimizer)

    @failsafe
    def _after_optimizer_step(self, optimizer: Optimizer) -> None:
        """Called by the strategy wrapper on every rank after the update: rollback, weight check, snapshot."""
        if self._front is not None:
            self._front.new_moment()
            self.engine.after_step(self._front, optimizer)

    @property
    def _trainer(self) -> Trainer | None:
        """The Trainer of the fit in progress (``None`` outside a fit, and in a pickled guard)."""
        return self._front.trainer if self._front is not None else None

    def _front_of(self, trainer: Trainer, pl_module: LightningModule) -> TrainerFrontEnd:
        """The engine's view of this fit (made once per fit: a Trainer or module change makes a new one)."""
        front = self._front
        if front is None or front.trainer is not trainer or front.module is not pl_module:
            front = self._front = TrainerFrontEnd(trainer, pl_module, self.loss_fn)
        front.new_moment()
        return front

    def _strategy_active(self) -> bool:
        state = self.controller.state  # `self.active`, without the property's call (twice a step)
        return not state.disabled or state.failing

    # ------------------------------------------------------------------ checkpoint

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """Never save non-finite weights: save the last good snapshot instead, or refuse.

        A check that fails (an optional part) leaves the checkpoint as Lightning made it, with a
        ``guard_error`` event: while the guard is on, no NaN/Inf reached the weights.
        """
        controller = self.controller
        try:
            substituted = controller.parts.run(
                "checkpoint_check", make_checkpoint_finite, controller, trainer, pl_module, checkpoint, self.state_key
            )
        except NonFiniteTrainingError as error:
            raise NonFiniteTrainingError(str(error), self.events[-1:]) from None
        if self._front is not None:
            self._front.new_moment()
            self.controller.report_failures(self._front)
        if substituted is not None:
            key = f"checkpoint-{checkpoint.get('nanguard_substituted_step')}"
            self.recorder.notices.warn(key, f"NanGuard: {substituted}.")

    @override
    def state_dict(self) -> dict[str, Any]:
        """Counters, remedy state and the last 100 events, as primitives (``weights_only``-safe)."""
        return guard_state(self.controller)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore counters, remedies and events; keys added in later versions default sensibly."""
        load_guard_state(self.controller, own_rank_state(state_dict))
