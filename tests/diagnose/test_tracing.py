"""The instruments of a localisation run (``lightning_nanguard.diagnose.tracing``), used directly.

``localize`` (tests/diagnose/test_localization.py) runs them on real failure classes; here each
piece is checked alone: readable function names, row-wise finiteness, the graph walk, the BatchNorm
channels, and what the forward and backward tracers record.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_nanguard.diagnose.tracing import (
    BackwardTracer,
    ForwardTracer,
    Rows,
    _nodes,
    function_name,
    user_frame,
)

HERE = str(Path(__file__).resolve())


@pytest.mark.parametrize(
    ("func", "name"),
    [
        (torch.Tensor.__truediv__, "torch.div"),
        (torch.Tensor.__rmul__, "torch.mul"),
        (torch.Tensor.__matmul__, "torch.matmul"),
        (torch.Tensor.__neg__, "torch.neg"),
        (torch.Tensor.sqrt, "torch.sqrt"),
        (torch.sqrt, "torch.sqrt"),
        (torch.Tensor.__getitem__, "torch.Tensor.__getitem__"),
        (F.softmax, "torch.nn.functional.softmax"),
        (math.sqrt, "math.sqrt"),
    ],
)
def test_function_name(func: Any, name: str) -> None:
    assert function_name(func) == name


def test_function_name_of_a_plain_function_is_its_qualified_name() -> None:
    def helper() -> None:
        pass

    assert (
        function_name(helper)
        == f"{__name__}.test_function_name_of_a_plain_function_is_its_qualified_name.<locals>.helper"
    )


def test_nodes_visit_each_node_of_a_diamond_once() -> None:
    x = torch.ones(2, requires_grad=True)
    a = x * 2
    loss = (a.sin() + a.cos()).sum()
    names = [node.name().rpartition(":")[2] for node in _nodes(loss.grad_fn)]
    assert sorted(names) == [
        "AccumulateGrad",
        "AddBackward0",
        "CosBackward0",
        "MulBackward0",
        "SinBackward0",
        "SumBackward0",
    ]


def test_nodes_stop_before_the_ancestors_of_a_stopping_node() -> None:
    x = torch.ones(2, requires_grad=True)
    loss = (x * 2).exp().sum()
    names = [node.name() for node in _nodes(loss.grad_fn, stop=lambda node: node.name() == "ExpBackward0")]
    assert names == ["SumBackward0"]


def test_user_frame_is_this_line() -> None:
    found, line = user_frame(sys._getframe()), sys._getframe().f_lineno
    assert found == (HERE, line)


class Log(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.log(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Linear(2, 2, bias=False)
        self.log = Log()
        with torch.no_grad():
            self.scale.weight.copy_(torch.eye(2))

    def forward(self, x: Tensor) -> Tensor:
        return self.log(self.scale(x)).sum()


def test_forward_tracer_names_the_first_op_that_turns_finite_inputs_non_finite() -> None:
    net = Net()
    tracer = ForwardTracer(net, Rows(None, None))
    with tracer:
        loss = net(torch.tensor([[0.0, 1.0]]))
    tracer.remove()
    assert tracer.origin is not None
    op, site = tracer.origin
    assert op == "LogBackward0"
    assert (site.module, site.module_type, site.function, site.forward_nonfinite) == ("log", "Log", "torch.log", True)
    assert site.frames[0].path == HERE and site.frames[0].line == Log.forward.__code__.co_firstlineno + 1
    assert tracer.first_nonfinite is not None and tracer.first_nonfinite[0] == "LogBackward0"
    assert loss.grad_fn.metadata["nanguard"].function == "torch.sum"  # every node is tagged with its site
    assert not tracer.stack  # every module popped


def test_forward_tracer_ignores_deliberate_infinities() -> None:
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x: Tensor) -> Tensor:
            scores = (self.w * x).masked_fill(x == 0, -math.inf)
            return scores.softmax(-1).sum()

    net = Masked()
    tracer = ForwardTracer(net, Rows(None, None))
    with tracer:
        loss = net(torch.tensor([1.0, 0.0, 2.0]))
    tracer.remove()
    assert torch.isfinite(loss)
    assert tracer.origin is None and tracer.first_nonfinite is None


def test_forward_tracer_records_the_batchnorm_whose_statistics_went_bad() -> None:
    net = nn.Sequential(nn.Linear(1, 1), nn.BatchNorm1d(1))
    tracer = ForwardTracer(net, Rows(None, None))
    with tracer:
        net(torch.tensor([[1e20], [0.0], [0.0], [-1e20]]) * 1e5)
    tracer.remove()
    assert tracer.bn_origin is not None
    assert (tracer.bn_origin.module, tracer.bn_origin.module_type) == ("1", "BatchNorm1d")
    assert tracer.bn_origin.forward_nonfinite and tracer.bn_origin.function is None


def test_forward_tracer_remove_takes_every_hook_off() -> None:
    net = Net()
    tracer = ForwardTracer(net, Rows(None, None))
    assert net.log._forward_pre_hooks and net.log._forward_hooks
    tracer.remove()
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in net.modules())


def test_backward_tracer_names_the_node_that_turns_finite_gradients_non_finite() -> None:
    x = torch.tensor([0.0, 4.0], requires_grad=True)
    loss = (torch.sqrt(x) * 3.0).sum()
    tracer = BackwardTracer(loss, Rows(None, None))
    loss.backward()
    tracer.remove()
    assert tracer.origin == ("SqrtBackward0", None)  # no forward tracer ran: no site
    assert not torch.isfinite(x.grad).all()


def test_backward_tracer_with_the_forward_sites() -> None:
    class Root(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return torch.sqrt(x).sum()

    net = Root()
    x = torch.tensor([0.0, 1.0], requires_grad=True)
    forward = ForwardTracer(net, Rows(None, None))
    with forward:
        loss = net(x)
    forward.remove()
    backward = BackwardTracer(loss, Rows(None, None))
    torch.autograd.grad(loss, [x])
    backward.remove()
    assert backward.origin is not None
    op, site = backward.origin
    assert op == "SqrtBackward0" and site is not None
    assert (site.module, site.module_type, site.function) == ("", "Root", "torch.sqrt")


def test_backward_tracer_follows_the_chosen_rows() -> None:
    """Row 0's gradient is non-finite, row 1's finite: watching row 1 only finds nothing."""
    x = torch.tensor([[0.0], [1.0]], requires_grad=True)
    loss = torch.sqrt(x).sum()
    tracer = BackwardTracer(loss, Rows([1], 2))
    torch.autograd.grad(loss, [x])
    tracer.remove()
    assert tracer.origin is None


def test_a_removed_backward_tracer_records_nothing() -> None:
    x = torch.tensor([0.0], requires_grad=True)
    loss = torch.sqrt(x).sum()
    tracer = BackwardTracer(loss, Rows(None, None))
    tracer.remove()
    torch.autograd.grad(loss, [x])
    assert tracer.origin is None
