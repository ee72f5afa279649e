"""Two-process DDP runs on CPU (gloo) with faults on one rank only; run by ``test_ddp.py``.

Usage: ``python tests/helpers/ddp_script.py SCENARIO OUTPUT_DIR``. Every rank builds its own data (no
distributed sampler); the fault is on rank 1 only. Each rank writes ``rank<N>.json``: a hash of
its final parameter bytes, the global steps whose update it skipped, its events, counters, learning
rate, whether its guard is still active, and the error it stopped with, if any.

Scenarios (``SCENARIOS``): ``skip`` (a NaN sample in batch 1 and a label typo in batch 20 of rank 1),
``max_events`` and ``consecutive`` (rank-local faults that escalate), ``lr_backoff`` (a remedy decided on
rank 1's incident), ``failure`` (rank 1's spike watch fails at step 0, then its core check at step 1),
``sync_free`` (rank 1's NaN skipped
on the device), ``logged`` (``self.log(..., sync_dist=True)`` with a NaN step and a spike on rank 1: both
dropped from the epoch values on every rank), ``spawn`` (``strategy="ddp_spawn"``: the workers write
``rank<N>.json`` when training ends, the process that called ``fit`` writes ``main.json`` with what its
own guard object saw).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from process_group import finish_script, leave_process_group_at_exit
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NanGuard, NonFiniteTrainingError

leave_process_group_at_exit()  # every process of the run, ddp_spawn's workers too (they import this file)

BAD_RANK = 1


@dataclass(frozen=True)
class Scenario:
    """A fault on rank 1 and the guard's configuration."""

    nan_indices: tuple[int, ...] = ()  # dataset items of rank 1 with a NaN feature (batch = index // 8)
    typo_indices: tuple[int, ...] = ()  # dataset items of rank 1 whose label is 1e4 instead of ~1 (a loss spike)
    guard: dict[str, Any] = field(default_factory=dict)
    fail_at_step: int | None = None  # rank 1's guard raises an internal error at this step (its core check)
    part_fails_at_step: int | None = None  # rank 1's spike watch (an optional part) raises at this step
    batches: int = 4
    fused: bool = False  # torch's fused Adam (which can skip a step on the device: sync_free)
    spawn: bool = False  # strategy="ddp_spawn": fit runs in two fresh worker processes
    log: bool = False  # self.log the loss (mean, sum, max; sync_dist=True) and record every step's value


SCENARIOS: dict[str, Scenario] = {
    "skip": Scenario(nan_indices=(11,), typo_indices=(8 * 20 + 5,), batches=24, guard={"remedies": ["quarantine"]}),
    "max_events": Scenario(nan_indices=(11, 27, 43, 59), guard={"max_events": 2}, batches=8),
    "consecutive": Scenario(nan_indices=(19, 27), guard={"max_consecutive_bad_steps": 2}),
    "lr_backoff": Scenario(nan_indices=(11,), guard={"remedies": ["lr_backoff"], "bisect": False}),
    "failure": Scenario(fail_at_step=1, part_fails_at_step=0),
    "sync_free": Scenario(nan_indices=(11,), guard={"sync_free": True}, fused=True),
    "spawn": Scenario(nan_indices=(11,), spawn=True),
    "logged": Scenario(nan_indices=(11,), typo_indices=(8 * 20 + 5,), batches=24, log=True),
}


class Regression(pl.LightningModule):
    def __init__(self, scenario: Scenario) -> None:
        super().__init__()
        torch.manual_seed(0)  # identical initial weights on every rank
        self.scenario = scenario
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.records: list[tuple[int, float, int]] = []  # (batch_idx, loss, batch size) of every step (LossRecord)

    def train_dataloader(self) -> DataLoader:
        rank = self.trainer.global_rank
        g = torch.Generator().manual_seed(100 + rank)  # different data per rank
        n = 8 * self.scenario.batches
        x, y = torch.randn(n, 4, generator=g), torch.randn(n, generator=g)
        if rank == BAD_RANK:
            for index in self.scenario.nan_indices:
                x[index, 1] = float("nan")
            for index in self.scenario.typo_indices:
                y[index] = 1e4
        return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        if self.scenario.log:
            self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
            self.log("loss_sum", loss, on_epoch=True, reduce_fx="sum", sync_dist=True)
            self.log("loss_max", loss, on_epoch=True, reduce_fx="max", sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2, fused=self.scenario.fused)


class SkipLog(pl.Callback):
    """Global steps whose update left every parameter bitwise unchanged, and the strategy class in use."""

    def __init__(self) -> None:
        self.skipped: list[int] = []
        self.strategy_class = ""
        self._before: list[torch.Tensor] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.strategy_class = type(trainer.strategy).__name__

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._before = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if all(torch.equal(a, p) for a, p in zip(self._before, pl_module.parameters(), strict=True)):
            self.skipped.append(trainer.global_step - 1)


