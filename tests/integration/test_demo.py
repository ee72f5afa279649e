"""The demo (examples/cosine_norm_demo.py with configs/demo.yaml + configs/nanguard.yaml), shrunk to one epoch."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_nanguard import NanGuard, read_events

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "cosine_norm_demo.py"
CONFIGS = ["--config", str(ROOT / "configs" / "demo.yaml")]
NANGUARD = ["--config", str(ROOT / "configs" / "nanguard.yaml")]
# 128 training images in 4 unshuffled batches of 32: the blank images 40 and 100 poison batches 1 and 3.
SMALL = [
    "--trainer.max_epochs=1",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--data.num_train=128",
    "--data.num_val=32",
    "--data.shuffle=false",
    "--data.blank_indices=[40, 100]",
    "--trainer.log_every_n_steps=1",
]


@pytest.fixture(scope="module")
def demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cosine_norm_demo", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # jsonargparse resolves the classes' annotations through their module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """configs/demo.yaml logs to ./nanguard_demo_logs: keep that inside the test's directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["cosine_norm_demo.py"])


@dataclass
class GuardedRun:
    cli: Any
    guard: NanGuard
    log_dir: Path
    root: Path
    stdout: str


@pytest.fixture(scope="module")
def guarded_run(demo: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> GuardedRun:
    """One small run of the demo with configs/nanguard.yaml, shared by the tests below."""
    root = tmp_path_factory.mktemp("demo")
    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout):
        patch.chdir(root)
        patch.setattr("sys.argv", ["cosine_norm_demo.py"])
        cli = demo.main(["fit", *CONFIGS, *NANGUARD, *SMALL])
    (guard,) = [callback for callback in cli.trainer.callbacks if isinstance(callback, NanGuard)]
    log_dir = root / "nanguard_demo_logs" / "cosine_norm_demo" / "version_0"
    return GuardedRun(cli, guard, log_dir, root, stdout.getvalue())


def test_blank_image_makes_the_model_non_finite(demo: ModuleType) -> None:
    """The NaN is real: a blank image alone gives NaN outputs, a normal one does not."""
    torch.manual_seed(0)
    layer = demo.CosineNormConv2d(1, 4)
    data = demo.ShapesDataset(4, blank_indices=[2])
    assert torch.isfinite(layer(data.images[[0, 1, 3]])).all()
    assert torch.isnan(layer(data.images[[2]])).all()


def test_demo_skips_the_bad_steps_and_keeps_the_weights_finite(demo: ModuleType, guarded_run: GuardedRun) -> None:
    run = guarded_run
    assert run.cli.trainer.global_step == 4  # every step counted, bad ones included
    assert run.guard.bad_steps_total == run.guard.skipped_total == 2
    assert demo.all_finite(run.cli.model)

    events = read_events(run.log_dir / "nanguard" / "events.jsonl")
    assert [(e.global_step, e.batch_idx, e.action) for e in events] == [(1, 1, "skipped"), (3, 3, "skipped")]
    for event in events:
        assert set(event.kinds) == {"loss", "grad", "bn_stats"}
        assert event.loss is not None and math.isnan(event.loss)
        assert "net.0.weight" in event.nonfinite_grads
        assert {"net.1.running_mean", "net.1.running_var"} <= set(event.nonfinite_buffers)
    assert [e.culprit_module for e in events] == ["net.0", "net.0"]  # the cosine layer
    assert [e.dataset_indices for e in events] == [(40,), (100,)]
    assert [e.cause for e in events] == ["data", "data"]


def test_demo_writes_tensorboard_and_csv_logs(guarded_run: GuardedRun) -> None:
    accumulator = EventAccumulator(str(guarded_run.log_dir)).Reload()
    tags = accumulator.Tags()
    assert {"nanguard/grad_norm", "nanguard/bad_steps_total", "nanguard/skipped_total"} <= set(tags["scalars"])
    assert [e.value for e in accumulator.Scalars("nanguard/skipped_total")][-1] == 2.0
    assert "nanguard/events/text_summary" in tags["tensors"]
    assert "custom_scalars__config__" in tags["tensors"]
    metrics_csv = guarded_run.root / "nanguard_demo_logs" / "cosine_norm_demo_csv" / "version_0" / "metrics.csv"
    assert "nanguard/skipped_total" in metrics_csv.read_text().splitlines()[0]


def test_demo_prints_where_the_logs_are(guarded_run: GuardedRun) -> None:
    out = guarded_run.stdout
    assert "--logdir nanguard_demo_logs/cosine_norm_demo/version_0" in out
    command = next(line for line in out.splitlines() if "view them with:" in line).split(":", 1)[1].split("--logdir")[0]
    program = command.split()[0]
    # the user's shell: scripts/demo.sh puts the interpreter's directory on the demo's PATH only
    venv_bin = str(Path(sys.executable).parent)
    user_path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep) if d and d != venv_bin)
    runnable = shutil.which(program, path=user_path) or Path(program).exists()
    assert runnable, f"the printed command {command!r} cannot be run from a shell without {venv_bin} on PATH"
    assert "nanguard_demo_logs/cosine_norm_demo/version_0/nanguard/events.jsonl" in out
    assert "bad steps: 2, skipped: 2" in out
    assert "final weights and BatchNorm statistics finite: True" in out


def test_replay_of_a_demo_bundle(guarded_run: GuardedRun) -> None:
    """The command the report prints for a repro bundle works on the demo's bundles."""
    bundles = sorted((guarded_run.log_dir / "nanguard").glob("step-*"))
    assert [b.name for b in bundles] == ["step-1", "step-3"]  # configs/nanguard.yaml saves bundles
    from lightning_nanguard.__main__ import main as nanguard_main

    assert nanguard_main(["replay", str(bundles[-1])]) == 0


def test_without_nanguard_the_weights_turn_nan(demo: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    """What the demo protects against: the same run without configs/nanguard.yaml ends with NaN weights."""
    cli = demo.main(["fit", *CONFIGS, *SMALL, "--trainer.enable_checkpointing=false"])
    assert all(torch.isnan(p).all() for p in cli.model.parameters())
    out = capsys.readouterr().out
    assert "NanGuard is not in trainer.callbacks" in out
    assert "final weights and BatchNorm statistics finite: False" in out
