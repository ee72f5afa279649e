"""Localising the origin of a diagnosed batch on the full batch (``diagnose/origin.py``)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_nanguard.diagnose.origin import localized, spike_localizes
from lightning_nanguard.diagnose.runner import SubBatchRunner


class LogOfSum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def training_step(self, x: Tensor, batch_idx: int) -> Tensor:
        return (self.w * x.sum(dim=1)).log().mean()


def test_the_origin_is_found_in_the_full_batch_and_the_model_is_left_as_it_was() -> None:
    x = torch.ones(4, 3)
    x[2] = 0
    module = LogOfSum()
    before = module.w.detach().clone()
    found, error = localized(SubBatchRunner(module, x), [2], True, None)
    assert error is None and found is not None
    assert (found.op, found.phase) == ("LogBackward0", "forward")
    assert module.w.grad is None and torch.equal(module.w.detach(), before)


def test_nothing_is_run_when_not_wanted_and_a_failure_is_reported_not_raised() -> None:
    runner = SubBatchRunner(LogOfSum(), torch.ones(2, 3))
    assert localized(runner, None, False, None) == (None, None)
    runner.step_fn = lambda batch, batch_idx: (_ for _ in ()).throw(RuntimeError("boom"))
    found, error = localized(runner, None, True, None)
    assert found is None and error == "localisation failed: RuntimeError('boom')"


def test_a_merely_large_loss_is_not_localised() -> None:
    runner = SubBatchRunner(LogOfSum(), torch.ones(2, 3), loss_threshold=1.0)
    assert not spike_localizes(runner, saw_nonfinite=False) and spike_localizes(runner, saw_nonfinite=True)
    assert spike_localizes(SubBatchRunner(LogOfSum(), torch.ones(2, 3)), saw_nonfinite=False)
