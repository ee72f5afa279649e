"""Every built-in callback of Lightning 2.6.6 beside the guard, each on a run with a bad step (issue 22).

Each test fits a tiny model whose data holds one known bad sample (a NaN feature, a blank record
whose zero norm is divided by, or a label typo for the loss-spike guards) with ``NanGuard`` and the
callback, and asserts what matters for that callback. The reference is the same run without the
guard, with the bad step skipped by hand (:class:`feature_models.HandSkip`: every gradient dropped,
the BatchNorm buffers put back): the guarded run must match it bit for bit, which shows at once that
the bad step left no trace and that every healthy step, before and after it, behaved exactly as
without the guard. Loaders never shuffle: sample ``i`` sits in batch ``i // 8``.

The ``compat`` marker of each test is a row of the README's compatibility table
(``scripts/compat_table.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import build_trainer, states_equal
from feature_models import (
    BATCH,
    BatchNormRegression,
    EpochData,
    Finetunable,
    FollowEpoch,
    HandSkip,
    RecordingLogger,
    bn_regression,
    finetune_data,
    loader,
    regression_data,
    state,
)
from models import NAMESPACES
from torch.utils.data import Dataset

from lightning_nanguard import NanGuard

BAD = 43  # batch 5 (position 3) of every epoch: global step 5 + 8 * epoch


def guard() -> NanGuard:
    return NanGuard(verbose=False, save_repro=False)


def fit(
    root: Path,
    module: Any,
    data: Dataset | Any,
    callbacks: list[Any],
    nan_guard: NanGuard | None,
    ns: str = "lightning",
    **trainer_kwargs: Any,
) -> Any:
    """Fit ``module`` on ``data`` (a dataset, or a loader) with ``callbacks`` (and ``nan_guard`` first); the trainer."""
    every = [nan_guard, *callbacks] if nan_guard is not None else callbacks
    trainer = build_trainer(ns, root, callbacks=every, **trainer_kwargs)
    trainer.fit(module, data if not isinstance(data, Dataset) else loader(data))
    if nan_guard is not None:
        assert nan_guard.active, "NanGuard disabled itself after an internal error (see the log)"
    return trainer


def all_finite(values: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(v.float()).all()) for v in values.values())


def skipped(nan_guard: NanGuard) -> list[tuple[int, str]]:
    return [(e.global_step, e.action) for e in nan_guard.events]


# ------------------------------------------------------------------------------------ weight averaging


@pytest.mark.compat(
    feature="StochasticWeightAveraging",
    kind="callback",
    status="works",
    note="a NaN step in an SWA epoch is absent from the averaged weights",
)
@pytest.mark.parametrize("ns_name", list(NAMESPACES))
def test_swa_averages_without_the_bad_training_step(ns_name: str, tmp_path: Path) -> None:
    """Epochs 1-2 average (swa_epoch_start=2), epoch 3 is SWA's BatchNorm epoch; a NaN in epoch 1's batch 5 only."""
    swa = NAMESPACES[ns_name].callbacks.StochasticWeightAveraging

    def run(root: Path, nan_guard: NanGuard | None, hand: HandSkip | None) -> Any:
        data = EpochData({1: (BAD,)})
        module = bn_regression(ns_name, optimizer="sgd", lr=0.05)
        callbacks = [FollowEpoch(data), swa(swa_lrs=0.02, swa_epoch_start=2), *([hand] if hand else [])]
        fit(root, module, data, callbacks, nan_guard, ns=ns_name, max_epochs=3)
        return module

    nan_guard = guard()
    module = run(tmp_path / "guarded", nan_guard, None)
    assert skipped(nan_guard) == [(13, "skipped")]
    hand = HandSkip(steps=[13])
    reference = run(tmp_path / "reference", None, hand)
    assert hand.skipped == [13]
    assert all_finite(state(module))
    assert states_equal(state(module), state(reference))  # averaged weights and BatchNorm epoch, bit for bit


@pytest.mark.compat(
    feature="StochasticWeightAveraging",
    kind="callback",
    status="works",
    note="SWA's forward-only BatchNorm epoch recomputes the statistics from the finite batches only",
)
def test_swa_batchnorm_epoch_leaves_out_the_bad_batch(tmp_path: Path) -> None:
    """The NaN sample in every epoch: steps 5, 13, 21 are skipped, and batch 5 of SWA's BatchNorm epoch (epoch 3).

    That epoch runs ``training_step`` with no backward on new ``running_mean``/``running_var`` tensors
    (``momentum=None``: a cumulative average): the statistics must be those of the seven finite batches.
    """

    def run(root: Path, nan_guard: NanGuard | None, hand: HandSkip | None) -> Any:
        module = bn_regression(optimizer="sgd", lr=0.05)
        callbacks = [pl.callbacks.StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=2), *([hand] if hand else [])]
        fit(root, module, regression_data(nan_at=(BAD,)), callbacks, nan_guard, max_epochs=3)
        return module

    nan_guard = guard()
    module = run(tmp_path / "guarded", nan_guard, None)
    reference = run(tmp_path / "reference", None, HandSkip(steps=[5, 13, 21], forward_only=[(3, 5)]))
    assert skipped(nan_guard)[:3] == [(5, "skipped"), (13, "skipped"), (21, "skipped")]
    assert all_finite(state(module)), {k: v for k, v in state(module).items() if not torch.isfinite(v.float()).all()}
    params, buffers = dict(module.named_parameters()), dict(module.named_buffers())
    assert states_equal({k: p.detach() for k, p in params.items()}, dict(reference.named_parameters()))
    for name, expected in reference.named_buffers():
        torch.testing.assert_close(buffers[name], expected, msg=name)  # from the seven finite batches


def _averaging(kind: str) -> Any:
    if kind == "EMAWeightAveraging":
        return pl.callbacks.EMAWeightAveraging(decay=0.9)
    return pl.callbacks.WeightAveraging()  # the equal-weight average of every step (SWA) by default


AVERAGED = "the averaged weights and BatchNorm buffers leave out the skipped step"


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param(kind, marks=pytest.mark.compat(feature=kind, kind="callback", status="works", note=AVERAGED))
        for kind in ("EMAWeightAveraging", "WeightAveraging")
    ],
)
def test_weight_averaging_excludes_the_skipped_step(kind: str, tmp_path: Path) -> None:
    """The average is updated after every step (BatchNorm buffers too) and copied into the model at the end."""
    nan_guard = guard()
    module = bn_regression()
    fit(tmp_path / "guarded", module, regression_data(nan_at=(BAD,)), [_averaging(kind)], nan_guard, max_epochs=2)
    assert skipped(nan_guard) == [(5, "skipped"), (13, "skipped")]
    reference = bn_regression()
    hand = HandSkip(steps=[5, 13])
    fit(tmp_path / "reference", reference, regression_data(nan_at=(BAD,)), [_averaging(kind), hand], None, max_epochs=2)
    assert all_finite(state(module))
    assert states_equal(state(module), state(reference))


# ------------------------------------------------------------------------------------ model surgery


def _pruning(module: Any) -> Any:
    """L1 pruning of both Linear weights at every epoch end (``weight`` becomes ``weight_orig`` and a mask)."""
    layers = [(module.net[0], "weight"), (module.net[3], "weight")]
    return pl.callbacks.ModelPruning("l1_unstructured", amount=0.25, parameters_to_prune=layers, verbose=0)


@pytest.mark.compat(
    feature="ModelPruning",
    kind="callback",
    status="works",
    note="a NaN step after pruning (gradients on `weight_orig`) is skipped; masks and weights as without it",
)
def test_model_pruning_skips_a_bad_step_on_the_pruned_weights(tmp_path: Path) -> None:
    """Pruned at the end of epoch 0 (and reset, lottery ticket): step 13 trains ``weight_orig`` through the mask."""
    nan_guard = guard()
    module = bn_regression()
    fit(tmp_path / "guarded", module, regression_data(nan_at=(BAD,)), [_pruning(module)], nan_guard, max_epochs=2)
    assert skipped(nan_guard) == [(5, "skipped"), (13, "skipped")]
    reference = bn_regression()
    hand = HandSkip(steps=[5, 13])
    fit(
        tmp_path / "reference",
        reference,
        regression_data(nan_at=(BAD,)),
        [_pruning(reference), hand],
        None,
        max_epochs=2,
    )
    assert all_finite(state(module))
    assert states_equal(state(module), state(reference))  # pruning made permanent at the end: masked weights
    assert int((module.net[0].weight == 0).sum()) >= 8  # really pruned (a quarter of 32, twice)


@pytest.mark.compat(
    feature="ModelPruning",
    kind="callback",
    status="works",
    note="the event names the pruned parameter `weight_orig`",
)
def test_model_pruning_event_names_weight_orig(tmp_path: Path) -> None:
    nan_guard = guard()
    module = bn_regression()
    fit(tmp_path, module, regression_data(nan_at=(BAD,)), [_pruning(module)], nan_guard, max_epochs=2)
    before, after = nan_guard.events
    assert "net.0.weight" in before.nonfinite_grads and "net.0.weight_orig" not in before.nonfinite_grads
    assert "net.0.weight_orig" in after.nonfinite_grads and "net.0.weight" not in after.nonfinite_grads


@pytest.mark.compat(
    feature="BackboneFinetuning",
    kind="callback",
    status="works",
    note="a NaN gradient in a backbone parameter unfrozen mid-run (a new parameter group) is caught and skipped",
)
def test_backbone_finetuning_catches_nan_in_a_newly_unfrozen_parameter(tmp_path: Path) -> None:
    """A blank sample: harmless while the backbone is frozen (epoch 0), NaN in ``backbone.weight.grad`` after."""

    def run(root: Path, nan_guard: NanGuard | None, hand: HandSkip | None) -> Any:
        module = Finetunable()
        finetuning = pl.callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5)
        callbacks = [finetuning, *([hand] if hand else [])]
        trainer = fit(root, module, finetune_data(blank_at=(BAD,)), callbacks, nan_guard, max_epochs=2)
        assert len(trainer.optimizers[0].param_groups) == 2  # the backbone's group was added at epoch 1
        return module

    nan_guard = guard()
    module = run(tmp_path / "guarded", nan_guard, None)
    assert skipped(nan_guard) == [(13, "skipped")]  # epoch 0 saw the blank sample too, with the backbone frozen
    assert nan_guard.events[0].nonfinite_grads == ("backbone.weight",)
    reference = run(tmp_path / "reference", None, HandSkip(steps=[13]))
    assert all_finite(state(module))
    assert states_equal(state(module), state(reference))


# ------------------------------------------------------------------------------------ tuners


@pytest.mark.compat(
    feature="BatchSizeFinder",
    kind="callback",
    status="works",
    note="the same batch size is found (a bad step in a trial run too); the fit that follows skips its bad steps",
)
def test_batch_size_finder_finds_the_same_size(tmp_path: Path) -> None:
    """Trials of 2 steps at batch sizes 2, 4, 8; sample 3 is in the trial at size 2 (its step 1), 43 only in the fit.

    Lightning runs the trials with no callback (the guard neither) and restores the model after them.
    """

    def run(root: Path, nan_guard: NanGuard | None, hand: HandSkip | None) -> tuple[Any, Any]:
        module = BatchNormRegression(batch_size=2)
        module.data = regression_data(nan_at=(3, BAD))
        finder = pl.callbacks.BatchSizeFinder(mode="power", steps_per_trial=2, init_val=2, max_trials=3)
        fit(root, module, None, [finder, *([hand] if hand else [])], nan_guard)
        return module, finder

    nan_guard = guard()
    module, finder = run(tmp_path / "guarded", nan_guard, None)
    assert finder.optimal_batch_size == module.batch_size == 8
    fit_steps = [0, 5]  # the fit at 8 a batch: samples 3 and 43 sit in batches 0 and 5
    assert skipped(nan_guard) == [(step, "skipped") for step in fit_steps]
    reference, reference_finder = run(tmp_path / "reference", None, HandSkip(steps=fit_steps))
    assert reference_finder.optimal_batch_size == 8
    assert all_finite(state(module))
    assert states_equal(state(module), state(reference))


@pytest.mark.compat(
    feature="LearningRateFinder",
    kind="callback",
    status="works",
    note="the finder's losses and suggested learning rate are bit for bit those found without the guard",
)
def test_learning_rate_finder_result_is_unaffected(tmp_path: Path) -> None:
    """The finder runs 20 steps on batches 0-19 (healthy); the fit that follows meets the NaN sample in batch 25."""
    bad = 25 * BATCH + 3

    def run(root: Path, nan_guard: NanGuard | None, hand: HandSkip | None) -> tuple[Any, Any]:
        module = bn_regression(lr=1e-3)
        finder = pl.callbacks.LearningRateFinder(min_lr=1e-4, max_lr=0.5, num_training_steps=20)
        data = regression_data(nan_at=(bad,), n=32 * BATCH)
        fit(root, module, data, [finder, *([hand] if hand else [])], nan_guard)
        return module, finder

    nan_guard = guard()
    module, finder = run(tmp_path / "guarded", nan_guard, None)
    assert skipped(nan_guard) == [(25, "skipped")]
    reference, reference_finder = run(tmp_path / "reference", None, HandSkip(steps=[25]))
    assert len(finder.optimal_lr.results["loss"]) == 20
    assert finder.optimal_lr.results == reference_finder.optimal_lr.results
    assert module.lr == reference.lr == finder.optimal_lr.suggestion() != 1e-3  # the suggestion was applied
    assert all_finite(state(module))
    assert states_equal(state(module), state(reference))


# ------------------------------------------------------------------------------------ schedules and monitors


@pytest.mark.compat(
    feature="GradientAccumulationScheduler",
    kind="callback",
    status="works",
    note="when accumulation starts mid-run, a bad micro-batch drops its whole accumulated step",
)
def test_gradient_accumulation_scheduler(tmp_path: Path) -> None:
    """One batch a step in epoch 0, two from epoch 1: batch 5 of epoch 1 is the second micro-batch of step 10."""

    def run(root: Path, nan_guard: NanGuard | None, hand: HandSkip | None) -> Any:
        module = bn_regression()
        schedule = pl.callbacks.GradientAccumulationScheduler(scheduling={0: 1, 1: 2})
        trainer = fit(
            root, module, regression_data(nan_at=(BAD,)), [schedule, *([hand] if hand else [])], nan_guard, max_epochs=2
        )
        assert trainer.global_step == 8 + 4
        return module

    nan_guard = guard()
    module = run(tmp_path / "guarded", nan_guard, None)
    assert skipped(nan_guard) == [(5, "skipped"), (10, "skipped")]
    assert nan_guard.events[1].details["micro_batch"] == 1
    reference = run(tmp_path / "reference", None, HandSkip(steps=[5, 10]))
    assert all_finite(state(module))
    assert states_equal(state(module), state(reference))


@pytest.mark.compat(
    feature="LearningRateMonitor",
    kind="callback",
    status="works",
    note="the logged learning rates are those without the guard (a skipped step still steps the scheduler)",
)
def test_learning_rate_monitor_logs_the_same_rates(tmp_path: Path) -> None:
    def run(root: Path, nan_guard: NanGuard | None, hand: HandSkip | None) -> tuple[Any, Any, RecordingLogger]:
        module = bn_regression(scheduler=True)
        monitor = pl.callbacks.LearningRateMonitor(logging_interval="step")
        logger = RecordingLogger(str(root))
        callbacks = [monitor, *([hand] if hand else [])]
        fit(root, module, regression_data(nan_at=(BAD,)), callbacks, nan_guard, max_epochs=2, logger=logger)
        return module, monitor, logger

    nan_guard = guard()
    module, monitor, logger = run(tmp_path / "guarded", nan_guard, None)
    assert skipped(nan_guard) == [(5, "skipped"), (13, "skipped")]
    reference, reference_monitor, reference_logger = run(tmp_path / "reference", None, HandSkip(steps=[5, 13]))
    assert monitor.lrs == reference_monitor.lrs and len(monitor.lrs["lr-Adam"]) == 16
    assert monitor.lrs["lr-Adam"][:7] == [0.01] * 3 + [0.005] * 3 + [0.0025]  # halved every 3 steps, step 5 included
    rates = [(step, m["lr-Adam"]) for step, m in logger.logged if "lr-Adam" in m]
    assert rates == [(step, m["lr-Adam"]) for step, m in reference_logger.logged if "lr-Adam" in m]
    assert states_equal(state(module), state(reference))


@pytest.mark.compat(
    feature="DeviceStatsMonitor",
    kind="callback",
    status="works",
    note="the stats are logged before and after every batch, the skipped one included",
)
def test_device_stats_monitor_logs_every_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``psutil`` is not in the test environment: the CPU accelerator's stats are stubbed, the monitor's code runs."""
    import lightning.pytorch.callbacks.device_stats_monitor as device_stats_monitor

    monkeypatch.setattr(device_stats_monitor, "_PSUTIL_AVAILABLE", True)
    monkeypatch.setattr(pl.accelerators.CPUAccelerator, "get_device_stats", lambda self, device: {"cpu_percent": 1.0})

    def run(root: Path, nan_guard: NanGuard | None, hand: HandSkip | None) -> tuple[Any, RecordingLogger]:
        module, logger = bn_regression(), RecordingLogger(str(root))
        callbacks = [pl.callbacks.DeviceStatsMonitor(), *([hand] if hand else [])]
        fit(root, module, regression_data(nan_at=(BAD,)), callbacks, nan_guard, logger=logger)
        return module, logger

    nan_guard = guard()
    module, logger = run(tmp_path / "guarded", nan_guard, None)
    assert skipped(nan_guard) == [(5, "skipped")]
    reference, reference_logger = run(tmp_path / "reference", None, HandSkip(steps=[5]))
    stats = logger.keys("DeviceStatsMonitor")
    assert stats == reference_logger.keys("DeviceStatsMonitor")
    start, end = (
        ("DeviceStatsMonitor.on_train_batch_start/cpu_percent",),
        ("DeviceStatsMonitor.on_train_batch_end/cpu_percent",),
    )
    assert stats == [(step, key) for step in range(8) for key in (start, end)]
    assert states_equal(state(module), state(reference))


