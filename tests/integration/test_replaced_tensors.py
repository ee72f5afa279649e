"""Tensors other code replaces mid-run are followed: the step is checked on what its optimizer updates,
and the BatchNorm buffers as the model holds them now.

Each test replaces tensors the guard found at ``on_train_start`` (a callback assigning BatchNorm buffers,
a head built mid-run and added to the optimizer) and then feeds a bad batch that only those new tensors
see: without following them, the NaN/Inf would reach the weights or the statistics with no event.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from fitting import build_trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NanGuard

BATCH = 4


def loader(bad_rows: tuple[int, ...] = (), flag_rows: tuple[int, ...] = ()) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y, flag = torch.randn(32, 4, generator=g), torch.randn(32, generator=g), torch.zeros(32)
    for row in bad_rows:
        x[row] = float("inf")
    for row in flag_rows:
        flag[row] = 1.0
    return DataLoader(TensorDataset(x, y, flag), batch_size=BATCH)


class Normed(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.out = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y, _ = batch
        return (self.out(self.bn(self.lin(x))).squeeze(-1) - y).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class ReplaceBuffers(pl.Callback):
    """Assigns new BatchNorm buffers at one batch, as SWA's reset or a user hook does; keeps their values."""

    def __init__(self, at_batch: int) -> None:
        self.at_batch = at_batch
        self.before_bad: dict[str, Tensor] = {}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.at_batch:
            pl_module.bn.running_mean = pl_module.bn.running_mean.clone()
            pl_module.bn.running_var = pl_module.bn.running_var.clone()
        if batch_idx == self.at_batch + 1:  # the bad batch comes next
            self.before_bad = {k: v.clone() for k, v in pl_module.bn.state_dict().items()}


def test_batchnorm_buffers_assigned_mid_run_are_checked_and_restored(tmp_path: Path) -> None:
    """New buffers at batch 2, the bad batch at 3: it is caught on them and they are put back."""
    guard, replace = NanGuard(verbose=False), ReplaceBuffers(at_batch=2)
    model = Normed()
    build_trainer("lightning", tmp_path, callbacks=[replace, guard]).fit(model, loader(bad_rows=(13,)))
    (event,) = guard.events
    assert event.batch_idx == 3 and "bn.running_mean" in event.nonfinite_buffers
    assert event.dataset_indices == (13,)
    assert torch.isfinite(model.bn.running_mean).all() and torch.isfinite(model.bn.running_var).all()
    after = model.bn.state_dict()
    assert int(after["num_batches_tracked"]) == 8 - 1  # the bad batch left no count either


class HeadBuiltMidRun(pl.LightningModule):
    """A second head built at epoch 1 and added to the optimizer; a flagged row gives NaN in its gradient only."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head: nn.Linear | None = None

    def on_train_epoch_start(self) -> None:
        if self.current_epoch == 1 and self.head is None:
            self.head = nn.Linear(4, 1)
            self.trainer.optimizers[0].add_param_group({"params": self.head.parameters()})

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y, flag = batch
        h = self.body(x)
        loss = (h.sum(-1) - y).pow(2).mean()
        if self.head is not None:
            out = self.head(h.detach()).squeeze(-1)
            # a division masked after the fact: finite forward, NaN gradient of the head for flagged rows only
            loss = loss + torch.where(flag > 0, torch.zeros_like(out), out / (1 - flag)).mean()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_parameter_group_added_mid_run_is_checked(tmp_path: Path) -> None:
    guard, model = NanGuard(verbose=False), HeadBuiltMidRun()
    build_trainer("lightning", tmp_path, max_epochs=2, callbacks=[guard]).fit(model, loader(flag_rows=(6,)))
    assert model.head is not None
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    (event,) = guard.events  # epoch 0 has no head: the flag does nothing there
    assert (event.epoch, event.batch_idx, event.kinds) == (1, 1, ("grad",))
    assert set(event.nonfinite_grads) == {"head.weight", "head.bias"}
    assert event.offending_samples == (2,) and event.dataset_indices == (6,)


class FrozenHead(HeadBuiltMidRun):
    """:class:`HeadBuiltMidRun` with the head built up front, frozen and outside the optimizer until unfrozen."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 1).requires_grad_(False)

    def on_train_epoch_start(self) -> None:
        pass

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.body.parameters(), lr=0.01)


