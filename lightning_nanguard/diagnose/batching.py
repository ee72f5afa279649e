"""Size and slice arbitrary training batches along the sample dimension.

Bisection re-runs ``training_step`` on sub-batches, so it must cut a batch of any structure into
the samples it contains: tensors (first dimension), tuples, lists, namedtuples, dicts,
``UserDict`` (e.g. Hugging Face ``BatchEncoding``), dataclasses (frozen ones too), and
non-tensor leaves such as a list of strings with one entry per sample. Anything else can be
handled by a user slicer (``NanGuard(batch_slicer=...)`` or a ``nanguard_slice_batch`` method on
the LightningModule).

:func:`nonfinite_fields` finds, without running the model, which fields of a batch hold NaN/Inf
and in which samples.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections import UserDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeAlias

import torch
from torch import Tensor

__all__ = [
    "BatchField",
    "BatchSlicer",
    "UnsliceableBatchError",
    "batch_size",
    "join_batches",
    "nonfinite_fields",
    "slice_batch",
]

BatchSlicer = Callable[[Any, Sequence[int]], Any]
"""``slicer(batch, positions) -> sub_batch``: keep the samples at ``positions``, in that order."""


BatchField: TypeAlias = str | int
"""Where a tensor sits in a batch: a key or attribute (``"pixel_values"``), a position in a tuple or
list (``0``), a dotted path when nested (``"inputs.x"``, ``"0.x"``), or ``"<batch>"`` for a bare tensor."""


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


def join_batches(first: Any, second: Any) -> Any:
    """One batch holding the samples of ``first``, then those of ``second`` (two batches of one structure).

    The inverse of :func:`slice_batch`: tensors with a sample dimension are concatenated (``second``'s
    moved to ``first``'s device and dtype), lists of per-sample leaves are joined, and everything
    else (a tensor or value shared by all samples) must be equal in both.

    Raises:
        UnsliceableBatchError: the batches differ in structure, in a shared value, or in the shape
            of a sample (e.g. sequences padded to other lengths).

    Example:
        >>> joined = join_batches((torch.zeros(2, 3), ["a", "b"], 0.5), (torch.ones(1, 3), ["c"], 0.5))
        >>> joined[0].shape, joined[1], joined[2]
        (torch.Size([3, 3]), ['a', 'b', 'c'], 0.5)
        >>> join_batches(torch.zeros(2, 3), torch.zeros(2, 4))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_nanguard...UnsliceableBatchError: cannot join batches: a sample of shape (4,) next to ...
    """
    n, m = batch_size(first), batch_size(second)

    def shared(a: Any, b: Any) -> Any:
        same = torch.equal(a, b.to(a.device)) if isinstance(a, Tensor) and isinstance(b, Tensor) else a == b
        if not same:
            raise UnsliceableBatchError("cannot join batches: a value shared by all samples differs between them")
        return a

    def join(a: Any, b: Any) -> Any:
        if isinstance(a, Tensor) and isinstance(b, Tensor):
            if a.dim() > 0 and b.dim() > 0 and a.shape[0] == n and b.shape[0] == m:
                if a.shape[1:] != b.shape[1:]:
                    raise UnsliceableBatchError(
                        f"cannot join batches: a sample of shape {tuple(b.shape[1:])} next to samples of shape "
                        f"{tuple(a.shape[1:])}"
                    )
                return torch.cat([a, b.to(device=a.device, dtype=a.dtype)])
            return shared(a, b)
        if type(a) is not type(b):
            raise UnsliceableBatchError(f"cannot join a {type(a).__name__} and a {type(b).__name__}")
        if isinstance(a, UserDict | Mapping):
            if list(a.keys()) != list(b.keys()):
                raise UnsliceableBatchError("cannot join batches with different keys")
            items = {key: join(a[key], b[key]) for key in a}
            if isinstance(a, UserDict):
                clone: Any = copy.copy(a)
                clone.data = items
                return clone
            try:
                return type(a)(items)  # type: ignore[call-arg]
            except TypeError:
                return items
        if dataclasses.is_dataclass(a) and not isinstance(a, type):
            clone = copy.copy(a)
            for f in dataclasses.fields(a):
                object.__setattr__(clone, f.name, join(getattr(a, f.name), getattr(b, f.name)))
            return clone
        if _is_namedtuple(a):
            return type(a)(*(join(x, y) for x, y in zip(a, b, strict=True)))
        if isinstance(a, list | tuple):
            leaves = not any(isinstance(v, Tensor | Mapping | list | tuple) for v in [*a, *b])
            if leaves and len(a) == n and len(b) == m:
                joined = [*a, *b]  # per-sample leaves (strings, ids, ...)
            elif len(a) == len(b):
                joined = [join(x, y) for x, y in zip(a, b, strict=True)]
            else:
                raise UnsliceableBatchError("cannot join batches: lists of different lengths")
            return type(a)(joined) if isinstance(a, tuple) else joined
        return shared(a, b)

    return join(first, second)


def _named_tensors(batch: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Tensor]]:
    """Every tensor of ``batch`` with its path of keys, attribute names and positions."""
    if isinstance(batch, Tensor):
        yield path, batch
    elif isinstance(batch, Mapping | UserDict):
        for key, value in batch.items():
            yield from _named_tensors(value, (*path, key))
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for f in dataclasses.fields(batch):
            yield from _named_tensors(getattr(batch, f.name), (*path, f.name))
    elif _is_namedtuple(batch):
        for name, value in zip(batch._fields, batch, strict=True):
            yield from _named_tensors(value, (*path, name))
    elif isinstance(batch, list | tuple):
        for position, value in enumerate(batch):
            yield from _named_tensors(value, (*path, position))


def _field_name(path: tuple[Any, ...]) -> BatchField:
    if not path:
        return "<batch>"
    if len(path) == 1 and isinstance(path[0], str | int):
        return path[0]
    return ".".join(str(part) for part in path)


def _float(tensor: Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def _additive_mask(tensor: Tensor) -> bool:
    """Only ``0`` and ``-inf``: an additive attention mask (deliberate infinities)."""
    return not tensor.is_complex() and bool(((tensor == 0) | (tensor == -math.inf)).all())


def nonfinite_fields(
    batch: Any, size: int | None = None, slicer: BatchSlicer | None = None
) -> dict[BatchField, list[int] | None]:
    """Fields of ``batch`` holding NaN/Inf, each with the positions of the samples holding it.

    A tensor whose first dimension is the batch size is read per sample; a NaN/Inf elsewhere
    (a tensor shared by all samples) maps to ``None``: no sample is to blame for it. With a custom
    ``slicer`` (the layout is the user's), every sample is cut out and read on its own. A tensor
    holding only ``0`` and ``-inf`` is an additive attention mask, deliberate, and never reported.

    Args:
        batch: the batch, as ``training_step`` received it.
        size: number of samples (default: :func:`batch_size`).
        slicer: the batch slicer the diagnosis uses, when not the built-in one.

    Example:
        >>> x = torch.ones(4, 3)
        >>> x[2, 1] = float("nan")
        >>> nonfinite_fields({"x": x, "y": torch.zeros(4), "ids": torch.arange(4)})
        {'x': [2]}
        >>> nonfinite_fields((torch.full((2,), float("inf")), torch.ones(2)))
        {0: [0, 1]}
        >>> nonfinite_fields({"x": torch.ones(2, 3), "mask": torch.tensor([[0, 0, -math.inf], [0, 0, 0]])})
        {}
    """
    floats = [(path, t) for path, t in _named_tensors(batch) if _float(t)]
    if not floats:
        return {}
    whole = [bool(torch.isfinite(t).all()) for _, t in floats]  # bad steps only: one read per tensor is fine
    suspects = [
        (path, t) for (path, t), finite in zip(floats, whole, strict=True) if not finite and not _additive_mask(t)
    ]
    if not suspects:
        return {}
    n = size if size is not None else batch_size(batch)
    found: dict[BatchField, list[int] | None] = {}
    if slicer is not None and slicer is not slice_batch:
        per_sample: dict[tuple[Any, ...], list[int]] = {path: [] for path, _ in suspects}
        for position in range(n):
            for path, tensor in _named_tensors(slicer(batch, [position])):
                if path in per_sample and _float(tensor) and not bool(torch.isfinite(tensor).all()):
                    per_sample[path].append(position)
        # a NaN/Inf no single sample carries (the slicer dropped or reshaped the field) blames no sample
        return {_field_name(path): (samples or None) for path, samples in per_sample.items()}
    for path, tensor in suspects:
        name = _field_name(path)
        if tensor.dim() > 0 and tensor.shape[0] == n:
            bad_rows = ~torch.isfinite(tensor.reshape(n, -1)).all(dim=1)
            found[name] = [int(i) for i in bad_rows.nonzero().flatten().tolist()]
        else:
            found[name] = None
    return found
