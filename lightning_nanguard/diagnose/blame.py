"""Verify the blame of the samples a search named: each must still fail beside known-healthy samples.

The search (:mod:`~lightning_nanguard.diagnose.bisection`) assumes a sub-batch is bad iff it holds
an offending sample. A batch can also fail as a whole: a loss averaged over zero targets (a
masked-LM batch that drew no masked token, every label ``ignore_index``), a statistic over a
degenerate batch (the std of one sample). Then every sub-batch fails, every sample "fails on its
own", and the search names all of them. :func:`check_blame` tells the two apart: a named sample is
at fault only if it also fails *beside known-healthy samples*.

The evidence, cheapest first:

1. **The search's own passes** (0 passes): a group that ran bad, holding the sample and otherwise
   only samples that ran finite (the pair ``[healthy, bad]`` of a binary split, the whole batch
   when every other sample ran finite).
2. **One pass beside healthy samples of the same batch** (:data:`COMPANY` of them, known good from
   the search), for the named samples without evidence, together.
3. **One pass beside the reference sub-batch** (:data:`COMPANY` samples of a recent healthy step the
   guard keeps), joined to the named samples, when no sample of the batch ran finite.

When that joint pass is bad and several samples are named, each is run beside the company on its
own (one pass each, within the pass budget) so that only the samples at fault stay named; those the
budget leaves unchecked stay named, unverified (their group fails beside healthy samples, each of
them may not). When the joint pass runs finite, the named samples fail only without healthy
company: the batch as a whole is at fault (cause ``"batch"``). Typically the check adds 0 passes (a
sample in a batch of healthy ones) or 1.

Example:
    >>> import torch
    >>> from lightning_nanguard.diagnose.runner import SubBatchRunner
    >>> class MeanOverTargets(torch.nn.Module):  # a mean over the targets that are not -100
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.w = torch.nn.Parameter(torch.ones(1))
    ...     def training_step(self, y, batch_idx):
    ...         kept = y != -100
    ...         return (self.w * y * kept).sum() / kept.sum()
    >>> runner = SubBatchRunner(MeanOverTargets(), torch.full((4,), -100.0))  # no target at all
    >>> bad = [runner.is_bad([p]) for p in range(4)]  # every sample "fails on its own"
    >>> reference = SubBatchRunner(MeanOverTargets(), torch.tensor([1.0, 2.0]))  # a healthy step's samples
    >>> found = check_blame(runner, [0, 1, 2, 3], reference, SubBatchRunner, budget=8)
    >>> found.verified, found.failed_alone, found.passes, found.company
    ((), (0, 1, 2, 3), 1, 'reference')
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_nanguard.diagnose.batching import join_batches
from lightning_nanguard.diagnose.runner import SubBatchRunner

__all__ = ["COMPANY", "UNCHECKED", "BlameCheck", "check_blame", "fails_beside_healthy"]

log = logging.getLogger("lightning_nanguard")

COMPANY = 2
"""Known-healthy samples run beside the named ones (two: BatchNorm in train mode, a batch statistic)."""

UNCHECKED = (
    "the pass budget (max_bisect_passes) ran out after their group failed beside healthy samples, "
    "before each was run beside them on its own"
)
"""Why named samples left unchecked when the budget runs out part-way stay unverified."""

RunnerFactory = Callable[..., SubBatchRunner]
Company = Literal["search", "batch", "reference", ""]


@dataclass(frozen=True)
class BlameCheck:
    """What :func:`check_blame` found about the named samples.

    Attributes:
        verified: named samples that fail beside known-healthy samples (at fault).
        failed_alone: named samples that ran finite beside known-healthy samples: they fail only
            without healthy company (the batch as a whole is at fault, not they).
        unverified: named samples that could not be checked (:attr:`reason` says why).
        passes: forward/backward passes the check added (0 when the search's passes were evidence).
        company: where the healthy samples came from: ``"search"`` (the search's own passes),
            ``"batch"`` (healthy samples of the same batch), ``"reference"`` (the reference sub-batch
            of a recent healthy step), ``""`` (none).
        reason: why :attr:`unverified` samples could not be checked.
    """

    verified: tuple[int, ...] = ()
    failed_alone: tuple[int, ...] = ()
    unverified: tuple[int, ...] = ()
    passes: int = 0
    company: Company = ""
    reason: str = ""

    @property
    def batch_reason(self) -> str:
        """Why the batch as a whole is at fault (see :attr:`batch_fault`), for the event."""
        where = {
            "batch": "healthy samples of the same batch",
            "reference": "the reference samples of a recent healthy step",
        }.get(self.company, "healthy samples")
        return f"samples {list(self.failed_alone)} fail on their own, but none fails beside {where}"

    @property
    def batch_fault(self) -> bool:
        """Every named sample was checked and none fails beside healthy samples: the batch is at fault."""
        return bool(self.failed_alone) and not self.verified and not self.unverified


def fails_beside_healthy(runner: SubBatchRunner, position: int) -> bool:
    """Whether a pass of the search already ran ``position`` bad beside samples that all ran finite (0 passes).

    Example:
        >>> import torch
        >>> class Log(torch.nn.Module):
        ...     def training_step(self, x, batch_idx):
        ...         return x.log().sum()
        >>> runner = SubBatchRunner(Log(), torch.tensor([1.0, 0.0, 2.0, 3.0]))
        >>> runner.is_bad([0, 1]), runner.is_bad([0]), runner.is_bad([1])
        (True, False, True)
        >>> fails_beside_healthy(runner, 1)
        True
    """
    good = set(runner.known_good)
    if position in good:  # it also ran finite somewhere: its badness depends on its company
        return False
    return any(
        bad and position in group and len(group) > 1 and all(p in good for p in group if p != position)
        for group, bad in runner.groups
    )


def check_blame(
    runner: SubBatchRunner,
    named: Sequence[int],
    reference: SubBatchRunner | None,
    factory: RunnerFactory,
    budget: int,
) -> BlameCheck:
    """Check that each sample in ``named`` fails beside known-healthy samples (see the module docs).

    Args:
        runner: the runner of the bad batch, after the search (its passes and known-good samples).
        named: positions the search named.
        reference: the runner of the reference sub-batch of a recent healthy step (``None``: none kept).
        factory: builds a runner for a batch of the named samples joined to the reference sub-batch
            (same arguments as :class:`SubBatchRunner`; a sharded model's runs it with every rank).
        budget: passes the check may use (what the search left of its budget).
    """
    named = list(named)
    evident = [p for p in named if fails_beside_healthy(runner, p)]
    rest = [p for p in named if p not in evident]
    if not rest:
        return BlameCheck(verified=tuple(evident), company="search" if evident else "")
    healthy = [g for g in runner.known_good if g not in named][:COMPANY]
    if healthy:
        run_with: Callable[[list[int]], bool] = lambda group: runner.is_bad([*group, *healthy])  # noqa: E731
        company: Company = "batch"
    else:
        joined = _reference_runner(runner, reference, factory)
        if isinstance(joined, str):
            return BlameCheck(verified=tuple(evident), unverified=tuple(rest), reason=joined)
        run_with, company = joined, "reference"
    if budget < 1:
        reason = "the pass budget (max_bisect_passes) was spent by the search"
        return BlameCheck(verified=tuple(evident), unverified=tuple(rest), company=company, reason=reason)
    passes = 1
    if not run_with(rest):
        return BlameCheck(tuple(evident), tuple(rest), (), passes, company)
    if len(rest) == 1:
        return BlameCheck((*evident, *rest), (), (), passes, company)
    at_fault: list[int] = []
    alone: list[int] = []
    unchecked: list[int] = []
    for position in rest:  # several named: each beside the company, while the budget lasts
        if passes >= budget:
            unchecked.append(position)  # its group fails beside healthy samples, but it may not: unverified
            continue
        passes += 1
        (at_fault if run_with([position]) else alone).append(position)
    if not at_fault and not unchecked:  # each is fine beside healthy samples, the group is not: they fail together
        at_fault, alone = alone, []
    reason = UNCHECKED if unchecked else ""
    return BlameCheck(tuple(sorted([*evident, *at_fault])), tuple(alone), tuple(unchecked), passes, company, reason)


def _reference_runner(
    runner: SubBatchRunner, reference: SubBatchRunner | None, factory: RunnerFactory
) -> Callable[[list[int]], bool] | str:
    """A pass of named samples joined to the reference sub-batch, or why there is none."""
    if reference is None:
        return "no sample of the batch ran finite and no reference sub-batch of a healthy step is kept yet"
    if runner.custom_slicer or runner.combined is not None:
        return "no sample of the batch ran finite, and a batch cut by a custom slicer cannot be joined to the reference"

    def run(group: list[int]) -> bool:
        joined = join_batches(runner.sub_batch(group), reference.batch)
        company = factory(
            runner.module,
            joined,
            runner.step_fn,
            runner.batch_idx,
            None,
            runner.context,
            runner.loss_threshold,
            runner.layout,
        )
        bad = company.is_bad(list(range(company.size)))
        runner.saw_nonfinite = runner.saw_nonfinite or company.saw_nonfinite
        return bad

    try:  # join once up front: a batch whose samples cannot be joined is told before any pass
        join_batches(runner.sub_batch(list(range(min(1, runner.size)))), reference.batch)
    except Exception as error:
        return f"no sample of the batch ran finite and it cannot be joined to the reference sub-batch: {error}"
    return run
