"""Closure optimizers (``torch.optim.LBFGS``): a bad step is undone, since it cannot be skipped halfway.

LBFGS evaluates its closure many times within one ``optimizer.step(closure)``, updating the weights
between evaluations (its iterations and line search). The guard checks every evaluation; the
first bad one is dropped (its gradients removed) and the whole step is then undone: the weights
and the optimizer's state go back to what they were before the step. LBFGS runs on small models,
so a copy of its parameters and state per step is affordable (the performance guide gives the
cost measured).

Example:
    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> lbfgs = torch.optim.LBFGS([w])
    >>> undo = ClosureUndo()
    >>> undo.before(lbfgs)
    >>> with torch.no_grad():
    ...     _ = w.add_(1.0)   # what a step did
    >>> undo.mark_bad()
    >>> undo.after(lbfgs), w.tolist()
    (True, [1.0, 1.0])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_nanguard.engine.step.params import optimizer_params

__all__ = ["ClosureUndo", "is_closure_optimizer"]


def is_closure_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` evaluates its closure several times per step (LBFGS), changing weights in between."""
    return isinstance(getattr(optimizer, "_optimizer", optimizer), torch.optim.LBFGS)


class ClosureUndo:
    """The weights and state of a closure optimizer before its step, put back when the step turns out bad."""

    def __init__(self) -> None:
        self._optimizer: Any = None
        self._params: list[tuple[Tensor, Tensor]] = []
        self._state: dict[Any, Any] | None = None
        self.bad = False

    def before(self, optimizer: Any) -> None:
        """A step of ``optimizer`` begins: copy what it may change."""
        inner = getattr(optimizer, "_optimizer", optimizer)
        params = optimizer_params(inner)
        with torch.no_grad():
            self._params = [(p, p.detach().clone()) for p in params]
        self._state = {param: {k: _copied(v) for k, v in state.items()} for param, state in inner.state.items()}
        self._optimizer, self.bad = inner, False

    def holds(self, optimizer: Any) -> bool:
        """Whether the step of ``optimizer`` in progress can be undone (its state was copied when it began)."""
        return self._optimizer is not None and getattr(optimizer, "_optimizer", optimizer) is self._optimizer

    def mark_bad(self) -> None:
        """An evaluation of the step's closure was bad: the step is undone when it ends."""
        self.bad = self._optimizer is not None

    def after(self, optimizer: Any) -> bool:
        """The step of ``optimizer`` ended: put the weights and state back if it was bad; whether it did."""
        if self._optimizer is None:  # nothing was copied (not a closure optimizer): every step of most runs
            return False
        inner = getattr(optimizer, "_optimizer", optimizer)
        undone = self.bad and inner is self._optimizer
        if undone:
            with torch.no_grad():
                for param, saved in self._params:
                    param.copy_(saved)
            assert self._state is not None
            inner.state.clear()
            inner.state.update(self._state)
            for param, _ in self._params:
                param.grad = None
        self._optimizer, self._params, self._state, self.bad = None, [], None, False
        return undone


def _copied(value: Any) -> Any:
    """A state entry as it is now: a tensor cloned (LBFGS updates ``prev_flat_grad`` in place), a list copied.

    The tensors in LBFGS's history lists are never changed in place (a step appends new ones and pops
    old ones), so a copy of each list keeps them as they were, at no per-tensor cost.
    """
    if isinstance(value, Tensor):
        return value.detach().clone()
    return list(value) if isinstance(value, list) else value
