"""The records of offending rows, named and checked on a real Trainer: the pipelines that break "row k is index k".

Every dataset here is :class:`record_pipelines.TokenRecords`: record ``i`` holds tokens ``10 * i + 1 + position``
and a bad record is negated. The guard is never told which record is bad nor what the tokens mean:
the expected dataset index is read off the values of the row the event names
(:func:`record_pipelines.record_of`) in the batch ``training_step`` received
(:class:`multitask_models.BatchKeeper`), and checked against the bad record the test planted.
"""

from __future__ import annotations

import warnings
from functools import partial
from pathlib import Path
from typing import Any

import fitting
import multitask_models as mm
import pytest
import record_pipelines as rp
import torch
from forensics_models import one_thread  # noqa: F401 (fixture)
from torch.utils.data import DataLoader

from lightning_nanguard import NanEvent, NanGuard
from lightning_nanguard.diagnose.batch_diagnosis import Diagnosis
from lightning_nanguard.diagnose.combined import CombinedIndices, CombinedLayout, LoaderSplit
from lightning_nanguard.engine.data.readers import RecordReader
from lightning_nanguard.engine.rows.record_names import RecordSettings, RowNamer
from lightning_nanguard.engine.rows.samples import bundle_samples, fill_event
from lightning_nanguard.engine.step.window import MicroBatch

pytestmark = pytest.mark.usefixtures("one_thread")

EVENT = NanEvent(3, 0, 3, 0, ("loss",), "skipped")


def fit(
    loaders: Any, root: Path, module: Any = None, **guard_kwargs: Any
) -> tuple[NanGuard, mm.BatchKeeper, list[str]]:
    """Fit one epoch; the guard, the batches ``training_step`` got, and the guard's warnings."""
    guard = NanGuard(verbose=False, save_repro=False, **guard_kwargs)
    keeper = mm.BatchKeeper()
    module = module or rp.SqrtModule()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fitting.fit(module, loaders, root=root, guard=guard, callbacks=[keeper], require_active=True)
    return guard, keeper, [str(w.message) for w in caught if str(w.message).startswith("NanGuard (rank")]


def held(keeper: mm.BatchKeeper, event: NanEvent, loader: str | None = None) -> int:
    """The record the event's offending row really holds, read off the row's values."""
    assert event.offending_samples is not None
    batch = keeper.batches[(event.epoch, event.batch_idx)]
    part = batch[loader] if loader is not None else batch
    return rp.record_of(part["x"][event.offending_samples[0]])


def loader(dataset: Any, collate: Any = rp.pad, batch_size: int = 8) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, collate_fn=collate)


# ------------------------------------------------------------------------------ the sampler's indices, checked


def test_a_sorting_collate_names_the_record_in_the_row_and_warns_once(tmp_path: Path) -> None:
    guard, keeper, told = fit(loader(rp.TokenRecords(24, bad=(9, 17)), rp.sorting_collate), tmp_path)
    assert [e.batch_idx for e in guard.events] == [1, 2]
    for event, bad in zip(guard.events, (9, 17), strict=True):
        assert event.dataset_indices == (held(keeper, event),) == (bad,)
        assert event.indices_verified is True and "reorders rows" in event.details["indices_note"]
    # the sampler's order would have named record 12 for row 4 (and 20 in the next batch)
    assert guard.events[0].offending_samples == (4,)
    assert told == [
        "NanGuard (rank 0): the collate reorders rows: the dataset index read off the sampler named record 12 for "
        "row 4, which holds record 9; corrected by re-reading. Pass index_key= to name records directly."
    ]


def test_a_sampler_order_kept_is_verified_without_a_warning(tmp_path: Path) -> None:
    guard, keeper, told = fit(loader(rp.TokenRecords(24, bad=(13,))), tmp_path)
    (event,) = guard.events
    assert event.dataset_indices == (held(keeper, event),) == (13,) and event.indices_verified is True
    assert told == []


def nan_padded(items: Any, longest_first: bool) -> dict[str, torch.Tensor]:
    """Records sorted by length and right-padded with NaN instead of 0 (a model that masks NaN)."""
    out = rp.pad(sorted(items, key=len, reverse=longest_first))
    return {**out, "x": out["x"].masked_fill(~out["mask"], float("nan"))}


