"""Remedies applied after an incident: gradient clipping, larger eps, lower LR, quarantine.

Each remedy is a small function that changes the training setup in place and returns a readable
description of what it did (or ``None`` when it could not apply). :class:`RemedyBook` keeps the
caps, the counts and the state that must survive a checkpoint.

Example:
    >>> net = torch.nn.Linear(2, 2)
    >>> opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    >>> lr_backoff_(opt, [], factor=0.5)
    'lr_backoff: learning rate x0.5 (group 0: 0.001 -> 0.0005)'
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeGuard, get_args

import torch
from torch import Tensor, nn
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from lightning_nanguard.core.dtensor import local_tensors

__all__ = [
    "NOT_REACHED",
    "REMEDIES",
    "ZERO_EPS_START",
    "QuarantineReach",
    "Remedy",
    "RemedyBook",
    "clip_gradients_",
    "clip_threshold",
    "lr_backoff_",
    "raise_eps_",
]

Remedy = Literal["clip_grad", "raise_eps", "lr_backoff", "quarantine"]
REMEDIES: tuple[str, ...] = get_args(Remedy)

_LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")

ZERO_EPS_START = 1e-6
"""What ``raise_eps`` sets an ``eps`` of exactly 0 to (0 times any factor stays 0): the default
of RMSNorm-style layers, and still representable in float16."""


def _raised_eps(old: float, factor: float, max_eps: float) -> float:
    return min(old * factor if old > 0 else ZERO_EPS_START, max_eps)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def clip_threshold(healthy_norms: Iterable[float], current: float | None, tighten: float = 0.5) -> float | None:
    """Clipping threshold: the median recent healthy norm, or ``current * tighten`` if already clipping.

    Example:
        >>> clip_threshold([1.0, 2.0, 3.0], None)
        2.0
        >>> clip_threshold([1.0, 2.0, 3.0], 2.0)
        1.0
    """
    if current is not None:
        return current * tighten
    norms = [n for n in healthy_norms if n == n and n != float("inf")]
    return statistics.median(norms) if norms else None


def clip_gradients_(grads: Sequence[Tensor], total_norm: float | Tensor, threshold: float) -> bool:
    """Scale ``grads`` in place so that their global norm is at most ``threshold``.

    ``total_norm`` is the norm the guard already computed, so clipping costs no extra reduction:

    - a host float (read with the step's flags): nothing is read, and nothing is launched when the
      norm is within the threshold (or NaN);
    - a 0-dim device tensor (sync-free mode): the coefficient ``min(1, threshold / norm)`` is
      computed and applied on the device, never read to the host.

    Gradients are grouped by device and dtype, one ``torch._foreach_mul_`` per group, as in
    ``torch.nn.utils.clip_grad_norm_``. Sharded gradients (``DTensor``) are scaled on their local
    shards: ``total_norm`` must then be the global norm over every rank's shards (the guard's is).

    Returns:
        Whether the gradients were scaled (``True`` for a device norm: the host does not know).

    Example:
        >>> g = [torch.tensor([3.0, 4.0])]
        >>> clip_gradients_(g, total_norm=5.0, threshold=1.0), [round(v, 6) for v in g[0].tolist()]
        (True, [0.6, 0.8])
        >>> h = [torch.tensor([3.0, 4.0]), torch.tensor([0.0], dtype=torch.float64)]
        >>> _ = clip_gradients_(h, torch.tensor(5.0), 1.0)
        >>> [round(v, 4) for v in h[0].tolist()], h[1].dtype
        ([0.6, 0.8], torch.float64)
    """
    if not grads:
        return False
    coefficient: float | Tensor
    if isinstance(total_norm, Tensor):
        coefficient = (threshold / (total_norm.float() + 1e-6)).clamp(max=1.0)
    elif total_norm <= threshold or total_norm != total_norm:
        return False
    else:
        coefficient = threshold / (total_norm + 1e-6)
    tensor_lists: list[list[Tensor | None]] = [list(local_tensors(grads))]
    for (device, _), ([group], _) in _group_tensors_by_device_and_dtype(tensor_lists).items():
        factor = coefficient.to(device, non_blocking=True) if isinstance(coefficient, Tensor) else coefficient
        torch._foreach_mul_(group, factor)  # type: ignore[arg-type]
    return True


def raise_eps_(
    module: nn.Module | None, optimizers: Sequence[torch.optim.Optimizer], factor: float, max_eps: float
) -> str | None:
    """Multiply ``eps`` of ``module`` (a norm layer or any layer with ``eps``) and of Adam-style optimizers.

    Never above ``max_eps``; an ``eps`` of exactly 0 becomes ``min(ZERO_EPS_START, max_eps)``.

    Example:
        >>> ln = nn.LayerNorm(4, eps=1e-5)
        >>> raise_eps_(ln, [], factor=10.0, max_eps=1e-3)
        'raise_eps: LayerNorm eps 1e-05 -> 0.0001'
        >>> raise_eps_(nn.LayerNorm(4, eps=0.0), [], factor=10.0, max_eps=1e-3)
        'raise_eps: LayerNorm eps 0 -> 1e-06'
    """
    changes: list[str] = []
    if module is not None and _is_number(getattr(module, "eps", None)):
        old = float(module.eps)  # type: ignore[arg-type]
        new = _raised_eps(old, factor, max_eps)
        if new > old:
            setattr(module, "eps", new)  # noqa: B010 - nn.Module.__setattr__ is typed for tensors/modules
            changes.append(f"{type(module).__name__} eps {old:g} -> {new:g}")
    for index, optimizer in enumerate(optimizers):
        for group_index, group in enumerate(optimizer.param_groups):
            eps = group.get("eps")
            if _is_number(eps):
                new = _raised_eps(float(eps), factor, max_eps)
                if new > eps:
                    group["eps"] = new
                    changes.append(f"optimizer {index} group {group_index} eps {eps:g} -> {new:g}")
    return "raise_eps: " + ", ".join(changes) if changes else None


def lr_backoff_(optimizer: torch.optim.Optimizer, schedulers: Sequence[Any], factor: float) -> str:
    """Multiply every param group's learning rate by ``factor``, and the schedulers' bases with it.

    LR schedulers recompute ``lr`` from ``base_lrs`` (``LambdaLR``, ``CosineAnnealingLR``...) or
    from the current ``lr`` (``StepLR``...): scaling both keeps the back-off in force either way,
    also for the schedulers inside ``SequentialLR`` and ``ChainedScheduler``.
    """
    changes = []
    for index, group in enumerate(optimizer.param_groups):
        old = group["lr"]
        for key in _LR_KEYS:
            if isinstance(group.get(key), int | float | Tensor):
                group[key] = group[key] * factor
        changes.append(f"group {index}: {float(old):g} -> {float(group['lr']):g}")
    for scheduler in _flattened(schedulers):
        if getattr(scheduler, "optimizer", None) is not optimizer:
            continue
        for attr in ("base_lrs", "_last_lr", "min_lrs"):
            values = getattr(scheduler, attr, None)
            if isinstance(values, list):
                setattr(scheduler, attr, [v * factor for v in values])
    return f"lr_backoff: learning rate x{factor:g} ({', '.join(changes)})"


def _flattened(schedulers: Sequence[Any]) -> list[Any]:
    """Schedulers and, recursively, those composed inside them (``SequentialLR``, ``ChainedScheduler``)."""
    out: list[Any] = []
    for scheduler in schedulers:
        out.append(scheduler)
        out.extend(_flattened(getattr(scheduler, "_schedulers", None) or []))
    return out


def _by_key(item: tuple[str | int, Any]) -> str:
    return str(item[0])


NOT_REACHED = "the guard holds no training loader that removes records (a Trainer fit or a Fabric loop gives it theirs)"
"""Why a quarantine removes nothing from a loader no front-end registered."""


@dataclass
class QuarantineReach:
    """Where the quarantine acts: for each training loader, whether it removes quarantined records, or why not.

    The front-end registers every training loader it reads (:meth:`acts` or :meth:`cannot`); a
    loader is named by its key among several training loaders, ``None`` when there is one. What is
    not registered removes nothing (:data:`NOT_REACHED`): the book never claims more than a loader does.

    Example:
        >>> reach = QuarantineReach()
        >>> reach.why_not(None) == NOT_REACHED
        True
        >>> reach.acts(None)
        >>> reach.cannot("b", "an IterableDataset and no index_key=")
        >>> reach.why_not(None), reach.why_not("b")
        (None, 'an IterableDataset and no index_key=')
    """

    acting: set[str | int | None] = field(default_factory=set)
    blocked: dict[str | int | None, str] = field(default_factory=dict)

    def acts(self, key: str | int | None = None) -> None:
        """Loader ``key`` removes quarantined records (by its batch sampler, or by cutting its batches)."""
        self.blocked.pop(key, None)
        self.acting.add(key)

    def cannot(self, key: str | int | None, why: str) -> None:
        """Loader ``key`` cannot remove quarantined records, because ``why``."""
        self.acting.discard(key)
        self.blocked[key] = why

    def why_not(self, key: str | int | None) -> str | None:
        """Why loader ``key`` keeps quarantined records (``None``: it removes them)."""
        return None if key in self.acting else self.blocked.get(key, NOT_REACHED)

    def clear(self) -> None:
        """Forget every loader (a new fit, or a new epoch's loaders, registers them again)."""
        self.acting.clear()
        self.blocked.clear()


@dataclass
class RemedyBook:
    """Which remedies are enabled, how often each was applied, and their state.

    Args:
        enabled: remedies to apply after an incident, in order.
        max_applications: cap per remedy.

    Attributes:
        quarantined: dataset indices the training loader never yields again; with several training
            loaders, indices every loader drops (a checkpoint of a version that kept one list).
        quarantined_by_loader: with several training loaders, each loader's own quarantine, by the
            loader's key (the same sets are held by the loaders' batch samplers).
        reach: which training loaders remove quarantined records (registered by the front-end; not
            saved: each fit registers its own loaders). :meth:`quarantine` says what is really done.
    """

    enabled: tuple[str, ...] = ()
    max_applications: int = 3
    applied: dict[str, int] = field(default_factory=dict)
    clip_threshold: float | None = None
    quarantined: set[int] = field(default_factory=set)
    module_eps: dict[str, float] = field(default_factory=dict)
    healthy_norms: deque[float] = field(default_factory=lambda: deque(maxlen=100))
    quarantined_by_loader: dict[str | int, set[int]] = field(default_factory=dict)
    reach: QuarantineReach = field(default_factory=QuarantineReach)

    def quarantine(self, indices: Iterable[int] = (), items: Iterable[tuple[str | int, int]] = ()) -> str | None:
        """Quarantine dataset ``indices`` (one loader) and ``items`` (``(loader key, index)``, several loaders).

        The sets are changed in place: the loaders hold them. Returns what is done, ``None`` when
        everything was quarantined already: "will not be trained on again" only for the loaders that
        remove the records (:attr:`reach`); for the others, that they will NOT be removed, and why.
        The indices are kept either way (saved in checkpoints: a later fit whose loader can remove
        them does).

        Example:
            >>> book = RemedyBook(enabled=("quarantine",))
            >>> book.reach.acts("a"), book.reach.acts("b")
            (None, None)
            >>> book.quarantine(items=[("b", 7), ("b", 9), ("a", 7)])
            "quarantine: dataset indices [7] of loader 'a', [7, 9] of loader 'b' will not be trained on again"
            >>> book.reach.cannot(None, "the training loader streams an IterableDataset and no index_key= is set")
            >>> book.quarantine([3])
            'quarantine: dataset indices [3] will NOT be removed from training: the training loader streams an \
IterableDataset and no index_key= is set'
            >>> book.quarantine(items=[("b", 7)]) is None
            True
        """
        new = set(indices) - self.quarantined
        self.quarantined.update(new)
        by_loader: dict[str | int, set[int]] = {}
        for key, index in items:
            own = self.quarantined_by_loader.setdefault(key, set())
            if index not in own:
                own.add(index)
                by_loader.setdefault(key, set()).add(index)
        parts: list[tuple[str, str | None]] = [(f"{sorted(new)}", self.reach.why_not(None))] if new else []
        parts += [
            (f"{sorted(found)} of loader {key!r}", self.reach.why_not(key))
            for key, found in sorted(by_loader.items(), key=_by_key)
        ]
        if not parts:
            return None
        removed = [what for what, why in parts if why is None]
        said = [f"dataset indices {', '.join(removed)} will not be trained on again"] if removed else []
        said += [f"dataset indices {what} will NOT be removed from training: {why}" for what, why in parts if why]
        return "quarantine: " + "; ".join(said)

    def can_apply(self, remedy: str) -> bool:
        """Enabled and below its cap."""
        return remedy in self.enabled and self.applied.get(remedy, 0) < self.max_applications

    def record(self, remedy: str) -> None:
        """Count one application."""
        self.applied[remedy] = self.applied.get(remedy, 0) + 1

    @property
    def total(self) -> int:
        """Applications of all remedies."""
        return sum(self.applied.values())

    def state_dict(self) -> dict[str, Any]:
        """Primitives only (``weights_only``-safe)."""
        return {
            "applied": dict(self.applied),
            "clip_threshold": self.clip_threshold,
            "quarantined": sorted(self.quarantined),
            "module_eps": dict(self.module_eps),
            "healthy_norms": list(self.healthy_norms),
            "quarantined_by_loader": [
                [key, sorted(found)] for key, found in sorted(self.quarantined_by_loader.items(), key=_by_key) if found
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.applied = {str(k): int(v) for k, v in state.get("applied", {}).items()}
        self.clip_threshold = state.get("clip_threshold")
        self.quarantined.clear()  # in place: the batch samplers hold this very set
        self.quarantined.update(int(i) for i in state.get("quarantined", []))
        for found in self.quarantined_by_loader.values():  # the same sets too (a checkpoint without them: emptied)
            found.clear()
        for key, found in state.get("quarantined_by_loader", []):
            self.quarantined_by_loader.setdefault(key if isinstance(key, int) else str(key), set()).update(
                int(i) for i in found
            )
        self.module_eps = {str(k): float(v) for k, v in state.get("module_eps", {}).items()}
        self.healthy_norms = deque((float(v) for v in state.get("healthy_norms", [])), maxlen=100)
