"""What Fabric does without calling a hook, seen by the guard: ``setup_module`` and early loaders.

Fabric calls ``on_after_setup`` from ``fabric.setup(model, ...)`` only. Loops that set up the model
with ``fabric.setup_module(model)`` and the optimizers with ``fabric.setup_optimizers`` (LitGPT's
LoRA recipe) would never be guarded, and loaders set up before the model (LitGPT's fine-tuning
recipes call ``fabric.setup_dataloaders`` first) would never record their dataset indices.
:func:`hold_fabric_class` wraps the two methods on the ``Fabric`` classes loaded (``lightning.fabric``
and the standalone ``lightning_fabric``), once per process; the wrappers act only for a ``Fabric``
whose callbacks hold a guard, and only towards the guard:

- ``setup_module``: the guard's ``on_after_setup(fabric, module)`` (no other callback is called);
- ``setup_dataloaders`` before the guard holds the loop: the loaders are kept on the ``Fabric``
  object and watched when it takes hold (:func:`early_loaders`).

The classes are wrapped only once a Fabric loop is in use: when a ``Fabric`` is built after a guard
was made (:func:`hold_fabric_class_for_guards`, called by the entry point Fabric loads in every
``Fabric()``), or when a guard takes hold at ``fabric.setup``. A Trainer-only run never touches
``Fabric``; a Fabric user without a guard never gets the wrappers.

Example:
    >>> import lightning as L
    >>> hold_fabric_class()
    >>> getattr(L.Fabric.setup_module, "__nanguard_wrapped__", False)
    True
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

__all__ = [
    "TAKES_SETUP_MODULE",
    "early_loaders",
    "hold_fabric_class",
    "hold_fabric_class_for_guards",
    "note_guard_made",
]

TAKES_SETUP_MODULE = "nanguard_takes_setup_module"  # a callback class attribute: hand it setup_module too
_EARLY = "_nanguard_early_loaders"
_FABRIC_MODULES = ("lightning.fabric.fabric", "lightning_fabric.fabric")
_guard_made = False  # a guard exists in this process: the next Fabric() built is held


def note_guard_made() -> None:
    """A guard was made: a ``Fabric`` built from now on is held (:func:`hold_fabric_class_for_guards`)."""
    global _guard_made
    _guard_made = True


def hold_fabric_class_for_guards() -> None:
    """Called in every ``Fabric()`` (the entry point): hold the ``Fabric`` classes once a guard exists."""
    if _guard_made:
        hold_fabric_class()


def hold_fabric_class() -> None:
    """Wrap ``setup_module`` and ``setup_dataloaders`` of every ``Fabric`` class imported so far (idempotent)."""
    for name in _FABRIC_MODULES:
        fabric_module = sys.modules.get(name)
        cls = getattr(fabric_module, "Fabric", None)
        if cls is None:
            continue
        for method, wrap in (("setup_module", _wrap_setup_module), ("setup_dataloaders", _wrap_setup_dataloaders)):
            original = cls.__dict__.get(method)
            if original is not None and not getattr(original, "__nanguard_wrapped__", False):
                wrapped = functools.wraps(original)(wrap(original))
                wrapped.__nanguard_wrapped__ = True  # type: ignore[attr-defined]
                setattr(cls, method, wrapped)


def early_loaders(fabric: Any) -> list[Any]:
    """The loaders ``fabric.setup_dataloaders`` gave before the guard took hold (then forgotten)."""
    return list(fabric.__dict__.pop(_EARLY, []))


def _guards(fabric: Any) -> list[Any]:
    return [cb for cb in getattr(fabric, "_callbacks", []) if getattr(type(cb), TAKES_SETUP_MODULE, False)]


def _holds(fabric: Any) -> bool:
    return any(getattr(guard, "holds_fabric", lambda _: False)(fabric) for guard in _guards(fabric))


def _wrap_setup_module(original: Callable[..., Any]) -> Callable[..., Any]:
    def setup_module(self: Any, module: Any, *args: Any, **kwargs: Any) -> Any:
        wrapped = original(self, module, *args, **kwargs)
        for guard in _guards(self):
            guard.on_after_setup(self, wrapped)
        return wrapped

    return setup_module


def _wrap_setup_dataloaders(original: Callable[..., Any]) -> Callable[..., Any]:
    def setup_dataloaders(self: Any, *dataloaders: Any, **kwargs: Any) -> Any:
        result = original(self, *dataloaders, **kwargs)
        if _guards(self) and not _holds(self):  # after take-hold the strategy's process_dataloader sees them
            loaders = result if isinstance(result, list) and len(dataloaders) > 1 else [result]
            self.__dict__.setdefault(_EARLY, []).extend(getattr(lo, "_dataloader", lo) for lo in loaders)
        return result

    return setup_dataloaders
