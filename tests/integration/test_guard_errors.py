"""The promise holds whatever else fails (issue 32): everyday numbers, and each part of the guard broken in turn.

A real ``Trainer`` with every part of the guard in play (:class:`fault_models.EveryPartModule`): a
BatchNorm, attention for the precursor watch and QK-clip, a logged value, a TensorBoard logger and
checkpoints. Two batches hold a NaN input (steps 3 and 9); whatever happens to the rest, both steps
must be dropped (weights, buffers and optimizer state bitwise unchanged) and the weights stay finite.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from fault_models import LOSSES, EveryPartModule, nan_loader
from fitting import StepRecorder, fit
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard_runs import read_tensorboard

import lightning_nanguard.engine.incident.inspector as inspector_module
import lightning_nanguard.engine.recording as recording_module
import lightning_nanguard.trainer.callback as callback_module
from lightning_nanguard import GuardInternalError, NanGuard
from lightning_nanguard.engine.parts import OPTIONAL_PARTS
from lightning_nanguard.engine.step.precursors import PrecursorWatch
from lightning_nanguard.engine.step.spikes import SpikeWatch
from lightning_nanguard.recover.recovery import Recovery
from lightning_nanguard.reporting.jsonl import JsonlEventLog, read_events
from lightning_nanguard.reporting.tensorboard import TensorBoardReporter
from lightning_nanguard.reporting.terminal import TerminalReporter
from lightning_nanguard.trainer.frontend import TrainerFrontEnd
from lightning_nanguard.trainer.strategy import StrategyHooks

BAD_STEPS = [3, 9]

# Where each optional part calls out: breaking it there must switch that part off alone.
PART_FAULTS: dict[str, tuple[Any, str]] = {
    "spikes": (SpikeWatch, "check"),
    "precursors": (PrecursorWatch, "arm"),
    "qk_clip": (PrecursorWatch, "clip"),
    "diagnosis": (inspector_module, "diagnose_micro_batches"),
    "bundles": (inspector_module, "save_incident_files"),
    "remedies": (Recovery, "apply"),
    "logged_values": (TrainerFrontEnd, "keep_logged"),
    "dataset_indices": (StrategyHooks, "batch_indices"),
    "checkpoint_check": (callback_module, "make_checkpoint_finite"),
    "events_file": (JsonlEventLog, "append"),
    "tensorboard": (TensorBoardReporter, "report"),
    "terminal": (TerminalReporter, "report"),
    "scalars": (recording_module, "_log_metrics"),
    "progress_bar": (TrainerFrontEnd, "show_in_progress_bar"),
}


def planted(part: str) -> Any:
    def fault(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"planted fault in {part}")

    return fault


def run(
    tmp_path: Path,
    guard: NanGuard,
    module: Any = None,
    checkpoints: bool = False,
    callbacks: tuple[Any, ...] = (),
    **trainer: Any,
) -> Any:
    """Fit ``module`` on 12 batches (NaN inputs in batches 3 and 9); the recorder of every step."""
    recorder = StepRecorder()
    callbacks = (recorder, *callbacks)
    if checkpoints:
        callbacks = (*callbacks, ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=2))
    fit(
        module if module is not None else EveryPartModule(),
        nan_loader(),
        root=tmp_path,
        guard=guard,
        callbacks=callbacks,
        enable_checkpointing=checkpoints,
        **trainer,
    )
    return recorder


def assert_bad_steps_dropped(guard: NanGuard, recorder: StepRecorder, module: Any, trains: bool = True) -> None:
    incidents = [e for e in guard.events if e.kinds not in (("guard_error",), ("precursor",))]
    assert [(e.global_step, e.action) for e in incidents] == [(step, "skipped") for step in BAD_STEPS]
    for step in BAD_STEPS:
        assert recorder.by_step(step).unchanged(), f"step {step} changed the model or the optimizer"
    if trains:
        healthy = recorder.by_step(BAD_STEPS[-1] + 1)
        assert healthy.changed_params(), "a healthy step after the NaN changed nothing: training stalled"
    assert all(torch.isfinite(p).all() for p in module.parameters())


def guard_errors(guard: NanGuard) -> list[Any]:
    return [e for e in guard.events if e.kinds == ("guard_error",)]


# ------------------------------------------------------------------------------------ everyday numbers


@pytest.mark.parametrize("loss", list(LOSSES))
def test_every_healthy_loss_keeps_the_guard_on_and_bad_steps_dropped(tmp_path: Path, loss: str) -> None:
    """Zero, negative, crossing zero, subnormal, huge, float64/bf16/fp16 and shape-[1] losses (issue 32, item 2)."""
    module = EveryPartModule(LOSSES[loss])
    guard = NanGuard(verbose=False)
    recorder = run(tmp_path, guard, module)
    assert guard.active and guard_errors(guard) == []
    assert_bad_steps_dropped(guard, recorder, module, trains=loss != "all_grads_zero")


def test_parameters_without_gradients_keep_the_guard_on(tmp_path: Path) -> None:
    module = EveryPartModule(unused=True)
    guard = NanGuard(verbose=False)
    recorder = run(tmp_path, guard, module)
    assert guard.active and guard_errors(guard) == []
    assert_bad_steps_dropped(guard, recorder, module)
    assert module.unused is not None and module.unused.weight.grad is None


def test_the_issue_run_a_zero_loss_then_a_nan_batch(tmp_path: Path) -> None:
    """The issue's run: every target of batch 2 masked (loss exactly 0), then NaN; defaults, 40 steps."""

    class Masked(EveryPartModule):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            mask = torch.zeros_like(y) if batch_idx == 2 else torch.ones_like(y)
            err = (self(x) - y) ** 2 * mask
            return err.sum() / mask.sum().clamp_min(1)

    module = Masked()
    guard = NanGuard(verbose=False)
    fit(module, nan_loader(batches=40, bad_batches=(30,)), root=tmp_path, guard=guard)
    assert guard.active and guard_errors(guard) == []
    assert [(e.global_step, e.action) for e in guard.events] == [(30, "skipped")]
    assert all(torch.isfinite(p).all() for p in module.parameters())


