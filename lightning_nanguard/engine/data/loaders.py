"""The training loaders of a fit, one or several, and the dataset indices of each batch they give.

``trainer.fit`` takes one training loader, or several in a collection (a dict, a list, nested
ones, a ``CombinedLoader``); Lightning then iterates every loader with its own sampler and gives
``training_step`` their batches in the same collection (``trainer.train_dataloader`` is that
collection). :class:`TrainingLoaders` reads it once per epoch, before the epoch's first batch is
fetched:

- the layout of the combined batch (:class:`~lightning_nanguard.diagnose.combined.CombinedLayout`:
  each loader's key and where its part sits), ``None`` for a bare loader;
- each loader's recording batch sampler (:mod:`~lightning_nanguard.engine.data.indices`), so the indices
  of a batch are popped from the FIFO of the loader that gave that part, and only when it gave
  one (an exhausted loader of ``CombinedLoader(mode="max_size")`` gives ``None``);
- each loader's quarantine: the indices quarantined for that loader, and those of an older
  checkpoint's flat list (which applied to every loader), dropped by its batch sampler or, for a
  loader without one whose batches carry an index field, cut out of its batches
  (:mod:`~lightning_nanguard.engine.data.streams`); or why the quarantine cannot act on it;
- each loader's :class:`~lightning_nanguard.engine.data.readers.RecordReader`, which reads a record again
  at an incident to check that an index names the record really in its row.

Example:
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> from lightning_nanguard.engine.data.indices import record_batch_indices
    >>> a = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=4)
    >>> b = DataLoader(TensorDataset(torch.arange(6.0)), batch_size=3)
    >>> loaders = TrainingLoaders.of({"a": a, "b": b}, record=record_batch_indices)
    >>> loaders.layout.keys
    ('a', 'b')
    >>> batch = {"a": next(iter(a)), "b": next(iter(b))}
    >>> loaders.batch_indices(batch).indices
    ([0, 1, 2, 3], [0, 1, 2])
"""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

import torch  # noqa: F401 (doctests)
from torch.utils._pytree import (
    SUPPORTED_NODES,
    GetAttrKey,
    MappingKey,
    SequenceKey,
    _get_node_type,
    tree_flatten_with_path,
)
from torch.utils.data import DataLoader, IterableDataset

from lightning_nanguard.diagnose.combined import CombinedIndices, CombinedLayout, LoaderKey
from lightning_nanguard.engine.data.indices import (
    RecordingBatchSampler,
    index_field,
    indices_from_batch,
    mark_epoch_end,
    next_recorded_indices,
)
from lightning_nanguard.engine.data.readers import RecordReader
from lightning_nanguard.engine.data.streams import StreamQuarantine, stream_quarantine_of

__all__ = ["Exclusion", "TrainingLoaders", "loader_paths", "quarantine_unreachable"]


class Exclusion(Container[int]):
    """The dataset indices one loader must never yield again: its own quarantine and the shared one.

    Example:
        >>> shared, own = {3}, {7}
        >>> exclusion = Exclusion(shared, own)
        >>> 3 in exclusion, 7 in exclusion, 8 in exclusion, bool(exclusion), bool(Exclusion(set(), set()))
        (True, True, False, True, False)
    """

    def __init__(self, *sets: set[int]) -> None:
        self.sets = sets

    def __contains__(self, index: object) -> bool:
        return any(index in s for s in self.sets)

    def __bool__(self) -> bool:
        return any(self.sets)


def _is_leaf(node: Any) -> bool:
    """Lightning's rule (``lightning.pytorch.utilities._pytree``): not a container, or a container of primitives."""
    node_type = _get_node_type(node)
    if node_type not in SUPPORTED_NODES:
        return True
    children, _ = SUPPORTED_NODES[node_type].flatten_fn(node)
    return all(isinstance(child, int | float | str) for child in children)


def _path_part(entry: Any) -> str | int:
    if isinstance(entry, MappingKey):
        key = entry.key
        return key if isinstance(key, str | int) else str(key)
    if isinstance(entry, SequenceKey):
        return int(entry.idx)
    if isinstance(entry, GetAttrKey):
        return str(entry.name)
    return str(entry)


def loader_paths(collection: Any) -> list[tuple[tuple[str | int, ...], Any]]:
    """Every loader of a collection with its path of keys and positions, in Lightning's order.

    A bare loader has the empty path. The order is the one Lightning flattens the collection in
    (``CombinedLoader.flattened``), which is the order of the parts of a combined batch.

    Example:
        >>> loader = object()
        >>> [path for path, _ in loader_paths({"x": [loader, loader], "y": loader})]
        [('x', 0), ('x', 1), ('y',)]
        >>> loader_paths(loader) == [((), loader)]
        True
    """
    leaves, _ = tree_flatten_with_path(collection, is_leaf=_is_leaf)
    return [(tuple(_path_part(entry) for entry in path), leaf) for path, leaf in leaves]