def test_rows_padded_with_nan_name_the_record_they_hold(tmp_path: Path) -> None:
    """Shortest first: a healthy step's first rows (the reference) are padded too, so the NaN padding is deliberate."""
    collate = partial(nan_padded, longest_first=False)
    guard, keeper, _ = fit(loader(rp.TokenRecords(24, bad=(9, 17)), collate), tmp_path)
    assert [e.batch_idx for e in guard.events] == [1, 2]
    for event, bad in zip(guard.events, (9, 17), strict=True):
        assert event.offending_samples is not None and len(event.offending_samples) == 1
        batch = keeper.batches[(event.epoch, event.batch_idx)]
        x, mask = batch["x"][event.offending_samples[0]], batch["mask"][event.offending_samples[0]]
        assert bool((~mask).any()) and torch.isnan(x[~mask]).all()  # the row is padded, with NaN
        assert event.dataset_indices == (rp.record_of(x[mask]),) == (bad,)  # not the sampler's record at that row
        assert event.indices_verified is True and event.cause == "data"


@pytest.mark.xfail(
    strict=True,
    reason="longest first, the reference rows (a healthy step's first two) hold no padding, so check_input takes the "
    "NaN padding for input data and names every padded row (cause 'input', blame verified)",
)
def test_rows_padded_with_nan_longest_first_are_not_an_input_fault(tmp_path: Path) -> None:
    collate = partial(nan_padded, longest_first=True)
    guard, _, _ = fit(loader(rp.TokenRecords(24, bad=(9, 17)), collate), tmp_path)
    event = guard.events[0]
    assert event.cause == "data" and event.dataset_indices == (9,)


def test_a_dropping_collate_matches_rows_by_content(tmp_path: Path) -> None:
    guard, keeper, told = fit(loader(rp.TokenRecords(24, bad=(13,)), rp.dropping_collate), tmp_path)
    (event,) = guard.events
    # rows [8, 9, 10, 12, 13, 14]: row 4 holds 13, where the sampler's order has 12
    assert event.offending_samples == (4,) and event.dataset_indices == (held(keeper, event),) == (13,)
    assert event.indices_verified is True
    assert len(told) == 1 and told[0].startswith("NanGuard (rank 0): the batch has 6 rows for 8 recorded indices")
    assert "row 4 was matched to record 13 by re-reading" in told[0] and "row_records=" in told[0]


def test_random_reads_name_no_record_and_say_why(tmp_path: Path) -> None:
    guard, _, told = fit(loader(rp.TokenRecords(24, bad=(13,), noise=True)), tmp_path)
    (event,) = guard.events
    assert event.dataset_indices is None and event.indices_verified is False  # no guess
    assert "different values" in event.details["indices_unverified"]
    assert told == [
        "NanGuard (rank 0): indices cannot be verified: re-reading a record gives different values (random "
        "augmentation or masking); pass index_key=."
    ]


def test_the_checks_reads_leave_every_random_generator_as_it_was(tmp_path: Path) -> None:
    """Training with noisy reads gives the same weights whether the indices are checked or not."""
    weights = []
    for verify in (True, False):
        torch.manual_seed(0)
        module = rp.SqrtModule()
        fit(loader(rp.TokenRecords(24, bad=(13,), noise=True)), tmp_path / str(verify), module, verify_indices=verify)
        weights.append(module.scale.detach().clone())
    assert torch.equal(weights[0], weights[1])


def test_packed_rows_without_an_index_field_are_unknown_with_the_fix(tmp_path: Path) -> None:
    guard, _, told = fit(loader(rp.TokenRecords(24, bad=(13,)), rp.packing_collate), tmp_path)
    (event,) = guard.events
    assert event.dataset_indices is None and event.sample_records is None and event.indices_verified is False
    assert event.details["dataset_indices_unknown"].startswith("4 rows for 8 recorded indices")
    assert event.details["indices_unverified"] == event.details["dataset_indices_unknown"]
    assert len(told) == 1 and "index_key=" in told[0] and "row_records=" in told[0]


