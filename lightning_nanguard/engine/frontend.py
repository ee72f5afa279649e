"""What a front-end gives the step engine: the one interface between a training loop and the guard.

The engine (:mod:`lightning_nanguard.engine`) guards one optimizer step at a time: it checks the
step, agrees with the other ranks, skips or rolls back, diagnoses a bad step and records it. It
knows no training loop. A *front-end* is what connects it to one: today the Trainer callback
(:class:`~lightning_nanguard.trainer.frontend.TrainerFrontEnd`); a Fabric loop is the next. A
front-end hands the engine, at each call, an object with the members below, grouped by what they
are for:

=====================  ==========================================================================
where the run is       ``global_step``, ``current_epoch``, ``global_rank``, ``world_size``,
                       ``is_global_zero``
the model and its step ``module`` (the model), ``device`` (where it computes),
                       ``automatic_optimization`` (the guard may skip the
                       update), ``optimizers``, ``strategy`` (a Lightning strategy, the Trainer's
                       or Fabric's: collectives, device, mesh), ``grad_scaler``, ``lr_schedulers``
re-running a step      ``step_fn()``, ``step_context()``, ``as_training_batch(...)``,
                       ``cannot_rerun()``
around the step        ``keep_logged()``, ``drop_logged()``, ``suspend_clipping()``,
                       ``resume_clipping()`` (no-ops where the loop has no such thing)
where to log           ``log_dir()``, ``loggers``, ``tensorboard_writers()``, ``logging_due()``,
                       ``progress_bar``, ``show_in_progress_bar(...)``
=====================  ==========================================================================

The micro-batches of a step are not part of it: the front-end hands them to the
:class:`~lightning_nanguard.engine.step.window.StepWindow` as they come
(``window.add_batch``, ``window.add_loss``), and calls the
:class:`~lightning_nanguard.engine.controller.StepController` at the moments of a step
(``begin_step``, ``check_step``, ``after_optimizer_step``).

Example:
    A minimal front-end for a hand-written loop on one process (what a test or a new loop starts
    from), checked against the protocol by a type checker:

    >>> import contextlib, torch
    >>> from torch import nn
    >>> class PlainLoop:
    ...     global_step, current_epoch, global_rank, world_size, is_global_zero = 0, 0, 0, 1, True
    ...     automatic_optimization, strategy, grad_scaler, loggers, progress_bar = True, None, None, [], None
    ...     device = torch.device("cpu")
    ...     def __init__(self, module, optimizer):
    ...         self.module, self.optimizers, self.lr_schedulers = module, [optimizer], []
    ...     def step_fn(self): return lambda batch, batch_idx: self.module(batch).sum()
    ...     def step_context(self): return contextlib.nullcontext()
    ...     def cannot_rerun(self): return None
    ...     def as_training_batch(self, record, layout=None, part=0, batch=None): return record
    ...     def keep_logged(self): return None
    ...     def drop_logged(self): pass
    ...     def suspend_clipping(self): pass
    ...     def resume_clipping(self): pass
    ...     def log_dir(self): return "."
    ...     def tensorboard_writers(self): return []
    ...     def logging_due(self): return False
    ...     def show_in_progress_bar(self, key, value): pass
    >>> net = nn.Linear(2, 1)
    >>> front: FrontEnd = PlainLoop(net, torch.optim.SGD(net.parameters(), lr=0.1))
    >>> front.step_fn()(torch.ones(3, 2), 0).shape
    torch.Size([])
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from lightning_nanguard.recover.recovery import TrainingParts

if TYPE_CHECKING:
    from lightning_nanguard.diagnose.combined import CombinedLayout

__all__ = ["FrontEnd", "LossFn", "StepView", "call_loss_fn", "training_parts"]

LossFn = Callable[
    ..., Any
]  # loss_fn(model, batch) or loss_fn(model, batch, optimizer) -> a loss, or a dict with "loss"


class FrontEnd(Protocol):
    """The members a front-end provides (see the module docs for what each group is for)."""

    # ------------------------------------------------------------------ where the run is

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far (the step being checked has this number)."""

    @property
    def current_epoch(self) -> int:
        """The epoch in progress."""

    @property
    def global_rank(self) -> int:
        """This process's rank."""

    @property
    def world_size(self) -> int:
        """The number of processes."""

    @property
    def is_global_zero(self) -> bool:
        """Whether this is rank zero (it writes the scalars)."""

    # ------------------------------------------------------------------ the model and its step

    @property
    def module(self) -> nn.Module:
        """The model being trained (the one whose parameters, buffers and metrics are checked)."""

    @property
    def device(self) -> torch.device:
        """Where the model computes now: the step's flags are made there."""

    @property
    def automatic_optimization(self) -> bool:
        """Whether the loop steps the optimizer itself after the check (so the guard may drop the update)."""

    @property
    def optimizers(self) -> Sequence[Any]:
        """The optimizers of the run."""

    @property
    def strategy(self) -> Any:
        """The Lightning strategy (the Trainer's or Fabric's): collectives, root device, device mesh."""

    @property
    def grad_scaler(self) -> Any:
        """The ``torch.amp.GradScaler`` of ``16-mixed``, else ``None``."""

    @property
    def lr_schedulers(self) -> list[Any]:
        """The LR schedulers (a rollback restores them, ``lr_backoff`` scales their base rates)."""

    # ------------------------------------------------------------------ re-running a step

    def step_fn(self) -> Callable[[Any, int], Any]:
        """``step(batch, batch_idx)`` running the training step's forward: a loss, or a dict with ``"loss"``."""

    def step_context(self) -> AbstractContextManager[Any]:
        """The context a training step runs in (autocast of the precision setting)."""

    def cannot_rerun(self) -> str | None:
        """Why this loop's steps cannot be re-run (no samples are named, the event says why), else ``None``."""

    def as_training_batch(
        self, record: Any, layout: CombinedLayout | None = None, part: int = 0, batch: Any = None
    ) -> Any:
        """A collated record as the loop would hand it to the step (device, precision, batch hooks)."""

    # ------------------------------------------------------------------ around the step

    def keep_logged(self) -> str | None:
        """Capture what the step's logging will add (undone if it is dropped); why it cannot, else ``None``."""

    def drop_logged(self) -> None:
        """Undo what a dropped step logged."""

    def suspend_clipping(self) -> None:
        """Turn the loop's own gradient clipping off for a dropped step (it has no gradients to clip)."""

    def resume_clipping(self) -> None:
        """Give the loop its gradient clipping back."""

    # ------------------------------------------------------------------ where to log

    def log_dir(self) -> str:
        """The run's log directory, the same on every rank (a collective: every rank calls it)."""

    @property
    def loggers(self) -> Sequence[Any]:
        """Loggers with ``log_metrics(metrics, step)``: the ``nanguard/`` scalars go through them."""

    def tensorboard_writers(self) -> Sequence[Any]:
        """The ``SummaryWriter`` of each TensorBoard logger (event text and the dashboard's layout go there)."""

    def logging_due(self) -> bool:
        """Whether the loop logs metrics at this step (the guard logs its scalars then too)."""

    @property
    def progress_bar(self) -> Any:
        """The live progress bar (a terminal panel prints through it), else ``None``."""

    def show_in_progress_bar(self, key: str, value: int) -> None:
        """Show a count in the progress bar, when the loop has one."""


