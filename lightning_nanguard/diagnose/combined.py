"""Batches of several training loaders: each loader's part of the batch is cut on its own.

``trainer.fit(model, train_dataloaders={"a": loader_a, "b": loader_b})`` (a list, a nested
collection or a ``CombinedLoader`` alike) gives ``training_step`` the loaders' batches in the same
collection, ``{"a": batch_a, "b": batch_b}``. Each part holds its own samples, often a different
number of them, so a sample of such a batch is a loader and a position in that loader's part.

:class:`CombinedLayout` says where each loader's part sits in the batch (its *key*: the dict key or
list position, dotted when nested, e.g. ``"b"``, ``1``, ``"tasks.0"``). :class:`CombinedBatch`
numbers the samples flat, part after part in the layout's order (with parts of 4 and 3 samples,
``a[0..3]`` are 0..3 and ``b[0..2]`` are 4..6), and cuts every part on its own. A part may not be
left empty (the loss of its loader would be undefined, e.g. a mean over no sample): the caller
adds a sample of that part known to be healthy, a *filler*. A part that is ``None`` (a loader
exhausted in ``CombinedLoader(mode="max_size")``) has no samples and is left as it is.

Example:
    >>> layout = CombinedLayout.from_paths([("a",), ("b",)])
    >>> batch = {"a": torch.arange(4), "b": torch.arange(10, 13)}
    >>> combined = CombinedBatch(batch, layout)
    >>> combined.keys, combined.sizes, combined.locate(5)
    (('a', 'b'), (4, 3), ('b', 1))
    >>> cut = combined.cut([1, 5, 6])
    >>> cut["a"].tolist(), cut["b"].tolist()
    ([1], [11, 12])
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch  # noqa: F401 (doctests)

from lightning_nanguard.diagnose.batching import (
    BatchField,
    BatchSlicer,
    UnsliceableBatchError,
    batch_size,
    nonfinite_fields,
    slice_batch,
)

__all__ = [
    "CombinedBatch",
    "CombinedIndices",
    "CombinedLayout",
    "LoaderKey",
    "LoaderPart",
    "LoaderSplit",
    "loader_key",
]

LoaderKey: TypeAlias = str | int
"""A training loader in a combined collection: its dict key or list position; a dotted path when nested."""

PathPart: TypeAlias = str | int


def loader_key(path: Sequence[PathPart]) -> LoaderKey:
    """The key of the loader at ``path`` in the collection.

    Example:
        >>> loader_key(["b"]), loader_key([1]), loader_key(["tasks", 0])
        ('b', 1, 'tasks.0')
    """
    if len(path) == 1:
        return path[0]
    return ".".join(str(part) for part in path)


def _is_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


_MISSING = object()


def _child(obj: Any, part: PathPart) -> Any:
    """``obj[part]`` (or the field ``part`` of a namedtuple); :data:`_MISSING` when there is none."""
    try:
        if isinstance(obj, Mapping):
            return obj[part]
        if _is_namedtuple(obj) and isinstance(part, str):
            return getattr(obj, part)
        if isinstance(obj, list | tuple) and isinstance(part, int):
            return obj[part]
    except (KeyError, IndexError, AttributeError):
        pass
    return _MISSING


def _with_child(obj: Any, part: PathPart, value: Any) -> Any:
    """A shallow copy of the container ``obj`` with ``part`` replaced by ``value``."""
    if isinstance(obj, Mapping):
        items = {**obj, part: value}
        try:
            return type(obj)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if _is_namedtuple(obj):
        return obj._replace(**{part: value}) if isinstance(part, str) else type(obj)(*_replaced(obj, part, value))
    if isinstance(obj, list):
        return _replaced(obj, int(part), value)
    if isinstance(obj, tuple):
        return tuple(_replaced(obj, int(part), value))
    raise UnsliceableBatchError(f"cannot rebuild a {type(obj).__name__} holding a loader's batch")


def _replaced(items: Sequence[Any], position: PathPart, value: Any) -> list[Any]:
    out = list(items)
    out[int(position)] = value
    return out


@dataclass(frozen=True)
class LoaderPart:
    """One loader's part of a combined batch: its key and the path of keys and positions leading to it."""

    key: LoaderKey
    path: tuple[PathPart, ...]


