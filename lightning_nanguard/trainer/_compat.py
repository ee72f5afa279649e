"""Import shims so one ``NanGuard`` serves ``lightning.pytorch`` and ``pytorch_lightning``.

Both packages ship their own ``Callback`` and ``TensorBoardLogger`` classes. The guard derives
from every ``Callback`` base that is installed, so either ``Trainer`` and either ``LightningCLI``
accepts it, and matches loggers of both namespaces.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

__all__ = ["CALLBACK_BASES", "TENSORBOARD_LOGGER_TYPES", "lightning_namespaces"]


def _try_import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


_NAMESPACES: tuple[ModuleType, ...] = tuple(
    module for module in (_try_import("lightning.pytorch"), _try_import("pytorch_lightning")) if module is not None
)

if not _NAMESPACES:  # pragma: no cover - exercised only without Lightning installed
    raise ImportError(
        "lightning_nanguard needs PyTorch Lightning: `pip install lightning` or `pip install pytorch-lightning`."
    )


def lightning_namespaces() -> tuple[ModuleType, ...]:
    """The installed Lightning namespaces, ``lightning.pytorch`` first.

    Example:
        >>> [ns.__name__ for ns in lightning_namespaces()]  # doctest: +SKIP
        ['lightning.pytorch', 'pytorch_lightning']
    """
    return _NAMESPACES


if TYPE_CHECKING:
    from lightning.pytorch.callbacks import Callback as _Callback

    CALLBACK_BASES: tuple[type[_Callback], ...]
else:
    CALLBACK_BASES = tuple(ns.Callback for ns in _NAMESPACES)

TENSORBOARD_LOGGER_TYPES: tuple[type[Any], ...] = tuple(ns.loggers.TensorBoardLogger for ns in _NAMESPACES)
