"""SpikeDetector: flags on spikes, silence on noise, warm-up, re-baseline, device-side accept, checkpoints."""

from __future__ import annotations

import copy
import io
import math
from collections.abc import Iterable

import pytest
import torch
import torch.nn.functional as F
from host_reads import HostReadCounter
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_nanguard.detect.spikes import SpikeDetector, SpikeStats, _Changes, _Statistic


def feed(detector: SpikeDetector, values: Iterable[float], dtype: torch.dtype = torch.float32) -> list[int]:
    """Check each value, accept it unless flagged (then report the spike); return the flagged positions."""
    flagged = []
    for i, value in enumerate(values):
        flag = detector.check(torch.tensor(value, dtype=dtype))
        spike = bool(flag.item())
        if spike:
            flagged.append(i)
            detector.record_spike()
        detector.accept(not spike and math.isfinite(value))
    return flagged


def noisy(n: int, level: float = 1.0, relative_noise: float = 0.1, seed: int = 0) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (level * torch.exp(relative_noise * torch.randn(n, generator=g, dtype=torch.float64))).tolist()


def warmed(values: Iterable[float] | None = None, **kwargs: object) -> SpikeDetector:
    detector = SpikeDetector(**kwargs)  # type: ignore[arg-type]
    assert feed(detector, noisy(200) if values is None else values) == []
    return detector


# ---------------------------------------------------------------------------- what is a spike


@pytest.mark.parametrize("factor", [5.0, 100.0, 1e5])
def test_flags_a_spike(factor: float) -> None:
    detector = warmed()
    flag = detector.check(torch.tensor(factor))
    assert flag.dtype == torch.float32 and flag.shape == (1,)
    assert flag.item() == 1.0


def test_noise_is_not_a_spike() -> None:
    detector = SpikeDetector()
    assert feed(detector, noisy(3000, relative_noise=0.3, seed=1)) == []


def test_one_sided_a_drop_is_not_a_spike() -> None:
    detector = warmed()
    for value in (1e-3, 1e-9, 0.0, -5.0):
        assert detector.check(torch.tensor(value)).item() == 0.0


def test_a_spike_needs_min_ratio_times_the_baseline_on_a_flat_loss() -> None:
    detector = warmed([2.0] * 40)  # no noise at all: the spread is 0, the min_ratio floor decides
    assert detector.check(torch.tensor(2.0 * 2.9)).item() == 0.0
    assert detector.check(torch.tensor(2.0 * 3.1)).item() == 1.0
    assert detector.stats().threshold == pytest.approx(6.0)


def test_fast_falling_loss_is_not_a_spike_and_a_spike_during_the_fall_is() -> None:
    values = [5.0 * 0.97**i * v for i, v in enumerate(noisy(300, relative_noise=0.05))]  # 9,000x fall
    detector = warmed(values)
    assert values[-1] < 5.0 / 5000
    assert detector.check(torch.tensor(values[-1] * 100)).item() == 1.0


def test_heavy_tailed_small_batch_losses_are_not_spikes() -> None:
    """Per-sample cross-entropy of a trained classifier spans orders of magnitude: log-normal, sigma 2."""
    detector = SpikeDetector()
    assert feed(detector, noisy(3000, level=0.05, relative_noise=2.0, seed=3)) == []
    assert detector.check(torch.tensor(0.05 * 1e8)).item() == 1.0


def test_periodic_batches_are_not_spikes() -> None:
    """An unshuffled small dataset: the same hard batch comes back every 4th step."""
    detector = SpikeDetector()
    values = [(2.5 if i % 4 == 3 else 1.0) * v for i, v in enumerate(noisy(400, relative_noise=0.02))]
    assert feed(detector, values) == []


def test_negative_losses_use_a_linear_scale() -> None:
    detector = warmed([-3.0 + 0.1 * v for v in noisy(200, relative_noise=1.0)])
    assert detector.check(torch.tensor(-2.9)).item() == 0.0
    assert detector.check(torch.tensor(1e3)).item() == 1.0
    stats = detector.stats()
    assert stats.scale == "linear" and stats.baseline < 0 and stats.threshold > stats.baseline


def test_losses_that_are_mostly_exactly_zero_never_flag() -> None:
    """A hinge-type loss: zero on most steps, so no spread can be measured; its rare positive steps train."""
    detector = SpikeDetector()
    values = [0.7 if i % 50 == 49 else 0.0 for i in range(300)]
    assert feed(detector, values) == []


