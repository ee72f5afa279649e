"""NanGuard on a real Trainer (both namespaces): loggers, checkpoints, pickling, actions, escalation, arguments."""

from __future__ import annotations

import csv
import dataclasses
import math
import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch
import pytest
import pytorch_lightning
import torch
from models import BATCH_SIZE, make_case, make_loader, make_module

from lightning_nanguard import NanEvent, NanGuard, NonFiniteTrainingError, read_events
from lightning_nanguard.decide.policy import Counters
from lightning_nanguard.reporting import event_markdown
from lightning_nanguard.trainer._compat import CALLBACK_BASES

TEXT_TAG = "nanguard/events/text_summary"
COSINE_GRADS = ("net.feature.weight",)
INPUT_GRADS = ("net.0.weight", "net.0.bias", "net.1.weight", "net.1.bias", "net.3.weight", "net.3.bias")


def _fit(
    make_trainer: Any,
    ns_name: str,
    guard: NanGuard | None,
    kind: str = "cosine_norm",
    bad: tuple[int, ...] = (11,),
    callbacks: tuple[Any, ...] = (),
    ckpt_path: str | None = None,
    module: Any = None,
    **trainer_kwargs: Any,
) -> tuple[Any, Any]:
    case = make_case(kind, bad=bad)
    module = module if module is not None else make_module(ns_name, kind)
    trainer = make_trainer(callbacks=[*([guard] if guard is not None else []), *callbacks], **trainer_kwargs)
    trainer.fit(module, make_loader(case.dataset), ckpt_path=ckpt_path)
    if guard is not None:
        assert guard.active, "NanGuard disabled itself after an internal error (see the log)"
    return trainer, module


def _dicts(events: list[NanEvent]) -> list[dict[str, Any]]:
    return [event.to_dict() for event in events]


def _all_finite(module: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in module.state_dict().values() if t.is_floating_point())


# ------------------------------------------------------------------------------------ one class, both namespaces


def test_one_class_is_a_callback_of_both_namespaces() -> None:
    guard = NanGuard()
    assert isinstance(guard, lightning.pytorch.Callback)
    assert isinstance(guard, pytorch_lightning.Callback)
    assert len(CALLBACK_BASES) == 2


