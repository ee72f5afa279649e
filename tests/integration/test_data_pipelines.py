"""Blame that checks itself (issue 21): data pipelines whose rows are not the sampler's records one for one.

Each test fits a tiny model (``pipeline_models``) on a shuffled loader whose sampler logs its order,
with a collate that sorts, drops, packs, blends or crops rows, or masks tokens at random. Every
record carries its own id, which the guard is never given: :class:`~pipeline_models.SeenRecords`
reads it from the batches the Trainer gave ``training_step``. The ground truth is computed without
the guard: the records that fail in a batch of their own on a fresh copy of the weights
(``lone_bad``), the rows each record sat in, the records trained on after an incident.

The rule under test: the guard names the right record, or says it does not know (and why), never a
wrong one; quarantine removes only records whose index and blame are both verified.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fitting
import lightning.pytorch as pl
import pattern_models as pm
import pipeline_models as pp
import pytest
import torch
from fitting import build_trainer
from forensics_models import one_thread  # noqa: F401 (fixture)
from launcher import launch
from torch.utils.data import DataLoader, Dataset

from lightning_nanguard import NanEvent, NanGuard

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH, SEED, N = 8, 7, 32
QUARANTINE = pytest.mark.parametrize("quarantine", [False, True], ids=["report", "quarantine"])


@dataclass
class Run:
    """One fit: the guard, the loader (its sampler's log), the batches trained on, the warnings raised."""

    guard: NanGuard
    loader: DataLoader
    seen: pp.SeenRecords
    warnings: list[str]
    module: pl.LightningModule

    @property
    def events(self) -> list[NanEvent]:
        """The NaN/Inf incidents (a loss spike of a tiny model is not what these tests are about)."""
        return [e for e in self.guard.events if not set(e.kinds) <= {"loss_spike", "grad_spike"}]

    @property
    def quarantined(self) -> set[int]:
        return set(self.guard.remedy_book.quarantined)

    def warned(self, pattern: str) -> list[str]:
        return [w for w in self.warnings if re.search(pattern, w, re.IGNORECASE)]

    def row_of(self, record: int, epoch: int = 0) -> tuple[pp.Seen, int]:
        """The batch of ``epoch`` holding ``record`` and its row there (one-record rows)."""
        (seen,) = [s for s in self.seen if s.epoch == epoch and (record,) in s.rows]
        return seen, seen.rows.index((record,))

    def sampler_position(self, record: int, epoch: int = 0) -> int:
        """Where ``record`` sat in its batch's list of dataset indices, as the sampler gave them."""
        return self.loader.sampler.passes[epoch].index(record) % BATCH  # type: ignore[attr-defined]


def fit(
    module: pl.LightningModule,
    dataset: Dataset,
    collate: Callable[[list[Any]], Any],
    root: Path,
    *,
    epochs: int = 2,
    quarantine: bool = False,
    batch_size: int = BATCH,
    field: str | None = "uid",
    **guard_kwargs: Any,
) -> Run:
    guard = NanGuard(verbose=False, save_repro=False, remedies=["quarantine"] if quarantine else None, **guard_kwargs)
    seen = pp.SeenRecords(field)
    loader = pp.loader(dataset, batch_size, collate, seed=SEED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fitting.fit(module, loader, root=root, guard=guard, callbacks=[seen], max_epochs=epochs, require_active=True)
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters()), "NaN/Inf reached the weights"
    return Run(guard, loader, seen, [str(w.message) for w in caught], module)


# ------------------------------------------------------------------------------------ what a right answer is


def bad_rows(seen: pp.Seen, guilty: set[int]) -> list[int]:
    return [row for row, records in enumerate(seen.rows) if guilty & set(records)]


def assert_one_event_per_batch_with(run: Run, guilty: set[int]) -> None:
    """An event at every step whose batch held a guilty record, and at no other step."""
    steps = [s.global_step for s in run.seen if guilty & s.records]
    assert [e.global_step for e in run.events] == steps, [e.headline() for e in run.events]


def assert_names_exactly(run: Run, guilty: set[int]) -> None:
    """One record per row: each event names the guilty rows and their records, verified both ways."""
    assert_one_event_per_batch_with(run, guilty)
    for event in run.events:
        seen = run.seen.at(event.global_step)
        rows = bad_rows(seen, guilty)
        assert event.cause == "data", event.headline()
        assert event.batch_idx == seen.batch_idx
        assert event.offending_samples is not None and sorted(event.offending_samples) == rows
        assert event.dataset_indices is not None, event.details.get("indices_unverified")
        named = dict(zip(event.offending_samples, event.dataset_indices, strict=True))
        assert named == {row: seen.rows[row][0] for row in rows}
        assert event.indices_verified is True, event.details.get("indices_unverified")
        assert event.blame_verified is True, event.details.get("blame_unverified")


def assert_never_wrong(run: Run, guilty: set[int]) -> None:
    """Rows named are guilty rows; every record named sits in its row; what is not known is said so, with why."""
    assert_one_event_per_batch_with(run, guilty)
    for event in run.events:
        seen = run.seen.at(event.global_step)
        assert event.cause == "data", event.headline()
        assert event.offending_samples is not None and sorted(event.offending_samples) == bad_rows(seen, guilty)
        truth = [set(seen.rows[row]) for row in event.offending_samples]
        if event.dataset_indices is not None:
            assert [{index} for index in event.dataset_indices] == truth, "a wrong dataset index"
        if event.sample_records is not None:
            assert [set(records) for records in event.sample_records] == truth, "wrong records of a row"
            assert event.dataset_indices is None
        if event.indices_verified is not True:  # nothing named, or named but not verified: said why
            assert event.indices_verified is False
            assert isinstance(event.details.get("indices_unverified"), str) and event.details["indices_unverified"]


def assert_quarantine(run: Run, guilty: set[int], innocents: set[int]) -> None:
    """Only verified, guilty records are quarantined; they are never trained on again, every innocent is."""
    verified = [e for e in run.events if e.indices_verified is True and e.blame_verified is True]
    if not verified:
        assert run.quarantined == set(), "quarantined records that were not verified"
    assert run.quarantined <= guilty, f"healthy records quarantined: {sorted(run.quarantined - guilty)}"
    after = run.seen.trained_after(run.events[0].global_step)
    assert innocents <= after, f"healthy records never trained on again: {sorted(innocents - after)}"
    assert not run.quarantined & after, "a quarantined record was trained on again"


def assert_no_record_named(run: Run, steps: list[int]) -> None:
    """Cause ``"batch"``: the batch as a whole, no sample and no record named, nothing quarantined."""
    assert [e.global_step for e in run.events] == steps, [e.headline() for e in run.events]
    for event in run.events:
        assert event.cause == "batch", event.headline()
        assert event.offending_samples is None and event.dataset_indices is None and event.sample_records is None
    assert run.quarantined == set()


# ------------------------------------------------------------------------------------ a. sorting collate


def sorted_rows(data: pp.Utterances, indices: list[int]) -> list[int]:
    """The dataset indices of the rows ``sort_by_length`` makes of these records."""
    return [int(u) - pp.UID_BASE for u in pp.sort_by_length([data[i] for i in indices])["uid"]]


def sorting_setup() -> tuple[pp.Utterances, int]:
    """Utterances, one silent: the first record of a batch that the sort moves down (as record 11 in the issue)."""
    (order,) = pp.planned_order(N, SEED)
    healthy = pp.Utterances(N)
    guilty = next(
        order[b] for b in range(BATCH, N, BATCH) if sorted_rows(healthy, order[b : b + BATCH]).index(order[b]) > 0
    )
    data = pp.Utterances(N, silent=(guilty,))
    assert pp.lone_bad(pp.UtteranceClassifier, data, pp.sort_by_length) == [guilty]
    return data, guilty


@QUARANTINE
@pytest.mark.parametrize("ids_in_batch", [True, False], ids=["ids", "no-ids"])
def test_a_sorting_collate_names_the_record_of_the_row(ids_in_batch: bool, quarantine: bool, tmp_path: Path) -> None:
    """Issue 21, case 1: the record at sampler position 0 sits in row 1 after the sort; the guard read position 1.

    ``no-ids``: the batch holds no record id at all (the issue's pipeline); the test knows the rows
    from the collate's own log.
    """
    data, guilty = sorting_setup()
    collate = pp.sort_by_length if ids_in_batch else pp.SortWithoutIds()
    run = fit(
        pp.UtteranceClassifier(), data, collate, tmp_path, quarantine=quarantine, field="uid" if ids_in_batch else None
    )
    if isinstance(collate, pp.SortWithoutIds):
        run.seen.fill_rows([rows for rows in collate.made if len(rows) > 1])  # the guard re-reads one record at a time
    assert run.sampler_position(guilty) == 0 and run.row_of(guilty)[1] > 0  # first for the sampler, not in the rows
    assert_names_exactly(run, {guilty})
    assert len(run.warned("reorder")) == 1, run.warnings
    if quarantine:
        assert run.quarantined == {guilty}
        assert_quarantine(run, {guilty}, set(range(N)) - {guilty})
    else:
        assert len(run.events) == 2  # once per epoch


@QUARANTINE
def test_a_sorting_collate_with_random_augmentation_never_names_a_wrong_record(
    quarantine: bool, tmp_path: Path
) -> None:
    """Random gain on every read: no record but the silent one reads the same twice (random reads)."""
    data, guilty = sorting_setup()
    data.random_gain = True
    run = fit(pp.UtteranceClassifier(), data, pp.sort_by_length, tmp_path, quarantine=quarantine)
    assert run.sampler_position(guilty) == 0 and run.row_of(guilty)[1] > 0
    assert_never_wrong(run, {guilty})
    assert len(run.warned("index_key|row_records")) == 1, run.warnings  # said once, with the fix
    first = run.events[0]  # the one record that reads the same twice is told by its content
    assert (first.dataset_indices, first.indices_verified) == ((guilty,), True)
    if quarantine:
        assert_quarantine(run, {guilty}, set(range(N)) - {guilty})
        assert run.quarantined == {guilty}


def test_a_indices_not_verified_are_never_quarantined(tmp_path: Path) -> None:
    """``verify_indices=False``: whatever index is named is unverified, and quarantine leaves every record alone."""
    data, guilty = sorting_setup()
    run = fit(pp.UtteranceClassifier(), data, pp.sort_by_length, tmp_path, quarantine=True, verify_indices=False)
    assert_one_event_per_batch_with(run, {guilty})  # it came back in the second epoch, and was caught again
    for event in run.events:
        assert event.cause == "data" and event.indices_verified is False
        assert event.details.get("indices_unverified"), event.details
    assert run.quarantined == set()
    assert_quarantine(run, {guilty}, set(range(N)) - {guilty})


# ------------------------------------------------------------------------------------ b. bucketing collate


@QUARANTINE
def test_b_a_collate_that_drops_long_records_never_names_a_wrong_record(quarantine: bool, tmp_path: Path) -> None:
    max_len = 6
    (order,) = pp.planned_order(N, SEED)
    healthy = pp.Utterances(N)
    kept = {i for i in range(N) if healthy.lengths[i] <= max_len}
    guilty = next(  # a kept record after a dropped one in its batch: its row is not its sampler position
        i for p, i in enumerate(order) if i in kept and any(j not in kept for j in order[p - p % BATCH : p])
    )
    data = pp.Utterances(N, silent=(guilty,))
    collate = pp.DropLonger(max_len)
    assert pp.lone_bad(lambda: pp.UtteranceClassifier(sorted_rows=False), data, collate, kept) == [guilty]
    run = fit(pp.UtteranceClassifier(sorted_rows=False), data, collate, tmp_path, quarantine=quarantine)
    _, row = run.row_of(guilty)
    assert run.sampler_position(guilty) != row
    assert_never_wrong(run, {guilty})
    assert len(run.warned("index_key|row_records")) == 1, run.warnings  # rows are not records: once, with the fix
    if quarantine:
        assert_quarantine(run, {guilty}, kept - {guilty})
        if run.events[0].indices_verified:
            assert run.quarantined == {guilty}


# ------------------------------------------------------------------------------------ c. dedup collate


@QUARANTINE
def test_c_a_collate_that_drops_duplicates_never_names_a_wrong_record(quarantine: bool, tmp_path: Path) -> None:
    (order,) = pp.planned_order(N, SEED)
    batch = order[BATCH : 2 * BATCH]
    duplicates = {batch[1]: batch[0], order[20]: order[3]}  # one dropped in batch 1, one pair across batches
    guilty = batch[4]  # sampler position 4, row 3 once the duplicate is dropped
    data = pp.Utterances(N, silent=(guilty,), duplicates=duplicates)
    assert pp.lone_bad(lambda: pp.UtteranceClassifier(sorted_rows=False), data, pp.dedup) == [guilty]
    run = fit(pp.UtteranceClassifier(sorted_rows=False), data, pp.dedup, tmp_path, quarantine=quarantine)
    assert (run.sampler_position(guilty), run.row_of(guilty)[1]) == (4, 3)
    assert_never_wrong(run, {guilty})
    assert len(run.warned("index_key|row_records")) == 1, run.warnings  # rows are not records: once, with the fix
    if quarantine:
        assert run.quarantined <= {guilty}
        after = {data.keys[i] for i in run.seen.trained_after(run.events[0].global_step)}
        assert set(data.keys) - {data.keys[guilty]} <= after, "a healthy record's content never trained on again"
        if run.events[0].indices_verified:
            assert run.quarantined == {guilty} and data.keys[guilty] not in after


# ------------------------------------------------------------------------------------ d. packed sequences


def packed_setup() -> tuple[pp.Utterances, int]:
    (order,) = pp.planned_order(N, SEED)
    guilty = order[BATCH + 3]  # batch 1, row 1 (with order[BATCH + 2]); the sampler's position 1 is another record
    data = pp.Utterances(N, silent=(guilty,))
    assert pp.lone_bad(pp.PackedClassifier, data, pp.PackPairs()) == [guilty]
    return data, guilty


def assert_row_mates_still_trained(run: Run, guilty: int) -> None:
    mates = {r for s in run.seen for row in s.rows if guilty in row for r in row} - {guilty}
    assert mates and mates <= run.seen.trained_after(run.events[0].global_step)


@QUARANTINE
def test_d_packed_rows_without_help_name_no_record(quarantine: bool, tmp_path: Path) -> None:
    data, guilty = packed_setup()
    run = fit(pp.PackedClassifier(), data, pp.PackPairs(), tmp_path, quarantine=quarantine, field="uids")
    assert_never_wrong(run, {guilty})
    for event in run.events:
        assert event.dataset_indices is None  # a row holds two records: no single index can be right
    assert len(run.warned("index_key|row_records")) == 1, run.warnings  # the reason and the fix, once
    if quarantine:
        assert run.quarantined == set()
        assert_quarantine(run, {guilty}, set(range(N)) - {guilty})


def assert_names_the_records_of_the_row(run: Run, guilty: int) -> None:
    """Rows holding several records: the bad row is named with exactly its records, verified."""
    assert_one_event_per_batch_with(run, {guilty})
    for event in run.events:
        seen = run.seen.at(event.global_step)
        (row,) = bad_rows(seen, {guilty})
        assert (event.cause, event.offending_samples, event.dataset_indices) == ("data", (row,), None)
        assert event.sample_records is not None and [set(r) for r in event.sample_records] == [set(seen.rows[row])]
        assert event.indices_verified is True


def packed_pairs(batch: Any, indices: list[int] | None) -> list[list[int]]:
    """``row_records``: row ``k`` of ``PackPairs`` holds the batch's records ``2k`` and ``2k + 1``."""
    assert indices is not None
    return [list(indices[k : k + 2]) for k in range(0, len(indices), 2)]


class PackedWithHook(pp.PackedClassifier):
    def nanguard_row_records(self, batch: Any, indices: list[int] | None) -> list[list[int]]:
        return packed_pairs(batch, indices)


@QUARANTINE
@pytest.mark.parametrize("helped_by", ["index_key", "row_records", "module_hook"])
def test_d_packed_rows_with_help_name_the_records_of_the_row(helped_by: str, quarantine: bool, tmp_path: Path) -> None:
    """Told by a 2-D index field, a ``row_records`` argument, or the module's ``nanguard_row_records``."""
    data, guilty = packed_setup()
    module = PackedWithHook() if helped_by == "module_hook" else pp.PackedClassifier()
    kwargs: dict[str, Any] = {
        "index_key": {"index_key": "index"},
        "row_records": {"row_records": packed_pairs},
        "module_hook": {},
    }[helped_by]
    collate = pp.PackPairs(with_index=helped_by == "index_key")
    run = fit(module, data, collate, tmp_path, quarantine=quarantine, field="uids", **kwargs)
    assert_names_the_records_of_the_row(run, guilty)
    if quarantine:
        assert_quarantine(run, {guilty}, set(range(N)) - {guilty})
        assert_row_mates_still_trained(run, guilty)


# ------------------------------------------------------------------------------------ e. mixup


def mixup_setup() -> tuple[pp.Powers, int]:
    guilty = 11
    data = pp.Powers(N, corrupt=(guilty,))
    assert pp.lone_bad(pp.MixupRegressor, data, pp.Mixup()) == [guilty]  # blended with itself
    return data, guilty


@QUARANTINE
def test_e_mixup_without_help_names_no_record(quarantine: bool, tmp_path: Path) -> None:
    data, guilty = mixup_setup()
    run = fit(pp.MixupRegressor(), data, pp.Mixup(seed=3), tmp_path, quarantine=quarantine, field="uids")
    assert_never_wrong(run, {guilty})
    for event in run.events:
        assert event.dataset_indices is None  # a row blends two records
    assert len(run.warned("index_key|row_records")) == 1, run.warnings
    if quarantine:
        assert run.quarantined == set()
        assert_quarantine(run, {guilty}, set(range(N)) - {guilty})


@QUARANTINE
def test_e_mixup_with_a_2d_index_field_names_both_records_of_each_row(quarantine: bool, tmp_path: Path) -> None:
    data, guilty = mixup_setup()
    collate = pp.Mixup(seed=3, with_index=True)
    run = fit(pp.MixupRegressor(), data, collate, tmp_path, quarantine=quarantine, field="uids", index_key="index")
    assert_one_event_per_batch_with(run, {guilty})
    for event in run.events:
        seen = run.seen.at(event.global_step)
        rows = bad_rows(seen, {guilty})  # its own row and the row it was blended into
        assert event.cause == "data" and event.offending_samples is not None
        assert sorted(event.offending_samples) == rows and event.dataset_indices is None
        assert event.sample_records is not None
        named = dict(zip(event.offending_samples, event.sample_records, strict=True))
        assert {row: set(records) for row, records in named.items()} == {row: set(seen.rows[row]) for row in rows}
        assert event.indices_verified is True
    if quarantine:
        assert_quarantine(run, {guilty}, set(range(N)) - {guilty})
        assert_row_mates_still_trained(run, guilty)


# ------------------------------------------------------------------------------------ f. multi-crop


def crops_setup() -> tuple[pp.Utterances, int]:
    guilty = 11
    data = pp.Utterances(N, silent=(guilty,), min_len=6, max_len=10)
    assert pp.lone_bad(pp.CropClassifier, data, pp.MultiCrop()) == [guilty]
    return data, guilty


@QUARANTINE
def test_f_multi_crop_with_a_repeated_index_field_names_the_record(quarantine: bool, tmp_path: Path) -> None:
    data, guilty = crops_setup()
    collate = pp.MultiCrop(seed=3, with_index=True)
    run = fit(pp.CropClassifier(), data, collate, tmp_path, quarantine=quarantine, index_key="index")
    assert_names_exactly(run, {guilty})  # both of its rows, each named as the record
    for event in run.events:
        assert len(event.offending_samples or ()) == 2
    if quarantine:
        assert run.quarantined == {guilty}
        assert_quarantine(run, {guilty}, set(range(N)) - {guilty})


@QUARANTINE
def test_f_multi_crop_without_help_never_names_a_wrong_record(quarantine: bool, tmp_path: Path) -> None:
    data, guilty = crops_setup()
    run = fit(pp.CropClassifier(), data, pp.MultiCrop(seed=3), tmp_path, quarantine=quarantine)
    assert_never_wrong(run, {guilty})
    if all(e.dataset_indices is None for e in run.events):
        assert len(run.warned("index_key|row_records")) == 1, run.warnings
    if quarantine:
        assert_quarantine(run, {guilty}, set(range(N)) - {guilty})


# ------------------------------------------------------------------------------------ g. masked LM


MLM_BATCH = 4


def no_mask_salt(data: pp.Tokens, passes: list[list[int]]) -> tuple[int, int]:
    """A salt whose masking draws no masked token in exactly one batch of these passes, and that batch."""
    batches = [p[k : k + MLM_BATCH] for p in passes for k in range(0, len(p), MLM_BATCH)]
    for salt in range(1000):
        empty = [b for b, indices in enumerate(batches) if pp.MaskTokens(salt).draws_no_mask(data, indices)]
        if len(empty) == 1:
            return salt, empty[0]
    raise AssertionError("no salt found")


@QUARANTINE
@pytest.mark.parametrize("kind", ["embedding", "bert"])
def test_g_a_masked_lm_batch_without_a_masked_token_is_the_batch(kind: str, quarantine: bool, tmp_path: Path) -> None:
    """Issue 21, case 2: the mean over zero masked tokens is NaN; no record is bad."""
    data = pp.Tokens(N)
    passes = pp.planned_order(N, SEED, passes=2)
    salt, empty = no_mask_salt(data, passes)
    run = fit(pp.MaskedLM(kind), data, pp.MaskTokens(salt), tmp_path, quarantine=quarantine, batch_size=MLM_BATCH)
    assert run.loader.sampler.passes == passes  # type: ignore[attr-defined]
    step = run.seen.seen[empty].global_step
    assert bool((run.seen.at(step).batch["labels"] == -100).all())  # the ground truth: nothing to predict
    records = sorted(run.seen.at(step).records)
    torch.manual_seed(0)
    fresh = pp.MaskedLM(kind)
    masked = pp.MaskTokens(salt, prob=0.5)([data[i] for i in records])  # the same records, with masked tokens
    assert torch.isfinite(fresh.training_step(masked, 0))
    assert_no_record_named(run, [step])
    (event,) = run.events
    assert re.search(r"ignore_index|denominator", event.details.get("hint", "")), event.details
    assert set(records) <= run.seen.trained_after(step)  # every record of the batch trained on again


# ------------------------------------------------------------------------------------ h. a degenerate batch


@QUARANTINE
@pytest.mark.filterwarnings(r"ignore:std\(\). degrees of freedom:UserWarning")  # the point of the test
def test_h_a_last_batch_of_one_sample_under_a_batch_std_is_the_batch(quarantine: bool, tmp_path: Path) -> None:
    """``h.std(0)`` over one sample is NaN: the sample is healthy beside any other (see test_everyday_patterns)."""
    data = pm.blank_rows(N + 1, blank=())  # 4 batches of 8, then one of 1
    xs, ys = data.tensors
    lone = pp.planned_order(N + 1, SEED)[0][-1]
    torch.manual_seed(0)
    fresh = pp.BatchStd()
    assert not torch.isfinite(fresh.training_step((xs[[lone]], ys[[lone]]), 0))
    assert torch.isfinite(fresh.training_step((xs[[lone, 0]], ys[[lone, 0]]), 0))  # healthy beside another
    guard = NanGuard(verbose=False, save_repro=False, remedies=["quarantine"] if quarantine else None)
    loader = pp.loader(data, BATCH, collate=torch.utils.data.default_collate, seed=SEED)
    steps, module = StepLog(), pp.BatchStd()
    build_trainer("lightning", tmp_path, callbacks=[guard, steps], max_epochs=2).fit(module, loader)
    assert guard.active and all(bool(torch.isfinite(p).all()) for p in module.parameters())
    assert [(e.global_step, e.cause, e.offending_samples, e.dataset_indices) for e in guard.events] == [
        (step, "batch", None, None) for step in steps.lone_steps
    ]
    assert len(steps.lone_steps) == 2 and guard.remedy_book.quarantined == set()
    assert any(bool((x == xs[lone]).all(-1).any()) for epoch, x in steps.batches if epoch == 1)  # trained on again


class StepLog(pl.Callback):
    """The inputs of every training batch (by epoch), and the global steps whose batch holds a single sample."""

    def __init__(self) -> None:
        self.lone_steps: list[int] = []
        self.batches: list[tuple[int, torch.Tensor]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.batches.append((trainer.current_epoch, batch[0].clone()))
        if len(batch[0]) == 1:
            self.lone_steps.append(trainer.global_step)


# ------------------------------------------------------------------------------------ i. DDP


def run_ddp(scenario: str, out: Path) -> dict[int, dict[str, Any]]:
    # a rank waiting alone in a collective would hang: the timeout turns it into a failure
    return launch("pipeline_ddp_script.py", scenario, out, nprocs=2, out_dir=out, timeout=180).results()


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["report", "quarantine"])
def test_i_ddp_each_rank_names_its_own_record_of_a_sorting_collate(scenario: str, tmp_path: Path) -> None:
    ranks = run_ddp(scenario, tmp_path)
    guilty = {int(rank): index for rank, index in ranks[0]["guilty"].items()}
    steps = {}
    for rank, data in ranks.items():
        assert (data["world_size"], data["finite"], data["active"]) == (2, True, True)
        order = data["passes"][0]
        (_, batch_idx, step, rows) = next(s for s in data["seen"] if s[0] == 0 and [guilty[rank]] in s[3])
        row = rows.index([guilty[rank]])
        assert order.index(guilty[rank]) - batch_idx * BATCH != row  # the sort moved it: position is not row
        steps[rank] = step
        named = [e for e in data["events"] if e.get("dataset_indices")]
        assert [(e["global_step"], e["offending_samples"], e["dataset_indices"]) for e in named] == [
            (step, [row], [guilty[rank]])
        ], "each rank names its own record, once"
        (event,) = named
        assert (event["cause"], event.get("indices_verified"), event.get("blame_verified")) == ("data", True, True)
        assert not [e for e in data["events"] if e.get("sample_records")]
        assert len([w for w in data["warnings"] if "reorder" in w.lower()]) == 1  # each rank tells its own, once
    for data in ranks.values():
        assert data["skipped_steps"] == sorted(steps.values())  # any rank bad: every rank skips
    assert ranks[0]["weights_sha256"] == ranks[1]["weights_sha256"]
    if scenario == "quarantine":
        for data in ranks.values():
            assert data["quarantined"] == sorted(guilty.values())
        epoch_1 = {i for data in ranks.values() for s in data["seen"] if s[0] == 1 for row in s[3] for i in row}
        assert epoch_1 == set(range(64)) - set(guilty.values())
    else:
        assert ranks[0]["quarantined"] == ranks[1]["quarantined"] == []
