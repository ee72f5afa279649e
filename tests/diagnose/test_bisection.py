"""``find_offending``: exact offending sets, pass counts within ``2*k*log2(n) + 2``, interaction, the cap.

The pass counts measured here (worst case over positions) are the numbers quoted in the issue's
closing note; ``test_pass_count_table`` pins the table so a regression in the search shows.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence

import pytest

from lightning_nanguard.diagnose.bisection import BisectionResult, find_offending

SIZES = (1, 2, 3, 5, 7, 8, 9, 12, 16, 17, 31, 32, 33, 64, 100, 128)


def bound(n: int, k: int) -> float:
    return 2 * k * math.log2(n) + 2


class Oracle:
    """``is_bad`` for offending samples ``bad``; records every call."""

    def __init__(self, bad: Sequence[int]) -> None:
        self.bad = set(bad)
        self.calls: list[list[int]] = []

    def __call__(self, positions: Sequence[int]) -> bool:
        self.calls.append(list(positions))
        return bool(self.bad & set(positions))


def subsets(n: int, k: int, rng: random.Random, limit: int = 400) -> list[tuple[int, ...]]:
    if math.comb(n, k) <= limit:
        return list(itertools.combinations(range(n), k))
    return [tuple(sorted(rng.sample(range(n), k))) for _ in range(limit)]


@pytest.mark.parametrize("n", SIZES)
def test_exact_sets_within_the_pass_bound(n: int) -> None:
    rng = random.Random(n)
    for k in sorted({1, 2, 3, 4, n // 2, n} - {0}):
        if k > n:
            continue
        for bad in subsets(n, k, rng):
            oracle = Oracle(bad)
            result = find_offending(n, oracle, max_passes=10_000)
            assert result.offending == list(bad), (n, bad)
            assert result.complete and result.reason == ""
            assert result.passes == len(oracle.calls)
            assert result.passes <= bound(n, k), (n, bad, result.passes)
            assert len(result.smallest_bad) == 1 and result.smallest_bad[0] in bad
            assert oracle.calls[0] == list(range(n))  # the whole batch is confirmed first


# worst case over all positions (n <= 64 exhaustive for k <= 2; else 400 random sets per (n, k))
PASS_TABLE = {
    (8, 1): 7,
    (8, 2): 11,
    (8, 8): 15,
    (16, 1): 9,
    (16, 2): 15,
    (16, 4): 23,
    (32, 1): 11,
    (32, 2): 19,
    (64, 1): 13,
    (64, 2): 23,
}


@pytest.mark.parametrize(("n", "k"), sorted(PASS_TABLE))
def test_pass_count_table(n: int, k: int) -> None:
    rng = random.Random(0)
    sets = list(itertools.combinations(range(n), k)) if math.comb(n, k) <= 5000 else subsets(n, k, rng, 2000)
    worst = max(find_offending(n, Oracle(bad), max_passes=10_000).passes for bad in sets)
    assert worst == PASS_TABLE[(n, k)]
    assert worst <= bound(n, k)


@pytest.mark.parametrize(("position", "passes"), [(0, 7), (3, 6), (4, 6), (7, 5)])
def test_single_sample_first_last_and_middle(position: int, passes: int) -> None:
    oracle = Oracle([position])
    result = find_offending(8, oracle)
    assert result.offending == [position]
    assert result.passes == passes  # a bad first half costs the check of the second half too
    assert result.smallest_bad == [position]


def test_every_sample_bad() -> None:
    result = find_offending(8, Oracle(range(8)))
    assert result.offending == list(range(8))
    assert result.passes == 15 <= bound(8, 8)


def test_batch_of_one() -> None:
    oracle = Oracle([0])
    assert find_offending(1, oracle) == BisectionResult([0], 1, "", [0])
    assert oracle.calls == [[0]]


def test_empty_batch() -> None:
    result = find_offending(0, Oracle([]))
    assert result.offending is None and result.passes == 0 and result.reason == "the batch is empty"


def test_whole_batch_not_reproduced() -> None:
    oracle = Oracle([])
    result = find_offending(8, oracle)
    assert result.offending is None and result.passes == 1
    assert "gave finite values" in result.reason
    assert result.smallest_bad == []


@pytest.mark.parametrize(
    "is_bad",
    [
        pytest.param(lambda p: len(p) == 8, id="only-the-whole-batch"),
        pytest.param(lambda p: {0, 7} <= set(p), id="first-and-last-together"),
        pytest.param(lambda p: {2, 3} <= set(p), id="neighbours-together"),
    ],
)
def test_batch_interaction_is_not_attributed(is_bad: object) -> None:
    result = find_offending(8, is_bad)  # type: ignore[arg-type]
    assert result.offending is None
    assert result.reason == (
        "no single sample is non-finite on its own: the samples only fail together (batch interaction)"
    )
    assert result.complete
    assert result.passes <= bound(8, 1)
    assert len(result.smallest_bad) >= 2  # localisation runs on a group that really is bad
    assert is_bad(result.smallest_bad)  # type: ignore[operator]


def test_offending_sample_next_to_an_interacting_pair() -> None:
    result = find_offending(8, lambda p: 5 in p or {0, 1} <= set(p))
    assert result.offending == [5]
    assert result.reason == "some groups only fail together: [[0, 1]]"


@pytest.mark.parametrize("cap", [1, 2, 3, 5])
def test_max_passes_caps_the_predicate_calls(cap: int) -> None:
    oracle = Oracle([6])
    result = find_offending(16, oracle, max_passes=cap)
    assert len(oracle.calls) == result.passes == cap
    assert result.complete is False
    assert result.offending is None if cap < 5 else result.offending == [6]  # found on the 5th pass
    assert f"max_bisect_passes={cap} reached" in result.reason
    if cap == 1:
        assert result.smallest_bad == list(range(16))
    else:
        assert 6 in result.smallest_bad and len(result.smallest_bad) < 16


def test_cap_after_the_first_sample_keeps_the_partial_result() -> None:
    result = find_offending(16, Oracle([0, 15]), max_passes=6)
    assert result.offending == [0] and result.complete is False and result.passes == 6
    assert result.reason == "max_bisect_passes=6 reached: more samples may be offending"


def test_without_confirming_the_whole_batch() -> None:
    oracle = Oracle([5])
    result = find_offending(8, oracle, confirm_whole=False)
    assert result.offending == [5] and list(range(8)) not in oracle.calls
    nothing = find_offending(8, Oracle([]), confirm_whole=False)
    assert nothing.offending is None and "confirm_whole=False" in nothing.reason


# ------------------------------------------------------------------------------------ results known in advance


def test_known_results_cost_no_pass() -> None:
    oracle = Oracle([5])
    known = {tuple(range(8)): True, (1,): False, (5,): True}
    result = find_offending(8, oracle, known=known, spent=2)
    assert result.offending == [5]
    assert list(range(8)) not in oracle.calls and [5] not in oracle.calls
    assert not any(5 in call for call in oracle.calls)  # a group holding a known-bad sample is bad, untested
    assert result.passes == len(oracle.calls) == 3  # [0..3], [4], [6, 7]


def test_spent_passes_count_towards_the_cap() -> None:
    result = find_offending(16, Oracle([6]), max_passes=6, known={tuple(range(16)): True}, spent=4)
    assert result.passes == 2 and result.complete is False
    assert "max_bisect_passes=6 reached" in result.reason


class CountingRunner(Oracle):
    """The predicate with the runner's bookkeeping (``size``, ``passes``, ``known_good``) for the state check."""

    def __init__(self, n: int, bad: Sequence[int]) -> None:
        super().__init__(bad)
        self.size = n
        self.passes = 0
        self.known_good: list[int] = []

    def is_bad(self, positions: Sequence[int]) -> bool:
        self.passes += 1
        return self(positions)


