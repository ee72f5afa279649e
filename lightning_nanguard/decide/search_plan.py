"""Who searches and who records a bad step under sharding: decided from every rank's findings. Trainer-free.

Under ``ModelParallelStrategy`` every rank takes part in the diagnosis of a bad step
(:mod:`~lightning_nanguard.diagnose.lockstep`), but not every rank's batch holds the incident. Each
rank describes what it found (:class:`Finding`) and, after the search, what the search gave
(:class:`SearchResult`); these are gathered from every rank, and every rank derives the same plan from
them: :func:`plan_search` (which batches to search, and for a loss spike the threshold) and
:func:`recorders` (which rank records which event).

A non-finite loss or BatchNorm statistic can only come from the batch of the ranks that computed
it, so those batches are searched. A NaN/Inf found in gradients only can come from *any* batch
(the gradient reduction spreads it to the shards of ranks whose data is fine, and spares the
shards of the rank whose data is at fault), so every batch is searched. A loss spike is searched by
the ranks whose loss spiked. The lowest rank of each batch that reproduced the incident records
the event; when no batch reproduces it, ranks keep their own events as under DDP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_nanguard.core.events import NanEvent

__all__ = ["Finding", "SearchResult", "plan_search", "recorders"]


@dataclass(frozen=True)
class Finding:
    """What one rank found on a bad step before the search, shared with every rank to plan it.

    Attributes:
        rank: global rank.
        peers: the ranks sharing its batch.
        nonfinite: it confirmed NaN/Inf of its own (loss, gradient shards or BatchNorm statistics).
        origin: its loss or BatchNorm statistics are non-finite: its batch holds the incident.
        spike: its loss spiked.
        threshold: the loss above which a (sub-)batch counts as a spike.
        kinds: the event's kinds.
        nonfinite_grads: names of its non-finite gradient shards.
        nonfinite_weights: names of its non-finite weight shards.
    """

    rank: int
    peers: tuple[int, ...]
    nonfinite: bool = False
    origin: bool = False
    spike: bool = False
    threshold: float | None = None
    kinds: tuple[str, ...] = ()
    nonfinite_grads: tuple[str, ...] = ()
    nonfinite_weights: tuple[str, ...] = ()


@dataclass(frozen=True)
class SearchResult:
    """What one rank's search gave (gathered from every rank).

    Attributes:
        rank: global rank.
        peers: the ranks sharing its batch.
        searched: its batch was searched.
        holds: the search reproduced the incident in its batch.
        event: its event after the diagnosis (``None``: none).
        error: why its part of the diagnosis could not run.
        own: the rank found NaN/Inf (or a spike) of its own before the search (else its event was made
            for the search only, and is recorded only where the search reproduced the incident).
    """

    rank: int
    peers: tuple[int, ...]
    searched: bool = False
    holds: bool = False
    event: NanEvent | None = field(default=None, compare=False)
    error: str | None = None
    own: bool = True


def plan_search(findings: Sequence[Finding]) -> dict[tuple[int, ...], float | None]:
    """The batches to search (by their ranks) and the loss threshold of each (``None``: NaN/Inf).

    Example:
        >>> found = [Finding(0, (0,)), Finding(1, (1,), nonfinite=True, origin=True)]
        >>> plan_search(found)
        {(1,): None}
        >>> plan_search([Finding(0, (0,), nonfinite=True), Finding(1, (1,))])  # gradients only: every batch
        {(0,): None, (1,): None}
    """
    groups = list(dict.fromkeys(f.peers for f in findings))
    origins = {f.peers for f in findings if f.nonfinite and f.origin}
    gradients_only = not origins and any(f.nonfinite for f in findings)
    plan: dict[tuple[int, ...], float | None] = {}
    for group in groups:
        members = [f for f in findings if f.peers == group]
        if group in origins or gradients_only:
            plan[group] = None
        elif any(f.spike and f.threshold is not None for f in members):
            plan[group] = min(f.threshold for f in members if f.spike and f.threshold is not None)
    return plan


def recorders(results: Sequence[SearchResult]) -> dict[int, NanEvent]:
    """Which ranks record which event (see module docs).

    Example:
        >>> event = NanEvent(1, 0, 1, 0, ("grad",), "warned")
        >>> out = [SearchResult(0, (0,), True, False, event), SearchResult(1, (1,), True, True, event.replace(rank=1))]
        >>> {rank: e.rank for rank, e in recorders(out).items()}
        {1: 1}
    """
    groups_seen = list(dict.fromkeys(o.peers for o in results))
    holding = [group for group in groups_seen if any(o.holds for o in results if o.peers == group)]
    chosen: dict[int, NanEvent] = {}
    groups = holding or groups_seen
    for group in groups:
        members = sorted((o for o in results if o.peers == group and o.event is not None), key=lambda o: o.rank)
        if not members:
            continue
        members = [o for o in members if o.searched] if holding else [o for o in members if o.own]
        if not members:
            continue
        located = next((o for o in members if o.event is not None and o.event.phase is not None), members[0])
        leader = members[0].rank
        assert located.event is not None
        chosen[leader] = located.event.replace(rank=leader)
    return chosen
