"""``check_module`` (``engine/step/check.py``): the event of a module's NaN/Inf now, for ``guard.check``."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_nanguard.engine.step.check import check_module


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.bn = nn.BatchNorm1d(2)
        self.head = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.fc(x)))


TRAINER = SimpleNamespace(global_step=11, current_epoch=2, global_rank=1)


def test_a_healthy_module_has_no_event() -> None:
    net = Net()
    net(torch.randn(4, 2)).sum().backward()
    assert check_module(TRAINER, net, torch.tensor(0.5), 3) is None
    assert check_module(TRAINER, nn.Linear(2, 2), None, 0) is None  # no gradients at all


def test_non_finite_gradients() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    x = torch.randn(4, 2)
    x[1, 0] = math.nan
    net(x).sum().backward()
    event = check_module(TRAINER, net, None, 5)
    assert event is not None
    assert event.kinds == ("grad",)
    assert event.nonfinite_grads == ("0.weight", "2.weight")  # the biases never multiply the NaN input
    assert event.nonfinite_buffers == () and event.nonfinite_params == ()
    assert (event.global_step, event.epoch, event.batch_idx, event.rank) == (11, 2, 5, 1)
    assert event.action == "warned" and event.loss is None


def test_a_nan_batch_through_batchnorm_also_names_its_statistics() -> None:
    net = Net()
    x = torch.randn(4, 2)
    x[1, 0] = math.nan
    net(x).sum().backward()
    event = check_module(None, net, None, 0)
    assert event is not None and event.kinds == ("grad", "bn_stats")
    assert event.nonfinite_buffers == ("bn.running_mean", "bn.running_var")


def test_a_non_finite_loss_is_summed_to_one_value() -> None:
    event = check_module(None, nn.Linear(2, 2), torch.tensor([1.0, math.inf]), 0)
    assert event is not None and event.kinds == ("loss",) and event.loss == math.inf
    assert (event.global_step, event.epoch, event.rank) == (0, 0, 0)  # no Trainer


def test_a_finite_loss_is_recorded_with_another_kind() -> None:
    net = nn.Linear(2, 2)
    with torch.no_grad():
        net.weight[0, 0] = math.inf
    event = check_module(None, net, torch.tensor([0.5, 0.25], dtype=torch.float16), 0)
    assert event is not None and event.kinds == ("param",) and event.loss == 0.75
    assert event.nonfinite_params == ("weight",) and event.nonfinite_grads == ()


def test_batchnorm_statistics_alone() -> None:
    net = Net()
    net.bn.running_var[1] = -1.0  # negative variance counts
    event = check_module(None, net, None, 0)
    assert event is not None and event.kinds == ("bn_stats",) and event.nonfinite_buffers == ("bn.running_var",)


def test_every_kind_in_order() -> None:
    net = Net()
    net(torch.full((4, 2), math.nan)).sum().backward()
    with torch.no_grad():
        net.head.bias.fill_(math.nan)
    event = check_module(None, net, torch.tensor(math.nan), 9)
    assert event is not None and event.kinds == ("loss", "grad", "bn_stats", "param")
    assert event.nonfinite_params == ("head.bias",)
    assert math.isnan(event.loss)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_the_gradient_names_are_only_the_bad_ones(value: float) -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    net[1].bias.grad[0] = value
    event = check_module(None, net, None, 0)
    assert event is not None and event.nonfinite_grads == ("1.bias",)
