"""The states of the torchmetrics metrics in a module: captured before a step, put back when the step is dropped.

A skipped step's ``training_step`` has already updated the metrics it uses (``metric.update`` or
``metric(preds, target)``). :class:`MetricStates` finds every ``torchmetrics.Metric`` in a module
(nested modules, ``MetricCollection``, ``ModuleDict``/``ModuleList``) once, and per step:

- :meth:`~MetricStates.capture` copies every tensor state into a buffer of its own (one
  ``torch._foreach_copy_`` for all of them, on their devices: no host read) and notes the length of
  every list ("cat") state, ``_update_count`` and the cached ``_computed``/``_forward_cache`` values
  (references: torchmetrics re-binds those, never mutates them);
- :meth:`~MetricStates.restore` puts all of it back: tensor states copied back in place (so states
  that a ``MetricCollection`` compute group shares stay shared), list states cut back to their
  length (nothing of a list is ever copied), counts and caches re-bound.

A state of another type (a custom metric that keeps, say, a dict) cannot be restored: such metrics
are named in :attr:`~MetricStates.unsupported` and left alone. torchmetrics is optional: without it
a module has no metrics.

Example:
    >>> import torchmetrics
    >>> net = torch.nn.ModuleDict({"mse": torchmetrics.MeanSquaredError(), "seen": torchmetrics.CatMetric()})
    >>> states = MetricStates(net)
    >>> net["mse"].update(torch.tensor([1.0]), torch.tensor([0.0])); net["seen"].update(torch.tensor([1.0]))
    >>> _ = states.capture()
    >>> net["mse"].update(torch.tensor([float("nan")]), torch.tensor([0.0])); net["seen"].update(torch.tensor([2.0]))
    >>> states.restore()
    >>> float(net["mse"].compute()), net["seen"].compute().tolist(), net["mse"]._update_count
    (1.0, 1.0, 1)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn

__all__ = ["MetricStates"]

_CACHED = ("_computed", "_forward_cache")


def _metric_class() -> type | None:
    try:
        from torchmetrics import Metric
    except ImportError:  # torchmetrics is optional
        return None
    return Metric


def _states(metric: nn.Module) -> list[str]:
    """The names of a torchmetrics metric's states (``add_state``)."""
    return list(getattr(metric, "_defaults", {}))


@dataclass
class _Saved:
    """One metric's state at the last capture."""

    names: list[str] = field(default_factory=list)
    tensors: dict[str, Tensor] = field(default_factory=dict)
    lengths: dict[str, int] = field(default_factory=dict)
    scalars: dict[str, Any] = field(default_factory=dict)


class MetricStates:
    """Capture and restore the states of every supported torchmetrics metric in ``module`` (see module docs).

    Args:
        module: the model (searched once, here).

    Attributes:
        metrics: ``(qualified name, metric)`` of the metrics handled.
        unsupported: ``(qualified name, state name, type name)`` of states that cannot be restored; their
            metrics are not handled.
    """

    def __init__(self, module: nn.Module) -> None:
        self.metrics: list[tuple[str, nn.Module]] = []
        self.unsupported: list[tuple[str, str, str]] = []
        self._saved: list[_Saved] = []
        self._captured = False
        metric_class = _metric_class()
        if metric_class is None:
            return
        for name, child in module.named_modules():
            if isinstance(child, metric_class) and hasattr(child, "_update_count"):
                metric = cast(nn.Module, child)
                self.metrics.append((name, metric))
                self._saved.append(_Saved(_states(metric)))
        self._drop_unsupported()

    def _drop_unsupported(self) -> bool:
        """Stop handling metrics holding a state that is neither a tensor nor a list; ``True`` if one was found."""
        kept: list[tuple[str, nn.Module]] = []
        found = False
        for name, metric in self.metrics:
            bad = [
                (name, state, type(value).__name__)
                for state in _states(metric)
                if not isinstance(value := getattr(metric, state, None), Tensor | list)
            ]
            if bad:
                self.unsupported.extend(bad)
                found = True
            else:
                kept.append((name, metric))
        if found:
            self.metrics = kept
            self._saved = [_Saved(_states(metric)) for _, metric in kept]
            self._captured = False
        return found

    def __bool__(self) -> bool:
        return bool(self.metrics)

    def capture(self) -> bool:
        """Note the current state of every metric (one fused device copy for all tensor states).

        Returns ``True`` when a metric was found holding a state of another type since the last
        capture (it is named in :attr:`unsupported` and no longer handled).
        """
        targets: list[Tensor] = []
        sources: list[Tensor] = []
        for (_, metric), saved in zip(self.metrics, self._saved, strict=True):
            tensors, lengths = saved.tensors, saved.lengths
            for state in saved.names:
                value = getattr(metric, state)
                if type(value) is list:
                    lengths[state] = len(value)
                    continue
                if not isinstance(value, Tensor):  # a custom update re-bound a state to another type
                    changed = self._drop_unsupported()
                    return self.capture() or changed
                buffer = tensors.get(state)
                if (
                    buffer is None
                    or buffer.shape != value.shape
                    or buffer.dtype != value.dtype
                    or (buffer.device != value.device)
                ):
                    buffer = tensors[state] = torch.empty_like(value, requires_grad=False)
                targets.append(buffer)
                sources.append(value)
            scalars = saved.scalars
            scalars["_update_count"] = metric._update_count
            scalars["_computed"] = metric._computed
            scalars["_forward_cache"] = getattr(metric, "_forward_cache", None)
        if targets:
            with torch.no_grad():
                torch._foreach_copy_(targets, sources)
        self._captured = True
        return False

    def restore(self) -> None:
        """Put every metric back as it was at the last :meth:`capture` (no-op before the first one)."""
        if not self._captured:
            return
        with torch.no_grad():
            for (_, metric), saved in zip(self.metrics, self._saved, strict=True):
                for state, buffer in saved.tensors.items():
                    live = getattr(metric, state)
                    if isinstance(live, Tensor) and live.shape == buffer.shape and live.dtype == buffer.dtype:
                        live.copy_(buffer)
                    else:  # re-bound to another shape (a growing tensor state): put a copy back
                        setattr(metric, state, buffer.clone())
                for state, length in saved.lengths.items():
                    live = getattr(metric, state)
                    if isinstance(live, list):
                        del live[length:]
                for name, value in saved.scalars.items():
                    setattr(metric, name, value)

    def describe_unsupported(self) -> str | None:
        """A sentence naming the metrics whose states cannot be restored, or ``None``.

        Example:
            >>> MetricStates(torch.nn.Linear(1, 1)).describe_unsupported() is None
            True
        """
        if not self.unsupported:
            return None
        shown = ", ".join(f"{name or '<module>'}.{state} ({kind})" for name, state, kind in self.unsupported)
        return (
            f"the state of these metrics cannot be restored after a skipped step ({shown}): a state must be a "
            "tensor or a list (torchmetrics' add_state); their values include skipped steps"
        )
