"""``BatchNormSnapshot`` (``lightning_nanguard.recover.batchnorm``), without a Trainer."""

from __future__ import annotations

import math

import pytest
import torch
from batchnorm_models import Nested
from torch import nn

from lightning_nanguard import BatchNormSnapshot
from lightning_nanguard.detect.batchnorm import batchnorm_buffers


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, so NaN payloads and -0.0 compare exactly."""
    return tensor.detach().contiguous().view(-1).view(torch.uint8)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e21], ids=["nan", "+inf", "-inf", "1e21"])
def test_restore_is_bitwise_after_a_corrupting_forward(value: float) -> None:
    torch.manual_seed(0)
    net = Nested()
    net.train()
    for _ in range(3):  # non-trivial statistics first
        net(torch.randn(8, 2, 1, 1))
    before = {name: tensor.clone() for name, tensor in batchnorm_buffers(net)}
    live_objects = {name: tensor for name, tensor in batchnorm_buffers(net)}

    snapshot = BatchNormSnapshot(net)
    snapshot.capture()
    x = torch.randn(8, 2, 1, 1)
    x[5, 1] = value
    net(x)
    changed = [name for name, tensor in batchnorm_buffers(net) if not bitwise_equal(tensor, before[name])]
    assert "stem.1.running_var" in changed
    assert "stem.1.num_batches_tracked" in changed
    if value != 1e21:
        assert not torch.isfinite(net.stem[1].running_mean).all()

    snapshot.restore()
    for name, tensor in batchnorm_buffers(net):
        assert bitwise_equal(tensor, before[name]), name
        assert tensor is live_objects[name]  # restored in place: references held elsewhere stay valid


def test_capture_refreshes_the_copy_and_restore_can_repeat() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    snapshot = BatchNormSnapshot(net)
    net(torch.randn(4, 2))
    snapshot.capture()
    second = [t.clone() for _, t in batchnorm_buffers(net)]
    net(torch.randn(4, 2))
    snapshot.restore()
    snapshot.restore()
    assert all(bitwise_equal(t, s) for (_, t), s in zip(batchnorm_buffers(net), second, strict=True))
    assert int(net[1].num_batches_tracked) == 1


def test_snapshot_is_taken_at_construction() -> None:
    net = nn.Sequential(nn.BatchNorm1d(2))
    snapshot = BatchNormSnapshot(net)
    net(torch.tensor([[1.0, math.nan], [2.0, 3.0]]))
    snapshot.restore()
    assert net[0].running_mean.tolist() == [0.0, 0.0]
    assert net[0].running_var.tolist() == [1.0, 1.0]
    assert int(net[0].num_batches_tracked) == 0


def test_capture_does_not_alias_the_live_buffers() -> None:
    net = nn.Sequential(nn.BatchNorm1d(2))
    snapshot = BatchNormSnapshot(net)
    snapshot.capture()
    with torch.no_grad():
        net[0].running_mean.fill_(7.0)
    snapshot.restore()
    assert net[0].running_mean.tolist() == [0.0, 0.0]


def test_refresh_after_dtype_change() -> None:
    net = nn.Sequential(nn.BatchNorm1d(2))
    snapshot = BatchNormSnapshot(net)
    net.double()  # new buffer tensors: the snapshot must re-discover them
    snapshot.refresh()
    snapshot.capture()
    before = net[0].running_var.clone()
    net(torch.tensor([[1.0, 5.0], [2.0, 9.0]], dtype=torch.float64))
    snapshot.restore()
    assert net[0].running_var.dtype == torch.float64
    assert bitwise_equal(net[0].running_var, before)
    assert snapshot.nbytes == 2 * 8 + 2 * 8 + 8


def test_no_batchnorm_is_a_noop() -> None:
    net = nn.Linear(2, 2)
    snapshot = BatchNormSnapshot(net)
    snapshot.capture()
    snapshot.restore()
    assert snapshot.named_buffers == []
    assert snapshot.nbytes == 0


def test_nbytes() -> None:
    snapshot = BatchNormSnapshot(nn.Sequential(nn.BatchNorm1d(3), nn.BatchNorm1d(5)))
    assert snapshot.nbytes == (3 + 3) * 4 + 8 + (5 + 5) * 4 + 8


def test_restore_does_not_record_autograd_history() -> None:
    net = nn.Sequential(nn.BatchNorm1d(2))
    snapshot = BatchNormSnapshot(net)
    net(torch.randn(4, 2, requires_grad=True)).sum().backward()
    snapshot.restore()
    assert net[0].running_mean.grad_fn is None
    assert not net[0].running_mean.requires_grad