def test_verify_indices_false_keeps_the_samplers_index_unverified(tmp_path: Path) -> None:
    guard, keeper, told = fit(loader(rp.TokenRecords(24, bad=(9,)), rp.sorting_collate), tmp_path, verify_indices=False)
    (event,) = guard.events
    assert event.dataset_indices == (12,) != (held(keeper, event),)  # the sampler's order, not checked
    assert event.indices_verified is False and event.details["indices_unverified"] == "verify_indices=False"
    assert told == []


def test_a_dataset_that_must_not_be_read_again_is_unverified(tmp_path: Path) -> None:
    guard, _, _ = fit(loader(rp.TokenRecords(24, bad=(13,), reread=False)), tmp_path)
    (event,) = guard.events
    assert event.dataset_indices == (13,) and event.indices_verified is False
    assert event.details["indices_unverified"].endswith("nanguard_reread = False (its reads have side effects)")


def test_quarantine_drops_the_record_in_the_row_not_the_samplers_guess(tmp_path: Path) -> None:
    guard, _, _ = fit(loader(rp.TokenRecords(24, bad=(9,)), rp.sorting_collate), tmp_path, remedies=["quarantine"])
    assert guard.events[0].dataset_indices == (9,)
    assert guard.remedy_book.quarantined == {9}


# ------------------------------------------------------------------------------ indices named by the user


def test_an_iterable_dataset_with_index_key_is_verified(tmp_path: Path) -> None:
    guard, keeper, _ = fit(loader(rp.TokenStream(24, bad=(13,))), tmp_path, index_key="index")
    (event,) = guard.events
    assert event.dataset_indices == (held(keeper, event),) == (13,) and event.indices_verified is True


def test_a_2d_index_field_names_the_records_of_packed_rows(tmp_path: Path) -> None:
    data = rp.TokenRecords(24, bad=(13,), with_index=True)
    guard, keeper, told = fit(loader(data, rp.packing_collate), tmp_path, index_key="records")
    (event,) = guard.events
    assert event.offending_samples == (2,) and event.sample_records == ((12, 13),)
    assert event.dataset_indices is None and event.indices_verified is True and told == []
    assert held(keeper, event) == 12  # the row's first record, the second is the bad one


@pytest.mark.parametrize("where", ["argument", "module"])
def test_a_row_records_hook_names_the_records_of_packed_rows(tmp_path: Path, where: str) -> None:
    data = loader(rp.TokenRecords(24, bad=(13,)), rp.packing_collate)
    if where == "argument":
        guard, _, told = fit(data, tmp_path, row_records=rp.packed_rows)
    else:
        guard, _, told = fit(data, tmp_path, module=rp.PackedModule())
    (event,) = guard.events
    assert event.sample_records == ((12, 13),) and event.indices_verified is True and told == []


def test_a_row_records_hook_that_raises_leaves_indices_unknown(tmp_path: Path) -> None:
    def broken(batch: Any, indices: list[int] | None) -> list[list[int]]:
        raise KeyError("no such field")

    guard, _, told = fit(loader(rp.TokenRecords(24, bad=(13,)), rp.packing_collate), tmp_path, row_records=broken)
    (event,) = guard.events
    assert event.dataset_indices is None and event.sample_records is None and event.indices_verified is False
    assert event.details["indices_unverified"] == "row_records failed (KeyError: 'no such field')"
    assert told == [
        "NanGuard (rank 0): row_records failed (KeyError: 'no such field'): the dataset indices of the rows are "
        "unknown."
    ]


# ------------------------------------------------------------------------------ several training loaders


def test_each_loader_is_checked_against_its_own_loader(tmp_path: Path) -> None:
    loaders = {
        "plain": loader(rp.TokenRecords(32)),
        "sorted": loader(rp.TokenRecords(24, bad=(9,)), rp.sorting_collate),
    }
    guard, keeper, told = fit(loaders, tmp_path)
    (event,) = guard.events
    assert event.sample_loaders == ("sorted",) and event.offending_samples == (4,)
    assert event.dataset_indices == (held(keeper, event, "sorted"),) == (9,) and event.indices_verified is True
    assert told == [
        "NanGuard (rank 0): training loader 'sorted': the collate reorders rows: the dataset index read off the "
        "sampler named record 12 for row 4, which holds record 9; corrected by re-reading. Pass index_key= to name "
        "records directly."
    ]


