"""Every built-in callback of Lightning 2.6.6 beside the guard, each on a run with a bad step (issue 22).

Each test fits a tiny model whose data holds one known bad sample (a NaN feature, a blank record
whose zero norm is divided by, or a label typo for the loss-spike guards) with ``NanGuard`` and the
callback, and asserts what matters for that callback. The reference is the same run without the
guard, with the bad step skipped by hand (:class:`feature_models.HandSkip`: every gradient dropped,
the BatchNorm buffers put back): the guarded run must match it bit for bit, which shows at once that
the bad step left no trace and that every healthy step, before and after it, behaved exactly as
without the guard. Loaders never shuffle: sample ``i`` sits in batch ``i // 8``.

The ``compat`` marker of each test is a row of the compatibility table (docs/guide/compatibility.md)
(``scripts/compat_table.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fitting
import lightning.pytorch as pl
import pytest
import torch
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
from fitting import StepRecorder
from lightning.fabric.utilities.spike import TrainingSpikeException
from models import NAMESPACES
from states import states_equal
from torch.utils.data import Dataset

from lightning_nanguard import NanGuard, NonFiniteTrainingError

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
    train = data if not isinstance(data, Dataset) else loader(data)
    fitted = fitting.fit(
        module, train, root=root, guard=nan_guard, callbacks=callbacks, ns=ns, require_active=True, **trainer_kwargs
    )
    return fitted.trainer


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
    assert skipped(nan_guard) == [(5, "skipped"), (13, "skipped"), (21, "skipped"), (24, "skipped")]
    batchnorm_epoch = nan_guard.events[3]  # batch 5 of epoch 3, reported as no training step
    assert (batchnorm_epoch.epoch, batchnorm_epoch.batch_idx, batchnorm_epoch.kinds) == (3, 5, ("bn_stats",))
    assert "forward_only" in batchnorm_epoch.details
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
    """The finder runs 20 steps on batches 0-19 (healthy); the fit that follows meets the NaN sample in batch 25.

    Lightning runs the search with its own callback only (the guard's hooks are off, its strategy wrapper stays).
    """
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
@pytest.mark.filterwarnings("ignore:When using the `ThroughputMonitor`")  # no FLOPs: not what is tested
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


# ------------------------------------------------------------------------------------ checkpoints and stopping


@pytest.mark.compat(
    feature="OnExceptionCheckpoint",
    kind="callback",
    status="works",
    note="when the guard raises at a bad step, the checkpoint saved on the exception holds the weights before it",
)
def test_on_exception_checkpoint_when_the_guard_raises(tmp_path: Path, recorder: StepRecorder) -> None:
    nan_guard = NanGuard(verbose=False, save_repro=False, action="raise")
    on_exception = pl.callbacks.OnExceptionCheckpoint(dirpath=tmp_path / "exception")
    module = bn_regression()
    with pytest.raises(NonFiniteTrainingError):
        data = regression_data(nan_at=(BAD,))
        fit(tmp_path, module, data, [recorder, on_exception], nan_guard, enable_checkpointing=True)
    assert skipped(nan_guard) == [(5, "raised")]
    saved = torch.load(tmp_path / "exception" / "on_exception.ckpt", weights_only=True)
    assert saved["global_step"] == 5
    before = recorder.by_step(5)
    assert all_finite(saved["state_dict"])
    assert states_equal(saved["state_dict"], {**before.params_before, **before.buffers_before})
    assert states_equal(saved["optimizer_states"][0], before.optimizer_before)


@pytest.mark.compat(
    feature="OnExceptionCheckpoint",
    kind="callback",
    status="works",
    note="a user's exception after a skipped step saves the weights without that step",
)
def test_on_exception_checkpoint_after_a_skipped_step(tmp_path: Path) -> None:
    """The run is interrupted at batch 6 (a ``LambdaCallback`` raising); step 5 before it was skipped."""

    class Interrupted(Exception):
        pass

    def interrupt(trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 6:
            raise Interrupted

    def run(root: Path, nan_guard: NanGuard | None, hand: HandSkip | None) -> dict[str, Any]:
        on_exception = pl.callbacks.OnExceptionCheckpoint(dirpath=root / "exception")
        callbacks = [
            pl.callbacks.LambdaCallback(on_train_batch_start=interrupt),
            on_exception,
            *([hand] if hand else []),
        ]
        with pytest.raises(Interrupted):
            fit(root, bn_regression(), regression_data(nan_at=(BAD,)), callbacks, nan_guard, enable_checkpointing=True)
        return torch.load(root / "exception" / "on_exception.ckpt", weights_only=True)  # type: ignore[no-any-return]

    nan_guard = guard()
    saved = run(tmp_path / "guarded", nan_guard, None)
    assert skipped(nan_guard) == [(5, "skipped")] and saved["global_step"] == 6
    reference = run(tmp_path / "reference", None, HandSkip(steps=[5]))
    assert all_finite(saved["state_dict"])
    assert states_equal(saved["state_dict"], reference["state_dict"])
    assert states_equal(saved["optimizer_states"], reference["optimizer_states"])


@pytest.mark.compat(
    feature="ModelCheckpoint",
    kind="callback",
    status="works",
    note="checkpoints every n steps and at epoch ends hold no NaN and no trace of the skipped step",
)
def test_model_checkpoint_every_n_steps_and_at_epoch_end(tmp_path: Path) -> None:
    """Every 3 steps (step 6 is saved right after the skipped step 5) and at the end of both epochs (steps 8, 16)."""

    def run(root: Path, nan_guard: NanGuard | None, hand: HandSkip | None) -> dict[str, dict[str, Any]]:
        steps = pl.callbacks.ModelCheckpoint(
            dirpath=root / "ckpt",
            filename="s{step}",
            every_n_train_steps=3,
            save_top_k=-1,
            auto_insert_metric_name=False,
        )
        epochs = pl.callbacks.ModelCheckpoint(
            dirpath=root / "ckpt", filename="e{epoch}", save_on_train_epoch_end=True, save_top_k=-1
        )
        callbacks = [steps, epochs, *([hand] if hand else [])]
        data = regression_data(nan_at=(BAD,))
        fit(root, bn_regression(), data, callbacks, nan_guard, max_epochs=2, enable_checkpointing=True)
        return {p.name: torch.load(p, weights_only=True) for p in sorted((root / "ckpt").glob("*.ckpt"))}

    nan_guard = guard()
    saved = run(tmp_path / "guarded", nan_guard, None)
    assert skipped(nan_guard) == [(5, "skipped"), (13, "skipped")]
    reference = run(tmp_path / "reference", None, HandSkip(steps=[5, 13]))
    assert sorted(saved) == sorted(reference) and len(saved) == 7  # steps 3, 6, 9, 12, 15; epochs 0, 1
    assert {name: c["global_step"] for name, c in saved.items()}["s6.ckpt"] == 6
    for name, checkpoint in saved.items():
        assert all_finite(checkpoint["state_dict"]), name
        assert states_equal(checkpoint["state_dict"], reference[name]["state_dict"]), name
        assert states_equal(checkpoint["optimizer_states"], reference[name]["optimizer_states"]), name


def _early_stopping() -> Any:
    """Stops when the loss of an epoch's last step (a step metric: ``train_loss``, ``on_step=True``) stops falling."""
    return pl.callbacks.EarlyStopping(monitor="train_loss", patience=1, mode="min", check_on_train_epoch_end=True)


@pytest.mark.compat(
    feature="EarlyStopping",
    kind="callback",
    status="works",
    note="on a step metric, the decisions (best score, wait, stop epoch) are those without the guard",
)
def test_early_stopping_on_a_step_metric(tmp_path: Path) -> None:
    """Six epochs with a NaN at batch 5 of each; the monitor reads the loss of each epoch's last (healthy) step."""

    def run(root: Path, nan_guard: NanGuard | None, hand: HandSkip | None) -> tuple[Any, Any, Any]:
        module, stopping = bn_regression(lr=0.05), _early_stopping()
        data = regression_data(nan_at=(BAD,))
        trainer = fit(root, module, data, [stopping, *([hand] if hand else [])], nan_guard, max_epochs=6)
        return module, stopping, trainer

    nan_guard = guard()
    module, stopping, trainer = run(tmp_path / "guarded", nan_guard, None)
    steps = [5 + 8 * epoch for epoch in range(trainer.current_epoch)]
    assert skipped(nan_guard) == [(step, "skipped") for step in steps]
    reference, reference_stopping, reference_trainer = run(tmp_path / "reference", None, HandSkip(steps=steps))
    assert stopping.stopped_epoch == reference_stopping.stopped_epoch
    assert (stopping.wait_count, stopping.best_score) == (reference_stopping.wait_count, reference_stopping.best_score)
    assert trainer.current_epoch == reference_trainer.current_epoch and torch.isfinite(stopping.best_score)
    assert states_equal(state(module), state(reference))


@pytest.mark.compat(
    feature="EarlyStopping",
    kind="callback",
    status="works",
    note="a skipped last step of an epoch does not stop the run: the monitor reads the last applied step's value",
)
def test_early_stopping_on_a_step_metric_is_not_stopped_by_a_skipped_last_step(tmp_path: Path) -> None:
    """The NaN sits in the last batch of every epoch (sample 59, steps 7, 15, 23): skipped, it must not stop the run."""
    nan_guard, stopping = guard(), _early_stopping()
    trainer = fit(tmp_path, bn_regression(), regression_data(nan_at=(59,)), [stopping], nan_guard, max_epochs=3)
    assert skipped(nan_guard)[0] == (7, "skipped")
    assert trainer.current_epoch == 3 and stopping.stopped_epoch == 0
    assert torch.isfinite(stopping.best_score)


# ------------------------------------------------------------------------------------ display


@pytest.mark.compat(
    feature="RichProgressBar",
    kind="callback",
    status="works",
    note="the bar shows the guard's skip count; training as without the guard",
)
def test_rich_progress_bar(tmp_path: Path, recorder: StepRecorder) -> None:
    def run(root: Path, nan_guard: NanGuard | None, hand: HandSkip | None) -> tuple[Any, Any]:
        module, bar = bn_regression(), pl.callbacks.RichProgressBar()
        callbacks = [bar, recorder if nan_guard else HandSkip(), *([hand] if hand else [])]
        trainer = fit(root, module, regression_data(nan_at=(BAD,)), callbacks, nan_guard, enable_progress_bar=True)
        assert trainer.progress_bar_callback is bar
        return module, trainer

    nan_guard = guard()
    module, trainer = run(tmp_path / "guarded", nan_guard, None)
    assert skipped(nan_guard) == [(5, "skipped")]
    shown = [bar.get("nan_skipped") for bar in recorder.progress_bar]  # at the start of each batch
    assert shown == [None] * 6 + [1, 1]
    assert trainer.progress_bar_metrics["nan_skipped"] == 1
    reference, _ = run(tmp_path / "reference", None, HandSkip(steps=[5]))
    assert states_equal(state(module), state(reference))


@pytest.mark.compat(
    feature="RichModelSummary",
    kind="callback",
    status="works",
    note="the summary is printed as without the guard; training as without the guard",
)
def test_rich_model_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def run(root: Path, nan_guard: NanGuard | None, hand: HandSkip | None) -> tuple[Any, str]:
        module = bn_regression()
        callbacks = [pl.callbacks.RichModelSummary(max_depth=2), *([hand] if hand else [])]
        data = regression_data(nan_at=(BAD,))
        fit(root, module, data, callbacks, nan_guard, enable_model_summary=True)
        return module, capsys.readouterr().out

    nan_guard = guard()
    module, summary = run(tmp_path / "guarded", nan_guard, None)
    assert skipped(nan_guard) == [(5, "skipped")]
    reference, reference_summary = run(tmp_path / "reference", None, HandSkip(steps=[5]))
    assert "BatchNorm1d" in summary and "Trainable params" in summary
    assert summary == reference_summary
    assert states_equal(state(module), state(reference))


# ------------------------------------------------------------------------------------ spikes, user hooks, prediction


@pytest.mark.compat(
    feature="SpikeDetection",
    kind="callback",
    status="works",
    note="both flag a label typo's spike: NanGuard skips the update first, then SpikeDetection raises its exception",
)
def test_spike_detection_beside_the_guards_own(tmp_path: Path) -> None:
    """A label typo at step 25: NanGuard (``on_before_optimizer_step``) and Lightning's ``SpikeDetection``
    (``on_train_batch_end``) both see the spike; the guard acts first and drops the update, then
    ``SpikeDetection`` raises ``TrainingSpikeException`` (its way to stop a run). Alone, it raises after the update.
    """
    from spike_models import TYPOS, Regression, Regressor

    def run(root: Path, nan_guard: NanGuard | None) -> tuple[Any, Any, StepRecorder]:
        module, steps = Regressor(), StepRecorder()
        detection = pl.callbacks.SpikeDetection(exclude_batches_path=str(root / "skip_batches.json"))
        with pytest.raises(TrainingSpikeException, match="batch 25"):
            fit(root, module, loader(Regression(TYPOS)), [steps, detection], nan_guard)
        assert detection.bad_batches == [24, 25]  # what SpikeDetection asks a resumed run to leave out
        return module, detection, steps

    nan_guard = guard()
    module, _, steps = run(tmp_path / "guarded", nan_guard)
    assert nan_guard.active
    assert [(e.global_step, e.kinds, e.action) for e in nan_guard.events] == [(25, ("loss_spike",), "skipped")]
    spike = steps.by_step(25)
    assert spike.unchanged()  # the guard dropped the update before SpikeDetection raised
    alone, _, alone_steps = run(tmp_path / "alone", None)
    assert states_equal(alone_steps.by_step(25).params_before, spike.params_before)  # healthy steps: the same
    assert not states_equal(state(alone), state(module))  # alone, the typo's update landed before the exception


@pytest.mark.compat(
    feature="LambdaCallback",
    kind="callback",
    status="works",
    note="a user hook after the guard's sees no gradients at a skipped step, finite ones elsewhere",
)
def test_lambda_callback_sees_the_skip(tmp_path: Path) -> None:
    seen: list[tuple[int, str]] = []

    def grads(trainer: Any, pl_module: Any, optimizer: Any) -> None:
        found = [p.grad for group in optimizer.param_groups for p in group["params"]]
        if all(g is None for g in found):
            seen.append((trainer.global_step, "none"))
        else:
            finite = all(g is not None and bool(torch.isfinite(g).all()) for g in found)
            seen.append((trainer.global_step, "finite" if finite else "non-finite"))

    def run(root: Path, nan_guard: NanGuard | None, hand: HandSkip | None) -> Any:
        module = bn_regression()
        hook = pl.callbacks.LambdaCallback(on_before_optimizer_step=grads)
        fit(root, module, regression_data(nan_at=(BAD,)), [*([hand] if hand else []), hook], nan_guard)
        return module

    nan_guard = guard()
    module = run(tmp_path / "guarded", nan_guard, None)
    assert skipped(nan_guard) == [(5, "skipped")]
    assert seen == [(step, "none" if step == 5 else "finite") for step in range(8)]
    seen.clear()
    reference = run(tmp_path / "reference", None, HandSkip(steps=[5]))
    assert seen == [(step, "none" if step == 5 else "finite") for step in range(8)]  # the hand skip, as seen by it
    assert states_equal(state(module), state(reference))


@pytest.mark.compat(
    feature="LambdaCallback",
    kind="callback",
    status="works",
    note="BatchNorm buffers a user hook assigns anew mid-run are checked and restored at a skipped step",
)
def test_lambda_callback_assigning_new_batchnorm_buffers(tmp_path: Path) -> None:
    """At the start of epoch 1 a hook gives the BatchNorm new ``running_mean``/``running_var``; step 13 is bad."""

    def reassign(trainer: Any, pl_module: Any) -> None:
        if trainer.current_epoch == 1:
            bn = pl_module.net[1]
            bn.running_mean, bn.running_var = bn.running_mean.clone(), bn.running_var.clone()

    def run(root: Path, nan_guard: NanGuard | None, hand: HandSkip | None) -> Any:
        module = bn_regression()
        hook = pl.callbacks.LambdaCallback(on_train_epoch_start=reassign)
        fit(root, module, regression_data(nan_at=(BAD,)), [hook, *([hand] if hand else [])], nan_guard, max_epochs=2)
        return module

    nan_guard = guard()
    module = run(tmp_path / "guarded", nan_guard, None)
    assert skipped(nan_guard) == [(5, "skipped"), (13, "skipped")]
    assert set(nan_guard.events[1].nonfinite_buffers) == {"net.1.running_mean", "net.1.running_var"}
    reference = run(tmp_path / "reference", None, HandSkip(steps=[5, 13]))
    assert all_finite(state(module))
    assert states_equal(state(module), state(reference))


class MemoryWriter(pl.callbacks.BasePredictionWriter):
    """Keeps each predicted batch: ``(batch_idx, dataset indices, prediction)``."""

    def __init__(self) -> None:
        super().__init__(write_interval="batch")
        self.written: list[tuple[int, list[int], torch.Tensor]] = []

    def write_on_batch_end(
        self,
        trainer: Any,
        pl_module: Any,
        prediction: Any,
        batch_indices: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self.written.append((batch_idx, list(batch_indices), prediction.detach().clone()))


@pytest.mark.compat(
    feature="BasePredictionWriter",
    kind="callback",
    status="works",
    note="a predict run after a guarded fit, with the guard attached, writes what it writes without the guard",
)
def test_prediction_writer_after_a_guarded_fit(tmp_path: Path) -> None:
    """Fit (step 5 skipped), then ``trainer.predict`` on the same Trainer; the NaN sample predicts NaN, unguarded."""

    def run(root: Path, nan_guard: NanGuard | None, hand: HandSkip | None) -> tuple[Any, MemoryWriter]:
        module, writer = bn_regression(), MemoryWriter()
        data = regression_data(nan_at=(BAD,))
        trainer = fit(root, module, data, [writer, *([hand] if hand else [])], nan_guard)
        assert trainer.predict(module, loader(data), return_predictions=False) is None
        return module, writer

    nan_guard = guard()
    module, writer = run(tmp_path / "guarded", nan_guard, None)
    assert nan_guard.active and skipped(nan_guard) == [(5, "skipped")]  # nothing reported about prediction
    reference, reference_writer = run(tmp_path / "reference", None, HandSkip(steps=[5]))
    assert [(i, indices) for i, indices, _ in writer.written] == [(b, list(range(b * 8, b * 8 + 8))) for b in range(8)]
    assert states_equal([p for *_, p in writer.written], [p for *_, p in reference_writer.written])
    predictions = torch.cat([p for *_, p in writer.written])
    assert predictions.isnan().nonzero().flatten().tolist() == [BAD]
    assert states_equal(state(module), state(reference))


# ------------------------------------------------------------------------------------ healthy runs


def _checkpoints(root: Path) -> list[Any]:
    return [
        pl.callbacks.ModelCheckpoint(dirpath=root / "steps", every_n_train_steps=3, save_top_k=-1),
        pl.callbacks.ModelCheckpoint(dirpath=root / "epochs", save_on_train_epoch_end=True, save_top_k=-1),
    ]


def _reassign_batchnorm(trainer: Any, pl_module: Any) -> None:
    bn = pl_module.net[1]
    bn.running_mean, bn.running_var = bn.running_mean.clone(), bn.running_var.clone()


@dataclass(frozen=True)
class Healthy:
    """A healthy run: the module, the callbacks (given the module and the run's folder), the Trainer's arguments.

    ``data``: the training set (``None``: the module's own ``train_dataloader``, for the batch-size finder).
    """

    module: Callable[[], Any]
    callbacks: Callable[[Any, Path], list[Any]]
    trainer: dict[str, Any] = field(default_factory=dict)
    data: Callable[[], Dataset] | None = regression_data


def _data_module(**kwargs: Any) -> Any:
    module = BatchNormRegression(**kwargs)
    module.data = regression_data()
    return module


HEALTHY: dict[str, Healthy] = {
    "StochasticWeightAveraging": Healthy(
        lambda: bn_regression(optimizer="sgd", lr=0.05),
        lambda m, root: [pl.callbacks.StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=2)],
        {"max_epochs": 3},
    ),
    "EMAWeightAveraging": Healthy(bn_regression, lambda m, root: [_averaging("EMAWeightAveraging")], {"max_epochs": 2}),
    "WeightAveraging": Healthy(bn_regression, lambda m, root: [_averaging("WeightAveraging")], {"max_epochs": 2}),
    "ModelPruning": Healthy(bn_regression, lambda m, root: [_pruning(m)], {"max_epochs": 2}),
    "BackboneFinetuning": Healthy(
        Finetunable,
        lambda m, root: [pl.callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5)],
        {"max_epochs": 2},
        data=finetune_data,
    ),
    "BatchSizeFinder": Healthy(
        lambda: _data_module(batch_size=2),
        lambda m, root: [pl.callbacks.BatchSizeFinder(mode="power", steps_per_trial=2, init_val=2, max_trials=3)],
        data=None,
    ),
    "LearningRateFinder": Healthy(
        lambda: bn_regression(lr=1e-3),
        lambda m, root: [pl.callbacks.LearningRateFinder(min_lr=1e-4, max_lr=0.5, num_training_steps=20)],
        data=lambda: regression_data(n=32 * BATCH),
    ),
    "GradientAccumulationScheduler": Healthy(
        bn_regression,
        lambda m, root: [pl.callbacks.GradientAccumulationScheduler(scheduling={0: 1, 1: 2})],
        {"max_epochs": 2},
    ),
    "LearningRateMonitor": Healthy(
        lambda: bn_regression(scheduler=True),
        lambda m, root: [pl.callbacks.LearningRateMonitor(logging_interval="step")],
        {"max_epochs": 2, "logger": True},
    ),
    "Timer": Healthy(bn_regression, lambda m, root: [pl.callbacks.Timer(duration={"days": 1}, interval="step")]),
    "ModelCheckpoint": Healthy(
        bn_regression, lambda m, root: _checkpoints(root), {"max_epochs": 2, "enable_checkpointing": True}
    ),
    "EarlyStopping": Healthy(bn_regression, lambda m, root: [_early_stopping()], {"max_epochs": 6}),
    "RichProgressBar": Healthy(
        bn_regression, lambda m, root: [pl.callbacks.RichProgressBar()], {"enable_progress_bar": True}
    ),
    "RichModelSummary": Healthy(
        bn_regression, lambda m, root: [pl.callbacks.RichModelSummary()], {"enable_model_summary": True}
    ),
    "LambdaCallback": Healthy(
        bn_regression,
        lambda m, root: [pl.callbacks.LambdaCallback(on_train_epoch_start=_reassign_batchnorm)],
        {"max_epochs": 2},
    ),
}


@pytest.mark.parametrize("name", list(HEALTHY))
def test_a_healthy_run_is_bit_for_bit_the_unguarded_one(name: str, tmp_path: Path) -> None:
    """No bad sample: with the guard, the steps, weights and buffers are exactly those of the run without it."""
    case = HEALTHY[name]

    def run(root: Path, nan_guard: NanGuard | None) -> tuple[Any, Any]:
        module = case.module()
        data = case.data() if case.data is not None else None
        trainer = fit(root, module, data, case.callbacks(module, root), nan_guard, **case.trainer)
        return module, trainer

    nan_guard = guard()
    module, trainer = run(tmp_path / "guarded", nan_guard)
    assert nan_guard.events == [] and nan_guard.skipped_total == 0
    unguarded, unguarded_trainer = run(tmp_path / "unguarded", None)
    assert trainer.global_step == unguarded_trainer.global_step > 0
    assert states_equal(state(module), state(unguarded))
