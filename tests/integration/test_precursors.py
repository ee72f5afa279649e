"""Attention precursors through a real ``Trainer``: the warning's contract, the rate limit, the off switch.

The logits here are made to grow on purpose (a callback scales one layer's query projection after
every step from step 30 on), so the plumbing is tested apart from the rule's calibration; runs that
collapse by themselves at a too-high learning rate are in ``test_precursor_runs.py``. Under a
sharded strategy the watch is off (``GuardSettings``).
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fitting import build_trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NanGuard

STEPS = 120


class Attention(nn.Module):
    def __init__(self, dim: int, sdpa: bool) -> None:
        super().__init__()
        self.sdpa = sdpa
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.sdpa:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        logits = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
        causal = torch.ones(x.size(1), x.size(1), dtype=torch.bool).tril()
        return torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1) @ v


class TinyTransformer(pl.LightningModule):
    def __init__(self, sdpa: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 16)
        self.blocks = nn.ModuleList([nn.ModuleDict({"attn": Attention(16, sdpa)}) for _ in range(2)])
        self.head = nn.Linear(16, 16)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block["attn"](x)
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (ids,) = batch
        logits = self(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, 16), ids[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class GrowQueries(pl.Callback):
    """From step ``start`` on, scale ``blocks.1.attn.q`` by ``factor`` after every step: its logits grow."""

    def __init__(self, start: int = 30, factor: float = 1.08) -> None:
        self.start, self.factor = start, factor

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step >= self.start:
            with torch.no_grad():
                module.blocks[1]["attn"].q.weight.mul_(self.factor)
                module.blocks[1]["attn"].q.bias.mul_(self.factor)


def _data() -> DataLoader:
    ids = torch.randint(16, (STEPS * 4, 9), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(ids), batch_size=4)


def _fit(tmp_path: Path, guard: NanGuard, grow: bool, sdpa: bool = False, **trainer: Any) -> pl.Trainer:
    callbacks: list[Any] = [guard, *([GrowQueries()] if grow else [])]
    fitter = build_trainer("lightning", tmp_path, callbacks=callbacks, **trainer)
    fitter.fit(TinyTransformer(sdpa), _data())
    return fitter


@pytest.mark.parametrize("sdpa", [False, True], ids=["manual", "sdpa"])
def test_growing_logits_are_named_once_per_100_steps_and_the_step_is_applied(tmp_path: Path, sdpa: bool) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger

    guard = NanGuard(verbose=False, precursor_max_cost=None)  # this tiny model's steps: sampling exactly every 10
    logger = TensorBoardLogger(str(tmp_path), name="run")
    _fit(tmp_path, guard, grow=True, sdpa=sdpa, logger=logger)
    warnings = [e for e in guard.events if e.kinds == ("precursor",)]
    assert [e.culprit_module for e in warnings] == ["blocks.1.attn"]  # 120 steps: the cooldown holds it to one
    (event,) = warnings
    assert event.action == "warned" and guard.counters.skipped_total == 0 and guard.counters.bad_steps_total == 0
    assert event.global_step % 10 == 0 and 30 < event.global_step < 100  # sampled every 10 steps
    d = event.details
    assert d["signal"] == "attention_max_logit" and d["value"] > d["threshold"] == 80.0
    assert d["growth"] >= d["growth_threshold"] == 2.0 and d["earlier_step"] < event.global_step
    assert "QK-layernorm" in " ".join(d["fixes"])
    assert event.headline().endswith("-> step applied")
    line = json.loads((Path(logger.log_dir) / "nanguard" / "events.jsonl").read_text().splitlines()[0])
    assert line["kinds"] == ["precursor"] and line["culprit_module"] == "blocks.1.attn"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(logger.log_dir)
    accumulator.Reload()
    series = accumulator.Scalars("nanguard/attention_max_logit/blocks.1.attn")
    assert [s.step for s in series][:3] == [0, 10, 20]  # sampled every 10 steps
    assert series[-1].value > 10 * series[0].value
    assert "nanguard/attention_entropy/blocks.0.attn" in accumulator.Tags()["scalars"]


def test_a_healthy_run_gets_no_warning_and_the_switch_turns_it_off(tmp_path: Path) -> None:
    healthy = NanGuard(verbose=False, precursor_max_cost=None)
    _fit(tmp_path, healthy, grow=False)
    assert healthy.events == []
    off = NanGuard(verbose=False, precursors=False)
    _fit(tmp_path, off, grow=True)
    assert off.events == [] and off.controller.precursors is None


def test_the_warning_repeats_after_100_steps_if_the_growth_goes_on(tmp_path: Path) -> None:
    guard = NanGuard(verbose=False, precursor_growth=1.5, precursor_max_cost=None)
    fitter = build_trainer("lightning", tmp_path, callbacks=[guard, GrowQueries(factor=1.03)], max_epochs=3)
    fitter.fit(TinyTransformer(), _data())
    steps = [e.global_step for e in guard.events if e.kinds == ("precursor",)]
    assert len(steps) >= 2 and all(b - a >= 100 for a, b in itertools.pairwise(steps))


class Heavy(TinyTransformer):
    """The same attention, in a step dominated by other work (a stand-in for a large model's MLPs)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(768, 768)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x = torch.ones(128, 768)
        for _ in range(8):
            x = torch.tanh(self.mlp(x))
        return super().training_step(batch, batch_idx) + x.mean()


def test_a_watch_that_costs_more_than_its_limit_measures_less_often_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # on this tiny model measuring a step costs far more than 0.1% of every step's time (about 2-5% since the
    # probe's wrappers: at the default 1% a loaded machine's slower steps widened the interval to 2 only)
    guard = NanGuard(verbose=False, precursor_every_n_steps=1, precursor_max_cost=0.001)
    with caplog.at_level("WARNING", logger="lightning_nanguard"):
        _fit(tmp_path, guard, grow=False)
    watch = guard.controller.precursors
    assert watch is not None and watch.every >= 3  # widened from every step (by how much: the machine's timing)
    notices = [r.getMessage() for r in caplog.records if "precursor_max_cost" in r.getMessage()]
    assert notices and "measuring every 1 steps" in notices[0] and "Set precursor_max_cost=None" in notices[0]
    unlimited = NanGuard(verbose=False, precursor_every_n_steps=1, precursor_max_cost=None)
    _fit(tmp_path, unlimited, grow=False)
    assert unlimited.controller.precursors is not None and unlimited.controller.precursors.every == 1


def test_a_watch_that_costs_little_keeps_its_interval(tmp_path: Path) -> None:
    guard = NanGuard(verbose=False, precursor_every_n_steps=5)
    fitter = build_trainer("lightning", tmp_path, callbacks=[guard], max_steps=40)
    fitter.fit(Heavy(), _data())
    watch = guard.controller.precursors
    assert watch is not None and watch.every == 5
    share = statistics.median(watch._measure_seconds) / (5 * statistics.median(watch._step_seconds))
    assert share < 0.01 / 3, share  # the margin this test keeps from the limit on a loaded machine


@pytest.mark.parametrize("sdpa", [False, True], ids=["manual", "sdpa"])
def test_a_fit_that_crashes_on_a_sampled_step_leaves_no_hook_and_no_wrapper(tmp_path: Path, sdpa: bool) -> None:
    """The error comes between the watched forward and the step's check: the watch was still armed."""

    class Crashing(TinyTransformer):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            loss = super().training_step(batch, batch_idx)
            if batch_idx == 20:  # a sampled step (every 10), after its forward
                raise RuntimeError("the user's step fails")
            return loss

    model = Crashing(sdpa)
    original = F.scaled_dot_product_attention
    fitter = build_trainer("lightning", tmp_path, callbacks=[NanGuard(verbose=False, precursor_max_cost=None)])
    with pytest.raises(RuntimeError, match="user's step fails"):
        fitter.fit(model, _data())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert F.scaled_dot_product_attention is original and "softmax" not in Tensor.__dict__
    assert not torch._C._is_torch_function_mode_enabled()