@dataclass(frozen=True)
class CombinedLayout:
    """Where each training loader's part sits in a combined batch (see the module docs).

    Example:
        >>> layout = CombinedLayout.from_paths([("x", 0), ("x", 1), ("y",)])
        >>> layout.keys
        ('x.0', 'x.1', 'y')
        >>> CombinedLayout.from_json(layout.to_json()) == layout
        True
    """

    parts: tuple[LoaderPart, ...]

    @classmethod
    def from_paths(cls, paths: Iterable[Sequence[PathPart]]) -> CombinedLayout:
        """The layout of the loaders at ``paths``, in the order the loaders were flattened."""
        return cls(tuple(LoaderPart(loader_key(path), tuple(path)) for path in paths))

    @property
    def keys(self) -> tuple[LoaderKey, ...]:
        return tuple(part.key for part in self.parts)

    def part(self, batch: Any, index: int) -> Any:
        """The batch of loader ``index`` (``None`` for an exhausted loader).

        Raises:
            UnsliceableBatchError: the batch does not have the layout's shape.
        """
        node = batch
        for step in self.parts[index].path:
            node = _child(node, step)
            if node is _MISSING:
                raise UnsliceableBatchError(
                    f"the batch has no part for training loader {self.parts[index].key!r}: it is not the "
                    "collection of the loaders' batches (changed in a hook such as on_after_batch_transfer?)"
                )
        return node

    def matches(self, batch: Any) -> bool:
        """Whether every loader's part can be found in ``batch``."""
        try:
            for index in range(len(self.parts)):
                self.part(batch, index)
        except UnsliceableBatchError:
            return False
        return True

    def with_parts(self, batch: Any, parts: Mapping[int, Any]) -> Any:
        """A copy of ``batch`` (containers only) with the parts of the loaders ``parts`` names replaced."""

        def rebuild(node: Any, depth: int, indices: list[int]) -> Any:
            done = [i for i in indices if len(self.parts[i].path) == depth]
            if done:
                return parts[done[0]]
            by_step: dict[PathPart, list[int]] = {}
            for i in indices:
                by_step.setdefault(self.parts[i].path[depth], []).append(i)
            for step, below in by_step.items():
                node = _with_child(node, step, rebuild(_child(node, step), depth + 1, below))
            return node

        return rebuild(batch, 0, list(parts))

    def to_json(self) -> list[dict[str, Any]]:
        """``[{"key": ..., "path": [...]}, ...]`` (saved in repro bundles)."""
        return [{"key": part.key, "path": list(part.path)} for part in self.parts]

    @classmethod
    def from_json(cls, data: Sequence[Mapping[str, Any]]) -> CombinedLayout:
        """Read :meth:`to_json` output back."""
        return cls(tuple(LoaderPart(item["key"], tuple(item["path"])) for item in data))


@dataclass(frozen=True)
class LoaderSplit:
    """The loaders of a combined batch that hold samples, and how many each: flat positions to ``(key, position)``.

    Example:
        >>> split = LoaderSplit(("a", "b"), (4, 3))
        >>> split.locate(3), split.locate(4), split.flat("b", 2)
        (('a', 3), ('b', 0), 6)
    """

    keys: tuple[LoaderKey, ...]
    sizes: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def part_of(self, flat: int) -> int:
        """Index (among :attr:`keys`) of the loader holding flat position ``flat``."""
        start = 0
        for index, size in enumerate(self.sizes):
            if flat < start + size:
                return index
            start += size
        raise IndexError(f"position {flat} is outside the {self.total} samples of the batch")

    def start(self, index: int) -> int:
        """Flat position of the first sample of loader ``index``."""
        return sum(self.sizes[:index])

    def locate(self, flat: int) -> tuple[LoaderKey, int]:
        """``(loader key, position in that loader's part)`` of flat position ``flat``."""
        index = self.part_of(flat)
        return self.keys[index], flat - self.start(index)

    def flat(self, key: LoaderKey, position: int) -> int:
        """The flat position of ``position`` in the part of loader ``key``."""
        index = self.keys.index(key)
        return self.start(index) + position


@dataclass(frozen=True)
class CombinedIndices:
    """The dataset indices of a combined batch: one list per loader of the layout (``None``: unknown).

    Attributes:
        layout: where each loader's part sits in the batch.
        indices: per loader of the layout, the dataset indices of its part, in batch order.
        unknown: per loader, why its indices are unknown (empty when known).
        mismatch: why the batch does not have the layout's shape (empty when it does): the loader of
            a sample cannot be known, and nothing of the layout applies to this batch.
    """

    layout: CombinedLayout
    indices: tuple[list[int] | None, ...]
    unknown: tuple[str, ...] = ()
    mismatch: str = ""

    def flat(self, split: LoaderSplit) -> list[int | None]:
        """Dataset indices aligned with the flat positions of ``split`` (``None`` where unknown).

        Example:
            >>> layout = CombinedLayout.from_paths([("a",), ("b",)])
            >>> CombinedIndices(layout, ([7, 9], None)).flat(LoaderSplit(("a", "b"), (2, 1)))
            [7, 9, None]
        """
        out: list[int | None] = []
        for key, size in zip(split.keys, split.sizes, strict=True):
            recorded = self.indices[self.layout.keys.index(key)]
            out.extend(recorded if recorded is not None and len(recorded) == size else [None] * size)
        return out

    def why_unknown(self, keys: Iterable[LoaderKey]) -> str | None:
        """Why the dataset indices of loaders ``keys`` are unknown, ``None`` when they are all known."""
        reasons = []
        for key in dict.fromkeys(keys):
            index = self.layout.keys.index(key)
            if self.indices[index] is None:
                reason = self.unknown[index] if index < len(self.unknown) and self.unknown[index] else "not recorded"
                reasons.append(f"loader {key!r}: {reason}")
        return "; ".join(reasons) or None