def diagnosis_passes(n: int, bad: Sequence[int]) -> int | None:
    """Passes of a diagnosis without a reference: the state check, then the search; ``None`` for a ``"state"`` cause."""
    from lightning_nanguard.diagnose.cause import check_state

    runner = CountingRunner(n, bad)
    state = check_state(runner, None, 10_000)  # type: ignore[arg-type]
    if state.state:
        return None
    result = find_offending(n, runner.is_bad, max_passes=10_000, known=state.known, spent=runner.passes)
    assert result.offending == sorted(bad)
    return runner.passes


# worst case of state check + search (same sets as PASS_TABLE): one pass more than the search alone at most
DIAGNOSIS_TABLE = {(8, 1): 7, (8, 2): 11, (16, 1): 10, (16, 2): 16, (32, 1): 12, (32, 2): 20, (64, 1): 14, (64, 2): 24}


@pytest.mark.parametrize(("n", "k"), sorted(DIAGNOSIS_TABLE))
def test_state_check_then_search_pass_table(n: int, k: int) -> None:
    counts = [diagnosis_passes(n, bad) for bad in itertools.combinations(range(n), k)]
    assert None not in counts  # one or two bad samples: never the model state
    worst = max(c for c in counts if c is not None)
    assert worst == DIAGNOSIS_TABLE[(n, k)] <= PASS_TABLE[(n, k)] + 1
    assert worst <= bound(n, k) + 1
