"""What happened at one optimizer step, and what every rank does about it. Trainer-free.

Every path of the guard goes through the same three steps, on every rank:

1. :class:`StepHealth` names the values of the step's one host read: this rank's flags from the
   fused check (and, under DDP, their sums over all ranks, reduced in the same tensor).
2. When a step is not healthy on some rank, each rank puts what it found into a
   :class:`RankVote` (its own NaN/Inf incident, an AMP overflow, a loss spike, an internal
   failure, the cause and what the remedies need), and the votes of all ranks are gathered.
3. :func:`decide` turns the votes, the shared :class:`Counters` and the :class:`Policy` into one
   :class:`StepDecision`. Its inputs are identical on every rank, so is its output: every rank
   skips, raises, rolls back and applies remedies at the same step, for the same reason.

Examples:
    >>> policy = Policy(action="skip", max_consecutive_bad_steps=2)
    >>> bad = [RankVote(rank=0, incident=True, cause="data", quarantine=(7,))]
    >>> first, counters = decide(bad, Counters(), policy)
    >>> first.outcome, first.action, first.discard, counters.consecutive_bad_steps
    ('incident', 'skip', True, 1)
    >>> second, counters = decide(bad, counters, policy)
    >>> second.action, second.escalation
    ('raise', 'max_consecutive_bad_steps')
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from lightning_nanguard.core.defaults import default_of
from lightning_nanguard.detect.spikes import SpikeDetector

__all__ = [
    "LOCAL_FIELDS",
    "SHARED_FIELDS",
    "Counters",
    "StepOutcome",
    "Policy",
    "RankVote",
    "SpikeAction",
    "StepAction",
    "StepDecision",
    "StepHealth",
    "decide",
    "decide_weights",
    "local_vector",
    "shared_part",
]

StepOutcome = Literal["healthy", "incident", "overflow", "loss_scale", "spike", "failed"]
StepAction = Literal["skip", "raise", "warn", "rollback"]
SpikeAction = Literal["skip", "warn", "off"]

LOCAL_FIELDS: tuple[str, ...] = ("bad", "grad_norm", "others_bad", "spike", "failed", "loss", "part_failed")
"""This rank's values, in the order of :func:`local_vector`."""
SHARED_FIELDS: tuple[str, ...] = ("bad", "others_bad", "spike", "failed", "part_failed")
"""The flags summed over ranks (DDP), in the order of :func:`shared_part`."""
_LOCAL = len(LOCAL_FIELDS)

# Which cause wins when ranks disagree: the weights are shared, so a state cause anywhere is the
# cause; then NaN/Inf in a batch, then samples that reproduce it, then samples that only fail together,
# then a batch that fails only as a whole (a degenerate batch: no record and no weight is at fault).
_CAUSE_PRIORITY = ("state", "input", "data", "interaction", "batch")


def local_vector(
    summary: Tensor,
    spike: Tensor | None = None,
    failed: bool = False,
    loss: Tensor | None = None,
    part_failed: bool = False,
) -> Tensor:
    """This rank's flags as one float32 device vector laid out as :data:`LOCAL_FIELDS`.

    Args:
        summary: ``fused_health_check`` output ``[bad, grad_norm, others_bad]``.
        spike: 1-element flag of the loss-spike check (``None``: no check).
        failed: this rank's guard failed internally and cannot check (the vector then says so).
        loss: the step's loss, read with the flags for the spike statistic (``None``: NaN).
        part_failed: an optional part that holds a collective (QK-clip under DDP) went off on this
            rank: every rank switches it off at this step, so none waits in its collective.

    Examples:
        >>> local_vector(torch.tensor([0.0, 2.5, 0.0]), loss=torch.tensor(0.75)).tolist()
        [0.0, 2.5, 0.0, 0.0, 0.0, 0.75, 0.0]
    """
    device, dtype = summary.device, torch.float32
    spike = spike.reshape(1).to(dtype) if spike is not None else _flag(0.0, device)
    loss = loss.reshape(1).to(device=device, dtype=dtype) if loss is not None else _flag(math.nan, device)
    flags = (_flag(1.0 if failed else 0.0, device), loss, _flag(1.0 if part_failed else 0.0, device))
    return torch.cat((summary.to(dtype), spike, *flags))


