"""``NanGuardStrategy``: the guard's hold on the Trainer's strategy, applied by class swap.

Lightning checks ``isinstance(strategy, Strategy / ParallelStrategy / DDPStrategy)`` in many
places, so a proxy object would break it. Instead :func:`apply_nanguard_strategy` swaps the class
of the strategy instance the Trainer built for a generated subclass ``NanGuard<Original>`` that
adds :class:`NanGuardStrategyMixin` in front; :func:`remove_nanguard_strategy` swaps it back. A
wrapped strategy pickles as "the original class, wrapped again on load", so it unpickles in a
fresh process (``ddp_spawn``) where the generated class does not exist yet, and the equally named
strategies of ``lightning.pytorch`` and ``pytorch_lightning`` never collide.

The mixin owns what happens around the optimizer step on every rank:

- ``optimizer_step``: refuses what the guard cannot make safe (DeepSpeed's engine owns the step),
  lets the Trainer's precision plugin run the closure, unscale and call
  ``on_before_optimizer_step``, where the guard makes the one distributed skip decision per step
  (one ``reduce`` of the bad flag, every rank, any rank bad means all ranks skip), then runs the
  guard's after-step work (parameter check, snapshot, rollback) on every rank;
- ``process_dataloader``: makes each *training* loader record the dataset indices of its batches
  (and drop quarantined items) before Lightning first iterates it; a loader with no batch sampler to
  record (an ``IterableDataset``) cuts quarantined records out of its batches instead, when
  ``index_key`` names their index field (:mod:`~lightning_nanguard.engine.data.streams`); validation,
  test and predict loaders are left alone, and every swap is undone at teardown. With several
  training loaders, :meth:`StrategyHooks.start_epoch` then learns each loader's key (and quarantine)
  from the collection Lightning built (:mod:`~lightning_nanguard.engine.data.loaders`), and tells the
  remedy book which loaders the quarantine reaches (:meth:`StrategyHooks.enforce_quarantine`);
- ``batch_to_device``: Lightning fetches one batch ahead of a loader without a length, so the batch
  about to be trained on was cut before the step that quarantined a record of it: it is cut again
  here, before it moves to the device (a batch left with no row becomes ``None``, which Lightning
  skips).

The wrapper touches nothing of the guard's: it is given a :class:`StrategyHooks` with what it needs.
"""

from __future__ import annotations

import abc
import copyreg
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, SupportsIndex

from lightning_nanguard.core.events import NonFiniteTrainingError
from lightning_nanguard.core.timing import GuardClock
from lightning_nanguard.diagnose.combined import CombinedIndices, LoaderKey
from lightning_nanguard.engine.data.indices import (
    RecordingBatchSampler,
    indices_from_batch,
    next_recorded_indices,
    record_batch_indices,
    stop_recording,
)
from lightning_nanguard.engine.data.loaders import Exclusion, TrainingLoaders
from lightning_nanguard.engine.data.reach import QuarantineNotices
from lightning_nanguard.engine.data.readers import RecordReader
from lightning_nanguard.engine.data.streams import (
    StreamQuarantine,
    cut_quarantined_records,
    stop_cutting,
)
from lightning_nanguard.engine.shard_layout import strategy_kind
from lightning_nanguard.engine.step.closure_undo import is_closure_optimizer
from lightning_nanguard.recover.remedies import RemedyBook
from lightning_nanguard.reporting.notices import RankNotices

__all__ = [
    "NanGuardStrategyMixin",
    "StrategyHooks",
    "apply_nanguard_strategy",
    "remove_nanguard_strategy",
    "strategy_kind",
    "supported_strategy_kind",
]


