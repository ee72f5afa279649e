"""The Trainer front-end (``trainer/frontend.py``): what the engine reads off a Trainer, on a real ``Trainer``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer
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


class _Recorder(Callback):
    """Compares the front-end's ``logging_due`` with Lightning's own answer at each training hook."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, bool, bool]] = []
        self.steps: list[tuple[int, int]] = []

    def _compare(self, hook: str, trainer: Trainer, pl_module: Any) -> None:
        front = TrainerFrontEnd(trainer, pl_module)
        front.new_moment()
        self.seen.append((hook, trainer.global_step, front.logging_due(), trainer._logger_connector.should_update_logs))
        self.steps.append((front.global_step, trainer.global_step))

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._compare("batch_start", trainer, pl_module)
        if trainer.global_step == 5:
            trainer.should_stop = True  # the loop logs the step it stops at whatever log_every_n_steps says

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
        self._compare("before_optimizer_step", trainer, pl_module)

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._compare("batch_end", trainer, pl_module)

    def on_before_backward(self, trainer: Trainer, pl_module: Any, loss: Any) -> None:
        self._compare("before_backward", trainer, pl_module)


@pytest.mark.parametrize(("every", "accumulate"), [(1, 1), (3, 1), (2, 2), (0, 1)])
def test_logging_due_is_lightnings_answer_at_every_hook(tmp_path: Any, every: int, accumulate: int) -> None:
    recorder = _Recorder()
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_steps=8,
        log_every_n_steps=every,
        accumulate_grad_batches=accumulate,
        callbacks=[recorder],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(BoringModel())
    ours = [due for _, _, due, _ in recorder.seen]
    lightnings = [due for _, _, _, due in recorder.seen]
    assert ours == lightnings
    assert len(recorder.seen) >= 3 * 6
    if every:
        assert True in ours and (every == 1 or False in ours)  # both answers occur: the comparison can fail


class _TwoOptimizers(BoringModel):
    """Manual optimisation stepping two optimizers a batch (``global_step`` counts both)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.other = nn.Linear(32, 2)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        for optimizer in self.optimizers():
            optimizer.zero_grad()
            loss = self.layer(batch).sum() + self.other(batch).sum()
            self.manual_backward(loss)
            optimizer.step()
        return None

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.layer.parameters(), lr=0.01), torch.optim.SGD(self.other.parameters(), lr=0.01)


class _ManualByProperty(_TwoOptimizers):
    """Manual optimisation declared by overriding the property: its ``_automatic_optimization`` still says True."""

    def __init__(self) -> None:
        super().__init__()
        self._automatic_optimization = True

    @property
    def automatic_optimization(self) -> bool:
        return False

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        pass


@pytest.mark.parametrize("manual", [False, True, "by property"])
def test_global_step_is_the_trainers_at_every_hook(tmp_path: Any, manual: bool | str) -> None:
    recorder = _Recorder()
    model = {False: BoringModel, True: _TwoOptimizers, "by property": _ManualByProperty}[manual]()
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_steps=10,
        accumulate_grad_batches=1 if manual else 2,
        callbacks=[recorder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(model)
    assert recorder.steps and all(ours == lightnings for ours, lightnings in recorder.steps), recorder.steps
    assert all(TrainerFrontEnd(trainer, model).automatic_optimization is (not manual) for _ in range(2))
    assert len({lightnings for _, lightnings in recorder.steps}) >= 5  # the count moved: the comparison can fail