def _unknown_reason(loader: Any) -> str:
    if isinstance(loader, DataLoader) and isinstance(loader.dataset, IterableDataset):
        return "an IterableDataset has no batch sampler to record (name an index field with index_key=)"
    if isinstance(loader, DataLoader) and loader.batch_sampler is None:
        return "batch_size=None: no batch sampler to record (name an index field with index_key=)"
    return "its batch sampler cannot be recorded (name an index field with index_key=)"


def quarantine_unreachable(loader: Any, index_key: int | str | None = None) -> str:
    """Why the quarantine cannot remove records from a training ``loader`` that neither drops nor cuts them.

    Example:
        >>> from torch.utils.data import IterableDataset
        >>> class Stream(IterableDataset):
        ...     def __iter__(self):
        ...         return iter(range(3))
        >>> print(quarantine_unreachable(DataLoader(Stream())))  # doctest: +NORMALIZE_WHITESPACE
        the training loader streams an IterableDataset, which has no batch sampler to drop records from, and no
        index_key= names the batch field holding each row's dataset index (to cut them out of its batches)
    """
    if not isinstance(loader, DataLoader):
        return (
            f"the training loader is a {type(loader).__name__}, not a torch DataLoader: the guard can neither drop "
            "records in its sampler nor cut them out of its batches"
        )
    if isinstance(loader.dataset, IterableDataset):
        what = "streams an IterableDataset, which has no batch sampler to drop records from"
    elif loader.batch_sampler is None:
        what = "has batch_size=None, so no batch sampler to drop records from"
    else:
        what = "has a batch sampler the guard cannot swap for one that drops records"
    if index_key is None:
        return (
            f"the training loader {what}, and no index_key= names the batch field holding each row's dataset "
            "index (to cut them out of its batches)"
        )
    return f"the training loader {what}, and its batches could not be made to pass through the quarantine"


def _field_reason(part: Any, index_key: int | str) -> str:
    if index_field(part, index_key) is None:
        return f"no index field {index_key!r} in its batch"
    return f"the index field {index_key!r} holds several records per row, or no integers"


