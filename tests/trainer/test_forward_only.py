"""Forward-only epochs (``trainer/forward_only.py``): SWA's BatchNorm epoch keeps a bad batch out of the statistics."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import build_trainer
from lightning.pytorch.callbacks import StochasticWeightAveraging
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NanGuard
from lightning_nanguard.engine.step.window import StepWindow
from lightning_nanguard.trainer.forward_only import FORWARD_ONLY_NOTE, ForwardOnlyEpoch, forward_only

BAD_ROW, BATCH = 20, 8  # the row sits in batch 2 of every epoch (no shuffling)


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return (self.net(x).squeeze(-1) - y).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def data(bad: bool) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4, generator=g), torch.randn(64, generator=g)
    if bad:
        x[BAD_ROW] = float("inf")
    return TensorDataset(x, y)


def swa_fit(tmp_path: Path, bad: bool, drop_bad_batch: bool = False) -> tuple[Regressor, NanGuard]:
    torch.manual_seed(0)
    dataset = data(bad)
    if drop_bad_batch:  # the reference: the same run without the bad batch's rows at all
        keep = [i for i in range(len(dataset)) if i // BATCH != BAD_ROW // BATCH]
        dataset = TensorDataset(*(t[keep] for t in dataset.tensors))
    guard = NanGuard(verbose=False)
    swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)
    model = Regressor()
    build_trainer("lightning", tmp_path, max_epochs=3, callbacks=[guard, swa]).fit(
        model, DataLoader(dataset, batch_size=BATCH)
    )
    return model, guard


@pytest.mark.filterwarnings("ignore:.*SWA.*")
def test_a_bad_batch_in_swas_batchnorm_epoch_is_left_out_of_the_statistics(tmp_path: Path) -> None:
    model, guard = swa_fit(tmp_path / "bad", bad=True)
    bn = model.net[1]
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert bool(torch.isfinite(bn.running_mean).all() and torch.isfinite(bn.running_var).all())
    assert int(bn.num_batches_tracked) == 64 // BATCH - 1  # every batch of the statistics epoch but the bad one
    *training, last = guard.events
    assert [(e.epoch, e.batch_idx) for e in training] == [(0, 2), (1, 2), (2, 2)]  # the training steps skipped
    assert (last.epoch, last.batch_idx, last.kinds, last.action) == (3, 2, ("bn_stats",), "skipped")
    assert last.details["forward_only"] == FORWARD_ONLY_NOTE and last.offending_samples is None
    assert last.details["batch_dataset_indices"] == list(range(16, 24))


def test_without_a_bad_batch_the_guard_changes_nothing_in_swas_epoch(tmp_path: Path) -> None:
    guarded, guard = swa_fit(tmp_path / "g", bad=False)
    torch.manual_seed(0)
    plain = Regressor()
    swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)
    build_trainer("lightning", tmp_path / "p", max_epochs=3, callbacks=[swa]).fit(
        plain, DataLoader(data(False), batch_size=BATCH)
    )
    assert guard.events == []
    for (name, a), b in zip(guarded.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_forward_only_reads_the_fit_loop_flag() -> None:
    assert forward_only(SimpleNamespace(fit_loop=SimpleNamespace(_skip_backward=True)))
    assert not forward_only(SimpleNamespace(fit_loop=SimpleNamespace(_skip_backward=False)))
    assert not forward_only(None)


def test_a_batch_is_checked_on_the_buffers_as_they_are_after_a_reset() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    window = StepWindow()
    window.attach(net, track_batchnorm=True)
    epoch = ForwardOnlyEpoch()
    net[1].running_mean = torch.zeros(2)  # assigned anew, as SWA's reset does
    net[1].momentum = None
    epoch.before_batch(window)
    net(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    trainer = SimpleNamespace(global_step=9, current_epoch=3, global_rank=0)
    assert epoch.after_batch(trainer, window, 0) is None
    kept = net[1].running_mean.clone()
    epoch.before_batch(window, [4, 5])
    net(torch.tensor([[float("nan"), 2.0], [3.0, 4.0]]))
    event = epoch.after_batch(trainer, window, 1)
    assert event is not None and event.nonfinite_buffers[0] == "1.running_mean"
    assert torch.equal(net[1].running_mean, kept) and int(net[1].num_batches_tracked) == 1
    assert event.details["batch_dataset_indices"] == [4, 5]
