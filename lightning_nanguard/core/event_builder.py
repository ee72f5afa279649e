"""How a :class:`~lightning_nanguard.core.events.NanEvent` is built: the sections stages return, merged in one place.

An event's fields come from the stages a bad step meets, each knowing its own share only. A stage
returns a **section**, a small frozen record of that share, and :func:`build_event` merges the
sections into the event: the one place an event's fields are set. Which stage returns which
section, and which fields each section holds (:data:`FIELD_SECTIONS`):

=========== ========================================================== =====================================
section     returned by                                                fields
=========== ========================================================== =====================================
Where       the inspector, the weight check, a guard error             ``global_step``, ``epoch``,
            (``Where.at``); the diagnosis moves ``batch_idx`` to the   ``batch_idx``, ``rank``, ``optimizer``
            micro-batch it names (``engine/incident/step_diagnosis``)
Found       the confirmation and the spike watch                       ``kinds``, ``nonfinite_grads``,
            (``engine/incident/inspector``, ``sharded_inspector``),    ``nonfinite_buffers``,
            a collapsed loss scale (``inspector.loss_scale_event``),   ``nonfinite_params``, ``loss``,
            the weight check (``engine/after_step``), a guard error    ``grad_norm``
            (``engine/parts``)
Forensics   the diagnosis (``diagnose/event_fields``), the micro-batch ``cause`` (this rank's),
            it chose (``step_diagnosis``), the sharded search          ``culprit_module``, ``culprit_op``,
            (``sharded_inspector``), the weight check (``state``),     ``source_line``, ``phase``
            a collapsed loss scale (its hint)
Rows        the diagnosis (``diagnose/event_fields``), each sample's   ``offending_samples``,
            loader (``engine/rows/samples``), the records of the rows  ``dataset_indices``,
            (``engine/rows/record_names``), a loop that cannot re-run  ``sample_loaders``,
            a step (``inspector.with_rerun_note``)                     ``sample_records``,
                                                                       ``indices_verified``,
                                                                       ``blame_verified``
Decided     what became of the step: ``StepActions.act``               ``action``, ``cause`` (the ranks'),
            (``engine/step_actions``), the weight check's rollback or       ``remedies``
            raise (``engine/after_step``), a guard error
Files       the incident's files (``engine/incident/files``), a saved  ``repro_path``
            bundle (``reporting/repro``)
=========== ========================================================== =====================================

``details`` is the union of the ``details`` of Found, Forensics and Rows, each key written by the
section :data:`~lightning_nanguard.core.detail_keys.DETAIL_KEYS` names (checked here:
:func:`~lightning_nanguard.core.detail_keys.check_detail_keys`).

**The cause is decided here, once**: the cause the ranks share (``Decided.cause``, the step's
decision, which reconciles every rank's vote) when there is one, else this rank's diagnosis's
(``Forensics.cause``), else ``None``.

A stage after the event left the stage that built it (the decision: the controller hands on the
event; the sharded merge of the ranks' findings; replay) adds its section with
:func:`with_sections`, which takes the event apart into its sections (:meth:`EventSections.of`)
and builds it again with that section in place: the same merge, the same cause rule.

Example:
    >>> where = Where(global_step=3, epoch=0, batch_idx=3, rank=0)
    >>> event = build_event(where, Found(("loss",), loss=float("nan")), Forensics(cause="data"))
    >>> event.action, event.cause
    ('warned', 'data')
    >>> decided = with_sections(event, decided=Decided("skipped", cause="input"))
    >>> decided.action, decided.cause
    ('skipped', 'input')
    >>> EventSections.of(decided).event() == decided
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from lightning_nanguard.core.detail_keys import DETAIL_KEYS, check_detail_keys
from lightning_nanguard.core.events import EventAction, EventCause, EventKind, NanEvent

__all__ = [
    "FIELD_SECTIONS",
    "Decided",
    "EventSections",
    "Files",
    "Forensics",
    "Found",
    "Rows",
    "Where",
    "build_event",
    "noted",
    "with_sections",
]

Phase = Literal["forward", "backward"]


@dataclass(frozen=True)
class Where:
    """Which step of which rank (and which optimizer's step) the event is about.

    Attributes:
        global_step: the loop's global step when the step was checked.
        epoch: the loop's epoch.
        batch_idx: the batch within the epoch (the diagnosed micro-batch under accumulation).
        rank: the global rank of the process.
        optimizer: the index of the optimizer whose step it was (in ``trainer.optimizers``; in a
            Fabric loop, the order in which the optimizers first stepped); ``None`` when unknown.
    """

    global_step: int
    epoch: int
    batch_idx: int
    rank: int
    optimizer: int | None = None

    @classmethod
    def at(cls, front: Any, batch_idx: int, optimizer: int | None = None) -> Where:
        """The step ``front`` is at (its global step, epoch and rank; 0 for what it lacks).

        Example:
            >>> from types import SimpleNamespace
            >>> Where.at(SimpleNamespace(global_step=7, current_epoch=1, global_rank=2), 3, optimizer=1)
            Where(global_step=7, epoch=1, batch_idx=3, rank=2, optimizer=1)
        """
        return cls(
            getattr(front, "global_step", 0),
            getattr(front, "current_epoch", 0),
            batch_idx,
            getattr(front, "global_rank", 0),
            optimizer,
        )


@dataclass(frozen=True)
class Found:
    """What the check found: the kinds, the non-finite tensors, the loss and the gradient norm."""

    kinds: tuple[EventKind, ...]
    nonfinite_grads: tuple[str, ...] = ()
    nonfinite_buffers: tuple[str, ...] = ()
    nonfinite_params: tuple[str, ...] = ()
    loss: float | None = None
    grad_norm: float | None = None
    details: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Forensics:
    """What the diagnosis concluded: this rank's cause and the origin (module, op, source line, phase)."""

    cause: EventCause | None = None
    culprit_module: str | None = None
    culprit_op: str | None = None
    source_line: str | None = None
    phase: Phase | None = None
    details: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Rows:
    """Which rows are named (positions, loaders), the records they hold, and whether index and blame are verified."""

    offending_samples: tuple[int, ...] | None = None
    dataset_indices: tuple[int, ...] | None = None
    sample_loaders: tuple[str | int, ...] | None = None
    sample_records: tuple[tuple[int, ...], ...] | None = None
    indices_verified: bool | None = None
    blame_verified: bool | None = None
    details: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Decided:
    """What became of the step: the action, the cause the ranks share, the remedies applied."""

    action: EventAction = "warned"
    cause: EventCause | None = None
    remedies: tuple[str, ...] = ()


@dataclass(frozen=True)
class Files:
    """The incident's files: the repro bundle's directory (``None``: none saved)."""

    repro_path: str | None = None


FIELD_SECTIONS: Mapping[str, str] = {
    "global_step": "where",
    "epoch": "where",
    "batch_idx": "where",
    "rank": "where",
    "optimizer": "where",
    "kinds": "found",
    "nonfinite_grads": "found",
    "nonfinite_buffers": "found",
    "nonfinite_params": "found",
    "loss": "found",
    "grad_norm": "found",
    "cause": "forensics, decided",
    "culprit_module": "forensics",
    "culprit_op": "forensics",
    "source_line": "forensics",
    "phase": "forensics",
    "offending_samples": "rows",
    "dataset_indices": "rows",
    "sample_loaders": "rows",
    "sample_records": "rows",
    "indices_verified": "rows",
    "blame_verified": "rows",
    "action": "decided",
    "remedies": "decided",
    "repro_path": "files",
    "details": "found, forensics, rows",
}
"""Each ``NanEvent`` field and the section(s) it comes from (``tests/core/test_event_builder.py`` checks it)."""


def build_event(
    where: Where,
    found: Found,
    forensics: Forensics | None = None,
    rows: Rows | None = None,
    decided: Decided | None = None,
    files: Files | None = None,
) -> NanEvent:
    """The event of these sections: the one place an event's fields are set (see module docs).

    A missing section is an empty one; without ``decided`` the action is ``"warned"`` (the step's
    decision is not taken yet). The cause: ``decided.cause`` when set, else ``forensics.cause``.
    """
    forensics = forensics if forensics is not None else Forensics()
    rows = rows if rows is not None else Rows()
    decided = decided if decided is not None else Decided()
    files = files if files is not None else Files()
    details: dict[str, Any] = {}
    for name, section in (("found", found.details), ("forensics", forensics.details), ("rows", rows.details)):
        check_detail_keys(name, section)
        details.update(section)
    return NanEvent(
        global_step=where.global_step,
        epoch=where.epoch,
        batch_idx=where.batch_idx,
        rank=where.rank,
        kinds=tuple(found.kinds),
        action=decided.action,
        nonfinite_grads=found.nonfinite_grads,
        nonfinite_buffers=found.nonfinite_buffers,
        loss=found.loss,
        offending_samples=rows.offending_samples,
        dataset_indices=rows.dataset_indices,
        culprit_module=forensics.culprit_module,
        culprit_op=forensics.culprit_op,
        source_line=forensics.source_line,
        phase=forensics.phase,
        remedies=decided.remedies,
        repro_path=files.repro_path,
        grad_norm=found.grad_norm,
        nonfinite_params=found.nonfinite_params,
        details=details,
        cause=decided.cause if decided.cause is not None else forensics.cause,  # the ranks' shared cause first
        sample_loaders=rows.sample_loaders,
        indices_verified=rows.indices_verified,
        blame_verified=rows.blame_verified,
        sample_records=rows.sample_records,
        optimizer=where.optimizer,
    )


@dataclass(frozen=True)
class EventSections:
    """The sections of one event, to build it (:meth:`event`) or to build it again with one section changed."""

    where: Where
    found: Found
    forensics: Forensics = field(default_factory=Forensics)
    rows: Rows = field(default_factory=Rows)
    decided: Decided = field(default_factory=Decided)
    files: Files = field(default_factory=Files)

    def event(self) -> NanEvent:
        """:func:`build_event` of these sections."""
        return build_event(self.where, self.found, self.forensics, self.rows, self.decided, self.files)

    @classmethod
    def of(cls, event: NanEvent) -> EventSections:
        """The sections ``event`` is built from: ``EventSections.of(event).event() == event``.

        Each ``details`` key goes to the section :data:`~lightning_nanguard.core.detail_keys.DETAIL_KEYS`
        names (an unregistered key to ``found``, where :func:`build_event` reports it); the cause
        goes to ``forensics`` (a decided cause is the event's cause from then on).
        """
        parted: dict[str, dict[str, Any]] = {"found": {}, "forensics": {}, "rows": {}}
        for key, value in event.details.items():
            parted[DETAIL_KEYS[key].section if key in DETAIL_KEYS else "found"][key] = value
        e = event
        return cls(
            Where(e.global_step, e.epoch, e.batch_idx, e.rank, e.optimizer),
            Found(
                e.kinds,
                e.nonfinite_grads,
                e.nonfinite_buffers,
                e.nonfinite_params,
                e.loss,
                e.grad_norm,
                parted["found"],
            ),
            Forensics(e.cause, e.culprit_module, e.culprit_op, e.source_line, e.phase, parted["forensics"]),
            Rows(
                e.offending_samples,
                e.dataset_indices,
                e.sample_loaders,
                e.sample_records,
                e.indices_verified,
                e.blame_verified,
                parted["rows"],
            ),
            Decided(e.action, None, e.remedies),
            Files(e.repro_path),
        )


def with_sections(
    event: NanEvent,
    *,
    where: Where | None = None,
    found: Found | None = None,
    forensics: Forensics | None = None,
    rows: Rows | None = None,
    decided: Decided | None = None,
    files: Files | None = None,
) -> NanEvent:
    """``event`` built again with the sections given in place of its own (a later stage's share).

    Example:
        >>> event = build_event(Where(3, 0, 3, 0), Found(("loss",)))
        >>> with_sections(event, files=Files("/runs/nanguard/step-3")).repro_path
        '/runs/nanguard/step-3'
    """
    own = EventSections.of(event)
    return EventSections(
        where if where is not None else own.where,
        found if found is not None else own.found,
        forensics if forensics is not None else own.forensics,
        rows if rows is not None else own.rows,
        decided if decided is not None else own.decided,
        files if files is not None else own.files,
    ).event()


_Noted = TypeVar("_Noted", Found, Forensics, Rows)


def noted(section: _Noted, **details: Any) -> _Noted:
    """``section`` with ``details`` added to its own (a note of the stage that returns it).

    Example:
        >>> noted(Rows(details={"batch_size": 8}), samples_not_named="no loss_fn").details
        {'batch_size': 8, 'samples_not_named': 'no loss_fn'}
    """
    return dataclasses.replace(section, details={**section.details, **details})