# ------------------------------------------------------------------------------------ each part broken


def test_every_optional_part_has_a_fault_here() -> None:
    assert set(PART_FAULTS) == set(OPTIONAL_PARTS)


@pytest.mark.parametrize("part", list(PART_FAULTS))
def test_a_broken_part_is_switched_off_alone_and_bad_steps_are_still_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, part: str
) -> None:
    owner, name = PART_FAULTS[part]
    monkeypatch.setattr(owner, name, planted(part))
    module = EveryPartModule()
    guard = NanGuard(qk_clip=50.0, remedies=["clip_grad"], precursor_every_n_steps=2, precursor_max_cost=None)
    recorder = run(tmp_path, guard, module, checkpoints=True, logger=TensorBoardLogger(tmp_path, name="tb"))
    assert guard.active
    assert_bad_steps_dropped(guard, recorder, module)
    (error,) = guard_errors(guard)
    assert error.details["part"] == part and f"planted fault in {part}" in error.details["error"]
    assert error.details["stops"] == OPTIONAL_PARTS[part] and error.action == "warned"
    assert set(guard.controller.parts.off) == {part}
    if part != "events_file":
        on_disk = read_events(Path(guard.log_dir) / "nanguard" / "events.jsonl")
        assert [e.details["part"] for e in on_disk if "guard_error" in e.kinds] == [part]


def test_a_guard_error_reaches_tensorboard_the_panel_and_the_progress_bar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(SpikeWatch, "check", planted("spikes"))
    bars: list[dict[str, Any]] = []

    class Bar(StepRecorder):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            bars.append(dict(trainer.progress_bar_metrics))

    guard = NanGuard(verbose=True)
    fit(
        EveryPartModule(),
        nan_loader(),
        root=tmp_path,
        guard=guard,
        callbacks=[Bar()],
        logger=TensorBoardLogger(tmp_path, name="tb"),
    )
    texts = read_tensorboard(Path(guard.log_dir)).texts("nanguard/events/text_summary")
    assert any("NanGuard's spikes part failed" in text for _, text in texts)
    panel = " ".join(word for word in capsys.readouterr().err.split() if word not in "│╭╮╰╯─")
    assert "NanGuard's spikes part failed (RuntimeError('planted fault in spikes'))" in panel
    assert "still guarded yes: NaN/Inf steps are still checked and dropped" in panel
    assert bars[-1]["nanguard_parts_off"] == 1 and bars[-1]["nan_skipped"] == 2


# ------------------------------------------------------------------------------------ the core broken