_FLAGS: dict[tuple[float, torch.device], Tensor] = {}


def _flag(value: float, device: torch.device) -> Tensor:
    """A cached, never-written 1-element float32 tensor (no allocation per step)."""
    key = (value, device)
    if key not in _FLAGS:
        _FLAGS[key] = torch.full((1,), value, dtype=torch.float32, device=device)
    return _FLAGS[key]


def shared_part(vector: Tensor) -> Tensor:
    """The entries of a :func:`local_vector` that are summed over ranks (views, no index tensor).

    Examples:
        >>> shared_part(torch.tensor([1.0, 9.0, 0.0, 1.0, 0.0, 0.5, 1.0])).tolist()
        [1.0, 0.0, 1.0, 0.0, 1.0]
    """
    return torch.cat((vector[0:1], vector[2:5], vector[6:7]))  # bad, others_bad, spike, failed, part_failed


class StepHealth(NamedTuple):
    """The step's one host read, named (a named tuple: every step makes one, and a tuple is made in C).

    Attributes:
        bad: this rank's check flagged a possible NaN/Inf (gradients, loss or BatchNorm statistics).
        grad_norm: global L2 norm of the gradients (-1 when not computed this step).
        others_bad: this rank's loss or BatchNorm statistics flagged.
        spike: this rank's loss is a spike.
        failed: this rank's guard failed internally.
        loss: this rank's step loss (NaN when not checked), for the spike statistic.
        ranks_bad, ranks_others_bad, ranks_spike, ranks_failed: how many ranks raised each flag
            (this rank's flag without DDP).
        ranks_part_failed: how many ranks switched off an optional part that holds a collective
            (not a reason to look at the step: :attr:`healthy` ignores it).
    """

    bad: bool
    grad_norm: float
    others_bad: bool
    spike: bool
    failed: bool
    loss: float
    ranks_bad: int
    ranks_others_bad: int
    ranks_spike: int
    ranks_failed: int
    ranks_part_failed: int = 0

    @classmethod
    def from_values(cls, values: Sequence[float]) -> StepHealth:
        """From ``local + shared`` values read to the host (``shared`` absent without DDP).

        Examples:
            >>> StepHealth.from_values([0.0, 1.5, 0.0, 0.0, 0.0, 0.7, 0.0]).healthy
            True
            >>> health = StepHealth.from_values([0.0, 1.5, 0.0, 0.0, 0.0, 0.7, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0])
            >>> health.healthy, health.ranks_bad, health.bad, health.ranks_part_failed
            (False, 1, False, 1)
        """
        bad, grad_norm, others_bad, spike, failed, loss, part_failed = values[:_LOCAL]
        shared = values[_LOCAL:] if len(values) > _LOCAL else (bad, others_bad, spike, failed, part_failed)
        # positional, in field order (bad, grad_norm, others_bad, spike, failed, loss, ranks_*): every step makes one
        return cls(
            bad > 0,
            float(grad_norm),
            others_bad > 0,
            spike > 0,
            failed > 0,
            float(loss),
            int(shared[0]),
            int(shared[1]),
            int(shared[2]),
            int(shared[3]),
            int(shared[4]),
        )

    @classmethod
    def local(
        cls,
        bad: bool = False,
        grad_norm: float = -1.0,
        others_bad: bool = False,
        spike: bool = False,
        failed: bool = False,
        loss: float = math.nan,
    ) -> StepHealth:
        """A step of one process decided on the host (no vector): its flags are the ranks' counts.

        The same as :meth:`from_values` of the values :data:`LOCAL_FIELDS` lays out, without a list.

        Examples:
            >>> values = [0.0, 1.5, 0.0, 0.0, 0.0, 0.7, 0.0]  # bad, grad_norm, others_bad, spike, failed, loss, part
            >>> StepHealth.local(grad_norm=1.5, loss=0.7) == StepHealth.from_values(values)
            True
            >>> StepHealth.local(bad=True).ranks_bad
            1
        """
        counts = (int(bad), int(others_bad), int(spike), int(failed), 0)
        # made in C: the named tuple's own __new__ is a Python function (every step makes one)
        return tuple.__new__(cls, (bad, grad_norm, others_bad, spike, failed, loss, *counts))

    @property
    def healthy(self) -> bool:
        """No rank flagged anything: the fast path."""
        return not (self.ranks_bad or self.ranks_spike or self.ranks_failed)


