"""The Trainer front-end (``trainer/frontend.py``): what the engine reads off a Trainer, on a real ``Trainer``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn

from lightning_nanguard.engine.frontend import FrontEnd, StepView, training_parts
from lightning_nanguard.trainer.frontend import TrainerFrontEnd, training_step_of


def test_the_original_step_of_a_compiled_module() -> None:
    module = nn.Linear(1, 1)
    calls: list[int] = []
    module._compiler_ctx = {"original_training_step": lambda batch, i: calls.append(i)}  # type: ignore[assignment]
    training_step_of(module)(None, 3)  # type: ignore[arg-type]
    assert calls == [3]
    assert training_step_of(SimpleNamespace(training_step=len)) is len  # type: ignore[arg-type]


def _front(**trainer_args: Any) -> TrainerFrontEnd:
    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, **trainer_args)
    return TrainerFrontEnd(trainer, BoringModel())


def test_a_trainer_front_end_is_a_front_end() -> None:
    front: FrontEnd = _front()  # the type checker holds TrainerFrontEnd to the protocol
    assert (front.global_step, front.current_epoch, front.global_rank, front.world_size) == (0, 0, 0, 1)
    assert front.is_global_zero and front.automatic_optimization
    assert front.grad_scaler is None and front.lr_schedulers == [] and list(front.loggers) == []
    assert front.logging_due() is False  # no logger: nothing is ever due
    assert front.tensorboard_writers() == []


def test_the_step_context_is_the_precision_plugins_autocast() -> None:
    front = _front(precision="bf16-mixed")
    with front.step_context():
        assert torch.is_autocast_enabled("cpu")
    with _front().step_context():
        assert not torch.is_autocast_enabled("cpu")


def test_clipping_is_suspended_and_given_back() -> None:
    front = _front(gradient_clip_val=0.5)
    front.suspend_clipping()
    assert front.trainer.gradient_clip_val is None
    front.resume_clipping()
    assert front.trainer.gradient_clip_val == 0.5
    front.resume_clipping()  # nothing suspended: unchanged
    assert front.trainer.gradient_clip_val == 0.5


def test_training_parts_read_off_the_trainer() -> None:
    front = _front()
    optimizer = torch.optim.SGD(front.module.parameters(), lr=0.1)
    front.trainer.strategy.optimizers = [optimizer]
    parts = training_parts(front)
    assert parts.module is front.module and parts.optimizers == [optimizer]
    assert parts.scaler is None and parts.global_step == 0


@pytest.mark.parametrize(("step", "epoch"), [(7, 1), (0, 0)])
def test_a_step_view_names_the_earlier_step_and_reads_everything_else_live(step: int, epoch: int) -> None:
    front = _front()
    view: Any = StepView(front, step, epoch)
    assert (view.global_step, view.current_epoch) == (step, epoch)
    assert view.module is front.module and view.world_size == 1
