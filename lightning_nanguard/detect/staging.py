"""Many small tensors copied into one flat buffer with a few kernels, so that one reduction reads them all.

:class:`Staging` is built once for a list layout (the shapes, in order) and reused every step:
tensors of a shape that occurs more than once are copied by one ``torch.stack`` per shape (a plain
copy per tensor, ~4x cheaper than ``_foreach_copy_`` on a CPU), the others by one
``_foreach_copy_``. Which tensors of the list each kernel takes is kept as a slice where the
positions are evenly spaced (a model's layers alternate weight and bias: ``[0::2]``, ``[1::2]``),
so picking them costs no Python per tensor. The sources are only read.

Example:
    >>> tensors = [torch.ones(2, 2), torch.zeros(3), torch.ones(2, 2), torch.zeros(3), torch.ones(1)]
    >>> staging = Staging(tensors)
    >>> staging.load(tensors).sum().item()
    9.0
    >>> staging.stacks[0][0]
    slice(0, 3, 2)
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch
from torch import Tensor

__all__ = ["STAGING", "LayoutPlans", "Selector", "Staging", "pick", "selector", "staged"]

Selector = slice | list[int]
"""Positions in a list of tensors: a slice when evenly spaced, else their indices."""

_CACHE_SIZE = 32

_Plan = TypeVar("_Plan")


def selector(positions: Sequence[int]) -> Selector:
    """``positions`` (increasing) as a slice when they are evenly spaced, else as a list.

    Examples:
        >>> selector([1, 3, 5]), selector([4]), selector([0, 1, 3])
        (slice(1, 6, 2), slice(4, 5, 1), [0, 1, 3])
    """
    if len(positions) == 1:
        return slice(positions[0], positions[0] + 1, 1)
    step = positions[1] - positions[0] if len(positions) > 1 else 0
    if step > 0 and all(b - a == step for a, b in itertools.pairwise(positions)):
        return slice(positions[0], positions[-1] + 1, step)
    return list(positions)


def pick(tensors: Sequence[Tensor], chosen: Selector) -> list[Tensor]:
    """The tensors of ``tensors`` at ``chosen`` (a slice of a list is taken in C, no Python per tensor)."""
    if isinstance(chosen, slice):
        picked = tensors[chosen]
        return picked if isinstance(picked, list) else list(picked)
    return [tensors[i] for i in chosen]


class Staging:
    """A flat buffer of one device and dtype that many tensors are copied into (see module docs).

    Args:
        like: tensors of the layout (one device and dtype, dense).
        positions: where ``like[i]`` sits in the lists :meth:`load` receives (default: ``i``).
        kind: the buffer's device and dtype (default: ``like[0]``'s; needed when ``like`` is empty).
        tail: elements after the staged ones (:attr:`tail`, a view): :meth:`load` copies its
            ``tail_sources`` (one element each) into their first slots with the same
            ``_foreach_copy_``, the last ones are the caller's (e.g. a total written there).
    """

    def __init__(
        self,
        like: Sequence[Tensor],
        positions: Sequence[int] | None = None,
        tail: int = 0,
        kind: tuple[torch.device, torch.dtype] | None = None,
    ) -> None:
        device, dtype = kind if kind is not None else (like[0].device, like[0].dtype)
        at = list(range(len(like))) if positions is None else list(positions)
        staged_numel = sum(t.numel() for t in like)
        self.flat = torch.empty(staged_numel + tail, dtype=dtype, device=device)
        self.tail = self.flat[staged_numel:]
        self.tail_views = list(self.tail.unbind()) if tail else []
        by_shape: dict[torch.Size, list[int]] = {}
        for index, tensor in enumerate(like):
            by_shape.setdefault(tensor.shape, []).append(index)
        self.stacks: list[tuple[Selector, torch.Size, Tensor]] = []
        singles: list[int] = []
        self.single_views: list[Tensor] = []
        offset = 0
        for shape, indices in by_shape.items():
            size = like[indices[0]].numel() * len(indices)
            view = self.flat[offset : offset + size].view(len(indices), *shape)
            offset += size
            if len(indices) > 1:
                self.stacks.append((selector([at[i] for i in indices]), shape, view))
            else:
                singles.append(at[indices[0]])
                self.single_views.append(view[0])
        self.singles: Selector | None = selector(singles) if singles else None  # the tensors copied one by one
        self._copy_views: dict[int, list[Tensor]] = {}  # the views one _foreach_copy_ writes, by tail sources

    def load(self, tensors: Sequence[Tensor], tail_sources: Sequence[Tensor] = ()) -> Tensor:
        """Copy the tensors (and ``tail_sources`` into the tail) into the buffer and return it.

        ``RuntimeError`` for a list of other shapes.
        """
        for chosen, shape, view in self.stacks:
            picked = pick(tensors, chosen)
            if picked[0].shape != shape:
                raise RuntimeError("other shapes than the staging buffer was built for")
            torch.stack(picked, out=view)  # checks every shape and the count
        if self.singles is not None or tail_sources:
            views = self._copy_views.get(len(tail_sources))
            if views is None:
                views = self._copy_views[len(tail_sources)] = self.single_views + self.tail_views[: len(tail_sources)]
            singles = self.singles
            if singles is None:
                sources: Sequence[Tensor] = ()
            else:  # positions evenly spaced (most layouts): a slice taken in C
                sources = tensors[singles] if isinstance(singles, slice) else [tensors[i] for i in singles]
            torch._foreach_copy_(views, [*sources, *tail_sources])
        return self.flat


class LayoutPlans(Generic[_Plan]):
    """Plans made once per layout, a list of tensors kept from step to step (the parameters of a step).

    Keyed by the list's identity; each list is held beside its plan, so its id cannot be reused while it
    is cached. The oldest of more than 32 layouts is dropped.

    Example:
        >>> plans = LayoutPlans(len)
        >>> layout = [torch.ones(2), torch.ones(3)]
        >>> plans.of(layout), plans.of(layout), plans.of(list(layout))  # the third list is another layout
        (2, 2, 2)
        >>> len(plans)
        2
    """

    def __init__(self, make: Callable[[list[Tensor]], _Plan]) -> None:
        self._make = make
        self._plans: OrderedDict[int, tuple[list[Tensor], _Plan]] = OrderedDict()

    def of(self, layout: list[Tensor]) -> _Plan:
        """The plan of ``layout``, made on its first use."""
        held = self._plans.get(id(layout))
        if held is not None and held[0] is layout:
            return held[1]
        plan = self._make(layout)
        self._plans[id(layout)] = (layout, plan)
        while len(self._plans) > _CACHE_SIZE:
            self._plans.popitem(last=False)
        return plan

    def __len__(self) -> int:
        return len(self._plans)


STAGING: OrderedDict[tuple[torch.device, torch.dtype, tuple[int, ...]], Staging] = OrderedDict()
"""Staging buffers by device, dtype and sizes, most recently used last."""


def staged(tensors: list[Tensor], sizes: list[int]) -> Tensor:
    """A flat copy of ``tensors`` (one device and dtype, dense; ``sizes`` their numels) through a cached buffer."""
    key = (tensors[0].device, tensors[0].dtype, tuple(sizes))
    staging = STAGING.get(key)
    if staging is not None:
        STAGING.move_to_end(key)
        try:
            return staging.load(tensors)
        except RuntimeError:  # the same sizes in other shapes: rebuild
            pass
    staging = STAGING[key] = Staging(tensors)
    while len(STAGING) > _CACHE_SIZE:
        STAGING.popitem(last=False)
    return staging.load(tensors)