@dataclass(frozen=True)
class RankVote:
    """What one rank puts into the shared decision on a step that was not healthy somewhere.

    Attributes:
        rank: global rank.
        incident: this rank confirmed NaN/Inf of its own, element-wise (not an AMP overflow).
        overflow: Inf-only gradients under a GradScaler with a finite loss and BatchNorm statistics
            (the scaler skips such a step itself).
        spike: this rank's loss is a spike.
        failed: this rank's guard failed internally.
        cause: the cause the diagnosis gave for this rank's incident (``None``: not investigated).
        quarantine: dataset indices of the offending samples (cause ``data``/``input``).
        culprit_module: module where the first NaN/Inf was produced (for ``raise_eps``).
        quarantine_items: with several training loaders, ``(loader key, dataset index)`` of the
            offending samples, instead of ``quarantine``.
    """

    rank: int
    incident: bool = False
    overflow: bool = False
    spike: bool = False
    failed: bool = False
    cause: str | None = None
    quarantine: tuple[int, ...] = ()
    culprit_module: str | None = None
    quarantine_items: tuple[tuple[str | int, int], ...] = ()


@dataclass(frozen=True)
class Policy:
    """The configuration that decides a step (mirrors the ``NanGuard`` arguments of the same names).

    ``can_skip`` is False when the update cannot be dropped from a hook (manual optimisation,
    LBFGS): ``skip`` and ``rollback`` then act as ``warn``.
    """

    action: StepAction = "skip"
    max_consecutive_bad_steps: int = 10
    max_events: int | None = None
    rollback_after_consecutive: int = 3
    min_loss_scale: float = 1.0
    max_consecutive_overflows: int = 20
    spike_action: SpikeAction = "skip"
    spike_rebaseline_after: int = default_of(SpikeDetector, "rebaseline_after")
    can_skip: bool = True


@dataclass(frozen=True)
class Counters:
    """Counts that mean the same on every rank: a bad step is a step that was bad on any rank."""

    bad_steps_total: int = 0
    skipped_total: int = 0
    consecutive_bad_steps: int = 0
    amp_overflow_total: int = 0
    consecutive_overflows: int = 0
    spikes_total: int = 0
    consecutive_spikes: int = 0

    def replace(self, **changes: int) -> Counters:
        """A copy with some counts changed."""
        return dataclasses.replace(self, **changes)

    def healthy(self) -> Counters:
        """After a healthy step: every run of consecutive incidents, overflows and spikes is over."""
        if not (self.consecutive_bad_steps or self.consecutive_overflows or self.consecutive_spikes):
            return self  # already at rest (frozen: sharing it is safe), no copy on every healthy step
        return self.replace(consecutive_bad_steps=0, consecutive_overflows=0, consecutive_spikes=0)


