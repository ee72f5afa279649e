"""Run ``training_step`` again without leaving a trace on training.

:func:`isolated` saves and restores everything a forward pass can change outside its return
value, so that after a bisection training continues bitwise as if it never happened:

- every module buffer (BatchNorm running statistics, ``num_batches_tracked``, user buffers);
- the ``training`` flag of every module;
- RNG streams: torch CPU, every CUDA device, ``random``, NumPy;
- ``self.log`` / ``self.log_dict`` (muted: values logged during a re-run are dropped);
- torchmetrics states (``metric_state``, ``_update_count``, ``_computed``, ``_forward_cache``) of metrics
  in the module.

Gradients are left alone by design: the re-run computes them with :func:`gradients`
(``torch.autograd.grad``; ``backward`` with every ``.grad`` saved and put back only where
``torch.autograd.grad`` is refused, as by reentrant activation checkpointing).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from lightning_nanguard.core.rng import RngState

__all__ = ["eager", "eagerly", "gradients", "isolated", "muted_logging"]


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def muted_logging(module: nn.Module) -> Iterator[None]:
    """Shadow ``log``/``log_dict`` with no-ops on the instance; the class methods come back after.

    Example:
        >>> class M(nn.Module):
        ...     def log(self, *a, **k): raise AssertionError("logged")
        >>> m = M()
        >>> with muted_logging(m):
        ...     m.log("x", 1.0)
        >>> "log" in vars(m)
        False
    """
    shadowed = [name for name in ("log", "log_dict") if hasattr(module, name)]
    previous = {name: vars(module)[name] for name in shadowed if name in vars(module)}
    for name in shadowed:
        setattr(module, name, _noop)
    try:
        yield
    finally:
        for name in shadowed:
            if name in previous:
                setattr(module, name, previous[name])
            else:
                delattr(module, name)


def _metric_states(module: nn.Module) -> list[tuple[Any, dict[str, Any]]]:
    try:
        from torchmetrics import Metric
    except ImportError:
        return []
    saved = []
    for child in module.modules():
        if isinstance(child, Metric):
            fields = {name: copy.deepcopy(getattr(child, name)) for name in child._defaults}
            fields["_update_count"] = child._update_count
            fields["_computed"] = copy.deepcopy(child._computed)
            # the value `metric(...)` returned last: forward re-binds it (never mutates it), and it may
            # be a non-leaf tensor that cannot be deep-copied, so keeping the reference is enough
            fields["_forward_cache"] = getattr(child, "_forward_cache", None)
            saved.append((child, fields))
    return saved


@contextlib.contextmanager
def isolated(module: nn.Module) -> Iterator[None]:
    """Undo, on exit, every side effect a forward pass of ``module`` can have (see module docs).

    Example:
        >>> net = nn.Sequential(nn.BatchNorm1d(2), nn.Dropout(0.5))
        >>> before = net[0].running_mean.clone()
        >>> with isolated(net):
        ...     _ = net(torch.randn(4, 2))
        >>> torch.equal(net[0].running_mean, before)
        True
    """
    buffers = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]
    modes = [(child, child.training) for child in module.modules()]
    metrics = _metric_states(module)
    rng = RngState.capture()
    try:
        with muted_logging(module):
            yield
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for child, training in modes:
            child.training = training
        for metric, fields in metrics:
            for name, value in fields.items():
                setattr(metric, name, value)
        rng.restore()


def _refuses_grad(loss: Tensor) -> bool:
    """Whether the graph of ``loss`` holds a node that refuses ``torch.autograd.grad`` (reentrant checkpointing)."""
    seen: set[int] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.name() in _REFUSE_GRAD:
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


_REFUSE_GRAD = frozenset({"CheckpointFunctionBackward"})  # torch.utils.checkpoint(..., use_reentrant=True)


def gradients(loss: Tensor, params: Sequence[Tensor]) -> list[Tensor | None]:
    """The gradients of ``loss`` with respect to ``params``, leaving every ``.grad`` as it was.

    ``torch.autograd.grad`` where it works. Reentrant activation checkpointing
    (``torch.utils.checkpoint(..., use_reentrant=True)``, Hugging Face's gradient checkpointing by
    default) refuses it: there ``backward`` runs with every ``.grad`` set aside and put back after.

    Example:
        >>> w = torch.ones(2, requires_grad=True)
        >>> w.grad = torch.full((2,), 7.0)
        >>> gradients((3 * w).sum(), [w])[0].tolist(), w.grad.tolist()
        ([3.0, 3.0], [7.0, 7.0])
    """
    if not _refuses_grad(loss):
        return list(torch.autograd.grad(loss, list(params), allow_unused=True))
    saved = [p.grad for p in params]
    try:
        for p in params:
            p.grad = None
        loss.backward()
        return [p.grad for p in params]
    finally:
        for p, grad in zip(params, saved, strict=True):
            p.grad = grad


_F = TypeVar("_F", bound=Callable[..., Any])


def eager() -> contextlib.AbstractContextManager[Any]:
    """Run ``torch.compile``d code eagerly inside the block (``torch.compiler.set_stance("force_eager")``).

    A diagnosis re-runs the step on sub-batches of new sizes and hooks the modules: compiled, each
    size would recompile (seconds each, until the recompile limit), dynamo would trace the hooks,
    and the ops would be named ``CompiledFunctionBackward`` instead of the op at fault.
    """
    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def eagerly(function: _F) -> _F:
    """Decorate ``function`` to run inside :func:`eager`."""

    @functools.wraps(function)
    def run_eagerly(*args: Any, **kwargs: Any) -> Any:
        with eager():
            return function(*args, **kwargs)

    return run_eagerly  # type: ignore[return-value]
