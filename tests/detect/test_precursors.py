"""``LogitGrowthRule``: a level and a growth together, per module, rate-limited."""

from __future__ import annotations

import math

from lightning_nanguard.detect.precursors import LogitGrowthRule


def _rule() -> LogitGrowthRule:
    return LogitGrowthRule(min_logit=50.0, growth=3.0, window=20, cooldown=100)


def test_a_high_but_steady_logit_never_fires() -> None:
    rule = _rule()
    assert all(rule.observe("attn", step, 400.0) is None for step in range(0, 300, 10))


def test_fast_growth_below_the_level_never_fires() -> None:
    rule = _rule()
    assert all(rule.observe("attn", step, 0.1 * 2 ** (step / 10)) is None for step in range(0, 80, 10))  # < 50


def test_growth_past_the_level_fires_once_per_cooldown_per_module() -> None:
    rule = _rule()
    values = {0: 5.0, 10: 12.0, 20: 40.0, 30: 130.0, 40: 400.0, 50: 1200.0}
    fired = [(s, f.ratio) for s, v in values.items() if (f := rule.observe("a", s, v)) is not None]
    assert [s for s, _ in fired] == [30]  # 130 > 50 and 130 / 12 (step 10) >= 3; then the cooldown
    assert math.isclose(fired[0][1], 130.0 / 12.0)
    assert rule.observe("b", 40, 60.0) is None  # b has no history yet
    assert rule.observe("b", 50, 200.0) is not None  # a's cooldown does not hold b
    assert rule.observe("a", 120, 1000.0) is None  # nothing within the window to compare with
    assert rule.observe("a", 130, 5000.0) is not None  # 100 steps after its warning: a may warn again


def test_the_comparison_reaches_back_at_most_the_window() -> None:
    rule = _rule()
    rule.observe("a", 0, 10.0)
    assert rule.observe("a", 40, 100.0) is None  # step 0 is older than 20 steps: no earlier value kept
    assert rule.observe("a", 50, 310.0) is not None  # 310 / 100 (step 40) >= 3


def test_nan_is_left_to_the_guards_other_checks_and_state_round_trips() -> None:
    rule = _rule()
    rule.observe("a", 0, 1.0)
    assert rule.observe("a", 10, float("nan")) is None
    assert rule.observe("a", 20, 100.0) is not None
    again = _rule()
    again.load_state_dict(rule.state_dict())
    again.observe("a", 30, 1.0)
    assert again.observe("a", 40, 1000.0) is None  # the cooldown survived the checkpoint


def test_a_non_finite_sample_is_never_the_reference_a_later_value_is_compared_with() -> None:
    rule = _rule()
    for value in (float("nan"), float("inf")):
        assert rule.observe("a", 0, value) is None  # a bad batch's logits: the NaN check's business
    assert rule.observe("a", 10, 60.0) is None  # no finite history yet: nothing to grow from
    assert rule.observe("a", 20, 65.0) is None  # 65 / 60: no growth, whatever came before
    assert rule.observe("b", 0, 1.0) is None
    assert rule.observe("b", 10, float("inf")) is None