@dataclass(frozen=True)
class StepDecision:
    """What every rank does about one step.

    Attributes:
        outcome: ``healthy``; ``incident`` (NaN/Inf on some rank); ``overflow`` (the GradScaler's
            business, counted only); ``loss_scale`` (the scale collapsed: an incident); ``spike``;
            ``failed`` (the guard's core failed on some rank: the step cannot be vouched for, so it is
            dropped, and every rank turns its guard off).
        action: what is done: ``skip``, ``raise``, ``warn`` or ``rollback`` (``None`` when healthy).
        discard: drop this step's update (gradients to ``None``, BatchNorm statistics restored).
        escalation: the rule that made the guard raise whatever ``action`` is configured.
        rollback_due: restore the last good snapshot after the optimizer step.
        cause: the shared cause of the incident.
        quarantine: dataset indices to quarantine (union over ranks).
        culprit_module: module for ``raise_eps`` (lowest reporting rank).
        quarantine_items: ``(loader key, dataset index)`` to quarantine, several loaders (union over ranks).
        rebaseline: the spike statistic must start over (several spikes in a row).
        disable: some rank's guard failed: every rank disables its guard after this step.
    """

    outcome: StepOutcome
    action: StepAction | None = None
    discard: bool = False
    escalation: str | None = None
    rollback_due: bool = False
    cause: str | None = None
    quarantine: tuple[int, ...] = ()
    culprit_module: str | None = None
    rebaseline: bool = False
    disable: bool = False
    reports: tuple[RankVote, ...] = field(default=(), repr=False)
    quarantine_items: tuple[tuple[str | int, int], ...] = ()

    @property
    def bad(self) -> bool:
        """An incident (NaN/Inf or a collapsed loss scale), counted toward escalation."""
        return self.outcome in ("incident", "loss_scale")


def _items(reports: Iterable[RankVote]) -> tuple[tuple[str | int, int], ...]:
    """The union of the reports' ``(loader key, dataset index)`` items, in a stable order."""
    found = {item for r in reports for item in r.quarantine_items}
    return tuple(sorted(found, key=lambda item: (str(item[0]), item[1])))


def _shared_cause(reports: Sequence[RankVote]) -> str | None:
    causes = {r.cause for r in reports if r.incident and r.cause}
    return next((c for c in _CAUSE_PRIORITY if c in causes), None)


def _rank(report: RankVote) -> int:
    return report.rank


def _escalation(counters: Counters, policy: Policy) -> str | None:
    if counters.consecutive_bad_steps >= policy.max_consecutive_bad_steps:
        return "max_consecutive_bad_steps"
    if policy.max_events is not None and counters.bad_steps_total >= policy.max_events:
        return "max_events"
    return None


