"""Short sentences for an event's cause, origin and call stack (``lightning_nanguard.reporting.explain``)."""

from __future__ import annotations

import pytest
from event_factory import make_event

from lightning_nanguard.reporting.explain import (
    blame_text,
    cause_text,
    indices_mark,
    origin_text,
    records_text,
    stack_text,
)


@pytest.mark.parametrize(
    ("cause", "text"),
    [
        ("data", "data: the offending samples reproduce it on their own"),
        ("input", "input: the batch itself holds NaN/Inf"),
        ("state", "model state: the weights/optimizer are at fault, no sample is to blame"),
        ("interaction", "interaction: samples fail only together"),
        ("batch", "batch: the batch as a whole, no record is at fault"),
        (None, None),
    ],
)
def test_cause_text(cause: str | None, text: str | None) -> None:
    assert cause_text(make_event(cause=cause, details={})) == text


def test_cause_text_names_the_input_fields() -> None:
    event = make_event(cause="input", details={"input_fields": ["pixel_values", 0, "mask"]})
    assert cause_text(event) == "input: the batch itself holds NaN/Inf (in pixel_values, [0], mask)"
    assert cause_text(event.replace(cause="data")) == "data: the offending samples reproduce it on their own"


def test_an_unknown_cause_is_shown_as_it_is() -> None:
    assert cause_text(make_event(cause="cosmic_rays")) == "cosmic_rays"  # type: ignore[arg-type]


def test_origin_of_a_forward_op_with_its_function_and_module_type() -> None:
    event = make_event(
        culprit_module="enc.0",
        culprit_op="DivBackward0",
        phase="forward",
        details={"function": "torch.div", "module_type": "Ratio"},
    )
    assert origin_text(event) == "forward: torch.div (DivBackward0) in module enc.0 (Ratio)"
    assert origin_text(event, code="`") == "forward: `torch.div` (`DivBackward0`) in module `enc.0` (Ratio)"


def test_origin_of_a_backward_op() -> None:
    event = make_event(culprit_op="SqrtBackward0", phase="backward", details={"function": "torch.sqrt"})
    assert origin_text(event) == "backward: SqrtBackward0 (gradient of torch.sqrt) in module net.norm"


def test_origin_without_a_function() -> None:
    event = make_event(culprit_op="running_var", culprit_module="bn", phase="forward", details={})
    assert origin_text(event) == "forward of running_var in module bn"
    assert origin_text(event.replace(phase=None, culprit_op=None)) == "? of ? in module bn"


def test_origin_in_the_lightning_module_or_an_unknown_module() -> None:
    in_step = make_event(culprit_module="", culprit_op="LogBackward0", phase="backward", details={})
    assert origin_text(in_step) == "backward of LogBackward0 in module <LightningModule>"
    unknown = make_event(culprit_module=None, culprit_op="LogBackward0", phase="backward", details={})
    assert origin_text(unknown) == "backward of LogBackward0 in an unknown module"


def test_origin_in_the_batch_itself() -> None:
    event = make_event(culprit_op="<input>", culprit_module=None, details={"input_fields": ["x", 1]})
    assert origin_text(event) == "the batch itself (in x, [1]), before any op"
    assert origin_text(event, code="`") == "the batch itself (in `x, [1]`), before any op"
    assert origin_text(event.replace(details={})) == "the batch itself, before any op"


def test_no_origin() -> None:
    assert origin_text(make_event(culprit_op=None, culprit_module=None)) is None


def test_stack_text_outermost_first_and_only_with_two_frames_or_more() -> None:
    stack = [
        {"file": "train.py", "line": 40, "function": "training_step"},
        {"file": "model.py", "line": 12, "function": "forward"},
        "not a frame",
    ]
    assert stack_text(make_event(details={"stack": stack})) == "train.py:40 training_step > model.py:12 forward"
    assert stack_text(make_event(details={"stack": stack[:1]})) is None
    assert stack_text(make_event(details={"stack": "train.py:40"})) is None
    assert stack_text(make_event(details={})) is None


# ------------------------------------------------------------------------------------ what the guard verified


@pytest.mark.parametrize(
    ("verified", "details", "text"),
    [
        (True, {}, "verified"),
        (False, {"indices_unverified": "the collate reorders rows"}, "not verified: the collate reorders rows"),
        (False, {}, "not verified"),
        (None, {"indices_unverified": "never shown without the field"}, None),
    ],
)
def test_indices_mark(verified: bool | None, details: dict[str, str], text: str | None) -> None:
    assert indices_mark(make_event(indices_verified=verified, details=details)) == text


@pytest.mark.parametrize(
    ("cause", "verified", "details", "text"),
    [
        ("data", True, {"verify_passes": 1}, "verified: bad beside known-healthy samples (+1 pass)"),
        ("data", True, {"verify_passes": 2}, "verified: bad beside known-healthy samples (+2 passes)"),
        ("data", True, {"verify_passes": 0}, "verified: bad beside known-healthy samples"),
        ("input", True, {}, "verified: the samples hold NaN/Inf themselves"),
        ("data", False, {"blame_unverified": "max_bisect_passes reached"}, "not verified: max_bisect_passes reached"),
        ("data", False, {"verify_passes": 1}, "not verified"),
        ("data", None, {"blame_unverified": "never shown without the field"}, None),
    ],
)
def test_blame_text(cause: str, verified: bool | None, details: dict[str, object], text: str | None) -> None:
    assert blame_text(make_event(cause=cause, blame_verified=verified, details=details)) == text


def test_blame_text_carries_the_note() -> None:
    event = make_event(blame_verified=True, details={"blame_note": "sample 6 failed only alone and was dropped"})
    assert blame_text(event) == "verified: bad beside known-healthy samples; sample 6 failed only alone and was dropped"


def test_records_text_shows_each_row_and_cuts_long_rows() -> None:
    assert records_text([(10, 11), (40,)]) == "[10, 11], [40]"
    assert records_text([tuple(range(9)), ()]) == "[0, 1, 2, 3, 4, 5, 6, 7, +1 more], []"
