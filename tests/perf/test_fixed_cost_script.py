"""``benchmarks.fixed_cost``: the side-by-side ratios it prints (the timed fits are the benchmark's own business)."""

from __future__ import annotations

import pytest

from benchmarks.fixed_cost import paired_ratios


def test_each_repetition_is_divided_by_its_own_twin() -> None:
    """A loaded moment slows both runs of a pair by 3x: each pair's ratio stays 0.5 (never 50/320 across pairs)."""
    this = [50.0, 150.0, 55.0, 160.0]  # the second and fourth pairs ran on a loaded machine
    against = [100.0, 300.0, 110.0, 320.0]
    assert paired_ratios(this, against) == (0.5, 0.5, 0.5)


def test_the_median_min_and_max_of_the_pairs() -> None:
    assert paired_ratios([40.0, 60.0, 90.0], [100.0, 100.0, 100.0]) == pytest.approx((0.6, 0.4, 0.9))


def test_unpaired_lists_are_refused() -> None:
    with pytest.raises(ValueError):
        paired_ratios([1.0, 2.0], [1.0])
