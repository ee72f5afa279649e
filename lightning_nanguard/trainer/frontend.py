"""The Trainer as the step engine's front-end: what the engine needs, read off a ``Trainer`` and its module.

:class:`TrainerFrontEnd` implements :class:`~lightning_nanguard.engine.frontend.FrontEnd` for one
fit: the callback makes one at ``setup`` and hands it to the engine at every hook. Everything here
is Lightning's: the precision plugin (GradScaler, autocast, input conversion), the strategy
(collectives, device transfer), the loggers and the logger connector (what is due, the progress
bar), the fit loop's ``self.log`` aggregates and ``gradient_clip_val``.

Example:
    >>> from lightning.pytorch import Trainer
    >>> from lightning.pytorch.demos.boring_classes import BoringModel
    >>> trainer = Trainer(logger=False, enable_checkpointing=False)
    >>> front = TrainerFrontEnd(trainer, BoringModel())
    >>> front.grad_scaler is None, front.world_size, front.automatic_optimization  # 32-bit, one process
    (True, 1, True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from lightning_nanguard.engine.frontend import LossFn, call_loss_fn
from lightning_nanguard.engine.recording import Count
from lightning_nanguard.trainer._compat import tensorboard_logger_types
from lightning_nanguard.trainer.logged_values import LoggedValues

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

    from lightning_nanguard.diagnose.combined import CombinedLayout

__all__ = ["MANUAL_LOSS_HOOK", "MANUAL_RERUN", "TrainerFrontEnd", "training_step_of"]

MANUAL_LOSS_HOOK = "nanguard_loss"  # LightningModule.nanguard_loss(batch, optimizer) -> the loss of that step
MANUAL_RERUN = (
    "under manual optimisation naming the offending samples needs the loss the step's gradients came from: "
    "pass NanGuard(loss_fn=...), with loss_fn(module, batch) or loss_fn(module, batch, optimizer) -> loss, or "
    "define nanguard_loss(self, batch, optimizer) -> loss in the LightningModule"
)


def training_step_of(pl_module: LightningModule) -> Callable[[Any, int], Any]:
    """The module's own ``training_step`` (the original one under ``torch.compile``)."""
    compiler_ctx = getattr(pl_module, "_compiler_ctx", None)
    if compiler_ctx and compiler_ctx.get("original_training_step") is not None:
        original = compiler_ctx["original_training_step"]
        return lambda batch, batch_idx: original(batch, batch_idx)
    return pl_module.training_step


