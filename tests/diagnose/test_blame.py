"""The blame check (``diagnose/blame.py``) and how :func:`diagnose` decides with it.

Ground truth comes from the models themselves: a record is at fault when the model is non-finite
on it beside healthy samples (checked here with plain PyTorch, outside the guard); a batch is at
fault as a whole when every sample fails alone but none fails beside healthy ones.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_nanguard import NanEvent
from lightning_nanguard.diagnose.batch_diagnosis import diagnose
from lightning_nanguard.diagnose.blame import COMPANY, UNCHECKED, BlameCheck, check_blame, fails_beside_healthy
from lightning_nanguard.diagnose.event_fields import event_with_diagnosis
from lightning_nanguard.diagnose.runner import SubBatchRunner


class LogOfSum(nn.Module):
    """``log(w * sum(x))`` per row: a row is bad iff it sums to 0."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def training_step(self, x: Tensor, batch_idx: int) -> Tensor:
        return (self.w * x.sum(dim=1)).log().mean()


class MaskedLM(nn.Module):
    """A masked-LM head: cross-entropy over the tokens whose label is not -100 (a mean over zero tokens is NaN)."""

    def __init__(self, vocab: int = 11) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, 8)
        self.head = nn.Linear(8, vocab)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        logits = self.head(self.embed(batch["input_ids"]))
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def mlm_batch(rows: int, masked: bool, seed: int) -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 11, (rows, 6), generator=generator)
    labels = torch.full_like(ids, -100)
    if masked:
        labels[:, 2] = ids[:, 2]  # one masked token per row
    return {"input_ids": ids, "labels": labels}


EVENT = NanEvent(3, 0, 3, 0, ("loss",), "skipped")


def reference_loss_finite(module: nn.Module, batch: Any) -> bool:
    """Plain PyTorch: is the loss of ``batch`` finite (and its gradients)?"""
    module.zero_grad()
    loss = module.training_step(batch, 0)
    loss.backward()
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    module.zero_grad()
    return bool(torch.isfinite(loss)) and all(bool(torch.isfinite(g).all()) for g in grads)


def test_a_sample_in_a_healthy_batch_is_verified_by_the_search_itself() -> None:
    x = torch.ones(8, 3)
    x[5] = 0
    found = diagnose(LogOfSum(), x)
    assert (found.cause, found.offending, found.blame_verified, found.verify_passes) == ("data", [5], True, 0)


@pytest.mark.parametrize("bad", [0, 3, 7])
def test_evidence_from_the_search_names_a_bad_group_of_healthy_others(bad: int) -> None:
    x = torch.ones(8, 3)
    x[bad] = 0
    runner = SubBatchRunner(LogOfSum(), x)
    assert runner.is_bad(list(range(8)))
    for p in range(8):
        if p != bad:
            runner.is_bad([p])
    assert fails_beside_healthy(runner, bad) and not any(fails_beside_healthy(runner, p) for p in range(8) if p != bad)


def test_a_sample_that_also_ran_finite_is_never_evidence() -> None:
    runner = SubBatchRunner(LogOfSum(), torch.ones(4, 3))
    runner.is_bad([0, 1])
    runner.groups.append(((0, 1), True))  # as if it failed once beside 1: it still ran finite elsewhere
    assert not fails_beside_healthy(runner, 0)


def test_a_masked_lm_batch_without_a_masked_token_is_the_batch_not_its_records() -> None:
    model, batch = MaskedLM(), mlm_batch(4, masked=False, seed=1)
    reference = mlm_batch(COMPANY, masked=True, seed=2)
    assert not reference_loss_finite(model, batch)  # 0/0
    for p in range(4):  # ground truth: each record is fine beside the healthy reference samples
        alone = {k: v[p : p + 1] for k, v in batch.items()}
        assert not reference_loss_finite(model, alone)
        beside = {k: torch.cat([v[p : p + 1], reference[k]]) for k, v in batch.items()}
        assert reference_loss_finite(model, beside)
    found = diagnose(model, batch, reference_batch=reference)
    assert found.cause == "batch" and found.offending is None and found.blame_verified is None
    assert found.verify_passes == 1  # the named samples together, beside the reference
    assert found.localization is not None and found.localization.hint.startswith("the batch as a whole")
    event = event_with_diagnosis(EVENT, found, dataset_indices=range(40, 44))
    assert event.cause == "batch" and event.offending_samples is None and event.dataset_indices is None
    assert event.blame_verified is None and event.details["verify_passes"] == 1
    assert event.details["not_attributable"] == (
        "samples [0, 1, 2, 3] fail on their own, but none fails beside the reference samples of a recent healthy step"
    )


def test_without_a_reference_every_failing_sample_stays_named_but_unverified() -> None:
    found = diagnose(MaskedLM(), mlm_batch(2, masked=False, seed=1))
    assert found.cause is None and found.offending == [0, 1] and found.blame_verified is False
    event = event_with_diagnosis(EVENT, found, dataset_indices=[8, 9])
    assert event.blame_verified is False
    assert "no reference sub-batch" in event.details["blame_unverified"]


def test_a_bad_record_in_a_batch_without_healthy_samples_is_verified_beside_the_reference() -> None:
    x = torch.zeros(2, 3)  # both rows sum to 0
    reference = torch.ones(COMPANY, 3)
    found = diagnose(LogOfSum(), x, reference_batch=reference)
    assert (found.cause, found.offending, found.blame_verified) == ("data", [0, 1], True)
    assert found.verify_passes == 1 + 2  # together beside the reference, then each on its own


