"""Finiteness as a localisation tests it: of whole tensors, of the rows of chosen samples, of BatchNorm statistics.

:class:`Rows` restricts every test to the rows of the samples being followed (tensors whose first
dimension is the batch; with several training loaders, each loader's part by its size), so that
non-finite values healthy samples produce and mask on purpose are not mistaken for the origin.
A ``DTensor`` is tested on its local shard (no collective inside a traced pass), a sparse tensor
on the values it stores.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_nanguard.core.dtensor import local_tensor
from lightning_nanguard.core.host import all_true

__all__ = ["WHOLE", "Rows", "bn_bad_channels", "bn_channels_of", "finite", "floating"]


def floating(t: Any) -> bool:
    """Whether ``t`` is a floating-point or complex tensor (the only ones that can hold NaN/Inf)."""
    return isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex())


def finite(tensors: Sequence[Any]) -> bool:
    """Whether every floating-point (or complex) tensor among ``tensors`` is finite (one read per device).

    A ``DTensor`` is read on its local shard (no collective inside a traced pass); a sparse tensor on
    the values it stores.
    """
    return all_true([torch.isfinite(_stored(t)).all() for t in tensors if floating(t)])


def _stored(tensor: Tensor) -> Tensor:
    """The values of a tensor this rank holds: a ``DTensor``'s local shard, a sparse tensor's stored values."""
    tensor = local_tensor(tensor)
    return tensor.detach().coalesce().values() if tensor.is_sparse else tensor


class Rows:
    """Finiteness of the rows of chosen samples (tensors whose first dimension is the batch), or of whole tensors.

    With several training loaders each loader's part of the batch has its own size:
    :meth:`per_size` follows the chosen rows of each part by its size, and skips tensors whose first
    dimension is the size of a part without chosen rows (a healthy loader's).

    Example:
        >>> x = torch.tensor([[1.0], [float("nan")], [2.0]])
        >>> Rows([0, 2], 3).finite([x]), Rows(None, 3).finite([x])
        (True, False)
        >>> Rows.per_size({3: [1], 2: []}).finite([x]), Rows.per_size({3: [0], 2: []}).finite([x, x[:2] / 0])
        (False, True)
        >>> Rows(None, 3).nan_free([torch.tensor([float("-inf"), 1.0])])
        True
    """

    def __init__(self, rows: Sequence[int] | None, size: int | None) -> None:
        self.rows = list(rows) if rows is not None and size is not None else None
        self.size = size
        self._by_size: dict[int, list[int]] | None = (
            {size: self.rows} if self.rows is not None and size is not None else None
        )
        self._index: dict[tuple[int, torch.device], Tensor] = {}

    @classmethod
    def per_size(cls, rows_by_size: Mapping[int, Sequence[int]]) -> Rows:
        """Follow ``rows_by_size[n]`` in tensors whose first dimension is ``n`` (an empty list: skip them)."""
        follow = cls(None, None)
        follow._by_size = {int(n): list(rows) for n, rows in rows_by_size.items()}
        return follow

    def follows(self, t: Any) -> bool:
        """Whether ``t`` is tested by rows (its first dimension is a followed size), not whole."""
        if self._by_size is None or not floating(t):
            return False
        t = local_tensor(t)
        return t.dim() > 0 and not t.is_sparse and t.shape[0] in self._by_size

    def showing(self, tensors: Sequence[Any], nan_only: bool = False) -> Rows | None:
        """The test under which the NaN/Inf (``nan_only``: the NaN) of ``tensors`` is seen; ``None``: none is.

        ``self`` when the followed rows show it; :data:`WHOLE` when only tensors tested whole do (their
        first dimension is no followed size: a reshaped or reduced batch, a buffer). Inputs are
        to be judged by the same test as the outputs that showed it: judged by their followed rows,
        the inputs of an op that reshapes the batch would hide the very value it carries on (any row
        may have reached a tensor tested whole).

        Example:
            >>> x = torch.tensor([[1.0], [float("nan")], [2.0]])
            >>> follow = Rows([0], 3)
            >>> follow.showing([x]) is None, follow.showing([x.view(1, 3)]) is WHOLE, follow.showing([x / 0]) is follow
            (True, True, True)
            >>> WHOLE.finite([x])  # the reshaped NaN came from x: not born in the reshape
            False
        """
        check: Callable[[Sequence[Any]], bool] = self.nan_free if nan_only else self.finite
        followed = [t for t in tensors if self.follows(t)]
        if followed and not check(followed):
            return self
        whole = [t for t in tensors if floating(t) and not self.follows(t)]
        if whole and not (WHOLE.nan_free(whole) if nan_only else WHOLE.finite(whole)):
            return WHOLE
        return None

    def _view(self, t: Tensor) -> Tensor | None:
        """The part of ``t`` to test: its chosen rows, the whole tensor, or ``None`` (a healthy part's)."""
        t = local_tensor(t)
        if self._by_size is None or t.dim() == 0 or t.is_sparse:
            return _stored(t)
        rows = self._by_size.get(t.shape[0])
        if rows is None:
            return t
        if not rows:
            return None
        key = (t.shape[0], t.device)
        if key not in self._index:
            self._index[key] = torch.as_tensor(rows, dtype=torch.long, device=t.device)
        return t.detach().index_select(0, self._index[key])

    def _all(self, tensors: Sequence[Any], test: Callable[[Tensor], Tensor]) -> bool:
        checks = []
        for t in tensors:
            if floating(t):
                view = self._view(t)
                if view is not None:
                    checks.append(test(view))
        return all_true(checks)

    def finite(self, tensors: Sequence[Any]) -> bool:
        """Whether the followed rows of every floating-point tensor are finite."""
        return self._all(tensors, lambda t: torch.isfinite(t).all())

    def nan_free(self, tensors: Sequence[Any]) -> bool:
        """Whether the followed rows of every floating-point tensor hold no NaN (infinities allowed)."""
        return self._all(tensors, lambda t: ~torch.isnan(t).any())


WHOLE = Rows(None, None)
"""Every tensor tested whole (no rows followed)."""


def bn_bad_channels(bn: nn.Module) -> list[int]:
    """Channels of a BatchNorm whose running mean/var is non-finite (or whose variance is negative)."""
    mean, var = getattr(bn, "running_mean", None), getattr(bn, "running_var", None)
    if not isinstance(mean, Tensor) or not isinstance(var, Tensor):
        return []
    mean, var = local_tensor(mean), local_tensor(var)
    bad = ~torch.isfinite(var) | ~torch.isfinite(mean) | (var < 0)
    return [int(c) for c in bad.nonzero().flatten().tolist()]


def bn_channels_of(module: nn.Module) -> dict[str, list[int]]:
    """BatchNorm module name -> channels whose running statistics are non-finite (or a negative variance)."""
    found: dict[str, list[int]] = {}
    for name, child in module.named_modules():
        if isinstance(child, _BatchNorm):
            channels = bn_bad_channels(child)
            if channels:
                found[name] = channels
    return found
