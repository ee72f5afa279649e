"""Quarantine for training loaders with no batch sampler to drop records from: cut them out of each batch.

A map-style loader drops quarantined records in its batch sampler, before they are read
(:mod:`~lightning_nanguard.engine.data.indices`). A loader over an ``IterableDataset`` (or with
``batch_size=None``, or with a batch sampler the guard cannot swap) has none. When its batches carry
each row's dataset index in a field (``NanGuard(index_key=...)``), :func:`cut_quarantined_records`
makes the loader's iterator pass every collated batch through a :class:`StreamQuarantine`, in the
main process (so the same with or without worker processes), as the loop draws it:

- a batch whose index field names no quarantined record is yielded as it is;
- one that names some is cut down to its other rows with the diagnosis's batch slicer
  (:func:`~lightning_nanguard.diagnose.batching.slice_batch`, or the user's), and the cut is checked
  (its index field must name exactly the rows kept);
- one left with no row is not yielded: the next one is taken.

Where the quarantine cannot act as promised, it says so to its ``report`` hook (a
:class:`StreamProblem`) instead of passing the record on silently: an index field it cannot read
(the batch is yielded as it is: its records are *not* removed), a batch the slicer cannot cut (the
whole batch is dropped, the healthy rows with it), and under several processes a batch made only
of quarantined records (kept: one rank alone must not skip a batch; its records are *not* removed).

Cost: while the quarantine is empty, one truthiness test per batch. The index field is read only
once something is quarantined: a host list or a CPU tensor normally (the loader collates on the
host); a field already on an accelerator would then cost one device read per batch.

Example:
    >>> from torch.utils.data import DataLoader, IterableDataset
    >>> class Stream(IterableDataset):
    ...     def __iter__(self):
    ...         return iter([{"x": torch.tensor(float(i)), "index": i} for i in (0, 1, 2, 3, 2, 5)])
    >>> loader = DataLoader(Stream(), batch_size=2)
    >>> quarantined: set[int] = set()
    >>> cut_quarantined_records(loader, StreamQuarantine("index", quarantined))
    True
    >>> quarantined.update({2, 3})
    >>> [batch["index"].tolist() for batch in loader]
    [[0, 1], [5]]
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter

from lightning_nanguard.core.swapped import swapped_subclass
from lightning_nanguard.diagnose.batching import BatchSlicer, slice_batch
from lightning_nanguard.diagnose.combined import LoaderKey
from lightning_nanguard.engine.data.indices import index_field, indices_from_batch

__all__ = [
    "Cut",
    "StreamProblem",
    "StreamQuarantine",
    "WhileTraining",
    "at_each_pass",
    "cut_quarantined_records",
    "cut_rows",
    "stop_cutting",
    "stream_quarantine_of",
    "training_batches_only",
]

ProblemKind = Literal["unreadable", "uncut", "kept"]


@dataclass(frozen=True)
class Cut:
    """What :func:`cut_rows` made of one batch.

    Attributes:
        batch: the batch to train on (``None``: no row is left, drop it).
        removed: the dataset indices of the rows cut out.
        problem: why the quarantine could not act on this batch as designed (``None``: it did).
        kind: what that problem is: ``"unreadable"`` (the batch is kept as it is, its records are
            not removed) or ``"uncut"`` (the slicer failed: the whole batch is dropped).
    """

    batch: Any
    removed: tuple[int, ...] = ()
    problem: str | None = None
    kind: ProblemKind | None = None


def _unreadable(batch: Any, index_key: str | int) -> str:
    value = index_field(batch, index_key)
    if value is None:
        return f"the batch has no index field {index_key!r}"
    if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] > 1:
        return f"the index field {index_key!r} holds several records per row (a 2-D field)"
    return f"the index field {index_key!r} holds no integer per row ({type(value).__name__})"


def cut_rows(batch: Any, exclusion: Container[int], index_key: str | int, slicer: BatchSlicer | None = None) -> Cut:
    """Cut the rows whose dataset index (the batch's field ``index_key``) is in ``exclusion`` out of ``batch``.

    Args:
        batch: a collated batch.
        exclusion: the quarantined dataset indices.
        index_key: the batch field holding each row's dataset index.
        slicer: ``slicer(batch, positions) -> sub_batch`` (default: the built-in
            :func:`~lightning_nanguard.diagnose.batching.slice_batch`).

    Example:
        >>> batch = {"x": torch.arange(4.0), "index": torch.tensor([10, 11, 12, 13])}
        >>> cut = cut_rows(batch, {11, 13}, "index")
        >>> cut.batch["x"].tolist(), cut.removed
        ([0.0, 2.0], (11, 13))
        >>> cut_rows(batch, {10, 11, 12, 13}, "index").batch is None
        True
        >>> cut_rows({"x": torch.arange(4.0)}, {11}, "index").problem
        "the batch has no index field 'index'"
    """
    indices = indices_from_batch(batch, index_key)
    if indices is None:
        return Cut(batch, problem=_unreadable(batch, index_key), kind="unreadable")
    dropped = [position for position, index in enumerate(indices) if index in exclusion]
    if not dropped:
        return Cut(batch)
    removed = tuple(indices[p] for p in dropped)
    gone = set(dropped)
    keep = [position for position in range(len(indices)) if position not in gone]
    if not keep:
        return Cut(None, removed)
    try:
        sub = (slicer or slice_batch)(batch, keep)
    except Exception as error:  # the user's slicer, or a batch the built-in one cannot cut
        return Cut(None, tuple(indices), f"the batch slicer failed ({type(error).__name__}: {error})", "uncut")
    if indices_from_batch(sub, index_key) != [indices[p] for p in keep]:
        problem = f"the batch slicer did not cut the index field {index_key!r} down to the rows kept"
        return Cut(None, tuple(indices), problem, "uncut")
    return Cut(sub, removed)


@dataclass(frozen=True)
class StreamProblem:
    """A batch the quarantine could not treat as designed (see the module docs).

    Attributes:
        kind: ``"unreadable"`` (kept as it is: its records are not removed), ``"uncut"`` (dropped
            whole, healthy rows with it) or ``"kept"`` (only quarantined records, kept under
            several processes: its records are not removed).
        key: the loader's key among several training loaders (``None``: the one loader).
        reason: what went wrong.
        rows: how many rows the batch had (``None``: unknown).
    """

    kind: ProblemKind
    key: LoaderKey | None
    reason: str
    rows: int | None = None


def training_batches_only() -> bool:
    """Whether a batch drawn now is a training batch by the Fabric front-end's rule: autograd is on.

    (A validation loop runs under ``torch.no_grad()`` or ``torch.inference_mode()``.)
    """
    return torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


class WhileTraining(Container[int]):
    """A quarantine that applies only to training batches, by :func:`training_batches_only` (a Fabric loop's rule).

    Example:
        >>> quarantined = WhileTraining({3})
        >>> bool(quarantined), 3 in quarantined
        (True, True)
        >>> with torch.no_grad():
        ...     bool(quarantined)
        False
    """

    def __init__(self, indices: Container[int]) -> None:
        self.indices = indices

    def __contains__(self, index: object) -> bool:
        return index in self.indices

    def __bool__(self) -> bool:
        return bool(self.indices) and training_batches_only()


@dataclass(eq=False)
class StreamQuarantine:
    """One loader's quarantine of streamed records (see the module docs).

    Attributes:
        index_key: the batch field holding each row's dataset index.
        exclusion: the dataset indices to cut out (shared with the guard's quarantine: indices
            added later are cut from then on).
        slicer: cuts a batch down to some of its rows (``None``: the built-in slicer).
        key: the loader's key among several training loaders (``None``: the one loader).
        drop_empty: a batch left with no row is not yielded; ``False`` under several processes,
            where one rank alone must not skip a batch (it is then kept, and reported).
        applies: whether a batch drawn now is a training batch (``None``: always; a Fabric loop
            passes :func:`training_batches_only`).
        report: told of every :class:`StreamProblem`.
    """

    index_key: str | int
    exclusion: Container[int]
    slicer: BatchSlicer | None = None
    key: LoaderKey | None = None
    drop_empty: bool = True
    applies: Callable[[], bool] | None = None
    report: Callable[[StreamProblem], None] | None = None

    def __call__(self, batch: Any, quiet: bool = False) -> tuple[bool, Any]:
        """``(keep, batch)``: whether to yield this batch, and the batch to yield (cut when needed).

        ``quiet``: an index field that cannot be read is not reported (a second look at a batch,
        after hooks that may have changed it).
        """
        if not self.exclusion or (self.applies is not None and not self.applies()):
            return True, batch
        try:
            cut = cut_rows(batch, self.exclusion, self.index_key, self.slicer)
        except Exception as error:  # the guard's own failure: never the loop's (the batch goes on, and it is said)
            cut = Cut(batch, problem=f"the quarantine failed ({type(error).__name__}: {error})", kind="unreadable")
        if cut.problem is not None and cut.kind is not None and not (quiet and cut.kind == "unreadable"):
            self._tell(cut.kind, cut.problem, len(cut.removed) or None)
        if cut.batch is not None:
            return True, cut.batch
        if cut.kind is None and not self.drop_empty:  # only quarantined rows, under several processes
            self._tell("kept", "every row of the batch holds a quarantined record", len(cut.removed))
            return True, batch
        return False, None

    def _tell(self, kind: ProblemKind, reason: str, rows: int | None) -> None:
        if self.report is not None:
            self.report(StreamProblem(kind, self.key, reason, rows))


_LOADER_CLASSES: dict[type, type] = {}
_ITERATOR_CLASSES: dict[type, type] = {}
_ATTR = "nanguard_stream"
_ON_PASS = "nanguard_on_pass"


def _passed(iterator: Iterator[Any], quarantine: StreamQuarantine) -> Iterator[Any]:
    """A loader whose ``__iter__`` gives no DataLoader iterator: the same filter as a generator."""
    for batch in iterator:
        keep, batch = quarantine(batch)
        if keep:
            yield batch


def _iterator_class(cls: type) -> type:
    """A subclass of a DataLoader iterator class whose ``__next__`` passes each batch through the quarantine."""
    if cls not in _ITERATOR_CLASSES:
        base_next = cls.__next__  # type: ignore[attr-defined]

        def __next__(self: Any) -> Any:
            while True:
                batch = base_next(self)
                quarantine = self.__dict__.get(_ATTR)
                if quarantine is None:
                    return batch
                keep, batch = quarantine(batch)
                if keep:
                    return batch

        _ITERATOR_CLASSES[cls] = type(f"NanGuardStream{cls.__name__}", (cls,), {"__next__": __next__})
    return _ITERATOR_CLASSES[cls]


def _loader_class(cls: type) -> type:
    """A subclass of a DataLoader class whose iterators pass each batch through the loader's quarantine."""
    if cls not in _LOADER_CLASSES:
        base_iter = cls.__iter__  # type: ignore[attr-defined]

        def __iter__(self: Any) -> Any:
            on_pass = self.__dict__.get(_ON_PASS)
            if on_pass is not None:
                on_pass()
            iterator = base_iter(self)
            quarantine = self.__dict__.get(_ATTR)
            if quarantine is None:
                return iterator
            if isinstance(iterator, _BaseDataLoaderIter):  # keep Lightning's isinstance checks true
                if type(iterator) not in _ITERATOR_CLASSES.values():
                    iterator.__class__ = _iterator_class(type(iterator))
                object.__setattr__(iterator, _ATTR, quarantine)  # a persistent workers' iterator: again each pass
                return iterator
            return _passed(iterator, quarantine)

        _LOADER_CLASSES[cls] = swapped_subclass(  # pickles as the original, without the quarantine
            cls, f"NanGuardStream{cls.__name__}", {"__iter__": __iter__}, module=__name__
        )
    return _LOADER_CLASSES[cls]


def _swap(loader: Any) -> bool:
    if not isinstance(loader, DataLoader):
        return False
    if type(loader) not in _LOADER_CLASSES.values():
        try:
            loader.__class__ = _loader_class(type(loader))
        except TypeError:
            return False
    return True


def cut_quarantined_records(loader: Any, quarantine: StreamQuarantine) -> bool:
    """Make ``loader`` pass every batch it yields through ``quarantine`` from its next pass on.

    Idempotent: a loader already made to cut takes the new ``quarantine``. Returns ``False`` (and
    leaves the loader alone) for anything but a ``DataLoader``, or a loader whose class cannot be
    swapped.
    """
    if not _swap(loader):
        return False
    object.__setattr__(loader, _ATTR, quarantine)  # DataLoader refuses some attributes after init
    return True


def at_each_pass(loader: Any, call: Callable[[], None]) -> bool:
    """Make ``loader`` call ``call()`` each time a pass over it starts (``iter(loader)``); ``False``: cannot.

    Example:
        >>> from torch.utils.data import TensorDataset
        >>> loader, passes = DataLoader(TensorDataset(torch.arange(4)), batch_size=2), []
        >>> at_each_pass(loader, lambda: passes.append(1))
        True
        >>> _ = list(loader), list(loader)
        >>> len(passes)
        2
    """
    if not _swap(loader):
        return False
    object.__setattr__(loader, _ON_PASS, call)
    return True


def stream_quarantine_of(loader: Any) -> StreamQuarantine | None:
    """The quarantine ``loader`` passes its batches through (``None``: none)."""
    found = getattr(loader, "__dict__", {}).get(_ATTR)
    return found if isinstance(found, StreamQuarantine) else None


def stop_cutting(loader: Any) -> None:
    """Undo :func:`cut_quarantined_records`: the loader gets its own class back, its live iterator its own too.

    Example:
        >>> from torch.utils.data import TensorDataset
        >>> loader = DataLoader(TensorDataset(torch.arange(4)), batch_size=2)
        >>> _ = cut_quarantined_records(loader, StreamQuarantine(1, set()))
        >>> stop_cutting(loader)
        >>> type(loader).__name__, stream_quarantine_of(loader)
        ('DataLoader', None)
    """
    iterator = getattr(loader, "_iterator", None)  # persistent workers keep theirs
    original_iterator = next((c for c, s in _ITERATOR_CLASSES.items() if type(iterator) is s), None)
    if iterator is not None and original_iterator is not None:
        iterator.__dict__.pop(_ATTR, None)
        iterator.__class__ = original_iterator
    original = next((c for c, s in _LOADER_CLASSES.items() if type(loader) is s), None)
    if original is not None:
        loader.__class__ = original
    if hasattr(loader, "__dict__"):
        loader.__dict__.pop(_ATTR, None)
        loader.__dict__.pop(_ON_PASS, None)