def test_a_broken_core_check_drops_the_step_in_hand_then_turns_the_guard_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lightning_nanguard.engine.step.check as check_module

    module = EveryPartModule()
    guard = NanGuard(verbose=False)

    def breaks_at_step_5(real: Any) -> Any:
        def check(*args: Any, **kwargs: Any) -> Any:
            if guard.controller.parts.step == 5:  # the check of step 5, whichever way it reads the step
                raise RuntimeError("planted core fault")
            return real(*args, **kwargs)

        return check

    # the step's check: the one read of a healthy step, the full check otherwise
    for name in ("fused_health_check", "staged_loss_and_total"):
        monkeypatch.setattr(check_module, name, breaks_at_step_5(getattr(check_module, name)))
    recorder = run(tmp_path, guard, module)
    assert not guard.active
    assert recorder.by_step(3).unchanged() and recorder.by_step(5).unchanged()  # the NaN step, the unvouched step
    (error,) = guard_errors(guard)
    assert (error.global_step, error.action, error.details["part"]) == (5, "skipped", "core")
    assert "planted core fault" in error.details["error"] and error.details["guard_on"] is False
    assert recorder.by_step(6).changed_params()  # unguarded from here: training goes on
    on_disk = read_events(Path(guard.log_dir) / "nanguard" / "events.jsonl")
    assert [(e.global_step, e.kinds) for e in on_disk] == [(3, ("loss", "grad", "bn_stats")), (5, ("guard_error",))]


def test_a_core_error_in_another_hook_drops_that_step_at_its_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_nanguard.engine.step.window import StepWindow

    real = StepWindow.add_loss

    def breaks_at_step_6(window: StepWindow, loss: torch.Tensor) -> None:
        if window.batch_idx == 6:
            raise RuntimeError("planted fault before backward")
        real(window, loss)

    monkeypatch.setattr(StepWindow, "add_loss", breaks_at_step_6)
    guard = NanGuard(verbose=False)
    recorder = run(tmp_path, guard)
    assert not guard.active and recorder.by_step(6).unchanged() and recorder.by_step(7).changed_params()
    (error,) = guard_errors(guard)
    assert (error.global_step, error.details["part"]) == (6, "core")
    assert " in loss " in error.details["where"]  # the engine's moment on_before_backward hands the loss to


@pytest.mark.parametrize("part", ["spikes", "core"])
def test_on_internal_error_raise_stops_training_with_the_part_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, part: str
) -> None:
    import lightning_nanguard.engine.step.check as check_module

    if part == "core":  # both ways the step's check reads: the one read of a healthy step, the full check
        monkeypatch.setattr(check_module, "fused_health_check", planted(part))
        monkeypatch.setattr(check_module, "staged_loss_and_total", planted(part))
    else:
        monkeypatch.setattr(SpikeWatch, "check", planted(part))
    guard = NanGuard(verbose=False, on_internal_error="raise")
    recorder = StepRecorder()
    with pytest.raises(GuardInternalError, match=f"NanGuard's {part} part failed: RuntimeError") as info:
        fit(EveryPartModule(), nan_loader(), root=tmp_path, guard=guard, callbacks=[recorder])
    assert info.value.part == part
    assert recorder.records[-1].global_step == 0 and not recorder.records[-1].params_after  # step 0, not applied


# ------------------------------------------------------------------------------------ faults from outside


