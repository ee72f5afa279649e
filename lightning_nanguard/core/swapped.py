"""Subclasses the guard swaps onto other code's objects (``obj.__class__ = ...``), which pickle as the original.

The guard watches loaders and batch samplers by swapping an instance's class for a generated
subclass. Such an object can end up in a pickle the user makes (``fabric.save(path, state)`` with a
loader in ``state``, a deep copy); :func:`swapped_subclass` makes it pickle as an instance of the
original class without the guard's attributes (those starting with ``nanguard_`` or
``_nanguard_``), so the file loads where the guard is not installed and holds no closures.

Example:
    >>> import pickle
    >>> from torch.utils.data import BatchSampler, SequentialSampler
    >>> sampler = BatchSampler(SequentialSampler(range(4)), batch_size=2, drop_last=False)
    >>> sampler.__class__ = swapped_subclass(BatchSampler, "NanGuardBatchSampler", {})
    >>> sampler.nanguard_fifo = [[0, 1]]
    >>> copy = pickle.loads(pickle.dumps(sampler))
    >>> type(copy).__name__, sorted(vars(copy))
    ('BatchSampler', ['batch_size', 'drop_last', 'sampler'])
"""

from __future__ import annotations

import copyreg
from typing import Any

__all__ = ["swapped_subclass"]

_NEWOBJ = getattr(copyreg, "__newobj__")  # noqa: B009  # what object.__reduce_ex__(2+) rebuilds with
_RECONSTRUCTOR = getattr(copyreg, "_reconstructor")  # noqa: B009  # stdlib: loads without the guard installed


def swapped_subclass(base: type, name: str, namespace: dict[str, Any], module: str | None = None) -> type:
    """A direct subclass of ``base`` named ``name`` with ``namespace``, pickling as a plain ``base``."""

    def __reduce_ex__(self: Any, protocol: Any) -> Any:
        reduced: Any = base.__reduce_ex__(self, protocol)  # type: ignore[call-arg]
        if not (isinstance(reduced, tuple) and len(reduced) >= 3 and reduced[0] is _NEWOBJ):
            return reduced
        state = reduced[2]
        if isinstance(state, dict):
            state = _without_guard(state)
        elif isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict):
            state = (_without_guard(state[0]), state[1])
        # copyreg's own reconstructor: the pickle names only the original class and the standard library
        return (_RECONSTRUCTOR, (base, object, None), state, *reduced[3:])

    body = {"__reduce_ex__": __reduce_ex__, "__module__": module or base.__module__, **namespace}
    return type(name, (base,), body)


def _without_guard(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if not (k.startswith("nanguard_") or k.startswith("_nanguard_"))}