class TrainerFrontEnd:
    """The engine's view of one fit (see module docs); ``trainer`` and ``pl_module`` as the hooks get them.

    ``loss_fn``: ``NanGuard(loss_fn=...)``, to re-run a step of manual optimisation (see :meth:`step_fn`).
    """

    def __init__(self, trainer: Trainer, pl_module: LightningModule, loss_fn: LossFn | None = None) -> None:
        self.trainer = trainer
        self.module = pl_module
        self.loss_fn = loss_fn
        self.optimizer_in_step: Any = None  # the optimizer whose step is being checked
        self.logged = LoggedValues()  # the epoch aggregates of `self.log`, kept for a possible drop
        self._clip_val: float | None = None  # the Trainer's gradient_clip_val, off during a dropped step
        self._strategy: Any = None  # the Trainer's strategy, read once
        self._announced = False  # a hook announced itself (new_moment): facts are read once per hook
        self._step: int | None = None  # the global step read in the hook in progress
        self._step_trackers: dict[bool, Any] = {}  # the loop's optimizer-step counter, by kind of optimisation
        self._plain_automatic = _plain_automatic_optimization(pl_module)
        self._logging: bool | None = None  # whether logging is due, read in the hook in progress

    def new_moment(self) -> None:
        """A hook of the guard begins: the step count and whether logging is due are read once until the next.

        Lightning reaches both through chains of properties (trainer, fit loop, epoch loop,
        progress; logger connector, active loop, stage), and neither changes inside one of the
        guard's hooks; the engine asks for them several times a step. A front-end no hook has
        announced (one made by hand) reads them afresh each time.
        """
        self._announced = True
        self._step = self._logging = None

    # ------------------------------------------------------------------ where the run is

    @property
    def global_step(self) -> int:
        step = self._step
        if step is None:  # not read yet in this hook (always, on a front-end no hook announced)
            step = self._trainer_step()
            if self._announced:
                self._step = step
        return step

    def _trainer_step(self) -> int:
        """``trainer.global_step``, read from the epoch loop's progress counter without its chain of properties.

        What ``_TrainingEpochLoop.global_step`` returns (the optimizer steps completed, automatic or
        manual): the counter's tracker is found once per kind of optimisation (the loops make their
        progress objects once and reset or reload them in place), then one attribute is read, three
        times a step; the property itself where the loop is laid out otherwise.
        """
        try:
            module = self.module  # the automatic_optimization property's answer, without its call (3 times a step)
            automatic = module._automatic_optimization if self._plain_automatic else module.automatic_optimization
            tracker = self._step_trackers.get(automatic) or self._step_tracker(automatic)
            steps = tracker.completed
        except AttributeError:
            return int(self.trainer.global_step)
        return steps if type(steps) is int else int(self.trainer.global_step)

    def _step_tracker(self, automatic: bool) -> Any:
        loop = self.trainer.fit_loop.epoch_loop
        if automatic:
            tracker = loop.automatic_optimization.optim_progress.optimizer.step.total
        else:
            tracker = loop.manual_optimization.optim_step_progress.total
        self._step_trackers[automatic] = tracker
        return tracker

    @property
    def current_epoch(self) -> int:
        return self.trainer.current_epoch

    @property
    def global_rank(self) -> int:
        return self.trainer.global_rank

    @property
    def world_size(self) -> int:
        return self.trainer.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.trainer.is_global_zero

    # ------------------------------------------------------------------ the model and its step

    @property
    def device(self) -> torch.device:
        return self.module.device  # the LightningModule's, kept up to date by its `.to()`

    @property
    def automatic_optimization(self) -> bool:
        if self._plain_automatic:  # what the LightningModule's property returns, without its call
            return self.module._automatic_optimization
        return self.module.automatic_optimization

    @property
    def optimizers(self) -> Sequence[Any]:
        return self.strategy.optimizers  # what `trainer.optimizers` returns, two properties fewer (every step)

    @property
    def strategy(self) -> Any:
        strategy = self._strategy
        if strategy is None:  # the Trainer's, made at its init: kept (its property goes through its connector)
            strategy = self._strategy = self.trainer.strategy
        return strategy

    @property
    def grad_scaler(self) -> Any:
        return getattr(self.strategy.precision_plugin, "scaler", None)  # `trainer.precision_plugin`'s

    @property
    def lr_schedulers(self) -> list[Any]:
        return [config.scheduler for config in getattr(self.trainer, "lr_scheduler_configs", [])]

    # ------------------------------------------------------------------ re-running a step

    def step_fn(self) -> Callable[[Any, int], Any]:
        """``training_step``; under manual optimisation the loss of the optimizer being stepped.

        ``training_step`` of manual optimisation steps the optimizers itself: it cannot be re-run.
        The loss whose gradients this optimizer applies comes from ``NanGuard(loss_fn=...)``
        (``loss_fn(module, batch)`` or ``loss_fn(module, batch, optimizer)``), else from the module's
        ``nanguard_loss(batch, optimizer)``.
        """
        if self.automatic_optimization:
            return training_step_of(self.module)
        optimizer, module, loss_fn = self.optimizer_in_step, self.module, self.loss_fn
        if loss_fn is not None:
            return lambda batch, batch_idx: call_loss_fn(loss_fn, module, batch, optimizer)
        hook = getattr(module, MANUAL_LOSS_HOOK, None)
        if hook is None:
            raise RuntimeError(MANUAL_RERUN)
        return lambda batch, batch_idx: hook(batch, optimizer)

    def step_context(self) -> AbstractContextManager[Any]:
        return self.trainer.precision_plugin.train_step_context()

    def cannot_rerun(self) -> str | None:
        """Manual optimisation without ``loss_fn`` or ``nanguard_loss``: why no sample is named."""
        if self.automatic_optimization or self.loss_fn is not None:
            return None
        return None if callable(getattr(self.module, MANUAL_LOSS_HOOK, None)) else MANUAL_RERUN

    def as_training_batch(
        self, record: Any, layout: CombinedLayout | None = None, part: int = 0, batch: Any = None
    ) -> Any:
        """``record`` as the fit loop transforms a collated batch (``loops/training_epoch_loop.py``).

        The precision plugin's ``convert_input``, the ``on_before_batch_transfer`` hook, and the
        strategy's ``batch_to_device``, which calls the ``transfer_batch_to_device`` and
        ``on_after_batch_transfer`` hooks (of the LightningModule, or of the datamodule when it
        defines them), always with ``dataloader_idx=0`` as the fit loop does. With several training
        loaders (``layout``) those hooks receive the combined batch: the record replaces loader
        ``part``'s part of a copy of ``batch`` (the other parts as they are), and that part is
        returned. Raises whatever a hook raises (the caller leaves the row unverified, with the reason).
        """
        trainer = self.trainer
        combined = record if layout is None else layout.with_parts(batch, {part: record})
        combined = trainer.precision_plugin.convert_input(combined)
        combined = trainer.lightning_module._on_before_batch_transfer(combined, dataloader_idx=0)
        combined = trainer.strategy.batch_to_device(combined, dataloader_idx=0)
        return combined if layout is None else layout.part(combined, part)

    # ------------------------------------------------------------------ around the step

    def keep_logged(self) -> str | None:
        self.logged.capture(self.trainer)
        return self.logged.unsupported

    def drop_logged(self) -> None:
        self.logged.restore(self.trainer)
        self.logged.remember_monitors(self.trainer)

    def suspend_clipping(self) -> None:
        if getattr(self.trainer, "gradient_clip_val", None) is not None:
            self._clip_val, self.trainer.gradient_clip_val = self.trainer.gradient_clip_val, None

    def resume_clipping(self) -> None:
        if self._clip_val is not None:
            self.trainer.gradient_clip_val, self._clip_val = self._clip_val, None

    # ------------------------------------------------------------------ where to log

    def log_dir(self) -> str:
        """The first TensorBoardLogger's ``log_dir``, else ``trainer.log_dir``, else ``default_root_dir``.

        Rank zero's answer, broadcast (one collective on every rank, as ``trainer.log_dir`` does), so
        that every rank writes to the same directory.
        """
        trainer, boards = self.trainer, tensorboard_logger_types()
        board = next((lg for lg in trainer.loggers if isinstance(lg, boards)), None)
        if board is None:
            return str(trainer.log_dir or trainer.default_root_dir)
        return str(trainer.strategy.broadcast(board.log_dir))

    @property
    def loggers(self) -> Sequence[Any]:
        return self.trainer.loggers

    def tensorboard_writers(self) -> Sequence[Any]:
        boards = tensorboard_logger_types()
        return [lg.experiment for lg in self.trainer.loggers if isinstance(lg, boards)]

    def logging_due(self) -> bool:
        """Whether the Trainer logs metrics at this step (``log_every_n_steps``)."""
        due = self._logging
        if due is None:  # not read yet in this hook (always, on a front-end no hook announced)
            due = self._logging_due()
            if self._announced:
                self._logging = due
        return due

    def _logging_due(self) -> bool:
        trainer: Any = self.trainer  # `log_every_n_steps` is set on it at init; `state.stage` may be None
        try:
            loggers = trainer._loggers  # what its `loggers` property returns, without the call (every step)
        except AttributeError:
            loggers = trainer.loggers
        if not loggers:
            return False
        # LoggerConnector.should_update_logs while fitting, read without its chain of properties (~4 us a step),
        # and the stage's plain `_value_` attribute rather than the enum's `value` property (two Python calls)
        try:
            fitting = trainer.state.stage._value_ == "train"
            every, stepped = trainer.log_every_n_steps, trainer.fit_loop.epoch_loop._batches_that_stepped
        except AttributeError:
            fitting, every, stepped = False, None, None
        if fitting and type(every) is int and every > 0 and type(stepped) is int:
            return (stepped + 1) % every == 0 or bool(trainer.should_stop)  # +1: asked before the step is taken
        connector = getattr(trainer, "_logger_connector", None)
        return bool(connector.should_update_logs) if connector is not None else True

    @property
    def progress_bar(self) -> Any:
        return getattr(self.trainer, "progress_bar_callback", None)

    def show_in_progress_bar(self, key: str, value: int) -> None:
        """Lightning keeps the bar's values in its logger connector: a value put there is shown as is."""
        connector = getattr(self.trainer, "_logger_connector", None)
        metrics = getattr(connector, "_progress_bar_metrics", None)
        if isinstance(metrics, dict):
            metrics[key] = Count(value)


def _plain_automatic_optimization(module: Any) -> bool:
    """Whether ``module.automatic_optimization`` is Lightning's own property, which returns ``_automatic_optimization``.

    A module may override the property (``return False``): its attribute then says nothing.
    """
    for cls in type(module).__mro__:
        if "automatic_optimization" in vars(cls):
            owner = cls.__module__.rsplit(".", 2)[-2:]
            return (
                cls.__name__ == "LightningModule"
                and owner == ["core", "module"]
                and hasattr(module, "_automatic_optimization")
            )
    return False