def test_healthy_training_is_bitwise_unchanged_by_the_guard(make_trainer: Any, ns_name: str) -> None:
    """On healthy data the guard observes only: same weights, BatchNorm statistics and optimizer state."""
    guard = NanGuard()
    trainer, guarded = _fit(make_trainer, ns_name, guard, kind="input_data", bad=(), max_epochs=2)
    reference_trainer, reference = _fit(make_trainer, ns_name, None, kind="input_data", bad=(), max_epochs=2)
    assert trainer.global_step == reference_trainer.global_step == 8
    for (name, a), (_, b) in zip(guarded.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    opt_a = trainer.optimizers[0].state_dict()["state"]
    opt_b = reference_trainer.optimizers[0].state_dict()["state"]
    assert all(torch.equal(opt_a[i]["exp_avg"], opt_b[i]["exp_avg"]) for i in opt_a)
    assert guard.active
    assert guard.events == []
    assert (guard.bad_steps_total, guard.skipped_total, guard.consecutive_bad_steps) == (0, 0, 0)
    assert not (Path(trainer.default_root_dir) / "nanguard" / "events.jsonl").exists()
    assert "nan_skipped" not in trainer.progress_bar_metrics


@pytest.mark.parametrize("with_norm", [True, False], ids=["norm-every-step", "element-test-only"])
def test_finite_gradients_with_an_overflowing_norm_are_not_an_incident(
    make_trainer: Any, ns_name: str, recorder: Any, with_norm: bool
) -> None:
    # remedies=["clip_grad"] makes the guard compute the norm every step (here without a logger)
    guard = NanGuard(verbose=False, remedies=["clip_grad"] if with_norm else None)
    _, module = _fit(make_trainer, ns_name, guard, kind="norm_overflow", callbacks=(recorder,))
    assert guard.active
    assert guard.events == []
    assert guard.bad_steps_total == 0
    # 16 gradients of 1e20: the float32 norm overflows (and is confirmed element-wise as finite);
    # without a norm the element-wise test never flags them at all
    assert guard.last_grad_norm == (math.inf if with_norm else None)
    assert all(record.changed_params() == ["net.weight"] for record in recorder.records)  # every step applied
    assert recorder.records[-1].adam_steps("after") == [4.0]
    assert _all_finite(module)


# ------------------------------------------------------------------------------------ where events go


def test_no_logger_writes_events_under_default_root_dir(
    make_trainer: Any, ns_name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    guard = NanGuard()  # verbose: a panel on stderr
    trainer, _ = _fit(make_trainer, ns_name, guard, logger=False)
    assert trainer.loggers == []
    assert guard.log_dir == str(tmp_path)
    events = read_events(tmp_path / "nanguard" / "events.jsonl")
    assert _dicts(events) == _dicts(guard.events)
    assert [(e.global_step, e.nonfinite_grads) for e in events] == [(1, COSINE_GRADS)]
    assert list(tmp_path.rglob("events.out.tfevents*")) == []  # no TensorBoard without a TensorBoardLogger
    assert not (tmp_path / "lightning_logs").exists()
    err = capsys.readouterr().err
    assert err.count("[rank 0] NanGuard") == 1
    assert "net.feature.weight" in err


def test_verbose_false_prints_no_panel(make_trainer: Any, ns_name: str, capsys: pytest.CaptureFixture[str]) -> None:
    guard = NanGuard(verbose=False)
    _fit(make_trainer, ns_name, guard)
    assert len(guard.events) == 1
    assert "NanGuard" not in capsys.readouterr().err


def test_default_logger_puts_events_in_its_log_dir(
    make_trainer: Any, ns_name: str, ns: Any, tmp_path: Path, tb_reader: Any
) -> None:
    guard = NanGuard(verbose=False)
    trainer, _ = _fit(make_trainer, ns_name, guard, logger=True)
    assert isinstance(trainer.logger, ns.loggers.TensorBoardLogger)  # the namespace's own default logger
    log_dir = tmp_path / "lightning_logs" / "version_0"
    assert trainer.log_dir == str(log_dir)
    assert guard.log_dir == str(log_dir)
    assert _dicts(read_events(log_dir / "nanguard" / "events.jsonl")) == _dicts(guard.events)
    assert not (tmp_path / "nanguard" / "events.jsonl").exists()
    run = tb_reader(log_dir)
    assert [step for step, _ in run.texts(TEXT_TAG)] == [1]
    assert len(run.layouts()) == 1


def test_tensorboard_and_csv_loggers_together(
    make_trainer: Any, ns_name: str, ns: Any, tmp_path: Path, tb_reader: Any
) -> None:
    tensorboard = ns.loggers.TensorBoardLogger(str(tmp_path), name="tb", version=0)
    csv_logger = ns.loggers.CSVLogger(str(tmp_path), name="csv", version=0)
    guard = NanGuard(verbose=False)
    trainer, _ = _fit(make_trainer, ns_name, guard, logger=[tensorboard, csv_logger])
    assert len(guard.events) == 1
    event = guard.events[0]
    assert event.global_step == 1

    # events.jsonl follows the first logger's log_dir
    tb_dir = tmp_path / "tb" / "version_0"
    assert _dicts(read_events(tb_dir / "nanguard" / "events.jsonl")) == _dicts(guard.events)

    # TensorBoard: scalars every logging step, the event as markdown text at its step, the layout
    run = tb_reader(tb_dir)
    assert run.scalars("nanguard/skipped_total") == [(0, 0.0), (1, 1.0), (2, 1.0), (3, 1.0)]
    assert run.scalars("nanguard/bad_steps_total") == [(0, 0.0), (1, 1.0), (2, 1.0), (3, 1.0)]
    norms = dict(run.scalars("nanguard/grad_norm"))
    assert sorted(norms) == [0, 2, 3]  # the bad step's NaN norm is not drawn (it would break the line)
    assert all(0 < norms[s] < math.inf for s in (0, 2, 3))
    assert TEXT_TAG in run.tags["tensors"]
    texts = run.texts(TEXT_TAG)
    assert texts == [(1, event_markdown(event))]
    assert "`net.feature.weight`" in texts[0][1]
    layouts = run.layouts()
    assert len(layouts) == 1
    assert [category.title for category in layouts[0].category] == ["NanGuard"]
    multiline_tags = {tag for chart in layouts[0].category[0].chart for tag in chart.multiline.tag}
    assert {"nanguard/grad_norm", "nanguard/bad_steps_total", "nanguard/skipped_total"} <= multiline_tags

    # CSV: the same scalars through logger.log_metrics
    with open(tmp_path / "csv" / "version_0" / "metrics.csv", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    skipped = {int(r["step"]): float(r["nanguard/skipped_total"]) for r in rows if r.get("nanguard/skipped_total")}
    assert skipped == {0: 0.0, 1: 1.0, 2: 1.0, 3: 1.0}
    assert "nan_skipped" not in rows[0]  # progress-bar only (logger=False)
    skipped = trainer.progress_bar_metrics["nan_skipped"]
    assert isinstance(skipped, int) and skipped == 1
    assert f"{skipped:.3f}" == "1"  # how RichProgressBar formats it: an integer, not 1.000
    from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

    assert Tqdm.format_num(skipped) == "1"


# ------------------------------------------------------------------------------------ checkpoints and pickling


def test_checkpoint_resume_keeps_counters_and_events(make_trainer: Any, ns_name: str, ns: Any, tmp_path: Path) -> None:
    guard = NanGuard(verbose=False)
    checkpoint = ns.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    _fit(make_trainer, ns_name, guard, callbacks=(checkpoint,), enable_checkpointing=True)
    assert guard.bad_steps_total == 1
    path = tmp_path / "ckpt" / "last.ckpt"

    ckpt = torch.load(path, weights_only=True)  # primitives only
    state = ckpt["callbacks"][guard.state_key]
    assert state == guard.state_dict()
    assert (state["bad_steps_total"], state["skipped_total"], state["consecutive_bad_steps"]) == (1, 1, 0)
    assert state["events"] == _dicts(guard.events)

    resumed = NanGuard(verbose=False)
    trainer, module = _fit(make_trainer, ns_name, resumed, ckpt_path=str(path), max_epochs=2)
    assert trainer.global_step == 8
    assert (resumed.bad_steps_total, resumed.skipped_total, resumed.consecutive_bad_steps) == (2, 2, 0)
    assert len(resumed.events) == 2
    assert resumed.events[0].to_dict() == guard.events[0].to_dict()
    assert (resumed.events[1].global_step, resumed.events[1].epoch, resumed.events[1].batch_idx) == (5, 1, 1)
    assert resumed.events[1].nonfinite_grads == COSINE_GRADS
    assert len(read_events(tmp_path / "nanguard" / "events.jsonl")) == 2  # appended, not overwritten
    assert _all_finite(module)


def test_state_dict_round_trip_without_a_trainer(tmp_path: Path) -> None:
    guard = NanGuard()
    names = [f.name for f in dataclasses.fields(Counters)]
    counters = Counters(**{name: 100 + i for i, name in enumerate(names)})  # every counter distinct
    guard.controller.state.counters = counters
    guard.controller.state.last_grad_norm = 2.5
    guard.events[:] = [
        NanEvent(i, 0, i, 0, ("loss", "grad"), "skipped", nonfinite_grads=("w",), loss=math.nan, grad_norm=math.inf)
        for i in range(150)
    ]
    state = guard.state_dict()
    assert len(state["events"]) == 100
    assert [e["global_step"] for e in state["events"]] == list(range(50, 150))  # the last 100
    torch.save(state, tmp_path / "state.pt")
    loaded_state = torch.load(tmp_path / "state.pt", weights_only=True)

    restored = NanGuard()
    restored.load_state_dict(loaded_state)
    assert restored.counters == counters  # every counter, amp_overflow_total and consecutive_overflows too
    assert (restored.bad_steps_total, restored.amp_overflow_total) == (counters.bad_steps_total, 103)
    assert restored.last_grad_norm == 2.5
    assert _dicts(restored.events) == _dicts(guard.events[50:])
    assert math.isnan(restored.events[0].loss)  # type: ignore[arg-type]
    assert restored.events[0].grad_norm == math.inf
    assert restored.state_dict() == state

    fresh = NanGuard()
    fresh.load_state_dict({})  # an older checkpoint without these keys
    assert (fresh.counters, fresh.last_grad_norm, fresh.events) == (Counters(), None, [])


def test_pickle_before_and_after_fit(make_trainer: Any, ns_name: str) -> None:
    guard = NanGuard(action="skip", check_every_n_steps=1, max_consecutive_bad_steps=7, verbose=False)
    fresh = pickle.loads(pickle.dumps(guard))
    assert (fresh.action, fresh.max_consecutive_bad_steps, fresh.verbose) == ("skip", 7, False)

    _fit(make_trainer, ns_name, guard, logger=True)  # holds a TensorBoard writer and the model during fit
    clone = pickle.loads(pickle.dumps(guard))
    assert _dicts(clone.events) == _dicts(guard.events)
    assert (clone.bad_steps_total, clone.skipped_total) == (1, 1)

    # The unpickled guard still works in a new run.
    trainer, _ = _fit(make_trainer, ns_name, clone, logger=False)
    assert trainer.global_step == 4
    assert clone.bad_steps_total == 2
    assert clone.events[-1].global_step == 1


# ------------------------------------------------------------------------------------ actions


def test_action_raise(make_trainer: Any, ns_name: str, recorder: Any, tmp_path: Path) -> None:
    guard = NanGuard(action="raise", verbose=False)
    module = make_module(ns_name, "input_data")
    with pytest.raises(NonFiniteTrainingError) as info:
        _fit(make_trainer, ns_name, guard, kind="input_data", module=module, callbacks=(recorder,))
    error = info.value
    event = error.event
    assert (event.global_step, event.epoch, event.batch_idx, event.action) == (1, 0, 1, "raised")
    assert event.kinds == ("loss", "grad", "bn_stats")
    assert event.nonfinite_grads == INPUT_GRADS
    assert event.nonfinite_buffers == ("net.1.running_mean", "net.1.running_var")
    assert _dicts(error.events) == _dicts([event])
    assert _dicts(guard.events) == _dicts([event])
    assert (guard.bad_steps_total, guard.skipped_total) == (1, 0)

    message = str(error)
    assert "step 1" in message
    assert "not applied" in message
    assert "error.event" in message
    assert "action='skip'" in message  # what to do next
    assert str(tmp_path / "nanguard" / "events.jsonl") in message

    # The step was not applied: weights, optimizer state and BatchNorm buffers as at the batch start.
    last = recorder.records[-1]
    assert last.global_step == 1
    assert last.params_after == {}  # on_train_batch_end never ran
    for name, tensor in module.named_parameters():
        assert torch.equal(tensor, last.params_before[name]), name
    for name, tensor in module.named_buffers():
        assert torch.equal(tensor, last.buffers_before[name]), name
    adam = module.trainer.optimizers[0].state_dict()["state"]
    assert [float(s["step"]) for s in adam.values()] == [1.0] * 6
    assert _all_finite(module)
    assert _dicts(read_events(tmp_path / "nanguard" / "events.jsonl")) == _dicts([event])


@pytest.mark.parametrize(("action", "done"), [("skip", "skipped"), ("warn", "warned")])
def test_escalation_after_max_consecutive_bad_steps(
    make_trainer: Any, ns_name: str, recorder: Any, action: str, done: str
) -> None:
    guard = NanGuard(action=action, max_consecutive_bad_steps=3, verbose=False)
    every_sample = tuple(range(4 * BATCH_SIZE))
    with pytest.raises(NonFiniteTrainingError) as info:
        _fit(make_trainer, ns_name, guard, kind="masked_div", bad=every_sample, callbacks=(recorder,))
    error = info.value
    assert [(e.global_step, e.action) for e in error.events] == [(0, done), (1, done), (2, "raised")]
    assert _dicts(guard.events) == _dicts(error.events)
    assert error.event.global_step == 2
    assert guard.bad_steps_total == 3
    assert guard.consecutive_bad_steps == 3
    assert guard.skipped_total == (2 if action == "skip" else 0)
    message = str(error)
    assert "3 consecutive bad steps" in message
    assert "max_consecutive_bad_steps=3" in message
    assert "learning rate" in message
    assert [record.global_step for record in recorder.records] == [0, 1, 2]
    if action == "skip":  # nothing ever reached the weights or the optimizer
        assert all(record.unchanged() for record in recorder.records[:-1])
        assert recorder.records[-1].optimizer_before["state"] == {}
        initial = recorder.records[0].params_before
        assert all(torch.equal(a, initial[n]) for n, a in recorder.records[-1].params_before.items())
    else:  # the first bad step was applied: NaN weights from then on
        assert not torch.isfinite(recorder.records[0].params_after["net.head.weight"]).all()


def test_max_events_raises_at_the_nth_incident_in_total(make_trainer: Any, ns_name: str) -> None:
    """Two non-consecutive incidents (batches 1 and 3 of 4), max_events=2: the second one raises with every event."""
    guard = NanGuard(max_events=2, verbose=False, save_repro=False)
    with pytest.raises(NonFiniteTrainingError) as info:
        _fit(make_trainer, ns_name, guard, bad=(11, 27))
    error = info.value
    assert [(e.global_step, e.action) for e in error.events] == [(1, "skipped"), (3, "raised")]
    assert (guard.bad_steps_total, guard.consecutive_bad_steps, guard.skipped_total) == (2, 1, 1)
    message = str(error)
    assert "2 bad steps in total reached max_events=2" in message
    assert "max_consecutive_bad_steps" not in message and "None" not in message


def test_consecutive_counter_resets_on_a_healthy_step(make_trainer: Any, ns_name: str) -> None:
    guard = NanGuard(max_consecutive_bad_steps=2, verbose=False)
    trainer, module = _fit(make_trainer, ns_name, guard, kind="masked_div", bad=(2, 2 * BATCH_SIZE + 1))
    assert trainer.global_step == 4  # bad, good, bad, good: never two in a row
    assert [e.global_step for e in guard.events] == [0, 2]
    assert all(e.action == "skipped" for e in guard.events)
    assert (guard.bad_steps_total, guard.consecutive_bad_steps) == (2, 0)
    assert _all_finite(module)


def test_action_warn_applies_the_step(make_trainer: Any, ns_name: str, recorder: Any) -> None:
    guard = NanGuard(action="warn", verbose=False)
    trainer, module = _fit(make_trainer, ns_name, guard, kind="input_data", callbacks=(recorder,))
    assert guard.active
    # Step 1 is bad and applied; the NaN weights make every later step bad as well.
    assert [(e.global_step, e.action) for e in guard.events] == [(1, "warned"), (2, "warned"), (3, "warned")]
    assert guard.events[0].nonfinite_grads == INPUT_GRADS
    assert guard.events[0].nonfinite_buffers == ("net.1.running_mean", "net.1.running_var")
    assert (guard.bad_steps_total, guard.skipped_total, guard.consecutive_bad_steps) == (3, 0, 3)
    bad = recorder.by_step(1)
    assert bad.changed_params() == list(bad.params_before)
    assert not torch.isfinite(bad.params_after["net.0.weight"]).all()
    assert bad.adam_steps("after") == [2.0] * 6  # the optimizer did step
    assert not torch.isfinite(bad.buffers_after["net.1.running_mean"]).all()  # statistics left as the batch made them
    assert bad.buffers_after["net.1.num_batches_tracked"].item() == 2
    assert not _all_finite(module)
    assert "nan_skipped" not in trainer.progress_bar_metrics


def test_check_every_n_steps_skips_a_bad_checked_step(make_trainer: Any, ns_name: str, recorder: Any) -> None:
    guard = NanGuard(check_every_n_steps=2, verbose=False)
    _, module = _fit(make_trainer, ns_name, guard, bad=(2 * BATCH_SIZE + 3,), callbacks=(recorder,))
    assert [(e.global_step, e.action, e.nonfinite_grads) for e in guard.events] == [(2, "skipped", COSINE_GRADS)]
    assert recorder.by_step(2).unchanged()
    assert _all_finite(module)


def test_check_every_n_steps_misses_an_unchecked_step(make_trainer: Any, ns_name: str, recorder: Any) -> None:
    """Step 1 is not checked: its NaN gradient is applied; the next checked step (2) sees the damage."""
    guard = NanGuard(check_every_n_steps=2, verbose=False)
    _, module = _fit(make_trainer, ns_name, guard, bad=(11,), callbacks=(recorder,))
    assert not torch.isfinite(recorder.by_step(1).params_after["net.feature.weight"]).all()
    assert [e.global_step for e in guard.events] == [2]  # step 3 is not checked either
    assert guard.events[0].kinds[:2] == ("loss", "grad")
    assert recorder.by_step(2).unchanged()
    assert not _all_finite(module)


@pytest.mark.parametrize("micro_batch", [0, 1])
def test_gradient_accumulation_skips_the_whole_window(
    make_trainer: Any, ns_name: str, recorder: Any, micro_batch: int
) -> None:
    """accumulate_grad_batches=2: NaN in either micro-batch discards the step of both micro-batches."""
    guard = NanGuard(verbose=False)
    trainer, module = _fit(
        make_trainer,
        ns_name,
        guard,
        kind="input_data",
        bad=(micro_batch * BATCH_SIZE + 3,),
        callbacks=(recorder,),
        accumulate_grad_batches=2,
    )
    assert guard.active
    assert trainer.global_step == 2
    assert [(e.global_step, e.action) for e in guard.events] == [(0, "skipped")]
    assert guard.events[0].nonfinite_buffers == ("net.1.running_mean", "net.1.running_var")
    first, second = recorder.records[0], recorder.records[1]
    assert (first.batch_idx, second.batch_idx) == (0, 1)
    for name, before in first.params_before.items():
        assert torch.equal(before, second.params_after[name]), name
    for name, before in first.buffers_before.items():  # both micro-batches' statistics undone
        assert torch.equal(before, second.buffers_after[name]), name
    assert second.optimizer_after["state"] == {}
    assert recorder.records[3].changed_params() == list(first.params_before)  # the next window trains
    assert _all_finite(module)


class _CorruptRunningVar(*CALLBACK_BASES):  # type: ignore[misc]
    """Writes a negative value into ``net.1.running_var`` after the backward of step 1."""

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_step == 1:
            with torch.no_grad():
                pl_module.net[1].running_var[3] = -0.5


def test_negative_running_var_is_a_bn_stats_incident(make_trainer: Any, ns_name: str, recorder: Any) -> None:
    guard = NanGuard(verbose=False)
    _, module = _fit(
        make_trainer, ns_name, guard, kind="input_data", bad=(), callbacks=(_CorruptRunningVar(), recorder)
    )
    assert len(guard.events) == 1
    event = guard.events[0]
    assert (event.global_step, event.kinds, event.nonfinite_grads) == (1, ("bn_stats",), ())
    assert event.nonfinite_buffers == ("net.1.running_var",)
    assert recorder.by_step(1).unchanged()
    assert bool((module.net[1].running_var >= 0).all())


# ------------------------------------------------------------------------------------ arguments


def test_max_consecutive_one_raises_on_the_first_bad_step(make_trainer: Any, ns_name: str) -> None:
    guard = NanGuard(max_consecutive_bad_steps=1, verbose=False)
    with pytest.raises(NonFiniteTrainingError) as info:
        _fit(make_trainer, ns_name, guard, kind="acos")
    assert info.value.event.global_step == 1
    assert info.value.event.nonfinite_grads == ("net.angle.scale",)
    assert guard.skipped_total == 0


def test_skip_restores_batchnorm_even_when_its_statistics_are_not_checked(
    make_trainer: Any, ns_name: str, recorder: Any
) -> None:
    """``check_bn_stats=False`` only removes BatchNorm statistics from the *check*; a skipped step must still
    be a true no-op, or the NaN statistics of the skipped batch poison every later evaluation."""
    guard = NanGuard(check_bn_stats=False, verbose=False)
    _, module = _fit(make_trainer, ns_name, guard, kind="input_data", callbacks=(recorder,))
    assert [(e.global_step, e.kinds, e.action) for e in guard.events] == [(1, ("loss", "grad"), "skipped")]
    bad = recorder.by_step(1)
    assert bad.changed_params() == []
    assert bad.unchanged(), "BatchNorm running statistics of the skipped batch were kept"
    assert _all_finite(module)


def test_a_training_step_returning_none_is_no_step_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """Lightning skips backward and the update for a ``None`` loss: the guard must not keep that batch's window."""

    class SkipsBatchTwo(lightning.pytorch.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if batch_idx == 2:
                return None
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, generator=g)
    x[27, 0] = math.nan  # batch 3, right after the skipped batch
    guard = NanGuard(verbose=False, save_repro=False)
    trainer = lightning.pytorch.Trainer(
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
        callbacks=[guard],
        enable_model_summary=False,
    )
    trainer.fit(SkipsBatchTwo(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8))
    assert trainer.global_step == 4  # Lightning counts the batch without a loss as a step
    (event,) = guard.events
    assert (event.batch_idx, event.offending_samples, event.dataset_indices) == (3, (3,), (27,))
    assert len(guard.controller.window.micro_batches) == 0
