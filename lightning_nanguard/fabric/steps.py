"""The moments of a step in a Fabric loop, carried to the step engine.

Fabric calls no hook before the update, and ``fabric.backward`` and ``fabric.clip_gradients`` call
none at all; the guard's strategy wrapper (:mod:`.strategy`) sees all three moments instead and
hands them here:

- a batch leaves a loader that ``fabric.setup_dataloaders`` set up (its dataset indices recorded)
  while autograd is on (a validation loop under ``torch.no_grad()`` is not training): kept until
  the backward that uses it;
- ``fabric.backward(loss)``: the first backward after an update opens the step's window (the
  pending batches go into it), every backward adds its loss;
- ``fabric.clip_gradients(...)`` or ``optimizer.step()``, whichever comes first: the step is
  checked once per optimizer, and a bad one dropped (its gradients set to ``None``); clipping a
  dropped step does nothing (no ``RuntimeError`` for a non-finite norm); ``optimizer.step(closure)``
  (LBFGS): every evaluation of the closure is checked, and a bad step is undone at its end;
- after ``optimizer.step()`` (Fabric's ``on_after_optimizer_step``): the after-step work (rollback,
  weight check, snapshot), and the step count moves on.

Every moment runs under the failsafe: an error that escapes the guard's parts reaches its core's failure
path (the step in hand dropped, then the guard off), never the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_nanguard.core.events import GuardInternalError, NonFiniteTrainingError
from lightning_nanguard.core.swapped import swapped_subclass
from lightning_nanguard.engine.data.indices import RecordingBatchSampler, next_recorded_indices, record_batch_indices
from lightning_nanguard.engine.data.readers import RecordReader
from lightning_nanguard.engine.moments import GuardEngine
from lightning_nanguard.engine.step.closure_undo import is_closure_optimizer
from lightning_nanguard.fabric.frontend import FabricFrontEnd

__all__ = ["FabricSteps"]

log = logging.getLogger("lightning_nanguard")


class FabricSteps:
    """One Fabric loop's steps under the guard (see module docs).

    Args:
        engine: the guard's step engine.
        front: the loop's front-end.
        keep_batches: keep each step's batches for a diagnosis (needs a ``loss_fn``).
    """

    def __init__(self, engine: GuardEngine, front: FabricFrontEnd, keep_batches: bool):
        self.engine = engine
        self.controller = engine.controller
        self.front = front
        self.keep_batches = keep_batches
        self._pending: list[tuple[Any, list[int] | None, tuple[RecordReader, ...]]] = []
        self._checked: dict[int, bool] = {}  # id(optimizer) -> dropped, for this step
        self._batches_seen = 0

    # ------------------------------------------------------------------ loaders

    def watch_loader(self, loader: Any) -> Any:
        """Make a training loader record its dataset indices and hand each batch here as it leaves."""
        sampler = record_batch_indices(loader) if self.keep_batches else None
        reader = RecordReader.of(loader) if sampler is not None else None

        def note(batch: Any) -> None:
            indices = next_recorded_indices([sampler]) if sampler is not None else None
            if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():  # not a validation loop's
                self._pending.append((batch, indices, (reader,) if reader is not None else ()))

        _note_batches(loader, note if self.keep_batches else None, sampler)
        return loader

    # ------------------------------------------------------------------ the moments of a step

    def before_backward(self, loss: Tensor) -> None:
        """Open the step's window at its first backward (with the batches that came since); keep the loss."""
        new_step = not self.controller.window.open
        if new_step:
            self._checked = {}
        if new_step and not self._pending:
            self.engine.open_step(self.front)  # no batch came from a loader the guard watches
        for batch, indices, readers in self._pending:
            self.engine.batch(self.front, batch, self._batches_seen, indices, readers, new_step, keep=self.keep_batches)
            self._batches_seen, new_step = self._batches_seen + 1, False
        self._pending = []
        self.engine.loss(loss)

    def before_update(self, optimizer: Any) -> bool:
        """Check the step for ``optimizer`` (once per step); ``True`` when its update was dropped."""
        key = id(optimizer)
        if key in self._checked and not is_closure_optimizer(optimizer):  # LBFGS: every closure evaluation
            return self._checked[key]
        first = not self.front.optimizers
        controller = self.controller
        if self.front.saw_optimizer(optimizer):
            controller.optimizer_added(self.front, optimizer)
        if first and self.engine.action == "rollback":  # the first snapshot, once the optimizer is known
            controller.after_step.initial_snapshot(self.front)
        self.front.optimizer_in_step = optimizer  # loss_fn(model, batch, optimizer) receives it
        self.engine.step(self.front, optimizer)
        dropped = all(p.grad is None for group in optimizer.param_groups for p in group["params"])
        self._checked[key] = dropped
        return dropped

    def add_model(self, module: Any) -> None:
        """Guard another model set up in this loop too (checked, snapshotted and rolled back with the first)."""
        before = self.front.module
        self.front.add_model(module)
        if self.front.module is not before:
            self.controller.attach(self.front)

    def after_update(self, optimizer: Any) -> None:
        """The after-step work, then the next step's number."""
        self.engine.after_step(self.front, optimizer)
        self.front.global_step += 1
        self._checked = {}
        self.controller.attention.arm(
            self.front.global_step
        )  # before the next step's forward (Fabric has no hook there)


def _note_batches(loader: Any, note: Callable[[Any], None] | None, sampler: RecordingBatchSampler | None) -> None:
    """Swap ``loader``'s class for a subclass whose iterator hands every batch to ``note`` (once per class)."""
    if note is None:
        return
    cls = type(loader)
    noting = _NOTING_CLASSES.get(cls)
    if noting is None:

        def __iter__(self: Any) -> Any:
            for batch in cls.__iter__(self):
                hand = self.__dict__.get("_nanguard_note")
                if hand is not None:
                    hand(batch)
                yield batch

        noting = swapped_subclass(cls, f"NanGuard{cls.__name__}", {"__iter__": __iter__}, module=__name__)
        _NOTING_CLASSES[cls] = noting
    object.__setattr__(loader, "_nanguard_note", note)  # DataLoader refuses some attributes after init
    loader.__class__ = noting


_NOTING_CLASSES: dict[type, type] = {}


def guarded(steps: FabricSteps | None, moment: Callable[..., Any], *args: Any) -> Any:
    """Run a moment of ``steps`` under the failsafe: the guard's own error disables it, never the loop."""
    if steps is None:
        return None
    state = steps.controller.state
    if state.disabled and not state.failing:
        return None
    try:
        return moment(*args)
    except (NonFiniteTrainingError, GuardInternalError):
        raise
    except Exception as error:
        steps.controller.fail(error, getattr(moment, "__name__", "a Fabric step"))
        return None


def zero_norm(device: torch.device) -> Tensor:
    """What ``clip_gradients(max_norm=...)`` returns for a dropped step: no gradients, norm 0."""
    return torch.zeros((), device=device)
