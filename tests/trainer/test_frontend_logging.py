"""Recording through the Trainer front-end (``engine/recording.py`` over ``trainer/frontend.py``): sinks, scalars, bar.

With stand-in Trainers (the attributes each method reads) seen through a real ``TrainerFrontEnd``,
and a real ``TensorBoardLogger``.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from event_factory import make_event
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from rich.console import Console

from lightning_nanguard.engine import recording as reporting
from lightning_nanguard.engine.recording import (
    PROGRESS_BAR_KEY,
    Count,
    EventSinks,
    IncidentRecorder,
    _terminal,
    default_tags,
)
from lightning_nanguard.reporting.scalars import scalar_tags
from lightning_nanguard.trainer.frontend import TrainerFrontEnd


class RecordingLogger:
    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, float], int]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append((metrics, step))


class Broadcast:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def broadcast(self, value: Any) -> Any:
        self.sent.append(value)
        return value


def trainer(tmp_path: Path, loggers: list[Any] | None = None, **fields: Any) -> Any:
    defaults: dict[str, Any] = {
        "loggers": loggers if loggers is not None else [],
        "log_dir": None,
        "default_root_dir": str(tmp_path),
        "is_global_zero": True,
        "global_rank": 0,
        "world_size": 1,
        "global_step": 0,
        "strategy": Broadcast(),
        "progress_bar_callback": None,
    }
    defaults.update(fields)
    return TrainerFrontEnd(SimpleNamespace(**defaults), SimpleNamespace(automatic_optimization=True))  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ where events go


def test_without_a_logger_events_go_to_the_default_root_dir(tmp_path: Path) -> None:
    sinks = EventSinks(verbose=False)
    assert sinks.nanguard_dir is None
    sinks.attach(trainer(tmp_path))
    assert sinks.log_dir == str(tmp_path) and sinks.nanguard_dir == str(tmp_path / "nanguard")
    assert sinks.jsonl is not None and sinks.jsonl.path == tmp_path / "nanguard" / "events.jsonl"
    assert sinks.tensorboard == []


def test_the_trainers_log_dir_comes_before_the_default_root_dir(tmp_path: Path) -> None:
    sinks = EventSinks(verbose=False)
    sinks.attach(trainer(tmp_path, log_dir=str(tmp_path / "csv" / "version_0")))
    assert sinks.log_dir == str(tmp_path / "csv" / "version_0")


def test_the_first_tensorboard_logger_decides_the_directory_on_rank_zero(tmp_path: Path) -> None:
    board = TensorBoardLogger(str(tmp_path / "tb"), name="run")
    csv = CSVLogger(str(tmp_path / "csv"))
    run = trainer(tmp_path, loggers=[csv, board], log_dir=str(tmp_path / "csv"))
    sinks = EventSinks(verbose=False)
    sinks.attach(run, tags=["nanguard/grad_norm"])
    assert sinks.log_dir == board.log_dir
    assert run.trainer.strategy.sent == [board.log_dir]  # every rank takes rank zero's directory
    assert len(sinks.tensorboard) == 1 and sinks.tensorboard[0].writer is board.experiment
    board.experiment.close()


def test_other_ranks_write_no_tensorboard(tmp_path: Path) -> None:
    board = TensorBoardLogger(str(tmp_path / "tb"))
    sinks = EventSinks(verbose=False)
    sinks.attach(trainer(tmp_path, loggers=[board], is_global_zero=False, global_rank=1))
    assert sinks.tensorboard == [] and sinks.log_dir == board.log_dir


def test_an_event_goes_to_events_jsonl_and_tensorboard(tmp_path: Path, tb_reader: Any) -> None:
    board = TensorBoardLogger(str(tmp_path / "tb"), name="", version="")
    sinks = EventSinks(verbose=False)
    sinks.attach(trainer(tmp_path, loggers=[board]))
    event = make_event(global_step=6, repro_path=None)
    sinks.event(event, rank=0)
    lines = (Path(board.log_dir) / "nanguard" / "events.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["global_step"] for line in lines] == [6]
    assert [step for step, _ in tb_reader(board.log_dir).texts("nanguard/events/text_summary")] == [6]
    board.experiment.close()


def test_a_verbose_sink_prints_a_panel(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sinks = EventSinks(verbose=True)
    sinks.attach(trainer(tmp_path))
    sinks.event(make_event(repro_path=None), rank=3)
    assert "[rank 3] NanGuard" in capsys.readouterr().err


def test_an_event_rewrites_its_bundle(tmp_path: Path) -> None:
    bundle = tmp_path / "step-12"
    bundle.mkdir()
    (bundle / "event.json").write_text("{}", encoding="utf-8")
    EventSinks(verbose=False).event(make_event(repro_path=str(bundle), action="rolled_back"), rank=0)
    assert json.loads((bundle / "event.json").read_text(encoding="utf-8"))["action"] == "rolled_back"


def test_a_bundle_that_cannot_be_rewritten_only_warns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def unwritable(event: Any) -> bool:
        raise PermissionError("read-only file system")

    monkeypatch.setattr(reporting, "update_bundle_event", unwritable)
    sinks = EventSinks(verbose=False)
    sinks.attach(trainer(tmp_path))
    sinks.parts.step = 12
    sinks.event(make_event(global_step=12, repro_path=str(tmp_path / "step-12")), rank=0)
    assert "its bundles part failed at step 12 (PermissionError('read-only file system'))" in caplog.text
    assert not sinks.parts.on("bundles") and sinks.parts.on("events_file")
    assert [f.part for f in sinks.parts.take_unreported()] == ["bundles"]  # its guard_error event, once
    sinks.event(make_event(global_step=13, repro_path=str(tmp_path / "step-13")), rank=0)
    assert sinks.jsonl is not None and len(sinks.jsonl.path.read_text(encoding="utf-8").splitlines()) == 2


# ------------------------------------------------------------------------------------ scalars


def connector(should_update_logs: bool) -> Any:
    return SimpleNamespace(should_update_logs=should_update_logs, _progress_bar_metrics={})


@pytest.mark.parametrize(
    ("loggers", "connector_", "due"),
    [([], connector(True), False), ([RecordingLogger()], connector(False), False), ([RecordingLogger()], None, True)],
    ids=["no-logger", "not-a-logging-step", "no-connector"],
)
def test_logging_due(tmp_path: Path, loggers: list[Any], connector_: Any, due: bool) -> None:
    run = trainer(tmp_path, loggers=loggers, _logger_connector=connector_)
    assert run.logging_due() is due
    assert trainer(tmp_path, loggers=[RecordingLogger()], _logger_connector=connector(True)).logging_due()


def test_scalars_only_on_rank_zero(tmp_path: Path) -> None:
    logger = RecordingLogger()
    sinks = EventSinks(verbose=False)
    sinks.write_scalars(trainer(tmp_path, loggers=[logger]), {"nanguard/skipped_total": 1.0}, step=4)
    sinks.write_scalars(trainer(tmp_path, loggers=[logger], is_global_zero=False), {"x": 2.0}, step=5)
    assert logger.logged == [({"nanguard/skipped_total": 1.0}, 4)]


def attached_recorder(tmp_path: Path, logger: RecordingLogger, tags: list[str], **fields: Any) -> tuple[Any, Any]:
    run = trainer(tmp_path, loggers=[logger], _logger_connector=connector(False), **fields)
    recorder = IncidentRecorder(verbose=False)
    recorder.attach(run, tags)
    return recorder, run


def test_recorder_scalars_at_logging_steps_incidents_and_when_forced(tmp_path: Path) -> None:
    logger = RecordingLogger()
    tags = ["nanguard/bad_steps_total", "nanguard/grad_norm"]
    recorder, run = attached_recorder(tmp_path, logger, tags, global_step=8)
    recorder.scalars(run, {"nanguard/bad_steps_total": 0.0, "nanguard/grad_norm": 1.0})  # not a logging step
    # (an infinite gradient norm below is not drawn)
    assert logger.logged == []
    recorder.scalars(run, {"nanguard/bad_steps_total": 0.0}, due=True)
    recorder.scalars(
        run,
        {"nanguard/bad_steps_total": 1.0, "nanguard/grad_norm": math.inf},
        previous={"nanguard/bad_steps_total": 0.0},
    )
    run.trainer.global_step = 9
    recorder.scalars(run, {"nanguard/bad_steps_total": 1.0, "nanguard/spikes_total": 5.0}, force=True)
    assert logger.logged == [
        ({"nanguard/bad_steps_total": 0.0}, 8),  # due: a logging step
        ({"nanguard/bad_steps_total": 1.0}, 8),  # an incident; its step was written already: no step before
        ({"nanguard/bad_steps_total": 1.0}, 9),  # forced; spikes_total is not a tag of this run
    ]


def test_recorder_scalars_step_at_an_incident(tmp_path: Path) -> None:
    logger = RecordingLogger()
    recorder, run = attached_recorder(tmp_path, logger, ["nanguard/bad_steps_total"], global_step=20)
    recorder.scalars(run, {"nanguard/bad_steps_total": 1.0}, previous={"nanguard/bad_steps_total": 0.0})
    assert logger.logged == [({"nanguard/bad_steps_total": 0.0}, 19), ({"nanguard/bad_steps_total": 1.0}, 20)]


def test_recorder_scalars_need_an_attached_recorder_on_rank_zero(tmp_path: Path) -> None:
    logger = RecordingLogger()
    run = trainer(tmp_path, loggers=[logger])
    IncidentRecorder(verbose=False).scalars(run, {"nanguard/bad_steps_total": 1.0}, force=True)  # not attached
    recorder, other = attached_recorder(tmp_path, logger, ["nanguard/bad_steps_total"], is_global_zero=False)
    recorder.scalars(other, {"nanguard/bad_steps_total": 1.0}, force=True)
    assert logger.logged == []


# ------------------------------------------------------------------------------------ the recorder


def test_the_recorder_keeps_events_and_sends_them_when_a_trainer_is_given(tmp_path: Path) -> None:
    recorder = IncidentRecorder(verbose=False)
    assert recorder.events_path is None
    run = trainer(tmp_path, global_rank=2, world_size=4)
    recorder.attach(run, default_tags())
    assert recorder.rank == 2 and (recorder.notices.rank, recorder.notices.world_size) == (2, 4)
    assert recorder.events_path == tmp_path / "nanguard" / "events.jsonl"
    alone = make_event(global_step=1, repro_path=None)
    recorder.record(None, alone)  # guard.check() outside a Trainer: kept only
    assert not recorder.events_path.exists()
    sent = make_event(global_step=2, repro_path=None)
    recorder.record(run, sent)
    assert recorder.events == [alone, sent]
    lines = recorder.events_path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["global_step"] for line in lines] == [2]


def test_default_tags_are_every_tag() -> None:
    assert default_tags() == scalar_tags("rollback", ("clip_grad",), has_scaler=True, spikes=True)
    assert len(default_tags()) == 7


# ------------------------------------------------------------------------------------ progress bar and terminal


def test_count_reads_as_an_integer_in_any_format() -> None:
    assert (f"{Count(8):.3f}", f"{Count(8):.3g}", f"{Count(8)}", str(Count(8))) == ("8", "8", "8", "8")
    assert Count(8) + 1 == 9 and isinstance(Count(8), int)


def test_show_in_progress_bar(tmp_path: Path) -> None:
    run = trainer(tmp_path, _logger_connector=connector(False))
    run.show_in_progress_bar("nan_skipped", 3)
    value = run.trainer._logger_connector._progress_bar_metrics["nan_skipped"]
    assert value == 3 and type(value) is Count
    trainer(tmp_path).show_in_progress_bar("nan_skipped", 3)  # no connector: nothing to do


def test_progress_shows_skipped_steps_once_there_are_some(tmp_path: Path) -> None:
    run = trainer(tmp_path, _logger_connector=connector(False))
    recorder = IncidentRecorder(verbose=False)
    recorder.progress(run, 0)
    assert run.trainer._logger_connector._progress_bar_metrics == {}
    recorder.progress(run, 2)
    assert run.trainer._logger_connector._progress_bar_metrics == {PROGRESS_BAR_KEY: 2}


def test_the_terminal_prints_through_a_live_progress_bar(tmp_path: Path) -> None:
    assert _terminal(1, None).console is None and _terminal(1, None).write is None
    disabled = SimpleNamespace(is_enabled=False, _console=Console(file=io.StringIO()))
    assert _terminal(0, trainer(tmp_path, progress_bar_callback=disabled)).console is None
    console = Console(file=io.StringIO())
    rich_bar = SimpleNamespace(is_enabled=True, _console=console)
    assert _terminal(0, trainer(tmp_path, progress_bar_callback=rich_bar)).console is console
    printed: list[str] = []
    tqdm_bar = SimpleNamespace(is_enabled=True, print=printed.append)
    reporter = _terminal(2, trainer(tmp_path, progress_bar_callback=tqdm_bar))
    reporter.report(make_event(bare=True))
    assert len(printed) == 1 and "[rank 2] NanGuard" in printed[0]
