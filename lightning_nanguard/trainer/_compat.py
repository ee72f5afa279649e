"""Import shims so one ``NanGuard`` serves ``lightning.pytorch`` and ``pytorch_lightning``.

Both packages ship their own ``Callback`` and ``TensorBoardLogger`` classes. The guard derives
from the ``Callback`` base of every namespace in use, so either ``Trainer`` and either
``LightningCLI`` accepts it, and matches loggers of both namespaces.

Importing a namespace is not free of side effects: each one points the logger and the deprecation
category that Lightning shares with ``lightning_utilities`` (``lightning_utilities.core.rank_zero.log``
and ``rank_zero_deprecation_category``) at its own, the last one imported winning. Importing
``pytorch_lightning`` behind a ``lightning.pytorch`` user's back therefore sent Lightning's info
messages to the ``pytorch_lightning`` logger, and ``logging.getLogger("lightning.pytorch")``
settings (Lightning's documented way to quiet it) stopped working. So this module imports no
namespace at all:

- the namespaces already imported are used at once (``lightning.pytorch`` first);
- a namespace installed but not imported yet is adopted the moment anyone imports it: an import
  hook (:class:`_AdoptOnImport`) puts its ``Callback`` among the bases of every class built on
  :data:`CALLBACK_BASES` (``NanGuard`` among them) right after the namespace's own import ran, and
  removes itself once nothing is pending. Until then those classes carry a placeholder base,
  :class:`_NamespacePlaceholder`, that records them. No ``Trainer`` or CLI exists before its
  namespace is imported, so each sees a guard that derives from its ``Callback``.

The shared state is then exactly what the user's own imports make it, in any order, with the
guard imported first, last or in between.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
import weakref
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

__all__ = [
    "CALLBACK_BASES",
    "NAMESPACES",
    "TENSORBOARD_LOGGER_TYPES",
    "lightning_namespaces",
    "tensorboard_logger_types",
]

NAMESPACES = ("lightning.pytorch", "pytorch_lightning")
"""The Lightning namespaces the guard serves, in order of preference."""

_TOP_LEVEL = {"lightning.pytorch": "lightning", "pytorch_lightning": "pytorch_lightning"}

_adopted: dict[str, ModuleType] = {}  # the namespaces in use, by name
_pending: set[str] = set()  # installed, not imported yet: adopted when imported
_followers: weakref.WeakSet[type] = weakref.WeakSet()  # classes built on CALLBACK_BASES while some are pending


def _installed(name: str) -> bool:
    """Whether the distribution of a namespace is installed (its top-level package is looked up, not imported)."""
    try:
        return importlib.util.find_spec(_TOP_LEVEL[name]) is not None
    except (ImportError, ValueError):  # pragma: no cover - a broken installation
        return False


def _imported(name: str) -> ModuleType | None:
    module = sys.modules.get(name)
    return module if module is not None and hasattr(module, "Callback") else None


def lightning_namespaces() -> tuple[ModuleType, ...]:
    """The Lightning namespaces in use in this process, ``lightning.pytorch`` first.

    A namespace installed but not imported yet joins the moment it is imported.

    Example:
        >>> [ns.__name__ for ns in lightning_namespaces()]  # doctest: +SKIP
        ['lightning.pytorch', 'pytorch_lightning']
    """
    return tuple(_adopted[name] for name in NAMESPACES if name in _adopted)


def tensorboard_logger_types() -> tuple[type[Any], ...]:
    """The ``TensorBoardLogger`` class of every namespace in use (read at the call, so late namespaces count)."""
    found = (getattr(getattr(ns, "loggers", None), "TensorBoardLogger", None) for ns in lightning_namespaces())
    return tuple(logger_type for logger_type in found if logger_type is not None)


class _NamespacePlaceholder:
    """The last base of :data:`CALLBACK_BASES` while an installed namespace is not imported yet.

    It records each class deriving from it directly, so that the namespace's ``Callback`` can be
    put in its place when the namespace is imported (:func:`_adopt`). It defines nothing else.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if _NamespacePlaceholder in cls.__bases__:
            _followers.add(cls)


def _callback_bases() -> tuple[type[Any], ...]:
    bases: tuple[type[Any], ...] = tuple(ns.Callback for ns in lightning_namespaces())
    return (*bases, _NamespacePlaceholder) if _pending else bases


def _adopt(name: str, module: ModuleType) -> None:
    """Use a namespace imported after this module: its ``Callback`` joins the bases of every follower."""
    global CALLBACK_BASES, TENSORBOARD_LOGGER_TYPES
    old = set(CALLBACK_BASES)
    _pending.discard(name)
    _adopted[name] = module
    CALLBACK_BASES = _callback_bases()
    TENSORBOARD_LOGGER_TYPES = tensorboard_logger_types()
    for cls in list(_followers):
        bases = list(cls.__bases__)
        at = next(i for i, base in enumerate(bases) if base in old)
        others = [base for base in bases if base not in old]
        try:
            cls.__bases__ = (*others[:at], *CALLBACK_BASES, *others[at:])
        except TypeError as error:  # pragma: no cover - a subclass whose layout forbids it
            warnings.warn(
                f"{cls.__qualname__} could not derive from {name}.Callback ({error}); "
                f"import {name} before lightning_nanguard to use it with {name}.",
                stacklevel=2,
            )
        if not _pending:
            _followers.discard(cls)
    if not _pending:
        sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _AdoptOnImport)]


class _AdoptingLoader(importlib.abc.Loader):
    """Runs a namespace's own loader, then adopts the namespace. It steps aside before the module runs."""

    def __init__(self, loader: importlib.abc.Loader, name: str) -> None:
        self.loader = loader
        self.name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # The module sees its own loader, as if this one had never been there.
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        if self.name in _pending and hasattr(module, "Callback"):
            try:
                _adopt(self.name, module)
            except Exception as error:  # pragma: no cover - never break the user's import
                warnings.warn(f"lightning_nanguard could not adopt {self.name}: {error!r}", stacklevel=2)

    def __getattr__(self, name: str) -> Any:  # get_code, get_source, is_package, ...: the real loader's
        if name == "loader":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


class _AdoptOnImport(importlib.abc.MetaPathFinder):
    """Watches for the import of a pending namespace; finds nothing itself, the other finders do."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _pending:
            return None
        for finder in list(sys.meta_path):
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _AdoptingLoader(spec.loader, fullname)
        return spec


for _name in NAMESPACES:
    _module = _imported(_name)
    if _module is not None:
        _adopted[_name] = _module
    elif _name not in sys.modules and _installed(_name):
        _pending.add(_name)
if not _adopted and not _pending:  # pragma: no cover - exercised only without Lightning installed
    raise ImportError(
        "lightning_nanguard needs PyTorch Lightning: `pip install lightning` or `pip install pytorch-lightning`."
    )
if _pending and not any(isinstance(finder, _AdoptOnImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _AdoptOnImport())

if TYPE_CHECKING:
    from lightning.pytorch.callbacks import Callback as _Callback

    CALLBACK_BASES: tuple[type[_Callback], ...]
else:
    CALLBACK_BASES = _callback_bases()
"""The bases of ``NanGuard``: the ``Callback`` of every namespace in use (and the placeholder of a pending one)."""

TENSORBOARD_LOGGER_TYPES: tuple[type[Any], ...] = tensorboard_logger_types()
"""The ``TensorBoardLogger`` classes of the namespaces in use; :func:`tensorboard_logger_types` is current."""
