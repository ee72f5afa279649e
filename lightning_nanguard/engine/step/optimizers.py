"""Loops that step several optimizers (a GAN's two, an actor and a critic): what the guard keeps per optimizer.

Each ``optimizer.step()`` is its own step under the guard: checked on the gradients it applies,
dropped alone. What counts steps counts them per optimizer, so that a generator that stays healthy
while its critic keeps failing reads as the critic's streak, not as a run of bad steps:

- the streak of bad steps in a row (``max_consecutive_bad_steps``, ``rollback_after_consecutive``)
  is each optimizer's own; ``guard.consecutive_bad_steps`` shows the longest current one;
- the loss-spike statistic is each optimizer's own (a discriminator's and a generator's losses
  are different quantities); the first optimizer's is the one a checkpoint keeps;
- an LR scheduler of an optimizer whose step was dropped is not advanced by the user's
  ``scheduler.step()`` in the same batch (manual optimisation; the Trainer steps its own schedulers
  only for the steps it takes).

With one optimizer none of this does anything (the loop's counters are that optimizer's).

Example:
    >>> import torch
    >>> from lightning_nanguard.decide.policy import Counters
    >>> first, second = torch.optim.SGD([torch.zeros(1)], lr=1.0), torch.optim.SGD([torch.zeros(1)], lr=1.0)
    >>> per = PerOptimizer()
    >>> per.index([first, second], second)
    1
    >>> counters = per.settle(Counters(consecutive_bad_steps=3), 1)   # the critic: 3 bad in a row
    >>> per.counters_for(counters, 0).consecutive_bad_steps, counters.consecutive_bad_steps
    (0, 3)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_nanguard.decide.policy import Counters
from lightning_nanguard.engine.step.spikes import SpikeWatch

__all__ = ["PerOptimizer"]


class PerOptimizer:
    """Streaks, spike statistics and held schedulers, per optimizer (see module docs)."""

    def __init__(self) -> None:
        self.streaks: dict[int, int] = {}
        self.spikes: dict[int, SpikeWatch] = {}  # the optimizers after the first (the first's is the controller's)
        self._held: list[tuple[Any, Any]] = []  # (scheduler, its own `step` attribute or None)

    @staticmethod
    def index(optimizers: Sequence[Any], optimizer: Any) -> int | None:
        """The position of ``optimizer`` among the loop's ``optimizers`` (``None``: not among them)."""
        inner = getattr(optimizer, "_optimizer", optimizer)
        for i, known in enumerate(optimizers):
            if known is optimizer or getattr(known, "_optimizer", known) is inner:
                return i
        return None

    def counters_for(self, counters: Counters, index: int) -> Counters:
        """``counters`` with the streak of optimizer ``index`` (what the decision of its step escalates on)."""
        return counters.replace(consecutive_bad_steps=self.streaks.get(index, 0))

    def settle(self, counters: Counters, index: int) -> Counters:
        """Keep optimizer ``index``'s streak from ``counters``; the loop's counters show the longest streak."""
        self.streaks[index] = counters.consecutive_bad_steps
        return counters.replace(consecutive_bad_steps=max(self.streaks.values()))

    def spike_watch(self, index: int, first: SpikeWatch | None) -> SpikeWatch | None:
        """The spike watch of optimizer ``index``: ``first`` for the first, else its own, made like ``first``."""
        if index == 0 or first is None:
            return first
        watch = self.spikes.get(index)
        if watch is None or watch.settings != first.settings:
            watch = self.spikes[index] = SpikeWatch(first.settings, watch_grad_norm=first.grad_norm is not None)
        return watch

    # ------------------------------------------------------------------ schedulers of a dropped step

    def hold_schedulers(self, schedulers: Sequence[Any], optimizer: Any) -> None:
        """The step of ``optimizer`` was dropped: its schedulers' next ``step()`` (in this batch) does nothing."""
        inner = getattr(optimizer, "_optimizer", optimizer)
        for scheduler in schedulers:
            if getattr(scheduler, "optimizer", None) is not inner or any(s is scheduler for s, _ in self._held):
                continue
            own = scheduler.__dict__.get("step")
            self._held.append((scheduler, own))

            def skip_once(*args: Any, _scheduler: Any = scheduler, **kwargs: Any) -> None:
                self._release(_scheduler)  # the next call steps again

            scheduler.step = skip_once

    @property
    def holding(self) -> bool:
        """Whether a scheduler is held (its next ``step`` is skipped)."""
        return bool(self._held)

    def release_schedulers(self) -> None:
        """The batch is over: every held scheduler steps normally again."""
        for scheduler, _ in list(self._held):
            self._release(scheduler)

    def _release(self, scheduler: Any) -> None:
        for i, (held, own) in enumerate(self._held):
            if held is scheduler:
                del self._held[i]
                if own is None:
                    scheduler.__dict__.pop("step", None)
                else:
                    scheduler.step = own
                return
