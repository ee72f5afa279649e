"""Where a default is written once: read it off the public signature that owns it.

Each default of the guard's configuration is written in one public signature: ``NanGuard``'s for
what only the callback knows, a documented Trainer-free class's or function's otherwise
(``SpikeDetector``'s window, ``diagnose``'s pass budget, ``Policy``'s escalation limits,
``Recovery``'s remedy factors). Everything else receives it with :func:`default_of`, so two places
can never disagree.

Example:
    >>> def search(n: int, max_passes: int = 128) -> None: ...
    >>> default_of(search, "max_passes")
    128
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["default_of"]


def default_of(owner: Callable[..., Any], name: str) -> Any:
    """The default value of parameter ``name`` in ``owner``'s signature (a function, class or dataclass).

    Raises:
        TypeError: ``owner`` has no parameter ``name``, or it has no default.
    """
    parameter = inspect.signature(owner).parameters.get(name)
    if parameter is None or parameter.default is inspect.Parameter.empty:
        raise TypeError(f"{getattr(owner, '__qualname__', owner)!r} has no parameter {name!r} with a default")
    return parameter.default