# ------------------------------------------------------------------------------ without a Trainer


def namer(**settings: Any) -> RowNamer:
    defaults: dict[str, Any] = {"index_key": None, "row_records": None, "verify": True}
    return RowNamer(RecordSettings(**{**defaults, **settings}))


def test_the_bundle_saves_the_corrected_indices_of_every_row_it_keeps() -> None:
    data = rp.TokenRecords(8)
    sampled = [0, 1, 2, 3]
    batch = rp.sorting_collate([data[i] for i in sampled])  # rows hold 3, 2, 1, 0
    micro = MicroBatch(batch, 0, sampled, readers=(RecordReader(data, rp.sorting_collate),))
    found = Diagnosis(4, [1], cause="data", known_good=[0, 3])
    with pytest.warns(UserWarning, match=r"rank 0\): the collate reorders rows"):
        event = fill_event(EVENT, found, micro, namer())
    assert event.dataset_indices == (2,) and event.indices_verified is True
    assert micro.row_indices == {0: 3, 1: 2}
    assert bundle_samples(event, micro, found, None).dataset_indices == [3, 2]


def test_a_hook_of_the_wrong_length_and_a_missing_reader_say_why() -> None:
    micro = MicroBatch(rp.pad([rp.tokens(i) for i in range(4)]), 0, [0, 1, 2, 3])
    with pytest.warns(UserWarning, match="row_records returned 1 rows"):
        wrong = namer(row_records=lambda batch, indices: [[0]]).name(EVENT, Diagnosis(4, [1], cause="data"), micro)
    unknown = wrong.details["dataset_indices_unknown"]
    assert unknown == "row_records returned 1 rows for a batch of 4 (one entry per row)"
    unread = namer().name(EVENT, Diagnosis(4, [1], cause="data"), micro)
    assert unread.dataset_indices == (1,) and unread.indices_verified is False
    assert unread.details["indices_unverified"].startswith("not re-readable")


def test_several_loaders_are_named_each_from_its_own_part() -> None:
    layout = CombinedLayout.from_paths([("a",), ("b",)])
    a, b = rp.TokenRecords(8), rp.TokenRecords(8, with_index=True)
    batch = {"a": rp.pad([a[i] for i in (4, 5)]), "b": rp.sorting_collate([b[i] for i in (0, 1, 2)])}
    indices = CombinedIndices(layout, ([4, 5], [0, 1, 2]))
    readers = (RecordReader.of(loader(a)), RecordReader.of(loader(b, rp.sorting_collate)))
    micro = MicroBatch(batch, 0, None, loaders=indices, readers=readers)
    found = Diagnosis(5, [0, 2], cause="data", loaders=LoaderSplit(("a", "b"), (2, 3)))
    with pytest.warns(UserWarning, match="training loader 'b': the collate reorders rows"):
        event = namer().name(EVENT.replace(offending_samples=(0, 0), sample_loaders=("a", "b")), found, micro)
    assert event.dataset_indices == (4, 2) and event.indices_verified is True  # b's rows hold 2, 1, 0
    with_key = namer(index_key="index").name(EVENT, found, micro)
    assert (
        with_key.dataset_indices is None
        and "loader 'a': no index field 'index'" in with_key.details["dataset_indices_unknown"]
    )


def test_the_batch_hooks_transform_the_record_read_again_too(tmp_path: Path) -> None:
    """``on_after_batch_transfer`` halves every token: the record read again is halved too, and still corrected."""
    guard, keeper, _ = fit(loader(rp.TokenRecords(24, bad=(9,)), rp.sorting_collate), tmp_path, rp.HookedModule())
    (event,) = guard.events
    batch = keeper.batches[(event.epoch, event.batch_idx)]
    assert event.offending_samples == (4,) and rp.record_of(batch["x"][4] * 2) == 9
    assert event.dataset_indices == (9,) and event.indices_verified is True
