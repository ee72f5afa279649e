"""The strategy class swap: ``NanGuard<Original>`` during fit, the original class after, pickling, refusals."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import build_trainer
from manual_loops import LbfgsRegressor, lbfgs_data
from models import NAMESPACES, make_case, make_loader, make_module
from torch.utils.data import DataLoader

import lightning_nanguard.trainer.strategy as strategy_module
from lightning_nanguard import NanGuard, NonFiniteTrainingError
from lightning_nanguard.trainer._compat import CALLBACK_BASES
from lightning_nanguard.trainer.strategy import (
    NanGuardStrategyMixin,
    StrategyHooks,
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
    assert isinstance(restored._nanguard, StrategyHooks)
    assert isinstance(restored._nanguard.after_optimizer_step.__self__, NanGuard)
    assert restored._nanguard.after_optimizer_step.__self__._trainer is None  # never pickles the Trainer


def _hooks(guard: NanGuard | None = None) -> StrategyHooks:
    guard = guard or NanGuard(verbose=False)
    return StrategyHooks(guard._after_optimizer_step, guard._strategy_active)


def test_both_namespaces_pickle_side_by_side() -> None:
    """``lightning.pytorch`` and ``pytorch_lightning`` both have a ``SingleDeviceStrategy``: no name clash."""
    hooks = _hooks()
    strategies = [ns.strategies.SingleDeviceStrategy("cpu") for ns in NAMESPACES.values()]
    for strategy in strategies:
        apply_nanguard_strategy(strategy, hooks)
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
    apply_nanguard_strategy(strategy, _hooks())
    data = pickle.dumps(strategy)
    monkeypatch.setattr(strategy_module, "_GENERATED", {})
    for name in [n for n in vars(strategy_module) if n.startswith("NanGuardDDPStrategy")]:
        monkeypatch.delattr(strategy_module, name)

    restored = pickle.loads(data)
    assert type(restored).__name__ == "NanGuardDDPStrategy"
    assert isinstance(restored, pl.strategies.DDPStrategy)
    assert isinstance(restored, pl.strategies.ParallelStrategy)
    assert isinstance(restored._nanguard, StrategyHooks)
    remove_nanguard_strategy(restored)
    assert type(restored) is pl.strategies.DDPStrategy


def test_apply_is_idempotent_and_remove_restores() -> None:
    import lightning.pytorch as pl

    strategy = pl.strategies.DDPStrategy(accelerator=None)
    first, second = _hooks(), _hooks()
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
        "ModelParallelStrategy": "model_parallel",
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


class SamplerProbe(*CALLBACK_BASES):  # type: ignore[misc]
    """The class of the training and validation loaders' batch samplers while training runs."""

    def __init__(self) -> None:
        self.sampler: Any = None
        self.train: list[str] = []
        self.val: list[str] = []

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        self.sampler = trainer.train_dataloader.batch_sampler
        self.train.append(type(self.sampler).__name__)

    def on_validation_batch_start(self, trainer: Any, *args: Any) -> None:
        self.val.append(type(trainer.val_dataloaders.batch_sampler).__name__)


def test_process_dataloader_makes_only_the_training_loader_record_and_undoes_it(tmp_path: Path) -> None:
    guard, probe = NanGuard(verbose=False), SamplerProbe()
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard, probe], limit_train_batches=2, limit_val_batches=1)
    case = make_case("input_data", bad=())
    loader: DataLoader = make_loader(case.dataset)
    val_loader: DataLoader = make_loader(case.dataset)
    module = make_module("lightning", "input_data")
    module.__class__ = type("WithValidation", (type(module),), {"validation_step": lambda self, batch, idx: None})
    trainer.fit(module, loader, val_loader)
    assert probe.train == ["NanGuardRecordingBatchSampler"] * 2  # during training
    assert probe.val == ["BatchSampler"]  # validation loaders are left alone
    assert type(probe.sampler).__name__ == "BatchSampler"  # teardown undid the swap
    assert not hasattr(probe.sampler, "nanguard_exclude")


def test_the_before_step_hook_runs_for_a_closure_optimizer_only(tmp_path: Path) -> None:
    """The LBFGS-only hook (it copies the state that undoes a bad step) costs other optimizers no call a step."""
    sgd_guard, lbfgs_guard = NanGuard(verbose=False), NanGuard(verbose=False)
    sgd_guard.clock.enabled = lbfgs_guard.clock.enabled = True
    sgd = build_trainer("lightning", tmp_path / "sgd", callbacks=[sgd_guard], max_steps=4)
    sgd.fit(make_module("lightning", "input_data", optimizer="sgd"), make_loader(make_case("input_data").dataset))
    lbfgs = build_trainer("lightning", tmp_path / "lbfgs", callbacks=[lbfgs_guard], max_steps=4)
    lbfgs.fit(LbfgsRegressor(), DataLoader(lbfgs_data(bad=()), batch_size=4))
    assert sgd.global_step == lbfgs.global_step == 4
    assert "_before_optimizer_step" not in sgd_guard.clock.calls, dict(sgd_guard.clock.calls)
    assert lbfgs_guard.clock.calls["_before_optimizer_step"] == 4, dict(lbfgs_guard.clock.calls)