def test_a_sample_that_fails_only_alone_is_dropped_beside_a_record_at_fault() -> None:
    """Row 0 has no target (fails alone), row 1 is corrupt (NaN beside anything): only row 1 is named."""

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))

        def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
            values, kept = batch[:, 0], batch[:, 1]
            return (self.w * values.log() * kept).sum() / kept.sum()

    batch = torch.tensor([[1.0, 0.0], [-1.0, 1.0]])  # log(-1) is NaN, and row 0 keeps no target
    reference = torch.tensor([[2.0, 1.0], [3.0, 1.0]])
    found = diagnose(Masked(), batch, reference_batch=reference)
    assert (found.cause, found.offending, found.blame_verified) == ("data", [1], True)
    assert "samples [0] failed only without healthy company" in found.blame_note


def test_the_check_stays_within_the_pass_budget() -> None:
    runner = SubBatchRunner(MaskedLM(), mlm_batch(2, masked=False, seed=1))
    reference = SubBatchRunner(MaskedLM(), mlm_batch(COMPANY, masked=True, seed=2))
    for p in range(2):
        runner.is_bad([p])
    spent = check_blame(runner, [0, 1], reference, SubBatchRunner, budget=0)
    assert spent == BlameCheck(unverified=(0, 1), company="reference", reason=spent.reason)
    assert "pass budget" in spent.reason and runner.passes == 2


def test_batches_that_cannot_be_joined_leave_the_blame_unverified_with_the_reason() -> None:
    runner = SubBatchRunner(MaskedLM(), mlm_batch(2, masked=False, seed=1))
    reference = SubBatchRunner(
        MaskedLM(), {"input_ids": torch.ones(2, 9, dtype=torch.long), "labels": torch.ones(2, 9)}
    )
    found = check_blame(runner, [0, 1], reference, SubBatchRunner, budget=8)
    assert found.unverified == (0, 1) and found.passes == 0
    assert "cannot be joined" in found.reason and "(6,)" in found.reason


class LogBesideKept(nn.Module):
    """Row ``(value, kept)``: the mean of ``log(value)`` over the kept rows (a negative value is NaN beside anything,
    a row that keeps nothing is 0/0 alone but fine beside kept rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        values, kept = batch[:, 0], batch[:, 1]
        return (self.w * values.log() * kept).sum() / kept.sum()


# rows 0 and 1 are corrupt (log of a negative value), row 2 keeps no target: each fails alone, so no row
# of the batch is known healthy and the reference samples are the company; only rows 0 and 1 are at fault
SEVERAL_NAMED = torch.tensor([[-1.0, 1.0], [-2.0, 1.0], [1.0, 0.0]])
HEALTHY_REFERENCE = torch.tensor([[2.0, 1.0], [3.0, 1.0]])


def test_the_ground_truth_of_the_several_named_samples() -> None:
    model = LogBesideKept()
    for row in range(3):
        assert not reference_loss_finite(model, SEVERAL_NAMED[row : row + 1])  # each fails alone
    beside = [
        reference_loss_finite(model, torch.cat([SEVERAL_NAMED[row : row + 1], HEALTHY_REFERENCE])) for row in range(3)
    ]
    assert beside == [False, False, True]  # rows 0 and 1 are at fault, row 2 only fails without company


@pytest.mark.parametrize(
    ("budget", "verified", "failed_alone", "unverified"),
    [
        (1, (), (), (0, 1, 2)),  # the group beside the reference only: no sample checked on its own
        (2, (0,), (), (1, 2)),  # the budget runs out after the first sample
        (3, (0, 1), (), (2,)),  # ... after the second: row 2, not at fault, is left unchecked
        (4, (0, 1), (2,), ()),  # every sample checked
    ],
)
def test_samples_the_budget_leaves_unchecked_stay_unverified(
    budget: int, verified: tuple[int, ...], failed_alone: tuple[int, ...], unverified: tuple[int, ...]
) -> None:
    runner = SubBatchRunner(LogBesideKept(), SEVERAL_NAMED)
    assert all(runner.is_bad([p]) for p in range(3))  # the search's passes: each sample fails on its own
    reference = SubBatchRunner(LogBesideKept(), HEALTHY_REFERENCE)
    found = check_blame(runner, [0, 1, 2], reference, SubBatchRunner, budget=budget)
    assert (found.verified, found.failed_alone, found.unverified) == (verified, failed_alone, unverified)
    assert found.passes == min(budget, 4) and found.company == "reference"
    assert (found.reason == UNCHECKED) == bool(unverified) and not found.batch_fault


@pytest.mark.parametrize("left", [1, 2, 3, 4])
def test_a_diagnosis_whose_budget_runs_out_part_way_claims_no_unchecked_blame(left: int) -> None:
    """``max_passes`` leaves ``left`` passes to the check after the search: verified means checked, each sample."""
    model = LogBesideKept()
    searched = diagnose(model, SEVERAL_NAMED, reference_batch=HEALTHY_REFERENCE)
    assert (searched.offending, searched.blame_verified, searched.verify_passes) == ([0, 1], True, 4)
    found = diagnose(model, SEVERAL_NAMED, reference_batch=HEALTHY_REFERENCE, max_passes=searched.passes + left)
    assert found.passes == searched.passes and found.verify_passes == left
    if left < 4:  # some sample left unchecked: all stay named, and the blame is not called verified
        assert found.offending == [0, 1, 2] and found.blame_verified is False
        assert UNCHECKED in found.blame_note
        event = event_with_diagnosis(EVENT, found, dataset_indices=[30, 31, 32])
        assert event.blame_verified is False and UNCHECKED in event.details["blame_unverified"]
    else:
        assert found.offending == [0, 1] and found.blame_verified is True
