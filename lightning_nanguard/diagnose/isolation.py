"""Run ``training_step`` again without leaving a trace on training.

:func:`isolated` saves and restores everything a forward pass can change outside its return
value, so that after a bisection training continues bitwise as if it never happened:

- every module buffer (BatchNorm running statistics, ``num_batches_tracked``, user buffers);
- the ``training`` flag of every module;
- RNG streams: torch CPU, every CUDA device, ``random``, NumPy;
- ``self.log`` / ``self.log_dict`` (muted: values logged during a re-run are dropped);
- torchmetrics states (``metric_state``, ``_update_count``, ``_computed``, ``_forward_cache``) of metrics
  in the module.

Gradients are left alone by design: the re-run uses ``torch.autograd.grad``, never ``backward``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lightning_nanguard.core.rng import RngState

__all__ = ["isolated", "muted_logging"]


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
