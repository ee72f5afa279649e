"""Confirm the bad path element by element: which tensors really hold NaN/Inf (or a negative variance).

The per-step check (:mod:`~lightning_nanguard.detect.check`) flags a *candidate*: a finite tensor
can overflow its sum or norm. These functions run only on a flagged step and name the tensors,
with one host read per device in all. A sharded tensor (``DTensor``) is read on its local shard:
the caller agrees with the other ranks when what they found must be shared.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from lightning_nanguard.core.dtensor import local_tensor
from lightning_nanguard.core.host import read_flags
from lightning_nanguard.detect.check import _dense, nonfinite_candidate

__all__ = ["all_finite", "bad_batchnorm_names", "negative_names", "nonfinite_names"]


def nonfinite_names(named_tensors: Iterable[tuple[str, Tensor]]) -> list[str]:
    """Names of the tensors holding at least one NaN or +/-Inf element (one host read in all).

    Examples:
        >>> nonfinite_names([("a", torch.ones(2)), ("b", torch.tensor([float("-inf")]))])
        ['b']
    """
    names, tensors = _unzip(named_tensors)
    if not tensors:
        return []
    finite = read_flags([torch.isfinite(t).all() for t in _dense(tensors)])
    return [name for name, ok in zip(names, finite, strict=True) if not ok]


def negative_names(named_tensors: Iterable[tuple[str, Tensor]]) -> list[str]:
    """Names of the tensors holding at least one negative element (e.g. a corrupted ``running_var``).

    Examples:
        >>> negative_names([("var", torch.tensor([1.0, -2.0])), ("ok", torch.ones(1))])
        ['var']
    """
    names, tensors = _unzip(named_tensors)
    if not tensors:
        return []
    negative = read_flags([(t < 0).any() for t in tensors])
    return [name for name, bad in zip(names, negative, strict=True) if bad]


def bad_batchnorm_names(named_buffers: Iterable[tuple[str, Tensor]]) -> list[str]:
    """BatchNorm buffers holding NaN/Inf, then ``running_var`` buffers holding a negative value.

    Examples:
        >>> bad_batchnorm_names([("bn.running_mean", torch.tensor([float("nan")])),
        ...                      ("bn.running_var", torch.tensor([-1.0]))])
        ['bn.running_mean', 'bn.running_var']
    """
    floats = [(name, tensor) for name, tensor in named_buffers if tensor.is_floating_point()]
    bad = nonfinite_names(floats)
    negative = negative_names((name, tensor) for name, tensor in floats if name.endswith("running_var"))
    return bad + [name for name in negative if name not in bad]


def all_finite(tensors: Sequence[Tensor], planned: bool = False) -> bool:
    """Element-wise: no NaN/Inf in any of ``tensors`` (floating/complex; others are ignored).

    One fused pass (the staged sums of :func:`~lightning_nanguard.detect.check.nonfinite_candidate`:
    a few kernels whatever the number of tensors, none per tensor) and one host read; only when a
    total is non-finite (which finite values can also cause, by overflowing it) are the tensors
    checked element by element. Tensors that require grad are read as they are (no ``detach``).
    ``planned``: ``tensors`` is a list of local floating-point tensors kept from call to call (see
    :class:`~lightning_nanguard.detect.weights.ModuleWeights`): it is checked through its layout's
    plan, made once, with no Python per tensor.

    Examples:
        >>> all_finite([torch.ones(2), torch.full((4,), 1e30)])  # the float32 norm overflows
        True
        >>> all_finite([torch.tensor([1.0, float("nan")]), torch.arange(3)])
        False
    """
    with torch.no_grad():
        if planned and isinstance(tensors, list):
            floats = tensors
            candidate = nonfinite_candidate(floats, layout=floats) if floats else None
        else:
            floats = [local_tensor(t) for t in tensors if t.is_floating_point() or t.is_complex()]
            candidate = nonfinite_candidate(floats) if floats else None
        if candidate is None or not bool(candidate):
            return True
        return not nonfinite_names((str(i), t) for i, t in enumerate(floats))


def _unzip(named_tensors: Iterable[tuple[str, Tensor]]) -> tuple[list[str], list[Tensor]]:
    pairs = list(named_tensors)
    return [name for name, _ in pairs], [local_tensor(tensor.detach()) for _, tensor in pairs]
