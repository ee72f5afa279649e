"""The module paths of 0.2.0, still importable: each forwards to where its names live now.

0.3.0 laid the package out by stage (``detect/``, ``decide/``, ``diagnose/``, ``recover/``,
``reporting/`` and the Lightning adapter, since split into ``engine/`` and ``trainer/``). The module
paths the 0.2.0 README documented (only ``lightning_nanguard.spikes``; everything else was reached
through ``lightning_nanguard`` itself, whose names are unchanged) keep working and give one
``DeprecationWarning`` naming the new path.
They are removed in :data:`REMOVED_IN`.

Example:
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     from lightning_nanguard.spikes import SpikeDetector
    >>> SpikeDetector.__module__, str(caught[0].message)[:63]
    ('lightning_nanguard.detect.spikes', '`lightning_nanguard.spikes` moved to `lightning_nanguard.detect')
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Any

__all__ = ["MOVED", "REMOVED_IN", "install"]

_P = "lightning_nanguard."

REMOVED_IN = "0.5"
"""The version that removes the forwarding."""

MOVED: dict[str, tuple[str, ...]] = {
    _P + old: tuple(_P + new for new in news)
    for old, news in {
        "spikes": ("detect.spikes",),  # the one module path the 0.2.0 README documented
    }.items()
}
"""Old module path -> the modules that hold its names now (looked up in this order)."""


class _ForwardingModule(types.ModuleType):
    """An old module path: attribute lookups go to the new modules."""

    def __init__(self, name: str, targets: Sequence[str]) -> None:
        super().__init__(name, f"Moved: see {', '.join(targets)}.")
        self._targets = tuple(targets)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        for target in self._targets:
            module = importlib.import_module(target)
            if hasattr(module, name):
                return getattr(module, name)
        moved = ", ".join(self._targets)
        raise AttributeError(f"module {self.__name__!r} (moved to {moved}) has no attribute {name!r}")

    def __dir__(self) -> list[str]:
        names: set[str] = set()
        for target in self._targets:
            names.update(getattr(importlib.import_module(target), "__all__", ()))
        return sorted(names)


def _importer_stacklevel() -> int:
    """The ``stacklevel`` that points ``warnings.warn`` at the line importing the old path.

    Frames of the import machinery and of this module are passed over; ``warnings.warn`` itself
    does not count ``importlib._bootstrap`` frames when it walks up ``stacklevel`` frames, so
    neither does this.
    """
    frame, level = sys._getframe(1), 1
    while frame is not None:
        filename = frame.f_code.co_filename
        internal = "importlib" in filename and "_bootstrap" in filename  # skipped by warnings.warn too
        if not internal and "importlib" not in filename and filename != __file__:
            break
        if not internal:
            level += 1
        frame = frame.f_back  # type: ignore[assignment]
    return level


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old module paths of :data:`MOVED` (and nothing else)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        targets = MOVED[spec.name]
        warnings.warn(
            f"`{spec.name}` moved to `{targets[0]}`"
            + (f" (and {', '.join(f'`{t}`' for t in targets[1:])})" if len(targets) > 1 else "")
            + f"; the old path will be removed in lightning_nanguard {REMOVED_IN}.",
            DeprecationWarning,
            stacklevel=_importer_stacklevel(),
        )
        return _ForwardingModule(spec.name, targets)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install() -> None:
    """Make the old module paths importable (idempotent; done by ``import lightning_nanguard``)."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
