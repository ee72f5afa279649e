"""The strategy class swap: ``NanGuard<Original>`` during fit, the original class after, pickling, refusals."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import build_trainer
from models import NAMESPACES, make_case, make_loader, make_module
from torch.utils.data import DataLoader

import lightning_nanguard.strategy as strategy_module
from lightning_nanguard import NanGuard, NonFiniteTrainingError
from lightning_nanguard._compat import CALLBACK_BASES
from lightning_nanguard.strategy import (
    NanGuardStrategyMixin,
    apply_nanguard_strategy,
    remove_nanguard_strategy,
    strategy_kind,
)


class StrategyProbe(*CALLBACK_BASES):  # type: ignore[misc]
    """Looks at (and pickles) ``trainer.strategy`` while training runs."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        strategy = trainer.strategy
        self.seen["class"] = type(strategy)
        self.seen["pickled"] = pickle.dumps(strategy)


@pytest.mark.parametrize("ns_name", list(NAMESPACES))
def test_strategy_is_wrapped_during_fit_and_restored_after(ns_name: str, tmp_path: Path) -> None:
    ns = NAMESPACES[ns_name]
    guard, probe = NanGuard(verbose=False), StrategyProbe()
    trainer = build_trainer(ns_name, tmp_path, callbacks=[guard, probe], max_steps=2)
    original = type(trainer.strategy)
    case = make_case("input_data", bad=())
    trainer.fit(make_module(ns_name, "input_data"), make_loader(case.dataset))

    wrapped = probe.seen["class"]
    assert wrapped.__name__ == f"NanGuard{original.__name__}" == "NanGuardSingleDeviceStrategy"
    assert issubclass(wrapped, original)
    assert issubclass(wrapped, ns.strategies.Strategy)
    assert issubclass(wrapped, NanGuardStrategyMixin)
    assert type(trainer.strategy) is original  # teardown gives the Trainer its own class back
    assert "_nanguard" not in vars(trainer.strategy)
    assert "_nanguard_original_class" not in vars(trainer.strategy)

    restored = pickle.loads(probe.seen["pickled"])
    assert type(restored) is wrapped
    assert isinstance(restored, ns.strategies.SingleDeviceStrategy)
    assert isinstance(restored._nanguard, NanGuard)
    assert restored._nanguard._trainer is None  # the callback never pickles the Trainer


def test_both_namespaces_pickle_side_by_side() -> None:
    """``lightning.pytorch`` and ``pytorch_lightning`` both have a ``SingleDeviceStrategy``: no name clash."""
    guard = NanGuard(verbose=False)
    strategies = [ns.strategies.SingleDeviceStrategy("cpu") for ns in NAMESPACES.values()]
    for strategy in strategies:
        apply_nanguard_strategy(strategy, guard)
    for strategy, ns in zip(strategies, NAMESPACES.values(), strict=True):
        restored = pickle.loads(pickle.dumps(strategy))
        assert type(restored) is type(strategy)
        assert isinstance(restored, ns.strategies.SingleDeviceStrategy)
        assert pickle.loads(pickle.dumps(type(strategy))) is type(strategy)
    assert type(strategies[0]) is not type(strategies[1])
    assert {type(s).__name__ for s in strategies} == {"NanGuardSingleDeviceStrategy"}


def test_wrapped_strategy_unpickles_where_the_class_was_never_generated(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh process (``ddp_spawn``, a pickled Trainer) has no ``NanGuard<Original>`` class yet."""
    import lightning.pytorch as pl

    strategy = pl.strategies.DDPStrategy(accelerator=None)
    apply_nanguard_strategy(strategy, NanGuard(verbose=False))
    data = pickle.dumps(strategy)
    monkeypatch.setattr(strategy_module, "_GENERATED", {})
    for name in [n for n in vars(strategy_module) if n.startswith("NanGuardDDPStrategy")]:
        monkeypatch.delattr(strategy_module, name)

    restored = pickle.loads(data)
    assert type(restored).__name__ == "NanGuardDDPStrategy"
    assert isinstance(restored, pl.strategies.DDPStrategy)
    assert isinstance(restored, pl.strategies.ParallelStrategy)
    assert isinstance(restored._nanguard, NanGuard)
    remove_nanguard_strategy(restored)
    assert type(restored) is pl.strategies.DDPStrategy


def test_apply_is_idempotent_and_remove_restores() -> None:
    import lightning.pytorch as pl

    strategy = pl.strategies.DDPStrategy(accelerator=None)
    first, second = NanGuard(verbose=False), NanGuard(verbose=False)
    apply_nanguard_strategy(strategy, first)
    wrapped = type(strategy)
    apply_nanguard_strategy(strategy, second)  # a second fit: same class, the new guard
    assert type(strategy) is wrapped
    assert strategy._nanguard is second
    assert type(strategy).__mro__[1] is NanGuardStrategyMixin
    assert strategy_kind(strategy) == "ddp"
    remove_nanguard_strategy(strategy)
    assert type(strategy) is pl.strategies.DDPStrategy
    remove_nanguard_strategy(strategy)  # harmless when not wrapped
    assert type(strategy) is pl.strategies.DDPStrategy


@pytest.mark.parametrize("ns_name", list(NAMESPACES))
def test_strategy_kind_of_real_strategy_classes(ns_name: str) -> None:
    """Instances made with ``object.__new__`` (no DeepSpeed/FSDP runtime needed): only the class matters."""
    strategies = NAMESPACES[ns_name].strategies
    expected = {
        "SingleDeviceStrategy": "single",
        "DDPStrategy": "ddp",
        "FSDPStrategy": "fsdp",
        "ModelParallelStrategy": "fsdp",
        "DeepSpeedStrategy": "deepspeed",
    }
    assert {name: strategy_kind(object.__new__(getattr(strategies, name))) for name in expected} == expected


def test_deepspeed_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    """``setup`` with the real ``DeepSpeedStrategy`` class (the deepspeed package is not needed to see it)."""
    import lightning.pytorch as pl

    class FakeTrainer:
        strategy = object.__new__(pl.strategies.DeepSpeedStrategy)

    guard = NanGuard(verbose=False)
    with pytest.raises(NonFiniteTrainingError, match="does not support DeepSpeed: its engine owns the optimizer step"):
        guard.setup(FakeTrainer(), pl.LightningModule(), "fit")
    assert guard.active  # a refusal, not an internal failure
    assert not isinstance(FakeTrainer.strategy, NanGuardStrategyMixin)


def test_inactive_guard_makes_the_wrapper_transparent(tmp_path: Path) -> None:
    """A disabled guard (after an internal failure) neither skips nor checks: plain training."""
    guard = NanGuard(verbose=False)
    guard.active = False
    case = make_case("input_data")  # has a NaN sample at index 11
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard])
    module = make_module("lightning", "input_data", optimizer="sgd")
    trainer.fit(module, make_loader(case.dataset))
    assert guard.events == []
    assert not all(torch.isfinite(p).all() for p in module.parameters())  # NaN went through: nothing guarded


def test_process_dataloader_makes_the_loader_record_indices(tmp_path: Path) -> None:
    guard = NanGuard(verbose=False)
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard], max_steps=1)
    case = make_case("input_data", bad=())
    loader: DataLoader = make_loader(case.dataset)
    trainer.fit(make_module("lightning", "input_data"), loader)
    sampler = trainer.train_dataloader.batch_sampler
    assert type(sampler).__name__ == "RecordingBatchSampler"
    assert sampler.nanguard_exclude is guard.remedy_book.quarantined