class FailingScalarsLogger(TensorBoardLogger):
    """A logger whose disk is full for the guard's scalars: it raises on every ``nanguard/`` key."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if any(key.startswith("nanguard/") for key in metrics):
            raise OSError(28, "No space left on device")
        super().log_metrics(metrics, step)


def test_a_logger_that_fails_on_the_guards_scalars_switches_off_the_scalars_only(tmp_path: Path) -> None:
    module = EveryPartModule()
    guard = NanGuard(verbose=False)
    recorder = run(tmp_path, guard, module, logger=FailingScalarsLogger(tmp_path, name="tb"))
    assert guard.active and set(guard.controller.parts.off) == {"scalars"}
    assert_bad_steps_dropped(guard, recorder, module)
    (error,) = guard_errors(guard)
    assert "No space left on device" in error.details["error"]
    assert read_tensorboard(Path(guard.log_dir)).scalars("train_mse_step")  # the user's own scalars still logged


def test_an_output_directory_that_cannot_be_written_switches_off_the_files_only(tmp_path: Path) -> None:
    (tmp_path / "nanguard").write_text("a file where the guard's directory should be")  # as root: chmod is no fence
    module = EveryPartModule()
    guard = NanGuard(verbose=False)
    recorder = run(tmp_path, guard, module)
    assert guard.active and set(guard.controller.parts.off) == {"bundles", "events_file"}
    assert_bad_steps_dropped(guard, recorder, module)
    assert {e.details["part"] for e in guard_errors(guard)} == {"bundles", "events_file"}
    first = next(e for e in guard.events if e.global_step == 3 and "loss" in e.kinds)
    assert first.offending_samples == (1,) and first.repro_path is None  # named, no bundle


def test_a_clock_that_stands_still_does_not_switch_anything_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning's own tests replace ``time.perf_counter`` (the guard binds its own at import); a coarse clock
    that stands still is the same for the precursor watch's cost limit, which divides by it."""
    import time

    import lightning_nanguard.detect.attention as attention_module
    import lightning_nanguard.engine.step.precursors as precursors_module

    for module in (time, precursors_module, attention_module):
        monkeypatch.setattr(module, "perf_counter", lambda: 1.0)
    module = EveryPartModule()
    guard = NanGuard(verbose=False, precursor_every_n_steps=1)
    recorder = run(tmp_path, guard, module)
    assert guard.active and guard.controller.parts.off == {}
    assert_bad_steps_dropped(guard, recorder, module)


def test_events_with_non_finite_details_still_reach_the_events_file(tmp_path: Path) -> None:
    guard = NanGuard(verbose=False)
    fit(EveryPartModule(), nan_loader(), root=tmp_path, guard=guard)
    lines = (Path(guard.log_dir) / "nanguard" / "events.jsonl").read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(line)["loss"] == "nan" for line in lines)
    assert not math.isfinite(float(json.loads(lines[0])["loss"]))


class PickyModule(EveryPartModule):
    """A training step that refuses anything but a full batch (the diagnosis re-runs sub-batches)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if len(batch[0]) != 4:
            raise ValueError("this model only takes batches of 4")
        return super().training_step(batch, batch_idx)


class ReadOnce(torch.utils.data.Dataset):
    """A dataset whose records can be read once only (a stream behind a map-style API): re-reads raise."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y
        self.seen: set[int] = set()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index in self.seen:
            raise OSError(f"record {index} is gone")
        self.seen.add(index)
        return self.x[index], self.y[index]


def refuse(*args: Any) -> Any:
    raise RuntimeError("the user's hook fails")


@pytest.mark.parametrize(
    "fault",
    ["training_step_refuses_sub_batches", "dataset_rereads_raise", "batch_slicer_raises", "row_records_raises"],
)
def test_the_users_code_failing_inside_a_diagnosis_leaves_bad_steps_dropped(tmp_path: Path, fault: str) -> None:
    module = PickyModule() if fault == "training_step_refuses_sub_batches" else EveryPartModule()
    guard = NanGuard(
        verbose=False,
        batch_slicer=refuse if fault == "batch_slicer_raises" else None,
        row_records=refuse if fault == "row_records_raises" else None,
    )
    recorder = StepRecorder()
    loader = nan_loader(dataset=ReadOnce if fault == "dataset_rereads_raise" else None)
    fit(module, loader, root=tmp_path, guard=guard, callbacks=[recorder])
    assert guard.active
    assert_bad_steps_dropped(guard, recorder, module)
    first = next(e for e in guard.events if e.global_step == 3)
    if fault == "dataset_rereads_raise":  # named, but the re-read that would verify the index failed
        assert first.offending_samples == (1,) and first.indices_verified is False
    elif fault == "row_records_raises":
        assert first.offending_samples == (1,) and first.dataset_indices is None
        assert "the user's hook fails" in first.details["indices_unverified"]
    else:  # no sub-batch could be run: no sample is named, and the event says why
        assert first.offending_samples is None and first.details.get("not_attributable")


def test_a_progress_bar_that_cannot_print_switches_off_the_panels_only(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import TQDMProgressBar

    class BrokenBar(TQDMProgressBar):
        def print(self, *args: Any, **kwargs: Any) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    module = EveryPartModule()
    guard = NanGuard(verbose=True)
    recorder = run(tmp_path, guard, module, enable_progress_bar=True, callbacks=[BrokenBar()])
    assert guard.active and set(guard.controller.parts.off) == {"terminal"}
    assert_bad_steps_dropped(guard, recorder, module)