def decide(
    reports: Sequence[RankVote],
    counters: Counters,
    policy: Policy,
    next_loss_scale: float | None = None,
) -> tuple[StepDecision, Counters]:
    """One decision for the step from every rank's report; the counters after it.

    Args:
        reports: one report per rank (a single one without DDP); empty for a healthy step.
        counters: the shared counters before this step.
        policy: the configuration.
        next_loss_scale: the loss scale the GradScaler will use after an overflow (``None``: no scaler).

    Examples:
        >>> overflow = [RankVote(rank=0, overflow=True)]
        >>> decision, counters = decide(overflow, Counters(), Policy(), next_loss_scale=2.0**15)
        >>> decision.outcome, decision.discard, counters.amp_overflow_total
        ('overflow', False, 1)
        >>> decide(overflow, counters, Policy(), next_loss_scale=0.5)[0].outcome
        'loss_scale'
        >>> failed, counters = decide([RankVote(rank=0), RankVote(rank=1, failed=True)], Counters(), Policy())
        >>> failed.outcome, failed.discard, failed.disable, counters.skipped_total, counters.bad_steps_total
        ('failed', True, True, 1, 0)
    """
    disable = any(r.failed for r in reports)
    if any(r.incident for r in reports):
        return _incident(reports, counters, policy, "incident", disable)
    if disable:  # no rank found NaN/Inf, but one could not check: the step is not vouched for, so it is dropped
        skip = policy.can_skip
        counters = counters.replace(skipped_total=counters.skipped_total + int(skip))
        action: StepAction = "skip" if skip else "warn"
        return StepDecision("failed", action=action, discard=skip, disable=True, reports=tuple(reports)), counters
    if any(r.overflow for r in reports):
        counters = counters.replace(
            amp_overflow_total=counters.amp_overflow_total + 1, consecutive_overflows=counters.consecutive_overflows + 1
        )
        collapsed = next_loss_scale is not None and next_loss_scale < policy.min_loss_scale
        if collapsed or counters.consecutive_overflows >= policy.max_consecutive_overflows:
            return _incident(reports, counters, policy, "loss_scale", disable)
        return StepDecision("overflow", disable=disable, reports=tuple(reports)), counters
    if any(r.spike for r in reports) and policy.spike_action != "off":
        spikes = counters.consecutive_spikes + 1
        rebaseline = spikes >= policy.spike_rebaseline_after
        counters = counters.replace(
            spikes_total=counters.spikes_total + 1, consecutive_spikes=0 if rebaseline else spikes
        )
        skip = policy.spike_action == "skip" and policy.can_skip
        if skip:
            counters = counters.replace(skipped_total=counters.skipped_total + 1)
        decision = StepDecision(
            "spike",
            action="skip" if skip else "warn",
            discard=skip,
            cause=_shared_cause([dataclasses.replace(r, incident=True) for r in reports if r.spike]),
            quarantine=tuple(sorted({i for r in reports if r.spike for i in r.quarantine})),
            quarantine_items=_items(r for r in reports if r.spike),
            rebaseline=rebaseline,
            disable=disable,
            reports=tuple(reports),
        )
        return decision, counters
    return StepDecision("healthy", disable=disable, reports=tuple(reports)), counters.healthy()


def decide_weights(counters: Counters, action: str, snapshot_available: bool) -> tuple[str, Counters]:
    """What every rank does when the weights are non-finite on some rank after an update.

    Returns ``"rollback"`` (with ``action="rollback"`` and a snapshot), ``"warn"`` (``action="warn"``)
    or ``"raise"``, and the counters after it (one more bad step).

    Examples:
        >>> decide_weights(Counters(), "rollback", snapshot_available=True)[0]
        'rollback'
        >>> decide_weights(Counters(), "skip", snapshot_available=True)[0]
        'raise'
    """
    counters = counters.replace(bad_steps_total=counters.bad_steps_total + 1)
    if action == "rollback" and snapshot_available:
        return "rollback", counters
    return ("warn" if action == "warn" else "raise"), counters


def _incident(
    reports: Sequence[RankVote], counters: Counters, policy: Policy, outcome: StepOutcome, disable: bool
) -> tuple[StepDecision, Counters]:
    counters = counters.replace(
        bad_steps_total=counters.bad_steps_total + 1,
        consecutive_bad_steps=counters.consecutive_bad_steps + 1,
        consecutive_spikes=0,
    )
    escalation = _escalation(counters, policy)
    action: StepAction = "raise" if escalation else policy.action
    if action in ("skip", "rollback") and not policy.can_skip:
        action = "warn"
    skipped = action in ("skip", "rollback")
    if skipped:
        counters = counters.replace(skipped_total=counters.skipped_total + 1)
    rollback_due = action == "rollback" and counters.consecutive_bad_steps >= policy.rollback_after_consecutive
    if rollback_due:
        counters = counters.replace(consecutive_bad_steps=0)
    cause = _shared_cause(reports)
    decision = StepDecision(
        outcome,
        action=action,
        discard=action in ("skip", "raise", "rollback"),
        escalation=escalation,
        rollback_due=rollback_due,
        cause=cause,
        quarantine=tuple(sorted({i for r in reports if r.cause in ("data", "input") for i in r.quarantine})),
        quarantine_items=_items(r for r in reports if r.cause in ("data", "input")),
        culprit_module=next((r.culprit_module for r in sorted(reports, key=_rank) if r.culprit_module), None),
        disable=disable,
        reports=tuple(reports),
    )
    return decision, counters
