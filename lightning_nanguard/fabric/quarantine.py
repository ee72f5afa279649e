"""The quarantine in a Fabric loop: the loaders ``fabric.setup_dataloaders`` gives drop or cut quarantined records.

Fabric does not say which of its loaders train. The guard's rule is the one it follows for batches
(:mod:`.steps`): a batch drawn while autograd is on is a training batch; a validation loop runs
under ``torch.no_grad()`` or ``torch.inference_mode()``. So, for each loader set up:

- a map-style loader's recording batch sampler drops quarantined records from the batches it gives
  while autograd is on (:class:`~lightning_nanguard.engine.data.streams.WhileTraining`);
- a loader without one (an ``IterableDataset``) cuts them out of the batches drawn while autograd is
  on, when ``index_key`` names their index field (:mod:`~lightning_nanguard.engine.data.streams`;
  Fabric fetches nothing ahead, so a batch is cut as the loop draws it);
- each pass over a loader that starts while autograd is on tells the remedy book whether the
  quarantine reaches that loader (the loop's training loader is the one it draws from).

Only where records are named at all: with ``NanGuard(loss_fn=...)`` (or a LitGPT recipe's loss);
without it no step is re-run, so no record is named or quarantined.
"""

from __future__ import annotations

from typing import Any
from weakref import WeakKeyDictionary

from lightning_nanguard.engine.data.indices import record_batch_indices
from lightning_nanguard.engine.data.loaders import quarantine_unreachable
from lightning_nanguard.engine.data.reach import QuarantineNotices
from lightning_nanguard.engine.data.streams import (
    StreamQuarantine,
    WhileTraining,
    at_each_pass,
    cut_quarantined_records,
    training_batches_only,
)
from lightning_nanguard.fabric.steps import FabricSteps

__all__ = ["quarantine_in_fabric"]

_TELLERS: WeakKeyDictionary[FabricSteps, QuarantineNotices] = WeakKeyDictionary()


def _teller(steps: FabricSteps) -> QuarantineNotices:
    """One :class:`QuarantineNotices` per Fabric loop (what it learned of unreadable index fields stays)."""
    if steps not in _TELLERS:
        controller = steps.controller
        _TELLERS[steps] = QuarantineNotices(controller.recovery.book, controller.recorder.notices)
    return _TELLERS[steps]


def quarantine_in_fabric(steps: FabricSteps, loader: Any) -> None:
    """Make a loader of a Fabric loop drop or cut quarantined records (see the module docs).

    Call it before :meth:`FabricSteps.watch_loader`, so that the batches the guard keeps for a
    diagnosis are the ones the loop trains on.
    """
    if not steps.keep_batches:  # no step is re-run: no record is named, none is quarantined
        return
    controller = steps.controller
    book = controller.recovery.book
    tell = _teller(steps)
    records = controller.diagnosis.records
    index_key = records.index_key if records is not None else None
    sampler = record_batch_indices(loader, exclude=WhileTraining(book.quarantined))  # watch_loader pops its FIFO
    why: str | None = None
    if sampler is None:
        quarantine = None
        if index_key is not None:
            quarantine = StreamQuarantine(
                index_key,
                book.quarantined,
                controller.diagnosis.slicer_for(steps.front.module),
                drop_empty=steps.front.world_size <= 1,
                applies=training_batches_only,
                report=tell.problem,
            )
        if quarantine is None or not cut_quarantined_records(loader, quarantine):
            why = quarantine_unreachable(loader, index_key)

    def training_pass() -> None:
        if training_batches_only():
            tell.loaders([(None, why)])

    if sampler is not None:
        sampler.nanguard_on_pass = training_pass  # the loader's class stays as Fabric made it
    elif not at_each_pass(loader, training_pass):  # not a DataLoader: registered now
        tell.loaders([(None, why)])
