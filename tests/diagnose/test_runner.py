"""One isolated forward/backward pass of a sub-batch (``lightning_nanguard.diagnose.runner``)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_nanguard.diagnose.runner import SubBatchRunner, finite_threshold, loss_from_output


class LogOf(nn.Module):
    """``log(w * x)`` per sample: non-finite exactly for the samples holding 0 (forward) or a negative value."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.seen: list[list[float]] = []

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        self.seen.append(batch.tolist())
        return (self.w * batch).log().mean()


class SqrtOf(nn.Module):
    """A finite loss with a NaN gradient for a sample holding exactly 0 (``sqrt`` at 0, times 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return ((self.w * batch).sqrt() * batch).sum()


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(1)
        self.sizes: list[int] = []

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        self.sizes.append(len(batch))
        self.modes = self.bn.training
        return self.bn(batch.unsqueeze(1)).square().mean()


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        (torch.tensor(2.0), 2.0),
        ({"loss": torch.tensor(3.0), "logits": torch.zeros(2)}, 3.0),
        ({"loss": 3.0}, None),
        ({"logits": torch.zeros(2)}, None),
        (None, None),
        ([torch.tensor(1.0)], None),
    ],
    ids=["tensor", "dict", "dict-float", "dict-no-loss", "none", "list"],
)
def test_loss_from_output(output: Any, expected: float | None) -> None:
    loss = loss_from_output(output)
    assert (loss.item() if loss is not None else None) == expected


@pytest.mark.parametrize(
    ("value", "expected"), [(2.5, 2.5), (1, 1.0), (math.nan, None), (math.inf, None), (-math.inf, None), (None, None)]
)
def test_finite_threshold(value: float | None, expected: float | None) -> None:
    assert finite_threshold(value) == expected


def test_is_bad_counts_passes_and_remembers_good_samples() -> None:
    module = LogOf()
    runner = SubBatchRunner(module, torch.tensor([1.0, 0.0, 2.0, 3.0]))
    assert runner.size == 4
    assert runner.is_bad([0, 1]) is True
    assert runner.is_bad([2, 0]) is False
    assert runner.is_bad([0, 3]) is False
    assert (runner.passes, runner.known_good, runner.saw_nonfinite) == (3, [2, 0, 3], True)
    assert module.seen == [[1.0, 0.0], [2.0, 1.0], [1.0, 3.0]]


def test_a_finite_loss_with_non_finite_gradients_is_bad() -> None:
    runner = SubBatchRunner(SqrtOf(), torch.tensor([4.0, 0.0]))
    assert runner.is_bad([1]) and not runner.is_bad([0])


def test_a_run_leaves_gradients_and_state_alone() -> None:
    module = SqrtOf()
    state = {k: v.clone() for k, v in module.state_dict().items()}
    runner = SubBatchRunner(module, torch.tensor([4.0, 0.0]))
    runner.is_bad([0, 1])
    assert module.w.grad is None  # torch.autograd.grad, never backward
    assert all(torch.equal(v, state[k]) for k, v in module.state_dict().items())


def test_the_whole_batch_in_order_is_the_batch_itself() -> None:
    batch = torch.tensor([1.0, 2.0, 3.0])
    runner = SubBatchRunner(LogOf(), batch)
    assert runner.sub_batch([0, 1, 2]) is batch
    assert runner.sub_batch([2, 1, 0]).tolist() == [3.0, 2.0, 1.0]
    assert runner.sub_batch([1]).tolist() == [2.0]


def test_a_loss_above_the_threshold_is_bad_but_not_non_finite() -> None:
    runner = SubBatchRunner(LogOf(), torch.tensor([1.0, 1e6]), loss_threshold=5.0)
    assert runner.is_bad([1]) and not runner.is_bad([0])
    assert not runner.saw_nonfinite and runner.known_good == [0]


def test_a_step_without_a_loss_is_never_bad() -> None:
    class NoLoss(nn.Module):
        def training_step(self, batch: Tensor, batch_idx: int) -> None:
            return None

    runner = SubBatchRunner(NoLoss(), torch.tensor([math.nan, 1.0]))
    assert runner.is_bad([0]) is False and runner.passes == 1


def test_step_fn_and_batch_idx_are_passed() -> None:
    calls: list[tuple[list[float], int]] = []

    def step(batch: Tensor, batch_idx: int) -> Tensor:
        calls.append((batch.tolist(), batch_idx))
        return batch.sum()

    runner = SubBatchRunner(nn.Linear(1, 1), torch.tensor([1.0, math.inf]), step_fn=step, batch_idx=7)
    assert runner.is_bad([1]) and not runner.is_bad([0])
    assert calls == [([math.inf], 7), ([1.0], 7)]


def test_a_single_sample_runs_next_to_a_known_good_one_under_train_mode_batchnorm() -> None:
    module = WithBatchNorm()
    runner = SubBatchRunner(module, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert runner.padded([2]) == ([2], True)  # no good sample yet: BatchNorm in eval mode
    runner.is_bad([2])
    assert module.sizes == [1] and module.modes is False
    runner.is_bad([0, 1])
    assert runner.padded([3]) == ([3, 2], False)
    runner.is_bad([3])
    assert module.sizes[-1] == 2 and module.modes is True
    assert module.bn.training  # the mode is restored after each run
    assert runner.padded([0, 1]) == ([0, 1], False)


def test_no_padding_without_train_mode_batchnorm() -> None:
    module = WithBatchNorm().eval()
    runner = SubBatchRunner(module, torch.tensor([1.0, 2.0]))
    assert not runner.has_train_bn and runner.padded([1]) == ([1], False)


def test_non_finite_batchnorm_statistics_make_a_run_bad() -> None:
    """Every gradient and the loss stay finite; only ``running_var`` overflows float32."""
    module = WithBatchNorm()
    runner = SubBatchRunner(module, torch.tensor([1e21, 0.0, 1.0, 2.0]))
    assert runner.is_bad([0, 1]) and not runner.is_bad([2, 3])
    assert torch.isfinite(module.bn.running_var).all()  # isolated: the statistics are restored


def test_the_context_is_entered_around_each_run() -> None:
    entered: list[bool] = []

    @contextlib.contextmanager
    def context() -> Iterator[None]:
        entered.append(True)
        yield

    runner = SubBatchRunner(LogOf(), torch.tensor([1.0, 2.0]), context=context)
    runner.is_bad([0])
    runner.is_bad([1])
    assert len(entered) == 2


def test_runs_under_no_grad_still_compute_gradients() -> None:
    runner = SubBatchRunner(SqrtOf(), torch.tensor([4.0, 0.0]))
    with torch.no_grad():
        assert runner.is_bad([1]) and not runner.is_bad([0])


class SequenceFirst:
    """A slicer for ``[time, batch]`` tensors, which also tells the batch size."""

    def __call__(self, batch: Tensor, positions: Sequence[int]) -> Tensor:
        return batch[:, list(positions)]

    def batch_size(self, batch: Tensor) -> int:
        return int(batch.shape[1])


def test_a_custom_slicer_with_its_batch_size() -> None:
    runner = SubBatchRunner(LogOf(), torch.ones(5, 3), slicer=SequenceFirst())
    assert runner.size == 3 and runner.custom_slicer
    assert runner.sub_batch([2]).shape == (5, 1)


def test_a_custom_slicer_with_the_modules_batch_size() -> None:
    module = LogOf()
    module.nanguard_batch_size = lambda batch: 3  # type: ignore[assignment]
    runner = SubBatchRunner(module, {"tokens": torch.ones(5, 3)}, slicer=lambda batch, positions: batch)
    assert runner.size == 3


def test_a_custom_slicer_without_a_batch_size_explains_what_to_add() -> None:
    with pytest.raises(TypeError, match="give it a `batch_size\\(batch\\)` attribute"):
        SubBatchRunner(LogOf(), object(), slicer=lambda batch, positions: batch)


def test_a_custom_slicer_falls_back_to_the_built_in_batch_size() -> None:
    runner = SubBatchRunner(LogOf(), torch.ones(4), slicer=lambda batch, positions: batch[list(positions)])
    assert runner.size == 4