@dataclass
class StrategyHooks:
    """What the strategy wrapper needs from the guard, passed in.

    Attributes:
        after_optimizer_step: called on every rank after each optimizer step (rollback, weight check).
        active: whether the guard still acts (``False``: the wrapper passes everything through).
        record_indices: whether training loaders record the dataset indices of their batches.
        exclude: dataset indices never to yield again (quarantine), shared with the guard: the training
            loader's, or with several loaders those of every loader (an older checkpoint's flat list).
        clock: measures the time spent in the wrapper's work.
        samplers: the batch samplers made to record (undone by :func:`remove_nanguard_strategy`).
        exclude_by_loader: with several training loaders, each loader's own quarantine, by its key
            (shared with the guard).
        loaders: the training loaders of the current epoch (:meth:`start_epoch`).
        tell: tells the remedy book which loaders the quarantine reaches, and the user once what it
            cannot do (:meth:`enforce_quarantine`).
        index_key: the batch field holding each row's dataset index (cuts quarantined records out of
            the batches of a loader without a batch sampler).
        batch_slicer: the user's batch slicer (else the module's ``nanguard_slice_batch``, else the built-in one).
        streams: the loaders made to cut quarantined records out of their batches (undone at teardown).
        before_optimizer_step: called on every rank as a closure optimizer's step begins (LBFGS), before
            its closure runs: its state is copied, to undo a bad step.
    """

    after_optimizer_step: Callable[[Any], None]
    active: Callable[[], bool]
    record_indices: bool = True
    exclude: set[int] = field(default_factory=set)
    clock: GuardClock = field(default_factory=GuardClock)
    samplers: list[RecordingBatchSampler] = field(default_factory=list)
    exclude_by_loader: dict[LoaderKey, set[int]] = field(default_factory=dict)
    loaders: TrainingLoaders | None = None
    tell: QuarantineNotices | None = None
    index_key: int | str | None = None
    batch_slicer: Callable[[Any, Any], Any] | None = None
    streams: list[Any] = field(default_factory=list)
    before_optimizer_step: Callable[[Any], None] | None = None

    def enforce_quarantine(
        self,
        book: RemedyBook,
        index_key: int | str | None,
        batch_slicer: Callable[[Any, Any], Any] | None,
        notices: RankNotices,
    ) -> None:
        """Let the quarantine act on every training loader it can, and tell ``book`` which it reaches.

        A loader with a batch sampler drops quarantined records there; one without (an
        ``IterableDataset``) cuts them out of its batches when ``index_key`` names their index field;
        for any other, ``book`` learns why it cannot (its quarantine messages say so), and
        ``notices`` says it once when ``"quarantine"`` is enabled.
        """
        self.tell = QuarantineNotices(book, notices)
        self.index_key, self.batch_slicer = index_key, batch_slicer

    def record(self, loader: Any) -> RecordingBatchSampler | None:
        """Make a training ``loader`` record its dataset indices and drop the excluded ones (idempotent)."""
        if not self.record_indices:
            return None
        sampler = record_batch_indices(loader, exclude=self.exclude, clock=self.clock)
        if sampler is not None and sampler not in self.samplers:
            self.samplers.append(sampler)
        return sampler

    def cut_streams(self, loader: Any, module_slicer: Callable[[Any, Any], Any] | None, world_size: int) -> None:
        """A training ``loader`` with no batch sampler to record: make it cut quarantined records out of its batches.

        Only with ``index_key`` (the rows' dataset indices) and while loaders record (``bisect`` or
        ``quarantine``). ``world_size > 1``: a batch made only of quarantined records is kept (one
        rank alone must not skip a batch), and reported.
        """
        if self.index_key is None or not self.record_indices or self.record(loader) is not None:
            return
        quarantine = StreamQuarantine(
            self.index_key,
            self.exclude,
            self.batch_slicer or module_slicer,
            drop_empty=world_size <= 1,
            report=self.tell.problem if self.tell is not None else None,
        )
        try:
            cutting = cut_quarantined_records(loader, quarantine)
        except Exception as error:  # the guard's own failure, never the fit's: the loader is left as it is
            cutting = False
            if self.tell is not None:
                self.tell.warn(
                    "quarantine-failed", f"NanGuard: quarantine could not hold a training loader ({error!r})."
                )
        if cutting and loader not in self.streams:
            self.streams.append(loader)

    def exclusion(self, key: LoaderKey) -> Exclusion:
        """What loader ``key`` of several must never yield: its own quarantine and the shared one."""
        return Exclusion(self.exclude, self.exclude_by_loader.setdefault(key, set()))

    def start_epoch(self, collection: Any) -> None:
        """Read the epoch's training loaders (``trainer.train_dataloader``) before its first batch is fetched.

        Every loader records (if the strategy did not already), each of several gets its own
        quarantine, and what the last epoch recorded ahead and never trained on is dropped.
        """
        if collection is None:
            return
        self.loaders = TrainingLoaders.of(collection, self.record, self.exclusion, self.index_key)
        self.loaders.mark_epoch_end()
        self._tell_reach(self.loaders)

    def _tell_reach(self, loaders: TrainingLoaders) -> None:
        """Tell the book which of this epoch's loaders the quarantine reaches (and the user once which it cannot)."""
        if self.tell is None:
            return
        unwatched = "the guard watches no training loader in this fit (bisect=False and no 'quarantine' remedy)"
        why = loaders.unreachable if self.record_indices else [unwatched] * len(loaders.keys)
        self.tell.loaders(list(zip(loaders.keys, why, strict=True)))

    def cut_fetched_batch(self, batch: Any) -> Any:
        """The batch about to be trained on, less the records quarantined since it was fetched (``None``: none left)."""
        if self.loaders is None:
            return batch
        try:
            keep, cut = self.loaders.cut_quarantined(batch)
        except Exception as error:  # a batch whose layout cannot be rebuilt: the loaders' own cut stands
            if self.tell is not None:
                self.tell.warn(
                    "quarantine-fetched-ahead-failed",
                    f"NanGuard: quarantine could not check a batch fetched ahead ({type(error).__name__}: {error}); "
                    "records quarantined by the step before it may be trained on once more.",
                )
            return batch
        if keep:
            return cut
        if self.tell is not None:
            self.tell.warn(
                "quarantine-fetched-ahead",
                "NanGuard: the batch Lightning had fetched ahead held only records quarantined since; it is skipped "
                "(Lightning's warning 'train_dataloader yielded None' is about it).",
            )
        return None

    def batch_indices(self, batch: Any, index_key: int | str | None) -> list[int] | CombinedIndices | None:
        """The dataset indices of the training batch that starts now (see :meth:`TrainingLoaders.batch_indices`)."""
        if self.loaders is not None:
            return self.loaders.batch_indices(batch, index_key)
        recorded = next_recorded_indices(self.samplers)  # popped either way: the FIFO stays aligned
        return indices_from_batch(batch, index_key) if index_key is not None else recorded

    def readers(self) -> tuple[RecordReader, ...]:
        """Each training loader's record reader (layout order; empty before the first epoch starts)."""
        return self.loaders.readers if self.loaders is not None else ()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["samplers"] = []  # loaders belong to the process that iterates them
        state["loaders"] = None
        state["streams"] = []
        return state