@dataclass
class TrainingLoaders:
    """The fit's training loaders (see the module docs).

    Attributes:
        layout: where each loader's part sits in a combined batch; ``None`` for a bare loader.
        samplers: each loader's recording batch sampler (``None``: not recordable), in layout order.
        reasons: why a loader's indices are unknown, in layout order (empty when recordable).
        readers: each loader's record reader, in layout order.
        streams: each loader's stream quarantine (``None``: its batch sampler drops records, or nothing
            does), in layout order.
        unreachable: why the quarantine cannot remove records from each loader (``None``: it does),
            in layout order.
    """

    layout: CombinedLayout | None
    samplers: list[RecordingBatchSampler | None] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    readers: tuple[RecordReader, ...] = ()
    streams: list[StreamQuarantine | None] = field(default_factory=list)
    unreachable: list[str | None] = field(default_factory=list)

    @classmethod
    def of(
        cls,
        collection: Any,
        record: Callable[[Any], RecordingBatchSampler | None],
        exclusions: Callable[[LoaderKey], Container[int]] | None = None,
        index_key: int | str | None = None,
    ) -> TrainingLoaders:
        """Read ``trainer.train_dataloader``: make every loader record (``record``), and set its quarantine.

        Args:
            collection: one loader or a collection of them.
            record: makes a loader record its indices; returns its recording sampler (or ``None``).
            exclusions: the indices a loader of a given key must never yield (several loaders only;
                a bare loader keeps the exclusion ``record`` gave it, its batch sampler's or its stream's).
            index_key: the batch field naming each row's dataset index (only to say why the
                quarantine cannot act on a loader).
        """
        paths = loader_paths(collection)
        combined = not (len(paths) == 1 and paths[0][0] == ())
        layout = CombinedLayout.from_paths(path for path, _ in paths) if combined else None
        samplers: list[RecordingBatchSampler | None] = []
        reasons: list[str] = []
        streams: list[StreamQuarantine | None] = []
        unreachable: list[str | None] = []
        for index, (_, loader) in enumerate(paths):
            sampler = record(loader)
            stream = stream_quarantine_of(loader) if sampler is None else None
            if layout is not None:
                if stream is not None:
                    stream.key = layout.parts[index].key
                if exclusions is not None and sampler is not None:
                    sampler.nanguard_exclude = exclusions(layout.parts[index].key)
                elif exclusions is not None and stream is not None:
                    stream.exclusion = exclusions(layout.parts[index].key)
            samplers.append(sampler)
            reasons.append("" if sampler is not None else _unknown_reason(loader))
            streams.append(stream)
            unreachable.append(
                None if sampler is not None or stream is not None else quarantine_unreachable(loader, index_key)
            )
        readers = tuple(RecordReader.of(loader) for _, loader in paths)
        return cls(layout, samplers, reasons, readers, streams, unreachable)

    @property
    def keys(self) -> tuple[LoaderKey | None, ...]:
        """Each loader's key in layout order (``(None,)`` for one bare loader)."""
        return self.layout.keys if self.layout is not None else (None,)

    def cut_quarantined(self, batch: Any) -> tuple[bool, Any]:
        """Cut the records quarantined since a batch was fetched out of it, as its loaders' streams would now.

        For the batch a loop fetched ahead (Lightning prefetches one batch of a loader without a
        length): its stream passed it through the quarantine before the step that quarantined a
        record of it. Only stream parts are cut; an index field that cannot be read here (changed by
        a batch hook) leaves the part as it is, quietly (the stream reports what it cannot read).

        Returns:
            ``(keep, batch)``: ``keep`` is ``False`` when a part is left with no row.
        """
        if not any(stream is not None and stream.exclusion for stream in self.streams):
            return True, batch
        if self.layout is None:
            stream = self.streams[0]
            return stream(batch, quiet=True) if stream is not None else (True, batch)
        if not self.layout.matches(batch):
            return True, batch
        replaced: dict[int, Any] = {}
        for index, stream in enumerate(self.streams):
            part = self.layout.part(batch, index) if stream is not None else None
            if stream is None or part is None:
                continue
            keep, cut = stream(part, quiet=True)
            if not keep:
                return False, None
            if cut is not part:
                replaced[index] = cut
        return True, self.layout.with_parts(batch, replaced) if replaced else batch

    def mark_epoch_end(self) -> None:
        """An epoch starts: indices recorded ahead and never trained on are dropped at each loader's next pass.

        See :func:`~lightning_nanguard.engine.data.indices.mark_epoch_end`.
        """
        for sampler in self.samplers:
            if sampler is not None:
                mark_epoch_end(sampler)

    def batch_indices(self, batch: Any, index_key: int | str | None = None) -> list[int] | CombinedIndices | None:
        """The dataset indices of the batch that starts now, popped from each loader that gave a part.

        Args:
            batch: the batch ``training_step`` is about to receive.
            index_key: a batch field holding the indices (read from each loader's part) instead of
                the recorded samplers (whose lists are popped all the same: they record for the
                quarantine, which drops indices in the sampler).

        Returns:
            A list (one loader, ``None`` when unknown) or
            :class:`~lightning_nanguard.diagnose.combined.CombinedIndices` (several; with a
            ``mismatch`` when the batch is not the loaders' collection, e.g. changed in a hook).
        """
        if self.layout is None:
            recorded = next_recorded_indices(self.samplers)  # popped either way
            return indices_from_batch(batch, index_key) if index_key is not None else recorded
        if not self.layout.matches(batch):
            for sampler in self.samplers:  # keep each loader's FIFO aligned with its batches
                if sampler is not None and sampler.nanguard_fifo:
                    sampler.nanguard_fifo.popleft()
            mismatch = (
                f"the batch is not the collection of the training loaders {list(self.layout.keys)} (changed in "
                "a hook such as on_after_batch_transfer?): the loader of each sample is unknown"
            )
            return CombinedIndices(self.layout, (), (), mismatch)
        indices: list[list[int] | None] = []
        reasons: list[str] = []
        for index, sampler in enumerate(self.samplers):
            part = self.layout.part(batch, index)
            if part is None:  # an exhausted loader (max_size mode) gave nothing: its FIFO stays as it is
                indices.append(None)
                reasons.append("no batch from this loader at this step")
            elif index_key is not None:
                if sampler is not None and sampler.nanguard_fifo:
                    sampler.nanguard_fifo.popleft()  # recorded for the quarantine: kept aligned, never read
                found = indices_from_batch(part, index_key)
                indices.append(found)
                reasons.append("" if found is not None else _field_reason(part, index_key))
            elif sampler is not None:
                indices.append(sampler.nanguard_fifo.popleft() if sampler.nanguard_fifo else None)
                reasons.append("" if indices[-1] is not None else "its sampler yielded no integer indices")
            else:
                indices.append(None)
                reasons.append(self.reasons[index])
        return CombinedIndices(self.layout, tuple(indices), tuple(reasons))
