"""The step engine guarding a hand-written loop through a plain front-end: no Trainer anywhere.

What a new front-end (a Fabric loop) relies on: the engine checks a step from what the loop hands it
(micro-batches, losses, the optimizer about to step), drops a bad update, names the offending
sample by re-running the step through ``step_fn``, and records the event through the front-end's
log directory, with the same fields as under the Trainer.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import torch
from fronts import PlainFront
from torch import nn

from lightning_nanguard import NanGuard
from lightning_nanguard.engine.controller import StepController
from lightning_nanguard.engine.recording import IncidentRecorder
from lightning_nanguard.engine.settings import GuardSettings
from lightning_nanguard.recover.recovery import Recovery

BATCH = 4
BAD_RECORD = 6  # in the second batch, at position 2


class Normalise(nn.Module):
    """``x / ||x||``: an all-zero record gives 0/0 = NaN in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        unit = x / x.norm(dim=-1, keepdim=True)
        return nn.functional.mse_loss(self.layer(unit).squeeze(-1), y)


def _settings(**changed: Any) -> GuardSettings:
    """The settings of ``NanGuard(**changed)``: the engine's one configuration path."""
    arguments = {name: p.default for name, p in inspect.signature(NanGuard).parameters.items()}
    return GuardSettings.from_arguments({**arguments, "verbose": False, **changed})


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 3, generator=g), torch.randn(12, generator=g)
    x[BAD_RECORD] = 0.0
    return x, y


def _run(tmp_path: Path, **changed: Any) -> tuple[StepController, Normalise, list[dict[str, torch.Tensor]]]:
    """Three steps of a plain loop under the engine; the weights after each step."""
    torch.manual_seed(0)
    model = Normalise()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    front = PlainFront(model, [optimizer], log_dir=str(tmp_path))
    controller = StepController(Recovery(), IncidentRecorder(verbose=False))
    controller.configure(_settings(**changed))
    controller.recorder.attach(front, controller.scalar_tags(front))
    controller.attach(front)
    x, y = _data()
    weights = []
    for step in range(3):
        front.global_step = step
        rows = list(range(step * BATCH, (step + 1) * BATCH))
        batch = (x[rows], y[rows])
        controller.begin_step(front, every_n_steps=1)
        controller.window.add_batch(batch, step, rows, keep=True)
        loss = model.training_step(batch, step)
        controller.window.add_loss(loss)
        loss.backward()
        controller.window.close()
        controller.check_step(front, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        controller.after_optimizer_step(front)
        weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return controller, model, weights


def test_a_bad_step_of_a_plain_loop_is_dropped_and_its_sample_named(tmp_path: Path) -> None:
    controller, model, weights = _run(tmp_path)
    (event,) = controller.recorder.events
    assert (event.global_step, event.action, event.kinds) == (1, "skipped", ("loss", "grad"))
    assert event.offending_samples == (2,) and event.dataset_indices == (BAD_RECORD,)
    assert (event.cause, event.blame_verified, event.indices_verified) == ("data", True, False)  # no reader given
    assert (event.phase, event.culprit_op, event.details["source_text"]) == (
        "forward",
        "div",
        "unit = x / x.norm(dim=-1, keepdim=True)",
    )
    assert event.repro_path == str(tmp_path / "nanguard" / "step-1") and Path(event.repro_path, "batch.pt").exists()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])  # the bad update was dropped
    assert not all(torch.equal(weights[1][k], weights[2][k]) for k in weights[1])  # the next one was not
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert controller.state.counters.skipped_total == 1
    lines = (tmp_path / "nanguard" / "events.jsonl").read_text(encoding="utf-8").splitlines()
    assert [(row["global_step"], row["dataset_indices"]) for row in map(json.loads, lines)] == [(1, [BAD_RECORD])]


def test_warn_keeps_the_bad_update(tmp_path: Path) -> None:
    controller, model, _ = _run(tmp_path, action="warn", bisect=False, localize=False, save_repro=False)
    events = controller.recorder.events
    assert [(e.global_step, e.action, e.offending_samples) for e in events] == [
        (1, "warned", None),
        (2, "warned", None),
    ]
    assert not any(bool(torch.isfinite(p).all()) for p in model.parameters())  # warned: the NaN went through
    assert controller.state.counters.skipped_total == 0