class StepView:
    """A front-end seen at an earlier step: a step checked sync-free is decided one step late.

    Example:
        >>> class Loop:
        ...     global_step, current_epoch, global_rank = 8, 1, 0
        >>> view = StepView(Loop(), global_step=7, current_epoch=1)
        >>> view.global_step, view.global_rank
        (7, 0)
    """

    def __init__(self, front: Any, global_step: int, current_epoch: int) -> None:
        self._front = front
        self.global_step = global_step
        self.current_epoch = current_epoch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._front, name)


def training_parts(front: FrontEnd) -> TrainingParts:
    """The module, optimizers, LR schedulers, GradScaler and global step a recovery acts on."""
    return TrainingParts(
        module=front.module,
        optimizers=list(front.optimizers),
        schedulers=front.lr_schedulers,
        scaler=front.grad_scaler,
        global_step=front.global_step,
    )


def call_loss_fn(loss_fn: LossFn, model: Any, batch: Any, optimizer: Any) -> Any:
    """``loss_fn(model, batch)``, or ``loss_fn(model, batch, optimizer)`` when it takes a third argument.

    The optimizer is the one whose step is being checked (a GAN's discriminator's or generator's),
    as the loop holds it (a Trainer's ``LightningOptimizer`` unwrapped: ``trainer.optimizers[i]``).

    Example:
        >>> call_loss_fn(lambda model, batch: batch * 2, None, 3, "opt")
        6
        >>> call_loss_fn(lambda model, batch, optimizer: optimizer, None, 3, "opt")
        'opt'
    """
    if _takes_optimizer(loss_fn):
        return loss_fn(model, batch, optimizer)
    return loss_fn(model, batch)


def _takes_optimizer(fn: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or a C extension: the two-argument form
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in parameters)
