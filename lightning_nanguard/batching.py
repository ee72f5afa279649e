"""Size and slice arbitrary training batches along the sample dimension.

Bisection re-runs ``training_step`` on sub-batches, so it must cut a batch of any structure into
the samples it contains: tensors (first dimension), tuples, lists, namedtuples, dicts,
``UserDict`` (e.g. Hugging Face ``BatchEncoding``), dataclasses (frozen ones too), and
non-tensor leaves such as a list of strings with one entry per sample. Anything else can be
handled by a user slicer (``NanGuard(batch_slicer=...)`` or a ``nanguard_slice_batch`` method on
the LightningModule).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import UserDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["BatchSlicer", "UnsliceableBatchError", "batch_size", "slice_batch"]

BatchSlicer = Callable[[Any, Sequence[int]], Any]
"""``slicer(batch, positions) -> sub_batch``: keep the samples at ``positions``, in that order."""


class UnsliceableBatchError(TypeError):
    """The batch has no tensor with a sample dimension, or its parts disagree about the size."""


def _is_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def _children(batch: Any) -> list[Any]:
    if isinstance(batch, Tensor):
        return []
    if isinstance(batch, Mapping | UserDict):
        return list(batch.values())
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    if isinstance(batch, list | tuple):
        return list(batch)
    return []


def _tensor_sizes(batch: Any) -> list[int]:
    if isinstance(batch, Tensor):
        return [batch.shape[0]] if batch.dim() > 0 else []
    return [size for child in _children(batch) for size in _tensor_sizes(child)]


def batch_size(batch: Any) -> int:
    """Number of samples: the first dimension shared by the batch's tensors.

    Raises:
        UnsliceableBatchError: no tensor with a first dimension, or tensors that disagree.

    Example:
        >>> batch_size({"x": torch.zeros(4, 3), "y": torch.zeros(4), "names": ["a", "b", "c", "d"]})
        4
    """
    sizes = set(_tensor_sizes(batch))
    if len(sizes) != 1:
        found = sorted(sizes) if sizes else "no tensor with a sample dimension"
        raise UnsliceableBatchError(
            f"cannot tell the batch size of a {type(batch).__name__} batch (first dimensions: {found}); "
            "pass `NanGuard(batch_slicer=...)` or define `nanguard_slice_batch(batch, positions)` on the module"
        )
    return sizes.pop()


def slice_batch(batch: Any, positions: Sequence[int], size: int | None = None) -> Any:
    """Keep the samples at ``positions`` (in that order) in every part of ``batch``.

    Tensors whose first dimension equals the batch size are indexed; lists/tuples of non-tensor
    leaves with one entry per sample are sliced too; everything else is passed through unchanged.

    Example:
        >>> sub = slice_batch((torch.arange(5), ["a", "b", "c", "d", "e"], 0.5), [1, 3])
        >>> sub[0].tolist(), sub[1], sub[2]
        ([1, 3], ['b', 'd'], 0.5)
    """
    n = batch_size(batch) if size is None else size
    index_cache: dict[torch.device, Tensor] = {}

    def index_on(device: torch.device) -> Tensor:
        if device not in index_cache:
            index_cache[device] = torch.as_tensor(list(positions), dtype=torch.long, device=device)
        return index_cache[device]

    def cut(obj: Any) -> Any:
        if isinstance(obj, Tensor):
            if obj.dim() > 0 and obj.shape[0] == n:
                return obj.index_select(0, index_on(obj.device))
            return obj
        if isinstance(obj, UserDict):
            clone: Any = copy.copy(obj)
            clone.data = {key: cut(value) for key, value in obj.data.items()}
            return clone
        if isinstance(obj, Mapping):
            items = {key: cut(value) for key, value in obj.items()}
            try:
                return type(obj)(items)  # type: ignore[call-arg]
            except TypeError:
                return items
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            clone = copy.copy(obj)  # shallow: fields are replaced below
            for f in dataclasses.fields(obj):
                object.__setattr__(clone, f.name, cut(getattr(obj, f.name)))
            return clone
        if _is_namedtuple(obj):
            return type(obj)(*(cut(value) for value in obj))
        if isinstance(obj, list | tuple):
            if len(obj) == n and not any(isinstance(v, Tensor | Mapping | list | tuple) for v in obj):
                picked = [obj[i] for i in positions]  # per-sample leaves (strings, ids, ...)
            else:
                picked = [cut(value) for value in obj]
            return type(obj)(picked) if isinstance(obj, tuple) else picked
        return obj

    return cut(batch)