class UnfreezeMidEpoch(pl.Callback):
    """Unfreezes the head at one batch of the epoch and adds it to the optimizer, as ``BackboneFinetuning`` does."""

    def __init__(self, at_batch: int) -> None:
        self.at_batch = at_batch
        self.around: dict[str, dict[str, Tensor]] = {}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.at_batch:
            pl_module.head.requires_grad_(True)
            trainer.optimizers[0].add_param_group({"params": list(pl_module.head.parameters())})
            self.around["before"] = {k: v.clone() for k, v in pl_module.state_dict().items()}

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.at_batch:
            self.around["after"] = {k: v.clone() for k, v in pl_module.state_dict().items()}


def test_a_parameter_group_added_mid_epoch_is_checked_from_its_first_step(tmp_path: Path) -> None:
    """The head joins the optimizer at batch 3 of the first epoch; its gradient is NaN at that very step (row 13)."""
    guard, model, unfreeze = NanGuard(verbose=False), FrozenHead(), UnfreezeMidEpoch(at_batch=3)
    initial_head = {k: v.clone() for k, v in model.head.state_dict().items()}
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard, unfreeze])
    trainer.fit(model, loader(flag_rows=(13,)))
    assert len(trainer.optimizers[0].param_groups) == 2
    assert [(e.epoch, e.batch_idx, e.kinds, e.action) for e in guard.events] == [(0, 3, ("grad",), "skipped")]
    event = guard.events[0]
    assert set(event.nonfinite_grads) == {"head.weight", "head.bias"}
    assert event.offending_samples == (1,) and event.dataset_indices == (13,)
    before, after = unfreeze.around["before"], unfreeze.around["after"]
    assert all(torch.equal(before[k], after[k]) for k in before)  # the step was skipped: nothing moved
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert not torch.equal(model.head.weight, initial_head["weight"])  # the head trained in the steps after


class LoadAssigned(pl.Callback):
    """Loads a state with ``assign=True`` at epoch 1: the model's parameters become new tensors the optimizer lacks."""

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.current_epoch == 1:
            state = {k: v.clone() for k, v in pl_module.state_dict().items()}
            pl_module.load_state_dict(state, assign=True)
            self.assigned = {name: p.detach().clone() for name, p in pl_module.named_parameters()}


def test_parameters_replaced_by_assign_are_told_once(tmp_path: Path, caplog: Any) -> None:
    guard, model, assign = NanGuard(verbose=False), Normed(), LoadAssigned()
    with caplog.at_level("WARNING", logger="lightning_nanguard"):
        build_trainer("lightning", tmp_path, max_epochs=3, callbacks=[assign, guard]).fit(model, loader())
    told = [r.getMessage() for r in caplog.records if "no longer the model's parameters" in r.getMessage()]
    assert len(told) == 1 and "6 tensor(s)" in told[0] and "assign=False" in told[0]  # weight and bias of lin, bn, out
    assert "training no longer changes those weights of the model" in told[0]
    for name, tensor in model.named_parameters():  # ... and by its effect: two epochs later, not one changed
        assert torch.equal(tensor, assign.assigned[name]), name
    assert guard.events == []


class ScaleOutsideTheModel(pl.LightningModule):
    """The optimizer also updates a plain tensor the module does not register; a flagged row makes its gradient NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.scale = torch.ones(1, requires_grad=True)  # not a Parameter: not in named_parameters()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y, flag = batch
        out = self.lin(x).squeeze(-1).detach() * self.scale
        masked = torch.where(flag > 0, torch.zeros_like(out), out / (1 - flag))  # NaN gradient of scale only
        return (self.lin(x).squeeze(-1) - y).pow(2).mean() + masked.mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([*self.parameters(), self.scale], lr=0.01)


def test_a_tensor_only_the_optimizer_holds_stays_checked_after_an_epoch_start(tmp_path: Path) -> None:
    """Its gradient is checked and named in every epoch, not only until parameters are found again."""
    guard, model = NanGuard(verbose=False), ScaleOutsideTheModel()
    build_trainer("lightning", tmp_path, max_epochs=2, callbacks=[guard]).fit(model, loader(flag_rows=(6,)))
    assert [(e.epoch, e.batch_idx, e.kinds) for e in guard.events] == [(0, 1, ("grad",)), (1, 1, ("grad",))]
    assert all(e.nonfinite_grads == ("<optimizer tensor 2 not in the model>",) for e in guard.events)
    assert bool(torch.isfinite(model.scale).all())