class CombinedBatch:
    """A combined batch bound to its layout: the loaders holding samples, their sizes, flat positions, cutting.

    Args:
        batch: the batch ``training_step`` received.
        layout: where each loader's part sits.
        slicer: cuts one loader's part (default :func:`~lightning_nanguard.diagnose.batching.slice_batch`).
        size_of: the number of samples of one loader's part (default
            :func:`~lightning_nanguard.diagnose.batching.batch_size`).

    Raises:
        UnsliceableBatchError: the batch does not have the layout's shape, or a part has no readable size.
    """

    def __init__(
        self,
        batch: Any,
        layout: CombinedLayout,
        slicer: BatchSlicer | None = None,
        size_of: Callable[[Any], int] | None = None,
    ) -> None:
        self.batch = batch
        self.layout = layout
        self.slicer: BatchSlicer = slicer if slicer is not None else slice_batch
        sizing = size_of if size_of is not None else batch_size
        self._active: list[int] = []  # layout indices of the parts holding samples
        parts, sizes = [], []
        for index in range(len(layout.parts)):
            part = layout.part(batch, index)
            if part is None:
                continue
            size = sizing(part)
            if size > 0:
                self._active.append(index)
                parts.append(part)
                sizes.append(size)
        self.parts: list[Any] = parts
        self.split = LoaderSplit(tuple(layout.parts[i].key for i in self._active), tuple(sizes))

    @property
    def keys(self) -> tuple[LoaderKey, ...]:
        return self.split.keys

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.split.sizes

    @property
    def total(self) -> int:
        return self.split.total

    def locate(self, flat: int) -> tuple[LoaderKey, int]:
        return self.split.locate(flat)

    def part_of(self, flat: int) -> int:
        return self.split.part_of(flat)

    def flat(self, part: int, position: int) -> int:
        return self.split.start(part) + position

    def group(self, positions: Iterable[int]) -> list[list[int]]:
        """The local positions of each part among the flat ``positions``, in the order given."""
        groups: list[list[int]] = [[] for _ in self.parts]
        for flat in positions:
            part = self.part_of(flat)
            groups[part].append(flat - self.split.start(part))
        return groups

    def cut(self, positions: Sequence[int]) -> Any:
        """The batch with every loader's part cut to its samples among the flat ``positions``.

        Raises:
            UnsliceableBatchError: a loader holding samples would be left with none.
        """
        groups = self.group(positions)
        empty = [self.keys[i] for i, group in enumerate(groups) if not group]
        if empty:
            raise UnsliceableBatchError(f"the part of loader(s) {empty} would be left empty")
        replaced = {
            layout_index: self.slicer(part, group)
            for layout_index, part, group in zip(self._active, self.parts, groups, strict=True)
        }
        return self.layout.with_parts(self.batch, replaced)

    def first_rows(self, count: int) -> list[int]:
        """The first ``count`` samples of every part (fewer where a part is smaller), flat."""
        return [self.flat(part, p) for part, size in enumerate(self.sizes) for p in range(min(count, size))]

    def rows(self, count: int, spread: bool = True) -> list[list[int]]:
        """``count`` groups of one sample per loader, spread over each part (middles of its ``count`` slices).

        With ``spread`` the groups use distinct samples of every part, and there are none when a part
        has fewer than ``count`` samples; without it small parts repeat their samples.

        Example:
            >>> layout = CombinedLayout.from_paths([("a",), ("b",)])
            >>> combined = CombinedBatch({"a": torch.arange(6), "b": torch.arange(3)}, layout)
            >>> combined.rows(3)
            [[1, 6], [3, 7], [5, 8]]
        """
        if spread and any(size < count for size in self.sizes):
            return []
        return [
            [self.flat(part, ((2 * i + 1) * size // (2 * count)) % size) for part, size in enumerate(self.sizes)]
            for i in range(count)
        ]

    def rows_by_size(self, positions: Iterable[int]) -> dict[int, list[int]]:
        """Local rows of the flat ``positions`` by part size (for following them in tensors of that first dimension).

        Parts of the same size share their rows; a size whose parts hold none of ``positions`` maps to ``[]``.
        """
        by_size: dict[int, set[int]] = {size: set() for size in self.sizes}
        for part, group in enumerate(self.group(positions)):
            by_size[self.sizes[part]].update(group)
        return {size: sorted(rows) for size, rows in by_size.items()}

    def nonfinite_fields(self, slicer: BatchSlicer | None = None) -> dict[BatchField, list[int] | None]:
        """:func:`~lightning_nanguard.diagnose.batching.nonfinite_fields` of every part, with flat positions.

        Field names are prefixed with the loader's path (``"b.x"``; ``"b"`` for a bare tensor).
        """
        found: dict[BatchField, list[int] | None] = {}
        for part_index, (layout_index, part, size) in enumerate(zip(self._active, self.parts, self.sizes, strict=True)):
            prefix = ".".join(str(step) for step in self.layout.parts[layout_index].path)
            for name, samples in nonfinite_fields(part, size, slicer).items():
                field = prefix if name == "<batch>" else f"{prefix}.{name}"
                found[field] = None if samples is None else [self.flat(part_index, p) for p in samples]
        return found
