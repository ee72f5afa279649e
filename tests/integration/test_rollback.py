"""``action="rollback"`` on a real Trainer: the state after a rollback is bitwise the last good snapshot's.

The tests record the whole training state (weights, BatchNorm buffers, Adam state, LR scheduler,
every RNG) after each batch in a helper callback and require the state after a rollback to be
bitwise the state recorded right after the last good snapshot. ``HostCopy`` and
``TrainingSnapshot`` on their own are tested in ``tests/recover/test_snapshot.py``.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from fitting import fit
from models import NAMESPACES
from states import clone_state, rng_states, states_equal
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NanGuard
from lightning_nanguard.trainer._compat import CALLBACK_BASES


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 1))


class _RollbackModule:
    """Linear -> BatchNorm -> ReLU -> Dropout -> Linear, Adam and a per-step StepLR."""

    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = _net()
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)  # type: ignore[attr-defined]
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _module(ns_name: str) -> Any:
    base = NAMESPACES[ns_name].LightningModule
    return type("RollbackModule", (_RollbackModule, base), {})()


class StateLog(*CALLBACK_BASES):  # type: ignore[misc]
    """Full training state after each batch, keyed by ``trainer.global_step`` (already incremented)."""

    def __init__(self, corrupt_steps: tuple[int, ...] = ()) -> None:
        self.corrupt_steps = corrupt_steps
        self.states: dict[int, dict[str, Any]] = {}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step in self.corrupt_steps:  # a huge-LR step: Adam moves every weight to +-inf/NaN
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = math.inf

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.states[trainer.global_step] = {
            "module": clone_state(pl_module.state_dict()),
            "optimizer": clone_state(trainer.optimizers[0].state_dict()),
            "scheduler": copy.deepcopy(trainer.lr_scheduler_configs[0].scheduler.state_dict()),
            "rng": rng_states(),
        }


def _regression_data(n: int, nan_at: tuple[int, ...] = ()) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 4, generator=g), torch.randn(n, generator=g)
    for i in nan_at:
        x[i, 1] = math.nan
    return TensorDataset(x, y)


@pytest.mark.parametrize("ns_name", list(NAMESPACES))
def test_rollback_restores_the_last_good_snapshot_bitwise(ns_name: str, tmp_path: Any) -> None:
    """Huge-LR steps 7 and 8 push every weight to +-inf/NaN; each is rolled back to the snapshot of step 5.

    Snapshots every 3 steps are taken after steps 2 and 5 (``global_step`` 3 and 6 after the batch);
    both rollbacks restore that same state: weights, BN buffers, Adam state (``step`` included), the
    StepLR state (it then steps once more, as after step 5) and the RNG streams.
    """
    guard = NanGuard(action="rollback", snapshot_every_n_steps=3, check_params_every_n_steps=1, verbose=False)
    log = StateLog(corrupt_steps=(7, 8))
    module, loader = _module(ns_name), DataLoader(_regression_data(96), batch_size=8)
    fit(module, loader, root=tmp_path, guard=guard, callbacks=[log], ns=ns_name, max_steps=11)

    assert [(e.global_step, e.kinds, e.action) for e in guard.events] == [
        (7, ("param",), "rolled_back"),
        (8, ("param",), "rolled_back"),
    ]
    assert all(e.remedies[0].startswith("rollback: restored the state") for e in guard.events)
    assert set(guard.events[0].nonfinite_params) == {n for n, _ in module.named_parameters()}
    assert guard.recovery.rollbacks_total == 2
    snapshot_state = log.states[6]
    assert states_equal(log.states[8], snapshot_state)
    assert states_equal(log.states[9], snapshot_state)  # the second rollback restores the very same state
    assert not states_equal(log.states[3], snapshot_state)
    assert not states_equal(log.states[10], log.states[9])  # training goes on from there
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert guard.skipped_total == 0  # nothing was skipped: the NaN came through an update, not a gradient


def test_rollback_after_consecutive_bad_steps(tmp_path: Any) -> None:
    """NaN samples in batches 2 and 3: step 2 is skipped, step 3 (2nd in a row) rolls back to step 1's snapshot."""
    guard = NanGuard(
        action="rollback", snapshot_every_n_steps=1, rollback_after_consecutive=2, save_repro=False, verbose=False
    )
    log = StateLog()
    loader = DataLoader(_regression_data(40, nan_at=(17, 26)), batch_size=8)
    fit(_module("lightning"), loader, root=tmp_path, guard=guard, callbacks=[log])

    assert [(e.global_step, e.action, e.dataset_indices) for e in guard.events] == [
        (2, "skipped", (17,)),
        (3, "rolled_back", (26,)),
    ]
    assert guard.recovery.rollbacks_total == 1
    assert guard.consecutive_bad_steps == 0
    assert guard.skipped_total == 2
    # after the rollback the state is the one right after step 1: LR schedule and RNG rewound too
    assert states_equal(log.states[4], log.states[2])
    assert not states_equal(log.states[3]["scheduler"], log.states[2]["scheduler"])
    assert not states_equal(log.states[5], log.states[4])
