"""The attention functions seen without a function mode: wrappers installed while a probe measures.

A :class:`~torch.overrides.TorchFunctionMode` sees every torch call made inside a module, which is
what the attention probe needs to find attention wherever it is written; but it costs a Python
dispatch on *every* torch call (projections, views, transposes), ~20 per attention call. Once the
probe knows which modules call attention, these wrappers see the attention calls alone: while a
probe watches a module's forward (:func:`start` to :func:`stop`),
``torch.nn.functional.scaled_dot_product_attention``,
``torch.nn.functional.softmax``, ``torch.softmax`` and ``Tensor.softmax`` are replaced by wrappers
that call the original and then hand the call to each probe watching (on the thread that installed
them; a call nested in another wrapped call, e.g. ``F.softmax`` calling ``Tensor.softmax``, is
handed over once). Code that bound a function before the wrappers were installed (``from
torch.nn.functional import scaled_dot_product_attention``) calls the original: the probe finds such
modules on the passes that use the mode (:data:`STATE.depth` tells it whether a call it sees went
through a wrapper) and keeps the mode for them.

The originals are restored when the last probe stops watching; nothing is replaced otherwise.

Example:
    >>> import torch
    >>> seen = []
    >>> class Probe:
    ...     def attention_call(self, kind, args, kwargs):
    ...         seen.append((kind, tuple(args[0].shape)))
    >>> probe = Probe()
    >>> start(probe)
    True
    >>> _ = torch.softmax(torch.zeros(1, 2, 3), dim=-1)
    >>> _ = torch.zeros(1, 2, 3).softmax(-1)
    >>> stop(probe)
    >>> seen, torch.softmax is ORIGINALS[1][2]  # restored
    ([(2, (1, 2, 3)), (2, (1, 2, 3))], True)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ORIGINALS", "SDPA", "SOFTMAX", "STATE", "WATCHED", "start", "stop"]

SDPA, SOFTMAX = 1, 2


class AttentionCallSink(Protocol):
    """What a wrapper hands an attention call to (the probe)."""

    def attention_call(self, kind: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None: ...


class _State:
    """The probes watching, the thread they watch, and how deep the calls in hand are nested."""

    __slots__ = ("depth", "sinks", "thread")

    def __init__(self) -> None:
        self.sinks: list[AttentionCallSink] = []
        self.thread: int | None = None
        self.depth = 0  # > 0 inside a wrapped call (its original and whatever that calls)


STATE = _State()

# (owner, attribute, original, kind): what is replaced while a probe watches
ORIGINALS: tuple[tuple[Any, str, Callable[..., Any], int], ...] = (
    (F, "scaled_dot_product_attention", F.scaled_dot_product_attention, SDPA),
    (torch, "softmax", torch.softmax, SOFTMAX),
    (F, "softmax", F.softmax, SOFTMAX),
    (Tensor, "softmax", torch._C.TensorBase.softmax, SOFTMAX),
)


def _wrapper(original: Callable[..., Any], kind: int) -> Callable[..., Any]:
    get_ident = threading.get_ident

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        state = STATE
        if state.depth or get_ident() != state.thread:  # nested in a wrapped call, or another thread
            return original(*args, **kwargs)
        state.depth = 1
        try:
            result = original(*args, **kwargs)
        finally:
            state.depth = 0
        for sink in state.sinks:
            sink.attention_call(kind, args, kwargs)
        return result

    wrapped.__wrapped__ = original  # type: ignore[attr-defined]
    wrapped.__name__ = getattr(original, "__name__", "attention")
    wrapped.__doc__ = original.__doc__
    return wrapped


WATCHED: dict[Any, int] = {original: kind for _, _, original, kind in ORIGINALS}
"""The attention functions and their wrappers, each with its kind (what a function mode looks for)."""

_WRAPPERS: dict[Any, Callable[..., Any]] = {}  # the wrapper of each function found in place (torch's, or a patch)
_SAVED: list[tuple[Any, str, Any]] = []  # (owner, attribute, what it held before the wrapper; None: inherited)


def _wrapper_of(function: Callable[..., Any], kind: int) -> Callable[..., Any]:
    wrapper = _WRAPPERS.get(function)
    if wrapper is None:
        wrapper = _WRAPPERS[function] = _wrapper(function, kind)
        WATCHED[wrapper] = kind
    return wrapper


for _, _, _original, _kind in ORIGINALS:  # torch's own, made once
    _wrapper_of(_original, _kind)


def _install() -> None:
    """Wrap what each attribute holds now (another library's patch of it included), keeping it for :func:`_restore`."""
    _SAVED.clear()
    for owner, name, original, kind in ORIGINALS:
        held = Tensor.__dict__.get(name) if owner is Tensor else getattr(owner, name)
        _SAVED.append((owner, name, held))
        setattr(owner, name, _wrapper_of(held if held is not None else original, kind))


def _restore() -> None:
    """Put back exactly what :func:`_install` found."""
    for owner, name, held in _SAVED:
        if held is not None:
            setattr(owner, name, held)
        elif name in owner.__dict__:  # inherited (Tensor.softmax from TensorBase): remove the wrapper
            delattr(owner, name)
    _SAVED.clear()


def start(sink: AttentionCallSink) -> bool:
    """Hand the attention calls made on this thread to ``sink`` (after each returns) until :func:`stop`.

    Several sinks may watch at once (each sees every call). ``False`` when another thread watches:
    the wrappers serve one thread, and nothing is installed for ``sink`` then.
    """
    me = threading.get_ident()
    if STATE.sinks and STATE.thread != me:
        return False
    if not STATE.sinks:
        STATE.thread, STATE.depth = me, 0
        _install()
    if sink not in STATE.sinks:
        STATE.sinks.append(sink)
    return True


def stop(sink: AttentionCallSink) -> None:
    """``sink`` stops watching (nothing if it was not); the originals are back once no sink watches."""
    if sink not in STATE.sinks:
        return
    STATE.sinks.remove(sink)
    if not STATE.sinks:
        _restore()
        STATE.thread = None