# ---------------------------------------------------------------------------- NaN/Inf, warm-up, re-baseline


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nonfinite_is_not_a_spike_and_never_enters_the_history(value: float) -> None:
    detector = warmed()
    before = detector.state_dict()["history"]
    flag = detector.check(torch.tensor(value))
    assert flag.item() == 0.0
    detector.accept(flag == 0, value=value)
    assert detector.state_dict()["history"] == before
    detector.check(torch.tensor(value))
    detector.accept(True)  # a careless caller (and one that lets the detector read the value): still left out
    assert detector.state_dict()["history"] == before
    assert detector.check(torch.tensor(50.0)).item() == 1.0
    assert feed(detector, noisy(300, seed=8)) == []


def test_warmup_never_flags_and_activates_within_warmup_plus_refresh() -> None:
    detector = SpikeDetector(warmup=16, refresh_every=4)
    for i in range(16):
        assert detector.check(torch.tensor(1e6)).item() == 0.0, f"flagged after {i} accepted values"
        detector.check(torch.tensor(1.0 + 0.01 * (i % 3)))
        detector.accept(True)
    assert detector.check(torch.tensor(1e6)).item() == 1.0
    assert detector.stats().history == 16


@pytest.mark.parametrize("refresh_every", [1, 3, 4])
def test_active_after_at_most_twenty_healthy_steps(refresh_every: int) -> None:
    detector = SpikeDetector(refresh_every=refresh_every)
    accepted = 0
    while not detector.check(torch.tensor(1e6)).item():
        detector.check(torch.tensor(1.0))
        detector.accept(True)
        accepted += 1
    assert accepted <= 20


def test_rebaseline_after_five_spikes_in_a_row_then_the_new_level_is_normal() -> None:
    detector = warmed()
    shifted = [10.0 * v for v in noisy(60, seed=5)]  # a curriculum change: the loss is 10x for good
    results = []
    for value in shifted[:5]:
        assert detector.check(torch.tensor(value)).item() == 1.0
        results.append(detector.record_spike())
        detector.accept(False)
    assert results == [False, False, False, False, True]
    assert detector.rebaselines_total == 1 and detector.spikes_total == 5 and detector.consecutive_spikes == 0
    assert detector.state_dict()["history"] == []
    assert feed(detector, shifted[5:]) == []  # the new level is learnt, not skipped
    assert detector.check(torch.tensor(1e4)).item() == 1.0


def test_a_healthy_step_ends_a_run_of_spikes() -> None:
    detector = warmed()
    for _ in range(4):
        detector.check(torch.tensor(100.0))
        assert detector.record_spike() is False
        detector.accept(False)
    detector.check(torch.tensor(1.0))
    detector.accept(True)
    assert detector.consecutive_spikes == 0
    detector.check(torch.tensor(100.0))
    assert detector.record_spike() is False


# ---------------------------------------------------------------------------- device side, no host reads


def test_accept_tensor_or_read_value_like_accept_bool_with_the_value() -> None:
    values = [*noisy(100), 80.0, *noisy(30, seed=2), math.nan, *noisy(10, seed=4)]
    by_bool, by_tensor = SpikeDetector(), SpikeDetector()
    for value in values:
        flag = by_bool.check(torch.tensor(value))
        by_bool.accept(not flag.item() and math.isfinite(value))
        flag = by_tensor.check(torch.tensor(value))
        by_tensor.accept(flag == 0)  # reads the flag and the value; NaN is left out by the detector itself
    assert by_tensor.state_dict()["history"] == by_bool.state_dict()["history"]
    assert 80.0 not in by_tensor.state_dict()["history"]
    assert len(by_tensor.state_dict()["history"]) == 128


def test_check_and_accept_with_the_value_read_nothing_to_the_host() -> None:
    """The guard reads the flag and the loss with its step's one read, and hands the loss to accept()."""
    detector = SpikeDetector(refresh_every=1)
    counter = HostReadCounter()
    values = [*noisy(150), 1e5, *noisy(20, seed=1)]
    flagged = []
    with counter:
        for value in values:
            flag = detector.check(torch.tensor(value))
            flagged.append(flag)
            detector.accept(value < 1e4, value=value)  # the caller's flag, from its own read
    assert sum(counter.reads.values()) == 0, dict(counter.reads)
    assert [i for i, f in enumerate(flagged) if f.item()] == [150]
    with counter:  # the counter sees reads: without the value, accept() reads it
        detector.check(torch.tensor(1.0))
        detector.accept(True)
    assert sum(counter.reads.values()) == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_low_and_high_precision_losses(dtype: torch.dtype) -> None:
    detector = warmed()
    flag = detector.check(torch.tensor(1.0, dtype=dtype))
    assert flag.dtype == torch.float32 and flag.item() == 0.0
    detector.accept(True)
    assert detector.check(torch.tensor(60000.0, dtype=dtype)).item() == 1.0  # fp16 max is 65504
    detector.accept(False)
    assert feed(SpikeDetector(), noisy(200), dtype=dtype) == []


