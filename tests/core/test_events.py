"""``NanEvent`` (the public record of a bad step) and ``NonFiniteTrainingError``."""

from __future__ import annotations

import dataclasses
import json
import math
import pickle

import pytest
from event_factory import make_event

from lightning_nanguard import NanEvent, NonFiniteTrainingError
from lightning_nanguard.core.events import EVENT_CAUSES, EVENT_KINDS

# The to_dict() keys are a public contract (events.jsonl): fields may be added, never renamed or removed.
CONTRACT_KEYS = [
    "global_step",
    "epoch",
    "batch_idx",
    "rank",
    "kinds",
    "action",
    "nonfinite_grads",
    "nonfinite_buffers",
    "loss",
    "offending_samples",
    "dataset_indices",
    "culprit_module",
    "culprit_op",
    "source_line",
    "phase",
    "remedies",
    "repro_path",
    "grad_norm",
    "nonfinite_params",
    "details",
    "cause",
]
# Written only when set (several training loaders): one loader's events are unchanged.
OPTIONAL_KEYS = ["sample_loaders"]
VERIFICATION_KEYS = ["indices_verified", "blame_verified", "sample_records"]  # written only when set
OPTIMIZER_KEYS = ["optimizer"]  # written only when known: events of one optimizer's steps are unchanged


def assert_same_event(a: NanEvent, b: NanEvent) -> None:
    """Field-by-field equality where NaN equals NaN."""
    for f in dataclasses.fields(NanEvent):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, float) and math.isnan(x):
            assert isinstance(y, float) and math.isnan(y), f.name
        else:
            assert x == y, f.name
            assert type(x) is type(y), f.name


def test_to_dict_keys_are_the_public_contract() -> None:
    assert list(make_event().to_dict()) == CONTRACT_KEYS
    fields = [f.name for f in dataclasses.fields(NanEvent)]
    assert fields == CONTRACT_KEYS + OPTIONAL_KEYS + VERIFICATION_KEYS + OPTIMIZER_KEYS
    two_loaders = make_event(sample_loaders=("b", 0)).to_dict()
    assert list(two_loaders) == CONTRACT_KEYS + OPTIONAL_KEYS
    assert two_loaders["sample_loaders"] == ["b", 0]


def test_sample_loaders_round_trip_and_absent_key_reads_as_none() -> None:
    event = make_event(sample_loaders=("b", "tasks.0"), offending_samples=(1, 3), dataset_indices=(41, 7))
    back = NanEvent.from_dict(json.loads(json.dumps(event.to_dict())))
    assert back.sample_loaders == ("b", "tasks.0") and back == event.replace(loss=back.loss)
    single = make_event().to_dict()
    assert "sample_loaders" not in single
    assert NanEvent.from_dict(single).sample_loaders is None


def test_the_optimizer_round_trips_and_an_older_line_reads_as_none() -> None:
    event = make_event(optimizer=1)
    written = json.loads(json.dumps(event.to_dict()))
    assert written["optimizer"] == 1 and list(written) == CONTRACT_KEYS + OPTIMIZER_KEYS
    assert NanEvent.from_dict(written).optimizer == 1
    older = make_event().to_dict()  # a line written before the field existed
    assert "optimizer" not in older and NanEvent.from_dict(older).optimizer is None
    positional = NanEvent(3, 0, 3, 0, ("loss",), "skipped", (), (), None, None, None, None, None, None, None, ())
    assert positional.optimizer is None  # the constructor's positional order is unchanged


@pytest.mark.parametrize(
    ("loss", "grad_norm", "loss_json", "norm_json"),
    [
        (math.nan, math.inf, "nan", "inf"),
        (math.inf, -math.inf, "inf", "-inf"),
        (-math.inf, math.nan, "-inf", "nan"),
        (0.5, 3.25, 0.5, 3.25),
        (None, None, None, None),
    ],
)
def test_round_trip_through_strict_json(
    loss: float | None, grad_norm: float | None, loss_json: object, norm_json: object
) -> None:
    event = make_event(loss=loss, grad_norm=grad_norm)
    data = event.to_dict()
    assert data["loss"] == loss_json
    assert data["grad_norm"] == norm_json
    text = json.dumps(data, allow_nan=False)  # no NaN/Infinity literals anywhere
    back = NanEvent.from_dict(json.loads(text))
    assert_same_event(back, event)
    assert back.to_dict() == data