class LossRecord(pl.Callback):
    """Every step's loss as ``training_step`` returned it (once per step: the guard's re-runs are not steps)."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
        pl_module.records.append((i, float(outputs["loss"]), len(batch[0])))


class ActiveLog(pl.Callback):
    """Whether the guard was active at the start of each step."""

    def __init__(self, guard: NanGuard) -> None:
        self.guard = guard
        self.active: list[bool] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.active.append(self.guard.active)


def _inject_failure(guard: NanGuard, rank: int, step: int) -> None:
    """Make rank ``rank``'s guard fail inside its per-step code at global step ``step`` (a bug in the guard)."""
    import lightning_nanguard.engine.controller as controller_module

    original = controller_module.step_flags

    def failing(trainer: Any, *args: Any, **kwargs: Any) -> Any:
        if trainer.global_rank == rank and trainer.global_step == step:
            raise RuntimeError("injected internal failure")
        return original(trainer, *args, **kwargs)

    controller_module.step_flags = failing  # this process's only guard: the per-step check of its controller


def _inject_part_failure(rank: int, step: int) -> None:
    """Make rank ``rank``'s spike watch (an optional part of its guard) fail at global step ``step``."""
    from lightning_nanguard.engine.step.spikes import SpikeWatch

    original = SpikeWatch.check
    calls = {"n": 0}

    def failing(watch: SpikeWatch, *args: Any) -> Any:
        calls["n"] += 1
        if torch.distributed.get_rank() == rank and calls["n"] == step + 1:
            raise RuntimeError("injected failure of the spike watch")
        return original(watch, *args)

    SpikeWatch.check = failing  # type: ignore[method-assign]


class SpawnedResult(pl.Callback):
    """Under ``ddp_spawn``: each worker writes its ``rank<N>.json`` when training ends (the workers' guards)."""

    def __init__(self, guard: NanGuard, skips: SkipLog, active: ActiveLog, out_dir: str) -> None:
        self.guard, self.skips, self.active, self.out_dir = guard, skips, active, out_dir

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _write(trainer, pl_module, self.guard, self.skips, self.active, None, self.out_dir)


def _write(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    guard: NanGuard,
    skips: SkipLog,
    active: ActiveLog,
    error: dict[str, Any] | None,
    out_dir: str,
) -> None:
    weights = b"".join(p.detach().cpu().numpy().tobytes() for p in module.parameters())
    result = {
        "rank": trainer.global_rank,
        "out_dir": out_dir,
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "strategy_class_during_fit": skips.strategy_class,
        "strategy_class_after_fit": type(trainer.strategy).__name__,
        "weights_sha256": hashlib.sha256(weights).hexdigest(),
        "finite": all(bool(torch.isfinite(p).all()) for p in module.parameters()),
        "skipped_steps": skips.skipped,
        "counters": {
            "bad_steps_total": guard.bad_steps_total,
            "skipped_total": guard.skipped_total,
            "consecutive_bad_steps": guard.consecutive_bad_steps,
            "spikes_total": getattr(getattr(guard, "counters", None), "spikes_total", 0),
        },
        "active": guard.active,
        "active_per_step": active.active,
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "quarantined": sorted(guard.remedy_book.quarantined),
        "events": [event.to_dict() for event in guard.events],
        "error": error,
        "records": getattr(module, "records", []),
        "epoch_values": {k: float(v) for k, v in trainer.callback_metrics.items() if not k.endswith("_step")},
    }
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(result, handle)


def main(name: str, out_dir: str) -> None:
    scenario = SCENARIOS[name]
    guard = NanGuard(verbose=False, save_repro=False, **scenario.guard)
    skips, active = SkipLog(), ActiveLog(guard)
    callbacks: list[pl.Callback] = [guard, skips, active, LossRecord()]
    if scenario.spawn:
        callbacks.append(SpawnedResult(guard, skips, active, out_dir))
    trainer = pl.Trainer(
        strategy="ddp_spawn" if scenario.spawn else "ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=out_dir,
        callbacks=callbacks,
    )
    if scenario.fail_at_step is not None:
        _inject_failure(guard, BAD_RANK, scenario.fail_at_step)
    if scenario.part_fails_at_step is not None:
        _inject_part_failure(BAD_RANK, scenario.part_fails_at_step)
    module = Regression(scenario)
    error: dict[str, Any] | None = None
    try:
        trainer.fit(module)
    except NonFiniteTrainingError as caught:
        error = {"type": type(caught).__name__, "message": str(caught), "step": trainer.global_step}
    if not scenario.spawn:
        _write(trainer, module, guard, skips, active, error, out_dir)
        return
    weights = b"".join(p.detach().cpu().numpy().tobytes() for p in module.parameters())  # sent back by rank 0
    main_result = {
        "events": [event.to_dict() for event in guard.events],
        "bad_steps_total": guard.bad_steps_total,
        "weights_sha256": hashlib.sha256(weights).hexdigest(),
    }
    with open(os.path.join(out_dir, "main.json"), "w", encoding="utf-8") as handle:
        json.dump(main_result, handle)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    finish_script()
