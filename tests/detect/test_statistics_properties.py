"""Properties of the guard's statistics over every finite series (hypothesis searches for the counterexample).

Any finite loss series (zeros, negatives, values crossing zero, subnormals, values near a dtype's
largest) keeps the spike threshold representable in the float32 the device compares with, never
raises, and flags only values above it; any finite max-logit series keeps the precursor rule
answering with JSON-safe findings. Counterexamples found once are kept as explicit ``@example``s.
"""

from __future__ import annotations

import json
import math

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.detect.precursors import LogitGrowthRule
from lightning_nanguard.detect.spikes import SpikeDetector

FLOAT32_MAX = torch.finfo(torch.float32).max
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

finite = st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=True)
everyday = st.one_of(
    finite,
    st.sampled_from([0.0, -0.0, 1e-30, 1e-40, 1e30, FLOAT32_MAX, -FLOAT32_MAX, 65504.0, 3.3e38]),
    st.floats(min_value=-10.0, max_value=10.0),
)
series = st.lists(everyday, min_size=0, max_size=80)


def _representable(threshold: float) -> bool:
    return threshold == math.inf or (math.isfinite(threshold) and abs(threshold) <= FLOAT32_MAX)


@settings(max_examples=300, deadline=None)
@given(values=series, dtype=st.sampled_from(DTYPES), refresh=st.integers(1, 4))
@example(values=[1.0] * 20 + [0.0] * 3 + [1.0] * 5, dtype=torch.float32, refresh=4)  # issue 32: a zero loss
@example(values=[-1.0, 0.5] * 20, dtype=torch.float32, refresh=1)  # losses crossing zero
@example(values=[1e-40] * 10 + [1e30] * 10, dtype=torch.float64, refresh=1)
def test_spike_threshold_stays_representable(values: list[float], dtype: torch.dtype, refresh: int) -> None:
    detector = SpikeDetector(warmup=4, window=16, recent=4, refresh_every=refresh)
    for value in values:
        loss = torch.tensor(value, dtype=torch.float64).to(dtype)  # what the model's dtype makes of it
        flag = detector.check(loss)
        stats = detector.stats()
        assert _representable(stats.threshold), stats
        assert flag.item() in (0.0, 1.0)
        as_float32 = float(loss.float())
        expected = math.isfinite(as_float32) and as_float32 > float(torch.tensor(stats.threshold).float())
        assert bool(flag.item()) == expected, (value, stats)
        detector.accept(not flag.item(), value=float(loss.double()))
    restored = SpikeDetector(warmup=4, window=16, recent=4)
    restored.load_state_dict(detector.state_dict())
    assert _representable(restored.stats().threshold)


@settings(max_examples=300, deadline=None)
@given(values=st.lists(everyday, max_size=60), every=st.integers(1, 10))
@example(values=[1e-300, 1e308], every=1)
@example(values=[-1e308, 1e308], every=1)
def test_precursor_rule_findings_are_json_safe(values: list[float], every: int) -> None:
    rule = LogitGrowthRule(min_logit=80.0, growth=2.0, window=20, cooldown=10)
    for index, value in enumerate(values):
        finding = rule.observe("attn", index * every, value)
        if finding is None:
            continue
        assert finding.value > 80.0 and finding.ratio >= 2.0
        event = NanEvent(finding.step, 0, finding.step, 0, ("precursor",), "warned", details={"growth": finding.ratio})
        json.dumps(event.to_dict(), allow_nan=False)  # events.jsonl never refuses a finding
    rule.load_state_dict(rule.state_dict())


@given(value=st.one_of(st.just(math.nan), st.just(math.inf), st.just(-math.inf), finite))
def test_event_details_are_json_safe_whatever_the_values(value: float) -> None:
    event = NanEvent(1, 0, 1, 0, ("loss_spike",), "skipped", details={"ratio": value, "nested": {"x": [value]}})
    line = json.dumps(event.to_dict(), allow_nan=False)
    back = NanEvent.from_dict(json.loads(line))
    ratio = back.details["ratio"]
    assert (float(ratio) == value) or (math.isnan(value) and math.isnan(float(ratio)))
