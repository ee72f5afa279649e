"""Finiteness as a localisation tests it: whole tensors, the rows of chosen samples (per loader), sparse, BatchNorm."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lightning_nanguard.diagnose.finiteness import Rows, bn_bad_channels, bn_channels_of, finite


def test_finite_reads_floating_and_complex_tensors_only() -> None:
    assert finite([torch.ones(2), torch.tensor([1 + 1j]), 3.0, "text", torch.tensor([-1])])
    assert not finite([torch.ones(2), torch.tensor([complex(0, math.inf)])])
    assert not finite([torch.tensor([1.0, math.nan], dtype=torch.float16)])
    assert finite([])


def test_rows_look_only_at_the_chosen_samples() -> None:
    x = torch.tensor([[1.0, 2.0], [math.nan, 0.0], [3.0, 4.0]])
    assert Rows([0, 2], 3).finite([x])
    assert not Rows([1], 3).finite([x])
    assert not Rows(None, 3).finite([x]) and not Rows([0], None).finite([x])  # no rows or no size: whole tensors


def test_rows_check_tensors_without_the_batch_dimension_whole() -> None:
    rows = Rows([0], 3)
    assert not rows.finite([torch.tensor([math.inf, 1.0])])  # first dimension 2, not the batch
    assert not rows.finite([torch.tensor(math.nan)])  # 0-dim
    assert rows.finite([torch.tensor([1, 2, 3])])  # integers are never non-finite


def _sparse(value: float) -> Tensor:
    return torch.sparse_coo_tensor(torch.tensor([[2]]), torch.tensor([value]), (3,), check_invariants=True)


def test_finiteness_of_sparse_tensors() -> None:
    assert finite([_sparse(1.0)]) and not finite([_sparse(math.nan)])
    assert not Rows([0], 3).finite([_sparse(math.inf)])  # sparse: checked whole


def test_bn_bad_channels_and_bn_channels_of() -> None:
    net = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 4), nn.BatchNorm1d(4), nn.LayerNorm(4))
    assert bn_channels_of(net) == {}
    net[0].running_mean[1] = math.nan
    net[0].running_var[3] = -1.0
    net[2].running_var[0] = math.inf
    assert bn_bad_channels(net[0]) == [1, 3]
    assert bn_channels_of(net) == {"0": [1, 3], "2": [0]}
    assert bn_bad_channels(nn.BatchNorm1d(2, track_running_stats=False)) == []
    assert bn_bad_channels(net[3]) == []


def test_rows_per_size_follow_each_loaders_rows_and_skip_healthy_loaders() -> None:
    a = torch.ones(4, 2)
    a[1] = math.nan  # a healthy loader's sample, masked on purpose: never followed
    b = torch.ones(3, 2)
    b[2] = math.inf
    follow = Rows.per_size({4: [], 3: [2]})
    assert not follow.finite([a, b]) and Rows.per_size({4: [], 3: [0, 1]}).finite([a, b])
    assert Rows.per_size({4: [0], 3: [2]}).nan_free([a, b])  # Inf is not NaN
    assert not Rows.per_size({4: [1], 3: []}).nan_free([a, b])
    assert not Rows.per_size({4: [0]}).finite([torch.full((5,), math.nan)])  # another size: tested whole
