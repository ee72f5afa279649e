"""The one builder of ``NanEvent``: each field from one section, ``details`` merged, the cause decided once."""

from __future__ import annotations

import dataclasses
import math

import pytest
from event_factory import make_event

from lightning_nanguard.core.event_builder import (
    FIELD_SECTIONS,
    Decided,
    EventSections,
    Files,
    Forensics,
    Found,
    Rows,
    Where,
    build_event,
    noted,
    with_sections,
)
from lightning_nanguard.core.events import NanEvent

WHERE = Where(global_step=12, epoch=1, batch_idx=4, rank=0)
SECTIONS = {"where", "found", "forensics", "rows", "decided", "files"}


def test_every_field_comes_from_a_section_and_the_table_says_which() -> None:
    assert list(FIELD_SECTIONS) != [] and set(FIELD_SECTIONS) == {f.name for f in dataclasses.fields(NanEvent)}
    for field, sections in FIELD_SECTIONS.items():
        for section in sections.split(", "):
            assert section in SECTIONS, field
            section_class = {"where": Where, "found": Found, "forensics": Forensics, "rows": Rows}.get(section)
            section_class = section_class or {"decided": Decided, "files": Files}[section]
            assert field in {f.name for f in dataclasses.fields(section_class)}, (field, section)


def test_an_event_is_its_sections_built() -> None:
    event = build_event(
        Where(7, 0, 3, 1, optimizer=2),
        Found(("loss", "grad"), ("fc.weight",), (), (), math.inf, math.nan, {"grads_checked": 2}),
        Forensics("data", "net.0", "DivBackward0", "m.py:3", "forward", {"hint": "eps"}),
        Rows((1,), (41,), None, None, True, True, {"batch_size": 8}),
        Decided("skipped", None, ("clip_grad",)),
        Files("/runs/step-7"),
    )
    assert (event.global_step, event.batch_idx, event.rank, event.optimizer) == (7, 3, 1, 2)
    assert event.kinds == ("loss", "grad") and event.nonfinite_grads == ("fc.weight",)
    assert (event.cause, event.culprit_module, event.phase) == ("data", "net.0", "forward")
    assert (event.offending_samples, event.dataset_indices, event.indices_verified) == ((1,), (41,), True)
    assert (event.action, event.remedies, event.repro_path) == ("skipped", ("clip_grad",), "/runs/step-7")
    assert event.details == {"grads_checked": 2, "hint": "eps", "batch_size": 8}


def test_without_a_decision_the_step_is_warned_and_nothing_else_is_set() -> None:
    event = build_event(WHERE, Found(("loss",)))
    assert event == NanEvent(12, 1, 4, 0, ("loss",), "warned")


@pytest.mark.parametrize(
    ("diagnosed", "shared", "cause"),
    [("data", None, "data"), ("data", "input", "input"), (None, "state", "state"), (None, None, None)],
)
def test_the_cause_is_the_ranks_shared_one_else_this_ranks_diagnosis(
    diagnosed: str | None, shared: str | None, cause: str | None
) -> None:
    event = build_event(WHERE, Found(("loss",)), Forensics(diagnosed), decided=Decided("skipped", shared))  # type: ignore[arg-type]
    assert event.cause == cause
    assert with_sections(event, decided=Decided("skipped")).cause == cause  # decided once, kept after


def test_sections_of_an_event_build_it_again() -> None:
    event = make_event(optimizer=1, indices_verified=True, sample_loaders=("a", "b"), offending_samples=(3, 5))
    sections = EventSections.of(event)
    assert sections.event() == event
    assert sections.found.details == {"grads_checked": 6}  # each details key to its registered section
    assert sections.forensics.details == {"bn_channels": {"net.1": [0, 2]}}
    assert sections.rows.details == {"batch_size": 8}


def test_with_sections_replaces_one_section_only() -> None:
    event = make_event()
    files = with_sections(event, files=Files("/elsewhere"))
    assert files == event.replace(repro_path="/elsewhere")
    where = with_sections(event, where=Where(3, 0, 3, 0, optimizer=0))
    assert (where.global_step, where.optimizer) == (3, 0) and where.replace(global_step=12, batch_idx=4, epoch=1) == (
        event.replace(optimizer=0)
    )


def test_noted_adds_details_to_a_section() -> None:
    rows = noted(Rows((1,), details={"batch_size": 8}), samples_not_named="x")
    assert rows.details == {"batch_size": 8, "samples_not_named": "x"} and rows.offending_samples == (1,)
