"""The samples an event names, the dashboard shows and a bundle saves, with one training loader or several."""

from __future__ import annotations

import torch

from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.diagnose.batch_diagnosis import Diagnosis
from lightning_nanguard.diagnose.combined import CombinedIndices, CombinedLayout, LoaderSplit
from lightning_nanguard.engine.rows.samples import bundle_samples, context_samples, fill_event
from lightning_nanguard.engine.step.window import MicroBatch

AB = CombinedLayout.from_paths([("a",), ("b",)])
EVENT = NanEvent(3, 0, 3, 0, ("grad",), "skipped")


def two_loaders(b_indices: list[int] | None = None) -> MicroBatch:
    batch = {"a": torch.arange(4.0), "b": torch.arange(10.0, 13.0)}
    return MicroBatch(batch, 3, None, loaders=CombinedIndices(AB, ([20, 21, 22, 23], b_indices), ("", "a stream")))


def test_one_loader_saves_a_known_good_sample_first_and_names_positions() -> None:
    micro = MicroBatch(torch.arange(8.0), 3, list(range(100, 108)))
    found = Diagnosis(8, [5], cause="data", known_good=[0, 1])
    event = fill_event(EVENT, found, micro)
    assert (event.offending_samples, event.dataset_indices, event.sample_loaders) == ((5,), (105,), None)
    saved = bundle_samples(event, micro, found, None)
    assert (saved.samples.tolist(), saved.positions, saved.dataset_indices, saved.reference) == (
        [0.0, 5.0],
        [0, 5],
        [100, 105],
        [0],
    )
    assert saved.layout is None and saved.sample_loaders is None
    assert context_samples(event, micro) == (micro.batch, [5])


def test_several_loaders_keep_every_loader_in_the_bundle_and_show_one_loaders_part() -> None:
    micro = two_loaders([7, 8, 9])
    found = Diagnosis(7, [6], cause="data", known_good=[0, 4], loaders=LoaderSplit(("a", "b"), (4, 3)))
    event = fill_event(EVENT, found, micro)
    assert (event.sample_loaders, event.offending_samples, event.dataset_indices) == (("b",), (2,), (9,))
    saved = bundle_samples(event, micro, found, None)
    assert saved.samples["a"].tolist() == [0.0] and saved.samples["b"].tolist() == [10.0, 12.0]
    assert (saved.sample_loaders, saved.positions, saved.dataset_indices) == (["a", "b", "b"], [0, 0, 2], [20, 7, 9])
    assert saved.reference == [0, 1] and saved.layout == AB
    part, positions = context_samples(event, micro)
    assert part is micro.batch["b"] and positions == [2]


def test_unknown_indices_are_said_and_samples_of_two_loaders_have_no_thumbnail_batch() -> None:
    micro = two_loaders(None)
    found = Diagnosis(7, [1, 6], cause="data", loaders=LoaderSplit(("a", "b"), (4, 3)))
    event = fill_event(EVENT, found, micro)
    assert event.dataset_indices is None and event.details["dataset_indices_unknown"] == "loader 'b': a stream"
    assert bundle_samples(event, micro, found, None).dataset_indices is None
    assert context_samples(event, micro) == (None, [1, 2])


def test_a_batch_that_lost_its_layout_says_so() -> None:
    micro = MicroBatch(torch.arange(4.0), 3, None, loaders_note="the loader of each sample is unknown")
    event = fill_event(EVENT, Diagnosis(4, [1], cause="data"), micro)
    assert event.sample_loaders is None and event.details["sample_loaders_unknown"].endswith("is unknown")
