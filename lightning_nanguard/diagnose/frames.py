"""Which stack frames are the user's code, and how to show their paths.

User code, for a source line, is:

- the files defining the LightningModule's class (and the classes it derives from, up to
  Lightning's own ``LightningModule``), and the files defining the classes of the modules where
  the op ran, wherever they are installed (Lightning's demos, Hugging Face models), except torch's
  own ``torch.nn`` classes;
- any other file outside torch, Lightning, lightning-utilities, torchmetrics, the standard library
  and this package.

A source line is the innermost frame in user code. Paths are shown relative to a source root (the
working directory at ``fit`` start) when the file is under it, absolute otherwise, so a path
printed during training and in a later ``replay`` of its bundle is the same.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from types import FrameType

__all__ = ["Frame", "UserCode", "class_files", "display_path", "library_dirs"]

# packages whose frames are never the user's (unless their file defines a class of the model)
_LIBRARIES = (
    "torch",
    "functorch",
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "lightning_utilities",
    "torchmetrics",
)
# classes from these modules never make their file "user code"
_FRAMEWORK_MODULES = (
    "torch",
    "builtins",
    "abc",
    "typing",
    "lightning.pytorch.core",
    "pytorch_lightning.core",
    "lightning.fabric",
    "lightning_fabric",
    "lightning_utilities",
    "lightning_nanguard",
)
STACK_LIMIT = 8


@dataclass(frozen=True)
class Frame:
    """One frame of user code: absolute file path, line number and function name."""

    path: str
    line: int
    function: str


def library_dirs() -> tuple[str, ...]:
    """Directories (with a trailing separator) of torch, Lightning, torchmetrics and this package.

    The standard library is handled apart (see :class:`UserCode`): packages installed under it
    (``.../site-packages``) are not library code.

    Example:
        >>> any(d.rstrip(os.sep).endswith("torch") for d in library_dirs())
        True
    """
    import torch

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # lightning_nanguard/, not diagnose/
    dirs = [os.path.dirname(torch.__file__), package]
    for name in _LIBRARIES:
        module = sys.modules.get(name)
        module_file = getattr(module, "__file__", None) if module is not None else None
        if module_file:
            dirs.append(os.path.dirname(module_file))
    return tuple(os.path.join(os.path.abspath(d), "") for d in dirs)


_STDLIB = os.path.join(os.path.dirname(os.path.abspath(contextlib.__file__)), "")


def _site_packages(path: str) -> bool:
    return f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path


def class_files(cls: type) -> set[str]:
    """Files defining ``cls`` and its bases, except torch's, Lightning core's and this package's classes.

    Example:
        >>> import torch
        >>> class Net(torch.nn.Linear):
        ...     pass
        >>> sorted(class_files(torch.nn.Linear))
        []
    """
    files: set[str] = set()
    for klass in cls.__mro__:
        module = getattr(klass, "__module__", "") or ""
        if module == "builtins" or any(module == m or module.startswith(m + ".") for m in _FRAMEWORK_MODULES):
            continue
        try:
            files.add(os.path.abspath(inspect.getfile(klass)))
        except (TypeError, OSError):  # built-in or dynamically created classes
            continue
    return files


def display_path(path: str, source_root: str | None = None) -> str:
    """``path`` relative to ``source_root`` (default: the working directory) when under it, else absolute.

    Example:
        >>> display_path("/work/project/model.py", "/work/project")
        'model.py'
        >>> display_path("/usr/lib/other.py", "/work/project")
        '/usr/lib/other.py'
    """
    path = os.path.abspath(path)
    root = os.path.abspath(source_root if source_root is not None else os.getcwd())
    try:
        if os.path.commonpath([path, root]) == root:
            return os.path.relpath(path, root)
    except ValueError:  # different drives
        pass
    return path


class UserCode:
    """Tells user frames from library frames (see the module docs); decisions are cached per file.

    Args:
        root_files: files that are user code wherever they are (the LightningModule's class files).
        skip_dirs: library directories (default :func:`library_dirs`).

    Example:
        >>> import torch
        >>> code = UserCode()
        >>> code.is_user(torch.__file__), code.is_user("/home/me/project/model.py")
        (False, True)
        >>> UserCode(root_files=[torch.__file__]).is_user(torch.__file__)
        True
    """

    def __init__(self, root_files: Iterable[str] = (), skip_dirs: tuple[str, ...] | None = None) -> None:
        self.root_files = frozenset(os.path.abspath(f) for f in root_files)
        self.skip_dirs = skip_dirs if skip_dirs is not None else library_dirs()
        self._outside: dict[str, bool] = {}

    def _outside_libraries(self, filename: str) -> bool:
        known = self._outside.get(filename)
        if known is None:
            if filename.startswith("<"):  # <frozen ...>, <string>, <doctest ...>
                known = False
            else:
                path = os.path.abspath(filename)
                stdlib = path.startswith(_STDLIB) and not _site_packages(path[len(_STDLIB) - 1 :])
                known = not stdlib and not path.startswith(self.skip_dirs)
            self._outside[filename] = known
        return known

    def is_user(self, filename: str, extra_files: Iterable[str] = ()) -> bool:
        """Whether a frame of ``filename`` is user code, with ``extra_files`` (module class files) counted in."""
        if filename in self.root_files or filename in extra_files:
            return True
        if not filename.startswith("<") and not os.path.isabs(filename):
            absolute = os.path.abspath(filename)
            if absolute in self.root_files or absolute in extra_files:
                return True
        return self._outside_libraries(filename)

    def frames(self, frame: FrameType | None, extra_files: Iterable[str] = (), limit: int = STACK_LIMIT) -> list[Frame]:
        """The innermost ``limit`` user frames from ``frame`` outwards, innermost first."""
        extra = extra_files if isinstance(extra_files, set | frozenset) else frozenset(extra_files)
        found: list[Frame] = []
        while frame is not None and len(found) < limit:
            code = frame.f_code
            if self.is_user(code.co_filename, extra):
                found.append(Frame(os.path.abspath(code.co_filename), frame.f_lineno, code.co_name))
            frame = frame.f_back
        return found