def test_grad_norm_is_watched_by_another_instance() -> None:
    loss, grad_norm = warmed(name="loss"), warmed([0.3 * v for v in noisy(200, seed=7)], name="grad_norm")
    assert grad_norm.check(torch.tensor(30.0)).item() == 1.0
    assert loss.check(torch.tensor(1.1)).item() == 0.0
    assert "grad_norm" in repr(grad_norm)


# ---------------------------------------------------------------------------- host side: stats, checkpoints


def test_stats_describe_the_crossed_threshold() -> None:
    detector = warmed([2.0] * 40)
    detector.check(torch.tensor(50.0))
    stats = detector.stats()
    assert isinstance(stats, SpikeStats)
    assert (stats.value, stats.baseline, stats.scale, stats.history) == (50.0, 2.0, "log", 40)
    assert stats.threshold == pytest.approx(6.0) and stats.ratio == pytest.approx(25.0)
    assert stats.spread == pytest.approx(math.log(3.0) / 6.0)  # no noise: the min_ratio floor
    details = detector.describe()
    assert set(details) == {"threshold", "baseline", "spread", "spread_scale", "ratio", "history"}
    detector.record_spike()
    detector.accept(False)
    for _ in range(4):  # re-baseline clears the history, not what the spike was measured against
        detector.check(torch.tensor(50.0))
        detector.record_spike()
    assert detector.rebaselines_total == 1
    assert detector.describe()["threshold"] == pytest.approx(6.0)


def test_stats_while_warming_up() -> None:
    detector = SpikeDetector()
    assert detector.stats().value is None
    detector.check(torch.tensor(1.0))
    stats = detector.stats()
    assert stats.threshold == math.inf and stats.history == 0 and stats.value == 1.0


def test_state_dict_round_trip_through_torch_save_weights_only() -> None:
    original = warmed(noisy(300))
    for _ in range(2):
        original.check(torch.tensor(1e3))
        original.record_spike()
        original.accept(False)
    buffer = io.BytesIO()
    torch.save({"spikes": original.state_dict()}, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)["spikes"]
    restored = SpikeDetector()
    restored.load_state_dict(state)
    assert restored.state_dict() == original.state_dict()
    assert (restored.consecutive_spikes, restored.spikes_total) == (2, 2)
    for value in [*noisy(50, seed=9), 5.0, 1e4, 0.9]:
        assert restored.check(torch.tensor(value)).item() == original.check(torch.tensor(value)).item()
        assert restored.stats().threshold == pytest.approx(original.stats().threshold)
        restored.accept(True)
        original.accept(True)


def test_load_state_dict_keeps_the_newest_values_and_defaults_missing_keys() -> None:
    detector = SpikeDetector(window=32)
    detector.load_state_dict({"history": [float(i) for i in range(1, 101)] + [math.nan]})
    assert detector.state_dict() == {
        "history": [float(i) for i in range(69, 101)],
        "consecutive_spikes": 0,
        "spikes_total": 0,
        "rebaselines_total": 0,
    }
    detector.load_state_dict({})
    assert detector.state_dict()["history"] == []


def test_copy_and_pickle_keep_the_history() -> None:
    detector = warmed()
    clone = copy.deepcopy(detector)
    assert clone.state_dict() == detector.state_dict()
    assert clone.check(torch.tensor(1e3)).item() == 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_history_follows_the_loss_to_the_gpu() -> None:
    detector = warmed()
    state = detector.state_dict()
    flag = detector.check(torch.tensor(1e3, device="cuda"))
    assert flag.device.type == "cuda" and flag.item() == 1.0
    detector.accept(False)
    restored = SpikeDetector()
    restored.load_state_dict(state)
    assert restored.check(torch.tensor(1e3, device="cuda")).item() == 1.0
    restored.accept(False)
    assert restored.state_dict() == state


# ---------------------------------------------------------------------------- bad input


def test_bad_input_gets_a_clear_error() -> None:
    detector = SpikeDetector()
    with pytest.raises(RuntimeError, match="check"):
        detector.accept(True)
    with pytest.raises(TypeError, match="floating-point"):
        detector.check(1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="floating-point"):
        detector.check(torch.tensor(1))
    with pytest.raises(ValueError, match="single loss value"):
        detector.check(torch.ones(4))
    for kwargs, name in [
        ({"window": 2}, "window"),
        ({"warmup": 1}, "warmup"),
        ({"sigmas": 0.0}, "sigmas"),
        ({"min_ratio": 0.5}, "min_ratio"),
        ({"min_ratio": math.inf}, "min_ratio"),
        ({"rebaseline_after": 0}, "rebaseline_after"),
        ({"refresh_every": True}, "refresh_every"),
    ]:
        with pytest.raises(ValueError, match=name):
            SpikeDetector(**kwargs)  # type: ignore[arg-type]


