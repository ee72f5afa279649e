"""event_with_diagnosis: the forensic fields of an event from a Diagnosis (one loader, replay, several loaders)."""

from __future__ import annotations

from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.diagnose.batch_diagnosis import Diagnosis
from lightning_nanguard.diagnose.combined import LoaderSplit
from lightning_nanguard.diagnose.event_fields import event_with_diagnosis
from lightning_nanguard.diagnose.localization import Localization

EVENT = NanEvent(3, 0, 3, 0, ("loss",), "skipped")


def test_samples_indices_cause_and_pass_counts() -> None:
    found = Diagnosis(8, [2, 5], passes=9, cause="data", state_passes=2, loss_threshold=4.0, input_fields=("x",))
    filled = event_with_diagnosis(EVENT, found, dataset_indices=range(10, 18))
    assert (filled.offending_samples, filled.dataset_indices, filled.cause) == ((2, 5), (12, 15), "data")
    assert filled.details == {
        "batch_size": 8,
        "bisect_passes": 9,
        "state_passes": 2,
        "input_fields": ["x"],
        "loss_threshold": 4.0,
    }


def test_indices_only_when_every_offending_sample_has_one() -> None:
    assert event_with_diagnosis(EVENT, Diagnosis(8, [7]), dataset_indices=[0, 1]).dataset_indices is None


def test_not_attributable_and_a_partial_search_say_why() -> None:
    assert event_with_diagnosis(EVENT, Diagnosis(8, None, "every sample fails")).details["not_attributable"] == (
        "every sample fails"
    )
    partial = event_with_diagnosis(EVENT, Diagnosis(8, [1], "max_bisect_passes=128 reached"))
    assert partial.details["bisect_note"] == "max_bisect_passes=128 reached"


def test_replay_maps_positions_back_to_the_original_batch() -> None:
    filled = event_with_diagnosis(EVENT, Diagnosis(2, [1]), positions=[4, 6], batch_size=32)
    assert filled.offending_samples == (6,) and filled.details["batch_size"] == 32


def test_the_origin_fields() -> None:
    origin = Localization(phase="backward", module="net.norm", op="SqrtBackward0", source_line="m.py:3", hint="eps")
    filled = event_with_diagnosis(EVENT, Diagnosis(8, [1], localization=origin))
    assert (filled.culprit_module, filled.culprit_op, filled.source_line, filled.phase) == (
        "net.norm",
        "SqrtBackward0",
        "m.py:3",
        "backward",
    )
    assert filled.details["hint"] == "eps"


def test_several_loaders_name_each_samples_loader_and_its_own_index() -> None:
    split = LoaderSplit(("a", "b"), (4, 3))
    filled = event_with_diagnosis(
        EVENT, Diagnosis(7, [1, 5], cause="data", loaders=split), dataset_indices=[0, 1, 2, 3, 40, 41, 42]
    )
    assert (filled.offending_samples, filled.sample_loaders, filled.dataset_indices) == ((1, 1), ("a", "b"), (1, 41))
    assert filled.details["loader_batch_sizes"] == [["a", 4], ["b", 3]]
    unknown = event_with_diagnosis(EVENT, Diagnosis(7, [5], loaders=split), indices_note="loader 'b' is iterable")
    assert unknown.dataset_indices is None and unknown.details["dataset_indices_unknown"] == "loader 'b' is iterable"
