"""A front-end for tests of the step engine without a Trainer: one process, a module and its optimizers.

:class:`PlainFront` implements :class:`lightning_nanguard.engine.frontend.FrontEnd` the plainest
way (what a hand-written loop would): the module's ``training_step`` (or its forward, summed) is
the step, no precision context, no loggers unless given, nothing logged or clipped by a loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn


class PlainFront:
    """A :class:`~lightning_nanguard.engine.frontend.FrontEnd` of a plain loop (attributes settable by tests)."""

    def __init__(
        self,
        module: nn.Module,
        optimizers: Sequence[Any] = (),
        *,
        global_step: int = 0,
        current_epoch: int = 0,
        global_rank: int = 0,
        world_size: int = 1,
        strategy: Any = None,
        grad_scaler: Any = None,
        loggers: Sequence[Any] = (),
        log_dir: str = ".",
        logging_due: bool = False,
        automatic_optimization: bool = True,
    ) -> None:
        self.module = module
        self.optimizers = list(optimizers)
        self.global_step = global_step
        self.current_epoch = current_epoch
        self.global_rank = global_rank
        self.world_size = world_size
        self.strategy = strategy
        self.grad_scaler = grad_scaler
        self.lr_schedulers: list[Any] = []
        self.loggers = list(loggers)
        self.progress_bar = None
        self.automatic_optimization = automatic_optimization
        self._log_dir = log_dir
        self._logging_due = logging_due
        self.dropped_logged = 0  # how often the engine asked to undo what a step logged
        self.clipping_suspended = False

    @property
    def device(self) -> torch.device:
        """The first parameter's device (CPU without parameters)."""
        first = next(self.module.parameters(), None)
        return first.device if first is not None else torch.device("cpu")

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    def step_fn(self) -> Callable[[Any, int], Any]:
        step = getattr(self.module, "training_step", None)
        return step if step is not None else (lambda batch, batch_idx: self.module(batch).sum())

    def step_context(self) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def cannot_rerun(self) -> str | None:
        return None

    def as_training_batch(self, record: Any, layout: Any = None, part: int = 0, batch: Any = None) -> Any:
        combined = record if layout is None else layout.with_parts(batch, {part: record})
        return combined if layout is None else layout.part(combined, part)

    def keep_logged(self) -> str | None:
        return None

    def drop_logged(self) -> None:
        self.dropped_logged += 1

    def suspend_clipping(self) -> None:
        self.clipping_suspended = True

    def resume_clipping(self) -> None:
        self.clipping_suspended = False

    def log_dir(self) -> str:
        return self._log_dir

    def tensorboard_writers(self) -> list[Any]:
        return []

    def logging_due(self) -> bool:
        return self._logging_due

    def show_in_progress_bar(self, key: str, value: int) -> None:
        pass
