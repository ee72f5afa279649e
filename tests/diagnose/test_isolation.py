"""Isolation: a re-run of ``training_step`` leaves no trace (logging muted, every side effect undone).

The same inside a real training run, bitwise against a run without forensics, is in
``tests/integration/test_isolation.py``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
import torchmetrics
from forensics_models import one_thread  # noqa: F401 (fixture)
from states import clone_state, states_equal
from torch import nn

from lightning_nanguard.diagnose.isolation import isolated, muted_logging

pytestmark = pytest.mark.usefixtures("one_thread")


class Logged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def log(self, name: str, value: Any) -> None:
        self.calls.append(name)

    def log_dict(self, values: dict[str, Any]) -> None:
        self.calls.extend(values)


def test_muted_logging_restores_class_and_instance_methods() -> None:
    module = Logged()
    with muted_logging(module):
        module.log("a", 1)
        module.log_dict({"b": 2})
    module.log("c", 3)
    assert module.calls == ["c"] and "log" not in vars(module) and "log_dict" not in vars(module)

    def own(name: str, value: Any) -> None:
        module.calls.append(f"own:{name}")

    module.log = own  # type: ignore[method-assign]
    with muted_logging(module):
        module.log("d", 4)
    module.log("e", 5)
    assert module.calls == ["c", "own:e"]


class Everything(nn.Module):
    """BatchNorm, dropout, a user buffer and two metrics: a forward changes all of them."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(3)
        self.drop = nn.Dropout(0.5)
        self.register_buffer("seen", torch.zeros(()))
        self.mse = torchmetrics.MeanSquaredError()
        self.mean = torchmetrics.MeanMetric()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x.shape[0]
        out = self.drop(self.bn(x))
        self.mse(out.sum(-1), torch.zeros(x.shape[0]))
        self.mean.update(out.sum())
        self.eval()  # a forward may even change modes
        return out


def metric_state(module: Everything) -> dict[str, Any]:
    state = {}
    for name in ("mse", "mean"):
        metric = getattr(module, name)
        for key in metric._defaults:
            state[f"{name}.{key}"] = clone_state(getattr(metric, key))
        state[f"{name}._update_count"] = metric._update_count
        state[f"{name}._computed"] = clone_state(metric._computed)
    return state


@pytest.mark.parametrize("fails", [False, True], ids=["returns", "raises"])
def test_isolated_undoes_every_side_effect(fails: bool) -> None:
    module = Everything()
    module(torch.randn(4, 3))  # non-trivial starting state
    module.train()
    module.mse.compute()  # a cached _computed value must come back too
    buffers = clone_state(dict(module.named_buffers()))
    metrics = metric_state(module)
    rng = torch.get_rng_state()
    py_rng, np_rng = random.getstate(), np.random.get_state()
    weight_grad = torch.ones(3)
    module.bn.weight.grad = weight_grad.clone()

    try:
        with isolated(module):
            out = module(torch.randn(5, 3) * 100)
            random.random()
            np.random.rand()
            torch.autograd.grad(out.sum(), [module.bn.weight])
            if fails:
                raise KeyError("boom")
    except KeyError:
        assert fails

    assert states_equal(dict(module.named_buffers()), buffers)
    assert states_equal(metric_state(module), metrics)
    assert all(m.training for m in module.modules())
    assert torch.equal(torch.get_rng_state(), rng)
    assert random.getstate() == py_rng
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state()[1:2], np_rng[1:2], strict=True))
    assert torch.equal(module.bn.weight.grad, weight_grad)
