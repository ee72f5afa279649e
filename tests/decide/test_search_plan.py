"""Who searches and who records a bad step under sharding: plan_search and recorders on every rank's findings."""

from __future__ import annotations

from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.decide.search_plan import Finding, SearchResult, plan_search, recorders


def _event(rank: int, phase: str | None = None) -> NanEvent:
    return NanEvent(3, 0, 3, rank, ("grad",), "warned", phase=phase)  # type: ignore[arg-type]


def test_a_nonfinite_loss_is_searched_where_it_was_computed() -> None:
    findings = [Finding(0, (0, 1), nonfinite=True), Finding(2, (2, 3), nonfinite=True, origin=True)]
    assert plan_search(findings) == {(2, 3): None}


def test_gradients_only_every_batch_is_searched_and_spikes_with_their_threshold() -> None:
    assert plan_search([Finding(0, (0,)), Finding(1, (1,), nonfinite=True)]) == {(0,): None, (1,): None}
    spikes = [Finding(0, (0,)), Finding(1, (1,), spike=True, threshold=2.5)]
    assert plan_search(spikes) == {(1,): 2.5}
    assert plan_search([Finding(0, (0,)), Finding(1, (1,))]) == {}


def test_the_batch_that_holds_it_records_once_with_the_origin_any_peer_found() -> None:
    outcomes = [
        SearchResult(0, (0, 1), True, False, _event(0)),  # its shards got the NaN, its data is fine
        SearchResult(1, (0, 1), True, False, _event(1)),
        SearchResult(2, (2, 3), True, True, _event(2)),
        SearchResult(3, (2, 3), True, True, _event(3, phase="backward")),  # the origin was in this rank's shard
    ]
    chosen = recorders(outcomes)
    assert list(chosen) == [2]
    assert (chosen[2].rank, chosen[2].phase) == (2, "backward")


def test_when_no_batch_holds_it_each_batch_keeps_its_own_event() -> None:
    outcomes = [SearchResult(0, (0,), True, False, _event(0)), SearchResult(1, (1,), False, False, None)]
    assert list(recorders(outcomes)) == [0]
    made_for_the_search = SearchResult(1, (1,), True, False, _event(1), own=False)  # its shards were finite
    assert list(recorders([outcomes[0], made_for_the_search])) == [0]