_GENERATED: dict[type, type] = {}
_NEWOBJ = copyreg.__newobj__  # type: ignore[attr-defined]  # how objects of plain classes pickle


class NanGuardStrategyMixin(abc.ABC):  # ABC: same metaclass and layout as Lightning strategies
    """Put in front of a Lightning strategy class; see the module docs."""

    _nanguard: StrategyHooks | None
    _nanguard_original_class: type

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        hooks = getattr(self, "_nanguard", None)
        if hooks is not None:  # LBFGS: its state is copied before its closure runs (no call for other optimizers)
            begin = hooks.before_optimizer_step
            if begin is not None and is_closure_optimizer(optimizer) and hooks.active():
                begin(optimizer)
        output = super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        if hooks is not None and hooks.active():
            hooks.after_optimizer_step(optimizer)
        return output

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[Any, ...]:
        """Pickle as the original class, wrapped again on load (see module docs)."""
        reduced = super().__reduce_ex__(protocol)
        original = type(self).__dict__.get("_nanguard_wraps")
        if original is None or not isinstance(reduced, tuple) or reduced[0] is not _NEWOBJ:
            return reduced
        return (_rewrapped, (original, *reduced[1][1:]), *reduced[2:])

    def process_dataloader(self, dataloader: Any) -> Any:
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        hooks = getattr(self, "_nanguard", None)
        module = getattr(self, "lightning_module", None)
        trainer = getattr(module, "_trainer", None)
        training = bool(getattr(trainer, "training", False))  # Lightning also processes val/test/predict loaders
        if hooks is not None and training:
            hooks.record(dataloader)
            world_size = int(getattr(self, "world_size", 1) or 1)
            hooks.cut_streams(dataloader, getattr(module, "nanguard_slice_batch", None), world_size)
        return dataloader

    def batch_to_device(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        hooks = getattr(self, "_nanguard", None)
        if hooks is not None and hooks.streams and hooks.active():
            trainer = getattr(getattr(self, "lightning_module", None), "_trainer", None)
            if bool(getattr(trainer, "training", False)):  # not a validation, test or predict batch
                batch = hooks.cut_fetched_batch(batch)
                if batch is None:
                    return None  # Lightning skips a None batch ("train_dataloader yielded None")
        return super().batch_to_device(batch, *args, **kwargs)  # type: ignore[misc]


def supported_strategy_kind(strategy: Any) -> str:
    """:func:`strategy_kind`, refusing DeepSpeed with a clear error (its engine owns the optimizer step).

    Raises:
        NonFiniteTrainingError: under DeepSpeed.
    """
    kind = strategy_kind(strategy)
    if kind == "deepspeed":
        raise NonFiniteTrainingError(
            "NanGuard does not support DeepSpeed: its engine owns the optimizer step, so a bad step cannot be "
            "skipped from Lightning. Remove NanGuard, or shard "
            "with ModelParallelStrategy (FSDP2, tensor parallelism), which NanGuard guards in full, or use DDP.",
            [],
        )
    return kind


def _wrapped_class(cls: type) -> type:
    """The ``NanGuard<Original>`` subclass of ``cls``, generated once per class.

    It is also registered in this module under a unique qualified name, so the class object itself
    pickles by reference in this process (``lightning.pytorch`` and ``pytorch_lightning`` both have
    a ``DDPStrategy``: the second gets a suffix).
    """
    if cls not in _GENERATED:
        name = f"NanGuard{cls.__name__}"
        generated = type(name, (NanGuardStrategyMixin, cls), {"__module__": __name__, "_nanguard_wraps": cls})
        module = sys.modules[__name__]
        qualname = name
        while hasattr(module, qualname):
            qualname += "_"
        generated.__qualname__ = qualname
        setattr(module, qualname, generated)
        _GENERATED[cls] = generated
    return _GENERATED[cls]


def _rewrapped(original: type, *args: Any) -> Any:
    """Unpickle a wrapped strategy: a bare instance of ``original``, its class swapped again."""
    instance = original.__new__(original, *args)
    instance.__class__ = _wrapped_class(original)
    return instance


def apply_nanguard_strategy(strategy: Any, hooks: StrategyHooks) -> None:
    """Swap ``strategy``'s class for its ``NanGuard<Original>`` subclass and attach ``hooks``."""
    cls = type(strategy)
    if not issubclass(cls, NanGuardStrategyMixin):
        strategy._nanguard_original_class = cls
        strategy.__class__ = _wrapped_class(cls)
    strategy._nanguard = hooks


def remove_nanguard_strategy(strategy: Any) -> None:
    """Undo :func:`apply_nanguard_strategy`: the strategy and the recorded samplers get their own classes back."""
    hooks = getattr(strategy, "_nanguard", None)
    if isinstance(hooks, StrategyHooks):
        for sampler in hooks.samplers:
            stop_recording(sampler)
        hooks.samplers.clear()
        for loader in hooks.streams:
            stop_cutting(loader)
        hooks.streams.clear()
    original = getattr(strategy, "_nanguard_original_class", None)
    if original is not None and isinstance(strategy, NanGuardStrategyMixin):
        strategy.__class__ = original
    for attr in ("_nanguard", "_nanguard_original_class"):
        vars(strategy).pop(attr, None)
