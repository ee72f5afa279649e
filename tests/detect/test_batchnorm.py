"""The BatchNorm running statistics the per-step check covers (``lightning_nanguard.detect.batchnorm``)."""

from __future__ import annotations

import torch
from batchnorm_models import Nested
from torch import nn

from lightning_nanguard.detect.batchnorm import batchnorm_buffers, batchnorm_running_vars


def test_batchnorm_buffers_names_every_tracked_batchnorm() -> None:
    names = [name for name, _ in batchnorm_buffers(Nested())]
    expected = []
    for module in ("stem.1", "blocks.0.1", "blocks.1.1", "norm3d", "sync"):
        expected += [f"{module}.running_mean", f"{module}.running_var", f"{module}.num_batches_tracked"]
    assert names == expected


def test_batchnorm_buffers_of_a_bare_batchnorm_and_of_no_batchnorm() -> None:
    assert [n for n, _ in batchnorm_buffers(nn.BatchNorm1d(2))] == [
        "running_mean",
        "running_var",
        "num_batches_tracked",
    ]
    assert batchnorm_buffers(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))) == []


def test_batchnorm_buffers_are_the_live_tensors() -> None:
    net = nn.Sequential(nn.BatchNorm1d(3))
    found = dict(batchnorm_buffers(net))
    assert found["0.running_mean"] is net[0].running_mean
    assert found["0.num_batches_tracked"] is net[0].num_batches_tracked


def test_lazy_batchnorm_counts_once_initialised() -> None:
    net = nn.Sequential(nn.LazyBatchNorm1d())
    names = [n for n, _ in batchnorm_buffers(net)]
    assert "0.running_mean" not in names  # uninitialised buffers are skipped
    assert "0.running_var" not in names
    net(torch.randn(4, 3))
    assert [n for n, _ in batchnorm_buffers(net)] == ["0.running_mean", "0.running_var", "0.num_batches_tracked"]


def test_batchnorm_running_vars() -> None:
    net = Nested()
    running_vars = batchnorm_running_vars(batchnorm_buffers(net))
    assert len(running_vars) == 5
    assert running_vars[0] is net.stem[1].running_var


def test_batchnorm_buffers_in_the_order_of_named_modules() -> None:
    net = nn.Sequential(nn.BatchNorm1d(2), nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), nn.BatchNorm1d(2))
    assert [n for n, _ in batchnorm_buffers(net)][::3] == ["0.running_mean", "1.1.running_mean", "2.running_mean"]


def test_running_vars_of_a_list_without_running_vars() -> None:
    assert batchnorm_running_vars([("bn.running_mean", torch.zeros(2))]) == []
    assert batchnorm_running_vars([]) == []
