"""The engine's diagnosis routine: StepDiagnosis, diagnose_micro_batches without batches and with a bad one."""

from __future__ import annotations

import torch
from fronts import PlainFront
from torch import nn

from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.diagnose.batch_diagnosis import Diagnosis
from lightning_nanguard.engine.incident.step_diagnosis import DiagnosisSettings, StepDiagnosis, diagnose_micro_batches
from lightning_nanguard.engine.step.window import MicroBatch

EVENT = NanEvent(5, 0, 5, 0, ("loss",), "skipped")
SETTINGS = DiagnosisSettings(True, True, 128, True, 5, None, True, None)


class Step(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return (self.w * batch).log().mean()


def test_reproduced_follows_the_diagnosis() -> None:
    assert StepDiagnosis(EVENT).reproduced  # not re-run: taken as reproduced
    assert StepDiagnosis(EVENT, Diagnosis(4, [1])).reproduced
    assert not StepDiagnosis(EVENT, Diagnosis(4, None, reproduced=False)).reproduced


def test_without_micro_batches_nothing_is_diagnosed() -> None:
    found = diagnose_micro_batches(PlainFront(Step()), EVENT, [], SETTINGS)
    assert found == StepDiagnosis(EVENT)


def test_a_bad_micro_batch_is_named_with_its_batch_index() -> None:
    micro = MicroBatch(torch.tensor([1.0, 0.0, 2.0, 3.0]), 7, [40, 41, 42, 43])
    found = diagnose_micro_batches(PlainFront(Step()), EVENT, [micro], SETTINGS)
    assert found.micro_batch is micro and found.diagnosis is not None
    assert (found.event.offending_samples, found.event.dataset_indices, found.event.batch_idx) == ((1,), (41,), 7)
    assert found.event.cause == "data" and found.reproduced
