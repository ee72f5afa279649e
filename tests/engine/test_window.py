"""The optimizer step in progress: micro-batches, losses, BatchNorm state, reference sample (``adapter.window``)."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from lightning_nanguard.engine.step.window import REFERENCE_SIZE, StepWindow


def batchnorm_net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))


def attached(net: nn.Module | None = None, track_batchnorm: bool = True) -> StepWindow:
    window = StepWindow()
    window.attach(net if net is not None else batchnorm_net(), track_batchnorm=track_batchnorm)
    return window


def test_a_checked_step_keeps_its_micro_batches_and_losses() -> None:
    window = attached()
    window.begin(checking=True)
    assert window.open and window.checking
    first, second = torch.ones(2, 2), torch.zeros(2, 2)
    window.add_batch(first, 6, [10, 11], keep=True)
    window.add_loss(torch.tensor(1.5, requires_grad=True))
    window.add_batch(second, 7, None, keep=True)
    window.add_loss(torch.tensor(0.5))
    assert [(m.batch, m.batch_idx, m.dataset_indices) for m in window.micro_batches] == [
        (first, 6, [10, 11]),
        (second, 7, None),
    ]
    assert window.micro_batches[0].batch is first  # by reference, no copy
    assert window.batch_idx == 7
    assert not any(loss.requires_grad for loss in window.losses)
    assert window.step_loss().item() == 2.0


def test_an_unchecked_step_keeps_nothing() -> None:
    window = attached()
    window.begin(checking=False)
    window.add_batch(torch.ones(2, 2), 3, None, keep=True)
    window.add_loss(torch.tensor(1.0))
    assert window.micro_batches == [] and window.losses == [] and window.step_loss() is None
    assert window.batch_idx == 3  # still known for an event


def test_batches_not_kept_are_not_kept() -> None:
    window = attached()
    window.begin(checking=True)
    window.add_batch(torch.ones(2, 2), 0, None, keep=False)
    assert window.micro_batches == []


def test_a_new_window_forgets_the_last_one() -> None:
    window = attached()
    window.begin(checking=True)
    window.add_batch(torch.ones(2, 2), 0, None, keep=True)
    window.add_loss(torch.tensor(1.0))
    window.close()
    assert not window.open
    window.begin(checking=True)
    assert window.micro_batches == [] and window.losses == []
    window.add_batch(torch.ones(2, 2), 1, None, keep=True)
    window.forget_batches()
    assert window.micro_batches == []


def test_step_loss_sums_the_micro_batches_in_float32_and_unscales() -> None:
    window = attached()
    window.begin(checking=True)
    window.add_loss(torch.tensor([1.0, 2.0], dtype=torch.float16))
    window.add_loss(torch.tensor(4.0, dtype=torch.bfloat16))
    loss = window.step_loss()
    assert loss.dtype == torch.float32 and loss.item() == 7.0
    assert window.step_loss(scale=torch.tensor(2.0)).item() == 3.5
    window.begin(checking=True)
    window.add_loss(torch.tensor(math.inf))
    assert window.step_loss().item() == math.inf


def test_restore_batchnorm_puts_back_the_buffers_before_the_step() -> None:
    net = batchnorm_net()
    window = attached(net)
    net(torch.randn(4, 2))  # statistics of an earlier step
    before = [t.clone() for t in net[1].buffers()]
    window.begin(checking=True)  # captured here
    net(torch.full((4, 2), math.nan))
    assert not torch.isfinite(net[1].running_mean).all()
    window.restore_batchnorm()
    assert all(torch.equal(a, b) for a, b in zip(net[1].buffers(), before, strict=True))


def test_an_unchecked_step_does_not_capture_the_buffers() -> None:
    net = batchnorm_net()
    window = attached(net)
    window.begin(checking=True)  # captures the initial statistics
    net(torch.randn(4, 2))
    after_first = [t.clone() for t in net[1].buffers()]
    window.begin(checking=False)  # no capture
    net(torch.randn(4, 2))
    window.restore_batchnorm()
    assert not all(torch.equal(a, b) for a, b in zip(net[1].buffers(), after_first, strict=True))
    assert int(net[1].num_batches_tracked) == 0  # back to the last capture


def test_batchnorm_buffers_only_when_tracked() -> None:
    net = batchnorm_net()
    window = attached(net, track_batchnorm=True)
    assert [name for name, _ in window.batchnorm_buffers] == [
        "1.running_mean",
        "1.running_var",
        "1.num_batches_tracked",
    ]
    assert window.running_vars == [net[1].running_var]
    assert attached(net, track_batchnorm=False).batchnorm_buffers == []
    assert StepWindow().batchnorm_buffers == [] and StepWindow().running_vars == []
    StepWindow().restore_batchnorm()  # not attached: nothing to do


@pytest.mark.parametrize("keep_after", [True, False])
def test_before_step_batchnorm(keep_after: bool) -> None:
    """Inside: the buffers as before the step (for a diagnosis); after: the step's own again, when the step is kept."""
    net = batchnorm_net()
    window = attached(net)
    window.begin(checking=True)
    initial = net[1].running_mean.clone()
    net(torch.randn(4, 2) + 5.0)
    stepped = net[1].running_mean.clone()
    with window.before_step_batchnorm(keep_after=keep_after):
        assert torch.equal(net[1].running_mean, initial)
        net(torch.randn(4, 2) - 5.0)  # a re-run that is not isolated changes them again
        inside = net[1].running_mean.clone()
    assert torch.equal(net[1].running_mean, stepped if keep_after else inside)


