"""The command line (``lightning_nanguard.__main__``): ``replay`` of a bundle, in this process.

Real training runs and fresh processes are in ``tests/integration/test_replay.py``; here bundles
are written directly with ``save_bundle`` from a tiny module.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from event_factory import make_event
from torch import Tensor, nn

from lightning_nanguard.__main__ import main
from lightning_nanguard.reporting.repro import save_bundle


class LogModel(nn.Module):
    """``log`` of each sample: a sample holding 0 gives ``-inf``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return torch.log(self.w * batch).mean()


def bundle(tmp_path: Path, batch: Tensor) -> Path:
    event = make_event(bare=True, global_step=5, batch_idx=5, loss=-math.inf, details={"batch_size": 4})
    return save_bundle(tmp_path, event, LogModel(), batch, batch_idx=5, positions=None, source_root=str(tmp_path))


def test_replay_reproduces_and_prints_the_event(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = bundle(tmp_path, torch.tensor([1.0, 2.0, 0.0, 3.0]))
    assert main(["replay", str(path), "--json"]) == 0
    out, err = capsys.readouterr()
    event = json.loads(out.strip().splitlines()[-1])
    assert (event["global_step"], event["offending_samples"], event["cause"]) == (5, [2], "data")
    assert event["culprit_op"] == "LogBackward0" and event["repro_path"] == str(path)
    assert "[rank 0] NanGuard" in err


def test_replay_of_samples_that_are_finite_now_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = bundle(tmp_path, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert main(["replay", str(path)]) == 1
    assert "the saved samples did not reproduce a non-finite step" in capsys.readouterr().err


def test_replay_of_a_missing_bundle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(tmp_path / "step-404")]) == 2
    assert "replay failed: the bundle" in capsys.readouterr().err


def test_replay_of_a_class_that_cannot_be_rebuilt_suggests_module(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = bundle(tmp_path, torch.tensor([0.0, 1.0]))
    assert main(["replay", str(path), "--module", "no_such_module_for_nanguard:Model"]) == 2
    assert "pass --module pkg.mod:Class" in capsys.readouterr().err


def test_a_command_is_required() -> None:
    with pytest.raises(SystemExit) as exited:
        main([])
    assert exited.value.code == 2
