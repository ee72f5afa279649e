"""Element-wise confirmation on the bad path (``lightning_nanguard.detect.confirm``): which tensors, one read."""

from __future__ import annotations

import math

import pytest
import torch
from host_reads import HostReadCounter
from torch import nn

from lightning_nanguard import nonfinite_names
from lightning_nanguard.detect.confirm import all_finite, bad_batchnorm_names, negative_names


def test_nonfinite_names_keeps_order_and_finds_all() -> None:
    named = [
        ("a", torch.ones(2)),
        ("b", torch.tensor([1.0, math.inf])),
        ("c", torch.ones(2)),
        ("d", torch.tensor([math.nan])),
        ("e", torch.tensor(-math.inf)),
    ]
    assert nonfinite_names(iter(named)) == ["b", "d", "e"]  # any iterable, e.g. a generator


def test_nonfinite_names_detaches_tensors_that_require_grad() -> None:
    weight = torch.nn.Parameter(torch.tensor([1.0, math.nan]))
    assert nonfinite_names([("weight", weight)]) == ["weight"]


def test_nonfinite_names_of_nothing() -> None:
    assert nonfinite_names([]) == []


def test_nonfinite_names_reads_the_host_once_for_all_tensors() -> None:
    named = [(str(i), torch.tensor([1.0, math.nan if i == 7 else 0.0])) for i in range(20)]
    with HostReadCounter() as counter:
        assert nonfinite_names(named) == ["7"]
    assert sum(counter.reads.values()) == 1


def test_nonfinite_names_of_sparse_and_complex_tensors() -> None:
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 4]]), torch.tensor([1.0, math.inf]), (6,), check_invariants=True)
    complex_nan = torch.tensor([1 + 1j, complex(0, math.nan)])
    named = [("sparse", sparse), ("complex", complex_nan), ("ok", torch.ones(2, dtype=torch.complex64))]
    assert nonfinite_names(named) == ["sparse", "complex"]


def test_negative_names() -> None:
    named = [("a", torch.tensor([0.0, -0.0])), ("b", torch.tensor([3.0, -1e-30])), ("c", torch.tensor([-5]))]
    assert negative_names(named) == ["b", "c"]
    assert negative_names([]) == []


def test_bad_batchnorm_names_lists_nonfinite_buffers_then_negative_variances() -> None:
    buffers = [
        ("a.running_mean", torch.tensor([math.nan])),
        ("a.running_var", torch.tensor([1.0])),
        ("b.running_mean", torch.tensor([-3.0])),  # a negative mean is fine
        ("b.running_var", torch.tensor([-1.0])),
        ("c.running_var", torch.tensor([math.inf, -2.0])),  # non-finite and negative: named once
        ("c.num_batches_tracked", torch.tensor(-1)),  # integer: never checked
    ]
    assert bad_batchnorm_names(buffers) == ["a.running_mean", "c.running_var", "b.running_var"]


def test_bad_batchnorm_names_of_a_real_batchnorm() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    buffers = [(f"1.{name}", tensor) for name, tensor in net[1].named_buffers()]
    assert bad_batchnorm_names(buffers) == []
    net[1].running_var[1] = -0.5
    assert bad_batchnorm_names(buffers) == ["1.running_var"]


@pytest.mark.parametrize(
    ("tensors", "expected"),
    [
        ([torch.ones(3), torch.zeros(2, dtype=torch.float64)], True),
        ([torch.full((8,), 3e38)], True),  # the norm overflows, every element is finite
        ([torch.ones(3), torch.tensor([math.inf])], False),
        ([torch.tensor([1.0, math.nan], dtype=torch.bfloat16)], False),
        ([torch.tensor([complex(math.inf, 0)])], False),
        ([torch.arange(4), torch.tensor([True])], True),  # integer and boolean tensors are ignored
        ([], True),
    ],
    ids=["finite", "norm-overflow", "inf", "bf16-nan", "complex-inf", "no-floats", "empty"],
)
def test_all_finite(tensors: list[torch.Tensor], expected: bool) -> None:
    assert all_finite(tensors) is expected


def test_all_finite_of_finite_tensors_is_one_host_read() -> None:
    tensors = [torch.randn(10) for _ in range(12)]
    with HostReadCounter() as counter:
        assert all_finite(tensors)
    assert sum(counter.reads.values()) == 1