def test_discard_update_drops_gradients_and_batchnorm_updates() -> None:
    net = batchnorm_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    window = attached(net)
    window.begin(checking=True)
    net(torch.randn(4, 2)).sum().backward()
    weights = [p.clone() for p in net.parameters()]
    window.discard_update(optimizer)
    assert all(p.grad is None for p in net.parameters())
    assert int(net[1].num_batches_tracked) == 0
    optimizer.step()
    assert all(torch.equal(p, w) for p, w in zip(net.parameters(), weights, strict=True))


def test_the_reference_is_the_first_samples_of_a_healthy_step_every_n_steps() -> None:
    window = attached()
    window.refresh_reference(0, every_n_steps=10, slicer=None)
    assert window.reference is None  # no batch kept yet
    window.begin(checking=True)
    first = torch.arange(8.0).reshape(4, 2)
    window.add_batch(first, 0, None, keep=True)
    window.refresh_reference(5, every_n_steps=10, slicer=None)
    assert window.reference_step == 5 and torch.equal(window.reference, first[:REFERENCE_SIZE])
    window.begin(checking=True)
    window.add_batch(first + 100, 1, None, keep=True)
    window.refresh_reference(14, every_n_steps=10, slicer=None)
    assert window.reference_step == 5  # 9 steps old: kept
    window.refresh_reference(15, every_n_steps=10, slicer=None)
    assert window.reference_step == 15 and window.reference[0, 0].item() == 100.0


def test_the_reference_through_a_custom_slicer_and_an_unsliceable_batch() -> None:
    calls: list[list[int]] = []

    def slicer(batch: Any, positions: list[int]) -> Any:
        calls.append(list(positions))
        return {"x": batch["x"][positions]}

    window = attached()
    window.begin(checking=True)
    window.add_batch({"x": torch.ones(3, 2)}, 0, None, keep=True)
    window.refresh_reference(0, every_n_steps=1, slicer=slicer)
    assert calls == [[0, 1]] and window.reference["x"].shape == (2, 2)
    window.begin(checking=True)
    window.add_batch(SimpleNamespace(opaque=True), 1, None, keep=True)
    window.refresh_reference(1, every_n_steps=1, slicer=None)
    assert window.reference is None and window.reference_step == 1


def test_a_batch_of_one_sample_gives_no_reference() -> None:
    window = attached()
    window.begin(checking=True)
    window.add_batch(torch.ones(1, 2), 0, None, keep=True)
    window.refresh_reference(0, every_n_steps=1, slicer=None)
    assert window.reference is None