def test_a_small_window_caps_warmup_and_recent() -> None:
    detector = SpikeDetector(window=8)  # warmup 16 and recent 16 do not fit: both become 8
    assert (detector.warmup, detector.recent) == (8, 8)
    assert feed(detector, noisy(40)) == []
    assert detector.check(torch.tensor(1e3)).item() == 1.0


# ---------------------------------------------------------------------------- issue 10's label typos


def test_label_typo_regression_is_flagged_at_once_and_nothing_else() -> None:
    """Two labels 1e4 instead of ~1: the step loss jumps ~1e5x; skipping those steps keeps the weights."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    y = x @ (torch.randn(8, generator=g) / 3) + 0.1 * torch.randn(512, generator=g)
    typo_batches = (25, 40)
    y[typo_batches[0] * 8 + 2] = y[typo_batches[1] * 8 + 5] = 1e4
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    detector = SpikeDetector()
    flagged = []
    for step in range(64):
        xb, yb = x[step * 8 : step * 8 + 8], y[step * 8 : step * 8 + 8]
        optimizer.zero_grad()
        loss = F.mse_loss(model(xb).squeeze(-1), yb)
        loss.backward()
        spike = bool(detector.check(loss).item())
        detector.accept(not spike)
        if spike:
            flagged.append(step)
            assert detector.stats().ratio > 1e4
            continue
        optimizer.step()
    assert flagged == list(typo_batches)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_check_takes_any_one_element_value_and_keeps_no_graph(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    detector = SpikeDetector(warmup=2, refresh_every=1)
    for value in (1.0, 1.0, 1.0):
        tracked = torch.full(shape, value, dtype=dtype, requires_grad=True)
        flag = detector.check(tracked * 1)
        assert flag.shape == (1,) and flag.dtype == torch.float32 and not flag.requires_grad
        detector.accept(True)
    flag = detector.check(torch.full(shape, 1e4, dtype=dtype, requires_grad=True) * 1)
    assert flag.tolist() == [1.0] and detector.stats().value == float(torch.tensor(1e4, dtype=dtype))
    assert detector.check(torch.full(shape, math.inf, dtype=dtype)).tolist() == [0.0]


@pytest.mark.parametrize("scale", [1.0, 1e-38, 1e-42], ids=["normal", "float32-tiny", "float32-subnormal"])
def test_a_tiny_loss_scale_changes_nothing_in_what_is_a_spike(scale: float) -> None:
    """The statistic is relative: losses of 1e-38 (float32's subnormal range) are judged as losses of 1.

    Noisy healthy losses (log-normal, a factor of ~2 from step to step) flag the same steps at every
    scale; a floor of the logs above the losses made every change 0, and the min_ratio floor alone
    then flagged 31 of these 300 healthy steps at 1e-38 (none at 1).
    """
    generator = torch.Generator().manual_seed(3)
    flagged: dict[float, list[int]] = {}
    for factor in (1.0, scale):
        detector = SpikeDetector()
        flagged[factor] = []
        for step in range(300):
            noise = math.exp(0.8 * float(torch.randn((), generator=generator)))
            loss = torch.tensor(noise * factor, dtype=torch.float32)
            if detector.check(loss).item():
                flagged[factor].append(step)
            detector.accept(True, value=float(loss))
        assert detector.check(torch.tensor(1e4 * factor, dtype=torch.float32)).item() == 1.0
        generator.manual_seed(3)
    assert len(flagged[scale]) <= len(flagged[1.0]) + 2, flagged


@settings(max_examples=80, deadline=None)
@given(
    window=st.integers(3, 8),
    refresh_every=st.integers(1, 3),
    steps=st.lists(
        st.one_of(
            st.floats(-1e6, 1e6, allow_nan=False),
            st.sampled_from([0.0, -0.0, 5e-324, 1e-38, math.nan, math.inf, "rebaseline", "reload"]),
        ),
        max_size=40,
    ),
)
def test_the_changes_kept_as_values_arrive_are_the_sorted_changes_of_the_window(
    window: int, refresh_every: int, steps: list[float | str]
) -> None:
    """The statistic refreshed from the changes kept step by step equals the one sorted afresh from the window."""
    detector = SpikeDetector(window=window, warmup=3, recent=2, refresh_every=refresh_every)
    for step in steps:
        if step == "rebaseline":
            detector.reset()
        elif step == "reload":
            detector.load_state_dict(detector.state_dict())
        else:
            detector.check_value(float(step))
            detector.accept(True)
        history, logs = list(detector._history), list(detector._logs)
        afresh = _Changes.of(history, logs)
        assert (detector._changes.values, detector._changes.logs) == (afresh.values, afresh.logs)
        statistic = _Statistic.of(history, logs, 3, 2, detector.sigmas, detector.min_ratio)
        kept = _Statistic.of(history, logs, 3, 2, detector.sigmas, detector.min_ratio, detector._changes)
        assert kept == statistic
