"""The guard's hold on a Fabric strategy: a class swap that sees backward, clipping and the optimizer step.

``fabric.backward``, ``fabric.clip_gradients`` and ``optimizer.step()`` all go through the live
strategy object (``fabric.strategy``): ``backward``, ``clip_gradients_norm``/``clip_gradients_value``
and ``optimizer_step``; ``fabric.setup_dataloaders`` goes through ``process_dataloader`` (each loader
then drops or cuts quarantined records, :mod:`.quarantine`, and is watched). Fabric
checks ``isinstance(strategy, ...)`` in places, so the instance's class is swapped for a generated
subclass ``NanGuard<Original>`` with :class:`NanGuardFabricMixin` in front (as the Trainer's
wrapper does), holding a :class:`~lightning_nanguard.fabric.steps.FabricSteps`.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning_nanguard.fabric.quarantine import quarantine_in_fabric
from lightning_nanguard.fabric.steps import FabricSteps, guarded, zero_norm

__all__ = ["NanGuardFabricMixin", "hold_fabric_strategy"]


class NanGuardFabricMixin(abc.ABC):  # ABC: the metaclass and instance layout of Fabric's strategies
    """What the guard adds to a Fabric strategy (see module docs); every moment passes through when off."""

    _nanguard_steps: FabricSteps | None

    def backward(self, tensor: Any, module: Any, *args: Any, **kwargs: Any) -> Any:
        guarded(self.__dict__.get("_nanguard_steps"), _before_backward, self, tensor)
        return super().backward(tensor, module, *args, **kwargs)  # type: ignore[misc]

    def clip_gradients_norm(self, module: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if guarded(self.__dict__.get("_nanguard_steps"), _before_update, self, optimizer):
            return zero_norm(self.root_device)  # type: ignore[attr-defined]  # dropped: nothing to clip
        with _unscaled_once(self, optimizer):
            return super().clip_gradients_norm(module, optimizer, *args, **kwargs)  # type: ignore[misc]

    def clip_gradients_value(self, module: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if guarded(self.__dict__.get("_nanguard_steps"), _before_update, self, optimizer):
            return None
        with _unscaled_once(self, optimizer):
            return super().clip_gradients_value(module, optimizer, *args, **kwargs)  # type: ignore[misc]

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        steps = self.__dict__.get("_nanguard_steps")
        closure = kwargs.get("closure")
        if steps is not None and callable(closure):  # LBFGS & co: the gradients exist only once the closure ran
            guarded(steps, steps.engine.begin_update, optimizer)  # a closure optimizer's bad step is undone

            def checked_closure() -> Any:
                loss = closure()
                guarded(steps, _before_update, self, optimizer)  # every evaluation: the bad one undoes the step
                return loss

            kwargs["closure"] = checked_closure
        else:
            guarded(steps, _before_update, self, optimizer)
        return super().optimizer_step(optimizer, **kwargs)  # type: ignore[misc]

    def process_dataloader(self, dataloader: Any) -> Any:
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        steps = self.__dict__.get("_nanguard_steps")
        if steps is not None:  # first: the batches the guard notes are the ones cut (a failure: remedies off)
            guarded(steps, steps.controller.parts.run, "remedies", quarantine_in_fabric, steps, dataloader)
        watched = guarded(steps, steps.watch_loader, dataloader) if steps is not None else None
        return watched if watched is not None else dataloader


def _before_backward(strategy: Any, loss: Any) -> None:
    strategy._nanguard_steps.before_backward(loss)


def _before_update(strategy: Any, optimizer: Any) -> bool:
    optimizer = getattr(optimizer, "optimizer", optimizer)
    _unscale(strategy, optimizer)
    return bool(strategy._nanguard_steps.before_update(optimizer))


def _scaler_stage(strategy: Any, optimizer: Any) -> tuple[Any, str | None]:
    """The precision's enabled ``GradScaler`` and its stage for ``optimizer`` (``READY``, ``UNSCALED``, ...)."""
    scaler = getattr(getattr(strategy, "precision", None), "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None, None
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer))
    stage = getattr(state.get("stage") if state else None, "name", "READY")
    return scaler, stage


def _unscale(strategy: Any, optimizer: Any) -> None:
    """Unscale a GradScaler's gradients before the check, as the Trainer's precision plugin does before its hook.

    The check then sees true gradients (an overflow stays the scaler's to skip), and a dropped step's
    ``scaler.step`` still finds the inf checks this unscale recorded (with no gradients left it would
    find none, and raise).
    """
    scaler, stage = _scaler_stage(strategy, optimizer)
    if scaler is not None and stage == "READY":
        scaler.unscale_(optimizer)


@contextmanager
def _unscaled_once(strategy: Any, optimizer: Any) -> Iterator[None]:
    """Within: the precision's ``unscale_gradients`` does nothing once the guard has unscaled.

    Fabric's ``clip_gradients`` unscales too, and a second ``unscale_`` in one step raises.
    """
    _, stage = _scaler_stage(strategy, optimizer)
    precision = getattr(strategy, "precision", None)
    if stage != "UNSCALED" or precision is None:
        yield
        return
    precision.unscale_gradients = lambda _optimizer: None
    try:
        yield
    finally:
        del precision.unscale_gradients


_WRAPPED: dict[type, type] = {}


def hold_fabric_strategy(strategy: Any, steps: FabricSteps) -> None:
    """Swap ``strategy``'s class for its ``NanGuard<Original>`` subclass and give it ``steps``."""
    cls = type(strategy)
    if not issubclass(cls, NanGuardFabricMixin):
        wrapped = _WRAPPED.get(cls)
        if wrapped is None:
            wrapped = type(f"NanGuard{cls.__name__}", (NanGuardFabricMixin, cls), {"__module__": __name__})
            _WRAPPED[cls] = wrapped
        strategy.__class__ = wrapped
    strategy._nanguard_steps = steps
