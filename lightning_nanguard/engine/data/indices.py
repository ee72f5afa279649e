"""Recover the dataset indices of each training batch.

Lightning does not track which dataset items form a batch. :func:`record_batch_indices` swaps the
class of a ``DataLoader``'s ``batch_sampler`` for a subclass that also appends every index list
it yields to a FIFO. The batch sampler runs in the main process even with worker processes, but
several batches ahead of training (prefetching), so the FIFO is popped once per training batch,
in order, rather than read as "the last list yielded". A pass over the data that was cut short
(the epoch ended first) leaves indices that will never be trained on: the next pass drops them,
as it drops what is left after :func:`mark_epoch_end` (an epoch that stopped early while workers
had already read the whole pass). A pass that ran to its end, mid-epoch, leaves only batches still
to be trained on: with several training loaders Lightning starts the next pass of a shorter loader
while the last batch of its previous pass may still be waiting (``CombinedLoader(mode="max_size_cycle")``),
so those stay.

Not available for an ``IterableDataset`` or ``batch_size=None`` (no batch sampler); name an index
field of the batch instead (``NanGuard(index_key=...)``): one index per row (:func:`indices_from_batch`),
or a 2-D field of the records each row holds (:func:`records_from_batch`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_nanguard.core.swapped import swapped_subclass
from lightning_nanguard.core.timing import GuardClock

__all__ = [
    "RecordingBatchSampler",
    "index_field",
    "indices_from_batch",
    "mark_epoch_end",
    "next_recorded_indices",
    "record_batch_indices",
    "records_from_batch",
    "stop_recording",
]

_RECORDING_CLASSES: dict[type, type] = {}
_IDLE_CLOCK = GuardClock()


class RecordingBatchSampler(Protocol):
    """A batch sampler whose class :func:`record_batch_indices` swapped: it records what it yields.

    ``nanguard_exclude`` (dataset indices, shared with the guard's quarantine) is dropped from every
    batch it yields from then on; ``nanguard_on_pass``, when set, is called as each pass starts.
    """

    nanguard_fifo: deque[list[int] | None]
    nanguard_exclude: Container[int]
    nanguard_clock: GuardClock
    nanguard_on_pass: Callable[[], None] | None

    def __iter__(self) -> Iterator[list[int]]: ...


def _as_ints(indices: Any) -> list[int] | None:
    """The indices as ints, or ``None`` when they are not integers (e.g. a sampler of keys or ``None``)."""
    try:
        return list(map(int, indices))  # a loop in C: every batch of every epoch
    except (TypeError, ValueError):
        return None


def _recording_iter(self: Any) -> Iterator[list[int]]:
    on_pass = getattr(self, "nanguard_on_pass", None)
    if on_pass is not None:  # a front-end learns which loader a pass draws from (a Fabric loop)
        on_pass()
    fifo = self.nanguard_fifo
    if not getattr(self, "nanguard_pass_done", True) or getattr(self, "nanguard_stale", False):
        fifo.clear()  # the last pass was cut short, or an epoch ended since: its leftovers will never be trained on
    self.nanguard_pass_done, self.nanguard_stale = False, False
    exclude: Container[int] = getattr(self, "nanguard_exclude", set())
    clock: GuardClock = getattr(self, "nanguard_clock", None) or _IDLE_CLOCK
    for indices in self._nanguard_base_iter():
        with clock.measure("batch_sampler"):
            as_ints = _as_ints(indices)
            if exclude and as_ints is not None:  # quarantined samples are never yielded again
                kept = [k for k, i in enumerate(as_ints) if i not in exclude]
                if not kept:
                    continue
                indices, as_ints = [indices[k] for k in kept], [as_ints[k] for k in kept]
            fifo.append(as_ints)  # one entry per batch (None: unknown) keeps the FIFO aligned
        yield indices
    self.nanguard_pass_done = True


def _recording_class(cls: type) -> type:
    """A direct subclass of ``cls`` (same layout, so ``__class__`` can be swapped) that records."""
    if cls not in _RECORDING_CLASSES:
        _RECORDING_CLASSES[cls] = swapped_subclass(  # pickles as the original, without the FIFO
            cls,
            f"NanGuardRecording{cls.__name__}",
            {"__iter__": _recording_iter, "_nanguard_base_iter": cls.__iter__},  # type: ignore[attr-defined]
            module=__name__,
        )
    return _RECORDING_CLASSES[cls]


def record_batch_indices(
    loader: Any, exclude: Container[int] | None = None, clock: GuardClock | None = None
) -> RecordingBatchSampler | None:
    """Make ``loader`` record the dataset indices of its batches; return the recording sampler.

    Args:
        loader: a ``DataLoader`` (anything else is left alone).
        exclude: dataset indices the sampler must drop from every batch from now on (the set is
            shared: items added later are dropped too).
        clock: measures the time the recording adds.

    Returns ``None`` when the loader has no batch sampler to record from.

    Example:
        >>> from torch.utils.data import TensorDataset
        >>> loader = DataLoader(TensorDataset(torch.arange(10)), batch_size=4, shuffle=True)
        >>> sampler = record_batch_indices(loader)
        >>> first = next(iter(loader))[0].tolist()
        >>> sampler.nanguard_fifo.popleft() == first
        True
    """
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return None  # an IterableDataset's batch sampler yields placeholders, not dataset indices
    batch_sampler = loader.batch_sampler
    if batch_sampler is None:
        return None
    if type(batch_sampler) not in _RECORDING_CLASSES.values():
        try:
            batch_sampler.__class__ = _recording_class(type(batch_sampler))
        except TypeError:  # a sampler whose layout cannot be swapped: indices stay unknown
            return None
    if not hasattr(batch_sampler, "nanguard_fifo"):
        batch_sampler.nanguard_fifo = deque()  # type: ignore[attr-defined]
    if exclude is not None:
        batch_sampler.nanguard_exclude = exclude  # type: ignore[attr-defined]
    if clock is not None:
        batch_sampler.nanguard_clock = clock  # type: ignore[attr-defined]
    return batch_sampler  # type: ignore[return-value]


def next_recorded_indices(samplers: Sequence[RecordingBatchSampler | None]) -> list[int] | None:
    """The dataset indices of the training batch that starts now: the oldest recorded list, ``None`` if unknown.

    ``None`` entries (loaders that do not record) are passed over.
    """
    for sampler in samplers:
        if sampler is not None and sampler.nanguard_fifo:
            return sampler.nanguard_fifo.popleft()
    return None


def mark_epoch_end(sampler: Any) -> None:
    """A new epoch starts: what the last pass left in the FIFO is dropped when the next pass starts.

    Only a sampler between passes is marked: one whose pass started already (Lightning creates the
    first epoch's iterator, and workers begin prefetching, before ``on_train_epoch_start``) keeps its
    record, and a pass cut short is dropped anyway.

    Example:
        >>> from torch.utils.data import TensorDataset
        >>> loader = DataLoader(TensorDataset(torch.arange(4)), batch_size=2)
        >>> sampler = record_batch_indices(loader)
        >>> _ = list(loader)  # a whole pass, never trained on (the epoch stopped early)
        >>> mark_epoch_end(sampler)
        >>> _ = next(iter(loader))
        >>> list(sampler.nanguard_fifo)
        [[0, 1]]
    """
    if getattr(sampler, "nanguard_pass_done", True):
        sampler.nanguard_stale = True


def stop_recording(sampler: Any) -> None:
    """Give a sampler made to record by :func:`record_batch_indices` its own class back.

    Example:
        >>> from torch.utils.data import TensorDataset
        >>> loader = DataLoader(TensorDataset(torch.arange(4)), batch_size=2)
        >>> sampler = record_batch_indices(loader)
        >>> stop_recording(sampler)
        >>> type(loader.batch_sampler).__name__, hasattr(loader.batch_sampler, "nanguard_fifo")
        ('BatchSampler', False)
    """
    original = next((base for base, recording in _RECORDING_CLASSES.items() if type(sampler) is recording), None)
    if original is not None:
        sampler.__class__ = original
    attrs = (
        "nanguard_fifo",
        "nanguard_exclude",
        "nanguard_clock",
        "nanguard_pass_done",
        "nanguard_stale",
        "nanguard_on_pass",
    )
    for attr in attrs:
        vars(sampler).pop(attr, None)


def index_field(batch: Any, key: str | int) -> Any:
    """The batch's index field ``key`` (a dict key, attribute or tuple position); ``None`` when it has none."""
    try:
        return batch[key] if isinstance(batch, Mapping) or isinstance(key, int) else getattr(batch, key)
    except (KeyError, IndexError, AttributeError, TypeError):
        return None


def _several_per_row(value: Any) -> bool:
    """A 2-D field with more than one column: the records of each row (packed rows, mixup pairs)."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 2 and value.shape[1] > 1
    return isinstance(value, list | tuple) and any(isinstance(v, list | tuple | torch.Tensor) for v in value)


def indices_from_batch(batch: Any, key: str | int) -> list[int] | None:
    """Read dataset indices stored in the batch itself (a dict key or a tuple position): one per row.

    Repeated indices are fine (several rows of one record, e.g. multi-crop). A 2-D field (the records
    of each row) gives ``None`` here, read it with :func:`records_from_batch`.

    Example:
        >>> indices_from_batch({"x": torch.zeros(2), "idx": torch.tensor([7, 9])}, "idx")
        [7, 9]
        >>> indices_from_batch({"idx": torch.tensor([[7, 8], [9, -1]])}, "idx") is None
        True
    """
    value = index_field(batch, key)
    if _several_per_row(value):
        return None
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.flatten().tolist()]
    if isinstance(value, list | tuple):
        try:
            return [int(v) for v in value]
        except (TypeError, ValueError):
            return None
    return None


def _row(value: Any) -> tuple[int, ...]:
    items = value.flatten().tolist() if isinstance(value, torch.Tensor) else list(value)
    return tuple(int(v) for v in items if int(v) >= 0)


def records_from_batch(batch: Any, key: str | int) -> tuple[tuple[int, ...], ...] | None:
    """The dataset indices each row holds, read from the batch's index field ``key``; ``None`` without one.

    A 1-D field holds one index per row; a 2-D field (a tensor, or a list of lists) the records of
    each row, negative entries being padding (packed rows of different counts, mixup pairs).

    Example:
        >>> records_from_batch({"idx": torch.tensor([[3, 4], [5, -1]])}, "idx")
        ((3, 4), (5,))
        >>> records_from_batch({"idx": [7, 7, 9]}, "idx")
        ((7,), (7,), (9,))
    """
    value = index_field(batch, key)
    try:
        if isinstance(value, torch.Tensor) and value.dim() in (1, 2):
            return tuple(_row(row) if value.dim() == 2 else (int(row),) for row in value.tolist())
        if isinstance(value, list | tuple):
            return tuple(_row(v) if isinstance(v, list | tuple | torch.Tensor) else (int(v),) for v in value)
    except (TypeError, ValueError):
        return None
    return None
