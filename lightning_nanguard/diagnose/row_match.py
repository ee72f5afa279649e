"""Does a row of a batch hold a given record? A tolerant comparison of a row with a re-read record.

:func:`record_matches` compares a batch of one row with a batch of one record (as the loader collates
it): the same structure (dict keys, dataclass fields, positions), and every leaf equal: tensors with
``allclose`` on the CPU (NaN equals NaN; the tolerance of the least precise dtype, so a row cast to
half precision still matches), integers and booleans exactly, strings and other values with ``==``.
A record padded into a longer row matches the row's leading region (right padding) or trailing
region (left padding) when the rest of the row is one padding value. A record that collates into
several rows (multi-crop) matches when one of its rows does. :func:`same_reads` tells whether two
reads of one record are the same (random augmentation or masking makes them differ).

Example:
    >>> row = torch.tensor([[7, 8, 0, 0]])  # right-padded to 4
    >>> record_matches(row, torch.tensor([[7, 8]])), record_matches(row, torch.tensor([[7, 9]]))
    (True, False)
"""

from __future__ import annotations

import dataclasses
import math
from collections import UserDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_nanguard.diagnose.batching import batch_size, slice_batch

__all__ = ["record_matches", "same_reads"]


def _leaves(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every leaf of a batch with its path (dict keys, fields, positions)."""
    if isinstance(obj, Tensor):
        yield path, obj
    elif isinstance(obj, UserDict | Mapping):
        for key, value in (obj.data if isinstance(obj, UserDict) else obj).items():
            yield from _leaves(value, (*path, ("key", key)))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _leaves(getattr(obj, f.name), (*path, ("field", f.name)))
    elif isinstance(obj, list | tuple):
        for position, value in enumerate(obj):
            yield from _leaves(value, (*path, position))
    else:
        yield path, obj


def _tolerance(*dtypes: torch.dtype) -> float:
    """Relative tolerance of the least precise floating dtype (a row cast to half still matches)."""
    eps = max((torch.finfo(d).eps for d in dtypes if d.is_floating_point), default=0.0)
    return max(1e-5, 2.0 * eps)


def _values_match(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape:
        return False
    if a.is_complex() or b.is_complex():
        return bool(torch.allclose(a.to(torch.complex128), b.to(torch.complex128), equal_nan=True))
    if a.is_floating_point() or b.is_floating_point():
        rtol = _tolerance(a.dtype, b.dtype)
        return bool(torch.allclose(a.double(), b.double(), rtol=rtol, atol=rtol * 1e-3, equal_nan=True))
    return bool(torch.equal(a.to(torch.int64), b.to(torch.int64)))


def _one_value(t: Tensor) -> bool:
    """All elements equal (NaN counts as equal to NaN): a padding region."""
    if t.numel() == 0:
        return True
    first = t.flatten()[0]
    if t.is_floating_point() and bool(torch.isnan(first)):
        return bool(torch.isnan(t).all())
    return bool((t == first).all())


def _region_matches(row: Tensor, record: Tensor, trailing: bool) -> bool:
    """The record in the row's leading (``trailing``: trailing) region, the rest of the row one padding value."""
    region = tuple(
        slice(size - kept, size) if trailing else slice(0, kept)
        for kept, size in zip(record.shape, row.shape, strict=True)
    )
    if not _values_match(row[region], record):
        return False
    padding = torch.ones(row.shape, dtype=torch.bool)
    padding[region] = False
    return _one_value(row[padding])


def _tensors_match(row: Tensor, record: Tensor) -> bool:
    row, record = row.detach().cpu(), record.detach().cpu()
    if row.shape == record.shape:
        return _values_match(row, record)
    if row.dim() != record.dim() or any(s > r for r, s in zip(row.shape, record.shape, strict=True)):
        return False  # not the record padded into a longer row
    return _region_matches(row, record, trailing=False) or _region_matches(row, record, trailing=True)


def _numpy_as_tensor(value: Any) -> Any:
    """A NumPy array or scalar as a tensor (a custom collate may keep them); anything else as it is."""
    if type(value).__module__ == "numpy" and hasattr(value, "shape"):
        try:
            return torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):  # object or string arrays
            return value
    return value


def _leaf_matches(row: Any, record: Any) -> bool:
    row, record = _numpy_as_tensor(row), _numpy_as_tensor(record)
    if isinstance(row, Tensor) or isinstance(record, Tensor):
        return isinstance(row, Tensor) and isinstance(record, Tensor) and _tensors_match(row, record)
    if isinstance(row, float) and isinstance(record, float) and math.isnan(row) and math.isnan(record):
        return True
    if isinstance(row, float) and isinstance(record, int | float):
        return math.isclose(row, record, rel_tol=1e-6)
    try:
        return bool(row == record)  # ints and bools exactly, strings, None
    except Exception:  # objects whose equality is not a bool (arrays): no match
        return False


def _whole_matches(row: Any, record: Any) -> bool:
    row_leaves, record_leaves = dict(_leaves(row)), dict(_leaves(record))
    if row_leaves.keys() != record_leaves.keys():
        return False
    return all(_leaf_matches(row_leaves[path], record_leaves[path]) for path in row_leaves)


def record_matches(row: Any, record: Any) -> bool:
    """Whether a batch of one ``row`` holds the record of ``record`` (a batch of that one record).

    Same structure; every leaf equal within tolerance (see the module docs). A record that collates
    into several rows (multi-crop) matches when one of its rows does.

    Example:
        >>> row = {"ids": torch.tensor([[0, 0, 5, 6]]), "name": ["b"]}  # left-padded to 4
        >>> record_matches(row, {"ids": torch.tensor([[5, 6]]), "name": ["b"]})
        True
        >>> record_matches(row, {"ids": torch.tensor([[5, 7]]), "name": ["b"]})
        False
    """
    if _whole_matches(row, record):
        return True
    try:
        count = batch_size(record)
    except TypeError:
        return False
    if count <= 1:
        return False
    return any(_whole_matches(row, slice_batch(record, [k], size=count)) for k in range(count))


def same_reads(first: Any, second: Any) -> bool:
    """Whether two reads of one record are the same (the same structure and shapes, values within tolerance).

    Example:
        >>> one = {"x": torch.ones(1, 2)}
        >>> same_reads(one, {"x": torch.ones(1, 2)}), same_reads(one, {"x": torch.zeros(1, 2)})
        (True, False)
    """
    a, b = dict(_leaves(first)), dict(_leaves(second))
    if a.keys() != b.keys():
        return False
    for path, left in a.items():
        right = b[path]
        if isinstance(left, Tensor) and isinstance(right, Tensor):
            if left.shape != right.shape or not _values_match(left.detach().cpu(), right.detach().cpu()):
                return False
        elif not _leaf_matches(left, right):
            return False
    return True