def test_to_dict_uses_json_types() -> None:
    data = make_event().to_dict()
    assert data["kinds"] == ["loss", "grad", "bn_stats"]
    assert data["offending_samples"] == [3, 5]
    assert data["remedies"] == ["lowered lr to 1e-4"]
    assert isinstance(data["details"], dict)
    assert data["details"]["bn_channels"] == {"net.1": [0, 2]}


def test_minimal_event_defaults_round_trip() -> None:
    event = NanEvent(global_step=0, epoch=0, batch_idx=0, rank=3, kinds=("loss",), action="raised")
    data = event.to_dict()
    assert data["offending_samples"] is None
    assert data["nonfinite_grads"] == []
    assert data["details"] == {}
    back = NanEvent.from_dict(json.loads(json.dumps(data, allow_nan=False)))
    assert back == event
    assert back.offending_samples is None
    assert back.nonfinite_grads == ()


def test_from_dict_ignores_unknown_keys_and_fills_missing_optional_ones() -> None:
    data = {"global_step": 7, "epoch": 0, "batch_idx": 7, "rank": 0, "kinds": ["grad"], "action": "warned"}
    data["added_in_a_future_version"] = {"x": 1}
    event = NanEvent.from_dict(data)
    assert event == NanEvent(7, 0, 7, 0, ("grad",), "warned")


def test_from_dict_does_not_mutate_its_input() -> None:
    data = make_event().to_dict()
    snapshot = json.dumps(data, sort_keys=True)
    NanEvent.from_dict(data)
    assert json.dumps(data, sort_keys=True) == snapshot


def test_events_are_frozen_and_replace_copies() -> None:
    event = make_event()
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.action = "raised"  # type: ignore[misc]
    raised = event.replace(action="raised")
    assert raised.action == "raised"
    assert event.action == "skipped"
    assert raised.nonfinite_grads == event.nonfinite_grads


def test_events_pickle() -> None:
    event = make_event(loss=0.25, grad_norm=1.0)
    assert pickle.loads(pickle.dumps(event)) == event


def test_event_kinds() -> None:
    assert EVENT_KINDS[:4] == ("loss", "grad", "bn_stats", "param")  # later kinds may be appended
    assert len(set(EVENT_KINDS)) == len(EVENT_KINDS)


@pytest.mark.parametrize(
    ("action", "suffix"),
    [
        ("skipped", "step skipped"),
        ("raised", "training stopped"),
        ("warned", "step applied (action='warn')"),
        ("rolled_back", "rolled back to the last good state"),
    ],
)
def test_headline(action: str, suffix: str) -> None:
    event = make_event(action=action)
    assert event.headline() == (
        "step 12 (epoch 1, batch 4): non-finite loss, grad, bn_stats "
        f"(2 parameter grads, 2 BatchNorm buffers, 1 parameters) -> {suffix}"
    )


def test_headline_without_names() -> None:
    assert make_event(bare=True, global_step=3, batch_idx=3).headline() == (
        "step 3 (epoch 0, batch 3): non-finite loss -> step skipped"
    )


def test_error_carries_events() -> None:
    first = make_event(bare=True, global_step=1, batch_idx=1, kinds=("grad",))
    last = make_event(bare=True, global_step=2, batch_idx=2, kinds=("grad",), action="raised")
    history = [first, last]
    error = NonFiniteTrainingError("stop here", history)
    assert isinstance(error, RuntimeError)
    assert str(error) == "stop here"
    assert error.event is last
    assert error.events == [first, last]
    history.clear()
    assert error.events == [first, last]  # a copy, not the caller's list
    with pytest.raises(NonFiniteTrainingError, match="stop here"):
        raise error


def test_verification_fields_round_trip_and_are_absent_when_unset() -> None:
    event = make_event(
        loss=1.5,
        offending_samples=(1,),
        indices_verified=False,
        blame_verified=True,
        sample_records=((3, 9),),
        details={"indices_unverified": "rows blend records"},
    )
    written = json.loads(json.dumps(event.to_dict()))
    assert written["sample_records"] == [[3, 9]] and written["indices_verified"] is False
    assert NanEvent.from_dict(written) == event
    assert not set(VERIFICATION_KEYS) & set(make_event().to_dict())
    assert "batch" in EVENT_CAUSES