@pytest.mark.compat(
    feature="ThroughputMonitor",
    kind="callback",
    status="works",
    note="batches and samples are counted as without the guard, the skipped step included",
)
def test_throughput_monitor_counts_the_same(tmp_path: Path) -> None:
    def run(root: Path, nan_guard: NanGuard | None, hand: HandSkip | None) -> tuple[Any, RecordingLogger]:
        module, logger = bn_regression(), RecordingLogger(str(root))
        monitor = pl.callbacks.ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0), window_size=2)
        fit(
            root, module, regression_data(nan_at=(BAD,)), [monitor, *([hand] if hand else [])], nan_guard, logger=logger
        )
        return module, logger

    def counts(logger: RecordingLogger) -> list[tuple[int | None, dict[str, float]]]:
        wanted = ("train/batches", "train/samples")
        return [(step, {k: m[k] for k in wanted}) for step, m in logger.logged if "train/samples" in m]

    nan_guard = guard()
    module, logger = run(tmp_path / "guarded", nan_guard, None)
    assert skipped(nan_guard) == [(5, "skipped")]
    reference, reference_logger = run(tmp_path / "reference", None, HandSkip(steps=[5]))
    assert counts(logger) == counts(reference_logger)
    assert counts(logger) == [(s, {"train/batches": s + 1, "train/samples": (s + 1) * BATCH}) for s in range(8)]
    assert logger.keys("train/") == reference_logger.keys("train/")
    assert states_equal(state(module), state(reference))


@pytest.mark.compat(feature="Timer", kind="callback", status="works", note="a bad step is timed and skipped")
def test_timer_runs_through_a_skipped_step(tmp_path: Path) -> None:
    def run(root: Path, nan_guard: NanGuard | None, hand: HandSkip | None) -> tuple[Any, Any, Any]:
        module, timer = bn_regression(), pl.callbacks.Timer(duration={"days": 1}, interval="step")
        trainer = fit(root, module, regression_data(nan_at=(BAD,)), [timer, *([hand] if hand else [])], nan_guard)
        return module, timer, trainer

    nan_guard = guard()
    module, timer, trainer = run(tmp_path / "guarded", nan_guard, None)
    assert skipped(nan_guard) == [(5, "skipped")]
    assert trainer.global_step == 8 and timer.time_elapsed("train") > 0 and timer.time_remaining("train") > 0
    reference, _, _ = run(tmp_path / "reference", None, HandSkip(steps=[5]))
    assert states_equal(state(module), state(reference))
