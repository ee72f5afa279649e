"""``NanGuardStrategy``: the guard's hold on the Trainer's strategy, applied by class swap.

Lightning checks ``isinstance(strategy, Strategy / ParallelStrategy / DDPStrategy)`` in many
places, so a proxy object would break it. Instead :func:`apply_nanguard_strategy` swaps the class
of the strategy instance the Trainer built for a generated subclass ``NanGuard<Original>`` that
adds :class:`NanGuardStrategyMixin` in front; :func:`remove_nanguard_strategy` swaps it back. A
wrapped strategy pickles as "the original class, wrapped again on load", so it unpickles in a
fresh process (``ddp_spawn``) where the generated class does not exist yet, and the equally named
strategies of ``lightning.pytorch`` and ``pytorch_lightning`` never collide.

The mixin owns what happens around the optimizer step on every rank:

- ``optimizer_step``: refuses what the guard cannot make safe (DeepSpeed's engine owns the step),
  lets the Trainer's precision plugin run the closure, unscale and call
  ``on_before_optimizer_step``, where the guard makes the one distributed skip decision per step
  (one ``reduce`` of the bad flag, every rank, any rank bad means all ranks skip), then runs the
  guard's after-step work (parameter check, snapshot, rollback) on every rank;
- ``process_dataloader``: makes each loader record the dataset indices of its batches before
  Lightning first iterates it.
"""

from __future__ import annotations

import abc
import copyreg
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, SupportsIndex

from lightning_nanguard.indices import record_batch_indices

if TYPE_CHECKING:
    from lightning_nanguard.guard import NanGuard

__all__ = ["NanGuardStrategyMixin", "apply_nanguard_strategy", "remove_nanguard_strategy", "strategy_kind"]

_GENERATED: dict[type, type] = {}
_NEWOBJ = copyreg.__newobj__  # type: ignore[attr-defined]  # how objects of plain classes pickle


class NanGuardStrategyMixin(abc.ABC):  # ABC: same metaclass and layout as Lightning strategies
    """Put in front of a Lightning strategy class; see the module docs."""

    _nanguard: NanGuard | None
    _nanguard_original_class: type

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        guard = getattr(self, "_nanguard", None)
        if guard is None or not guard.active:
            return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        output = super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        guard._after_optimizer_step(optimizer)
        return output

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[Any, ...]:
        """Pickle as the original class, wrapped again on load (see module docs)."""
        reduced = super().__reduce_ex__(protocol)
        original = type(self).__dict__.get("_nanguard_wraps")
        if original is None or not isinstance(reduced, tuple) or reduced[0] is not _NEWOBJ:
            return reduced
        return (_rewrapped, (original, *reduced[1][1:]), *reduced[2:])

    def process_dataloader(self, dataloader: Any) -> Any:
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        guard = getattr(self, "_nanguard", None)
        if guard is not None and guard.records_indices:
            sampler = record_batch_indices(dataloader)
            if sampler is not None:
                sampler.nanguard_exclude = guard.remedy_book.quarantined
                sampler.nanguard_clock = guard.clock
        return dataloader


def strategy_kind(strategy: Any) -> str:
    """``"deepspeed"``, ``"fsdp"``, ``"ddp"`` or ``"single"`` from the strategy's class hierarchy.

    Example:
        >>> from lightning.pytorch.strategies import SingleDeviceStrategy
        >>> strategy_kind(SingleDeviceStrategy("cpu"))
        'single'
    """
    names = {cls.__name__ for cls in type(strategy).__mro__}
    if "DeepSpeedStrategy" in names:
        return "deepspeed"
    if names & {"FSDPStrategy", "ModelParallelStrategy"}:
        return "fsdp"
    if names & {"DDPStrategy", "ParallelStrategy"}:
        return "ddp"
    return "single"


def _wrapped_class(cls: type) -> type:
    """The ``NanGuard<Original>`` subclass of ``cls``, generated once per class.

    It is also registered in this module under a unique qualified name, so the class object itself
    pickles by reference in this process (``lightning.pytorch`` and ``pytorch_lightning`` both have
    a ``DDPStrategy``: the second gets a suffix).
    """
    if cls not in _GENERATED:
        name = f"NanGuard{cls.__name__}"
        generated = type(name, (NanGuardStrategyMixin, cls), {"__module__": __name__, "_nanguard_wraps": cls})
        module = sys.modules[__name__]
        qualname = name
        while hasattr(module, qualname):
            qualname += "_"
        generated.__qualname__ = qualname
        setattr(module, qualname, generated)
        _GENERATED[cls] = generated
    return _GENERATED[cls]


def _rewrapped(original: type, *args: Any) -> Any:
    """Unpickle a wrapped strategy: a bare instance of ``original``, its class swapped again."""
    instance = original.__new__(original, *args)
    instance.__class__ = _wrapped_class(original)
    return instance


def apply_nanguard_strategy(strategy: Any, guard: NanGuard) -> None:
    """Swap ``strategy``'s class for its ``NanGuard<Original>`` subclass and attach ``guard``."""
    cls = type(strategy)
    if not issubclass(cls, NanGuardStrategyMixin):
        strategy._nanguard_original_class = cls
        strategy.__class__ = _wrapped_class(cls)
    strategy._nanguard = guard


def remove_nanguard_strategy(strategy: Any) -> None:
    """Undo :func:`apply_nanguard_strategy` (the Trainer's strategy is its own class again)."""
    original = getattr(strategy, "_nanguard_original_class", None)
    if original is not None and isinstance(strategy, NanGuardStrategyMixin):
        strategy.__class__ = original
    for attr in ("_nanguard", "_nanguard_original_class"):
        vars(strategy).pop(attr, None)
