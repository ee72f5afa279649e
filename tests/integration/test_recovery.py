"""Recovery on a real Trainer: remedies, a diverging run, quarantine, checkpoints, resume, and the safety contract.

Also ``Recovery`` itself with a stand-in for the few Trainer attributes it reads.
"""

from __future__ import annotations

import csv
import logging
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import StepRecorder, build_trainer, clone_state, read_tensorboard, states_equal
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from models import make_case, make_loader, make_module
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_nanguard import NanEvent, NanGuard, NonFiniteTrainingError
from lightning_nanguard.recover.remedies import ZERO_EPS_START
from lightning_nanguard.trainer._compat import CALLBACK_BASES

# ------------------------------------------------------------------------------------ models and data


class ScaleNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps)``: with ``eps=0`` an all-zero feature row gives 0/0 = NaN."""

    def __init__(self, eps: float = 0.0) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class Indexed(Dataset):
    """``(x, y, index)`` items, so the model can record which dataset items it trained on."""

    def __init__(self, n: int = 32, nan_at: tuple[int, ...] = (), zero_at: tuple[int, ...] = ()) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 4, generator=g), torch.randn(n, generator=g)
        for i in nan_at:
            self.x[i, 1] = math.nan
        for i in zero_at:
            self.x[i] = 0.0

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


class Regressor(pl.LightningModule):
    """``Linear(4, 8, bias=False) -> norm -> Linear(8, 1)``; records ``(epoch, global_step, indices)`` it trains on."""

    def __init__(
        self, norm: nn.Module | None = None, optimizer: str = "adam", lr: float = 1e-2, sched: str = ""
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 8, bias=False)
        self.norm = norm if norm is not None else nn.Identity()
        self.head = nn.Linear(8, 1)
        self.optimizer_name, self.lr, self.sched = optimizer, lr, sched
        self.seen: list[tuple[int, int, list[int]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        self.seen.append((self.current_epoch, self.global_step, index.tolist()))
        return nn.functional.mse_loss(self.head(self.norm(self.inp(x))).squeeze(-1), y)

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "lbfgs":
            return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)
        if self.optimizer_name == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        else:
            opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        if not self.sched:
            return opt
        if self.sched == "lambda":
            sched: Any = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.9**step)
        else:
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def trained_on(self, index: int) -> list[tuple[int, int]]:
        return [(epoch, step) for epoch, step, indices in self.seen if index in indices]


class LrLog(*CALLBACK_BASES):  # type: ignore[misc]
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.lrs.append(float(trainer.optimizers[0].param_groups[0]["lr"]))


def _loader(dataset: Dataset, shuffle: bool = False) -> DataLoader:
    return DataLoader(dataset, batch_size=8, shuffle=shuffle, generator=torch.Generator().manual_seed(0))


def _quiet(**kwargs: Any) -> NanGuard:
    return NanGuard(verbose=False, save_repro=False, **kwargs)


def _finite(module: nn.Module) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in module.state_dict().values() if t.is_floating_point())


# ------------------------------------------------------------------------------------ Recovery alone


# ------------------------------------------------------------------------------------ a diverging run


class LinearRegression(pl.LightningModule):
    """SGD on ``y = 5 * sum(x)`` with inputs of variance 9: ``lr=0.2`` diverges (no bad sample anywhere)."""

    def __init__(self, lr: float = 0.2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _diverging_data() -> TensorDataset:
    x = torch.randn(256, 4, generator=torch.Generator().manual_seed(0)) * 3
    return TensorDataset(x, x.sum(-1) * 5)


def test_plain_skip_cannot_save_a_diverging_run(tmp_path: Path) -> None:
    guard = _quiet(action="skip", bisect=False, localize=False)
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard], max_epochs=3)
    with pytest.raises(NonFiniteTrainingError, match="consecutive bad steps"):
        trainer.fit(LinearRegression(), _loader(_diverging_data()))


def test_diverging_run_is_caught_as_state_spikes_before_any_nan(tmp_path: Path) -> None:
    """With the defaults the blow-up is a run of finite loss spikes: skipped, blamed on the model state, remedied."""
    guard = _quiet(action="rollback", remedies=["clip_grad", "lr_backoff"], snapshot_every_n_steps=10)
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard], max_epochs=3)
    module = LinearRegression()
    trainer.fit(module, _loader(_diverging_data()))
    assert _finite(module) and trainer.global_step == 96
    assert guard.events and all(e.kinds[0] == "loss_spike" and e.action == "skipped" for e in guard.events)
    assert guard.bad_steps_total == 0 and guard.counters.spikes_total == len(guard.events)  # spikes never escalate
    first = guard.events[0]
    assert first.cause == "state" and first.offending_samples is None
    assert first.details["state_passes"] == 1  # the reference sample of a healthy step fails too
    assert [r.split(":")[0] for r in first.remedies] == ["clip_grad", "lr_backoff"]  # at the first incident
    assert guard.recovery.rollbacks_total == 0


def test_diverging_run_finishes_finite_with_rollback_clip_grad_and_lr_backoff(tmp_path: Path) -> None:
    guard = _quiet(
        action="rollback",
        remedies=["clip_grad", "lr_backoff"],
        snapshot_every_n_steps=10,
        rollback_after_consecutive=2,
        check_params_every_n_steps=0,
        bisect=False,
        localize=False,
        spike_action="off",  # let it diverge to NaN: the rollback path
    )
    tensorboard = TensorBoardLogger(tmp_path, name="tb", version=0)
    csv_logger = CSVLogger(tmp_path, name="csv", version=0)
    trainer = build_trainer(
        "lightning", tmp_path, callbacks=[guard], max_epochs=3, logger=[tensorboard, csv_logger], log_every_n_steps=1
    )
    module = LinearRegression()
    trainer.fit(module, _loader(_diverging_data()))

    assert _finite(module)
    assert trainer.global_step == 96
    assert guard.events, "the run must have diverged"
    assert guard.recovery.rollbacks_total >= 1
    assert any(e.action == "rolled_back" for e in guard.events)
    remedies = [r for e in guard.events for r in e.remedies]
    assert any(r.startswith("clip_grad: gradient norm clipped at") for r in remedies)
    assert any(r.startswith("lr_backoff: learning rate x0.5") for r in remedies)
    applied = guard.remedy_book.applied
    assert applied["lr_backoff"] == sum(r.startswith("lr_backoff") for r in remedies)
    assert applied["clip_grad"] == sum(r.startswith("clip_grad") for r in remedies)
    # every back-off is still in force at the end, rollbacks included
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.2 * 0.5 ** applied["lr_backoff"])
    assert guard.remedy_book.clip_threshold is not None

    run = read_tensorboard(tensorboard.log_dir)
    assert run.scalars("nanguard/rollbacks_total")[-1][1] == guard.recovery.rollbacks_total
    assert run.scalars("nanguard/remedies_total")[-1][1] == guard.remedy_book.total
    with open(Path(csv_logger.log_dir) / "metrics.csv", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    rollbacks = [float(r["nanguard/rollbacks_total"]) for r in rows if r.get("nanguard/rollbacks_total")]
    remedies_total = [float(r["nanguard/remedies_total"]) for r in rows if r.get("nanguard/remedies_total")]
    assert rollbacks[-1] == guard.recovery.rollbacks_total
    assert remedies_total[-1] == guard.remedy_book.total


def test_clip_grad_remedy_without_a_logger(tmp_path: Path) -> None:
    guard = _quiet(remedies=["clip_grad"], bisect=False, localize=False)
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard], logger=False)
    trainer.fit(Regressor(), _loader(Indexed(nan_at=(11,))))
    assert guard.events[0].remedies[0].startswith("clip_grad: gradient norm clipped at")
    assert guard.remedy_book.clip_threshold is not None


class StepGradNorms(*CALLBACK_BASES):  # type: ignore[misc]
    """The global gradient norm each optimizer step really uses (a step pre-hook: after the guard's clipping)."""

    def __init__(self) -> None:
        self.norms: dict[int, float] = {}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        def record(optimizer: Any, args: Any, kwargs: Any) -> None:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            if grads:  # a skipped step has none
                self.norms[trainer.global_step] = float(
                    torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
                )

        trainer.optimizers[0].register_step_pre_hook(record)


def test_clip_grad_clips_every_later_step_at_the_threshold_it_announces(tmp_path: Path) -> None:
    """ "clip_grad: gradient norm clipped at X", checked by its effect: no applied step after it goes above X."""
    guard, norms = _quiet(remedies=["clip_grad"], bisect=False, localize=False), StepGradNorms()
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard, norms], max_epochs=3)
    trainer.fit(Regressor(optimizer="sgd"), _loader(Indexed(nan_at=(11,))))
    announced = {
        e.global_step: float(r.rsplit(" ", 1)[1]) for e in guard.events for r in e.remedies if "clip_grad" in r
    }
    assert sorted(announced) == [1, 5, 9] and announced[5] == pytest.approx(announced[1] / 2, rel=1e-3)
    clipped = 0
    for step, norm in norms.norms.items():
        since = [s for s in announced if s < step]
        if since:
            threshold = announced[max(since)]
            assert norm <= threshold * (1 + 1e-3), (step, norm, threshold)
            clipped += norm == pytest.approx(threshold, rel=1e-3)
    assert clipped >= 3  # the clip did act (the steps' own norms were above it)


# ------------------------------------------------------------------------------------ raise_eps


@pytest.mark.parametrize(
    "norm", [ScaleNorm(0.0), nn.LayerNorm(8, eps=0.0), nn.GroupNorm(2, 8, eps=0.0)], ids=["user", "layer", "group"]
)
def test_raise_eps_on_the_culprit_norm_layer(norm: nn.Module, tmp_path: Path) -> None:
    """Sample 11 is all zeros: the eps-free norm layer divides 0 by 0. After one raise_eps it never recurs."""
    guard = _quiet(remedies=["raise_eps"])
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard], max_epochs=2)
    module = Regressor(norm)
    trainer.fit(module, _loader(Indexed(zero_at=(11,))))

    assert len(guard.events) == 1
    event = guard.events[0]
    assert (event.global_step, event.culprit_module, event.dataset_indices) == (1, "norm", (11,))
    name = type(norm).__name__
    assert event.remedies == (f"raise_eps: {name} eps 0 -> 1e-06, optimizer 0 group 0 eps 1e-08 -> 1e-07",)
    assert norm.eps == ZERO_EPS_START
    assert trainer.optimizers[0].param_groups[0]["eps"] == pytest.approx(1e-7)
    assert {step for _, step in module.trained_on(11)} == {1, 5}  # bad at step 1, healthy again at step 5
    assert guard.remedy_book.applied == {"raise_eps": 1}


def test_raise_eps_is_capped_by_max_eps(tmp_path: Path) -> None:
    norm = ScaleNorm(0.0)
    guard = _quiet(remedies=["raise_eps"], max_eps=5e-8)
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard])
    trainer.fit(Regressor(norm), _loader(Indexed(zero_at=(11,))))
    assert guard.events[0].remedies == ("raise_eps: ScaleNorm eps 0 -> 5e-08, optimizer 0 group 0 eps 1e-08 -> 5e-08",)
    assert norm.eps == 5e-8
    assert trainer.optimizers[0].param_groups[0]["eps"] == 5e-8


# ------------------------------------------------------------------------------------ lr_backoff with schedulers


@pytest.mark.parametrize("sched", ["lambda", "step"])
def test_lr_backoff_stays_in_force_with_lr_scheduler(sched: str, tmp_path: Path) -> None:
    """Sample 11 (step 1) is NaN and, with bisection off, not attributable: lr_backoff x0.5 from step 2 on."""
    guard = _quiet(remedies=["lr_backoff"], bisect=False, localize=False)
    lr_log = LrLog()
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard, lr_log], max_epochs=2)
    trainer.fit(Regressor(lr=0.1, sched=sched), _loader(Indexed(nan_at=(11,))))

    def schedule(step: int) -> float:
        return 0.1 * (0.9**step if sched == "lambda" else 0.5 ** (step // 2))

    assert len(guard.events) == 2  # sample 11 again in epoch 1, step 5: a second back-off
    assert [e.global_step for e in guard.events] == [1, 5]
    expected = [schedule(s) * (1.0 if s < 2 else 0.5 if s < 6 else 0.25) for s in range(8)]
    assert lr_log.lrs == pytest.approx(expected)


# ------------------------------------------------------------------------------------ quarantine


def test_quarantined_index_never_reaches_training_step_again(tmp_path: Path) -> None:
    guard = _quiet(remedies=["quarantine"])
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard], max_epochs=3)
    module = Regressor()
    trainer.fit(module, _loader(Indexed(nan_at=(11,)), shuffle=True))

    assert len(guard.events) == 1
    event = guard.events[0]
    assert event.dataset_indices == (11,)
    assert event.remedies == ("quarantine: dataset indices [11] will not be trained on again",)
    assert guard.remedy_book.quarantined == {11}
    assert {epoch for epoch, _ in module.trained_on(11)} == {0}  # only the bad step itself (and its bisection)
    assert {step for _, step in module.trained_on(11)} == {event.global_step}
    later = [i for epoch, _, indices in module.seen if epoch > 0 for i in indices]
    assert sorted(later) == sorted([i for i in range(32) if i != 11] * 2)  # everything else, once per epoch


class ValidatedRegressor(Regressor):
    """Also records the dataset indices its validation loop sees."""

    def __init__(self) -> None:
        super().__init__()
        self.validated: list[int] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.validated.extend(batch[2].tolist())


def test_quarantine_never_reaches_validation(tmp_path: Path) -> None:
    """Validation shares the training set's indices; quarantined training items must still be validated on."""
    guard = _quiet(remedies=["quarantine"])
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard], max_epochs=2, num_sanity_val_steps=0)
    module = ValidatedRegressor()
    trainer.fit(module, _loader(Indexed(nan_at=(3, 11, 20))), _loader(Indexed()))
    assert guard.remedy_book.quarantined == {3, 11, 20}
    assert sorted(module.validated) == sorted(list(range(32)) * 2)  # every item, every epoch
    assert not any(index in {3, 11, 20} for epoch, _, indices in module.seen if epoch > 0 for index in indices)


# ------------------------------------------------------------------------------------ checkpoints


def test_checkpoint_with_nonfinite_weights_is_refused(tmp_path: Path) -> None:
    guard = _quiet(action="warn")
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard])
    module = Regressor(optimizer="sgd")
    trainer.fit(module, _loader(Indexed(nan_at=(11,))))
    assert not _finite(module)  # action="warn" let the NaN through

    path = tmp_path / "refused.ckpt"
    with pytest.raises(NonFiniteTrainingError, match="refuses to save a checkpoint with non-finite weights"):
        trainer.save_checkpoint(path)
    assert not path.exists()


def test_checkpoint_with_nonfinite_batchnorm_statistics_is_refused(tmp_path: Path) -> None:
    """Weights finite, only ``running_var`` overflowed (``bn_overflow`` under ``action="warn"``): still refused."""
    case = make_case("bn_overflow")
    guard = _quiet(action="warn")
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard], max_steps=2)
    module = make_module("lightning", "bn_overflow")
    trainer.fit(module, make_loader(case.dataset))
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())
    assert not bool(torch.isfinite(module.net.input_bn.running_var).all())

    path = tmp_path / "refused.ckpt"
    with pytest.raises(NonFiniteTrainingError, match=r"net\.input_bn\.running_var"):
        trainer.save_checkpoint(path)
    assert not path.exists()


class Corrupt(*CALLBACK_BASES):  # type: ignore[misc]
    """Sets the LR to +Inf for the given steps (an Adam/SGD update then overflows every weight)."""

    def __init__(self, steps: tuple[int, ...]) -> None:
        self.steps = steps
        self.states: dict[int, dict[str, Any]] = {}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step in self.steps:
            trainer.optimizers[0].param_groups[0]["lr"] = math.inf

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.states[trainer.global_step] = {
            "state_dict": clone_state(pl_module.state_dict()),
            "optimizer": clone_state(trainer.optimizers[0].state_dict()),
        }


def test_checkpoint_with_nonfinite_weights_holds_the_last_good_snapshot(tmp_path: Path) -> None:
    """Weights go bad at the last step, unchecked (``check_params_every_n_steps=0``): the checkpoint holds the
    snapshot taken after step 2 (every 3 steps) instead, bitwise, and loads with ``weights_only=True``."""
    guard = _quiet(action="rollback", snapshot_every_n_steps=3, check_params_every_n_steps=0)
    corrupt = Corrupt(steps=(3,))
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard, corrupt])
    module = Regressor(nn.BatchNorm1d(8))
    trainer.fit(module, _loader(Indexed()))
    assert not _finite(module)

    path = tmp_path / "substituted.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    assert states_equal(dict(checkpoint["state_dict"]), corrupt.states[3]["state_dict"])
    assert states_equal(checkpoint["optimizer_states"][0], corrupt.states[3]["optimizer"])
    assert checkpoint["nanguard_substituted_step"] == guard.recovery.snapshot.global_step
    restored = Regressor(nn.BatchNorm1d(8))
    restored.load_state_dict(checkpoint["state_dict"])
    assert _finite(restored)


# ------------------------------------------------------------------------------------ resume


def test_resume_keeps_remedies_and_counters(tmp_path: Path) -> None:
    """Run 1 rolls back once on sample 11 and applies quarantine, clip_grad and lr_backoff; run 2 resumes."""

    def guard() -> NanGuard:
        return _quiet(
            action="rollback",
            remedies=["quarantine", "clip_grad", "lr_backoff"],
            rollback_after_consecutive=1,
            snapshot_every_n_steps=1,
        )

    first = guard()
    logger = CSVLogger(tmp_path, name="csv", version=0)
    trainer = build_trainer("lightning", tmp_path, callbacks=[first], max_epochs=1, logger=logger)
    trainer.fit(Regressor(lr=0.01), _loader(Indexed(nan_at=(11,)), shuffle=True))
    assert [e.action for e in first.events] == ["rolled_back"]
    assert first.remedy_book.applied == {"quarantine": 1, "clip_grad": 1, "lr_backoff": 1}
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.005)  # kept through the rollback
    path = tmp_path / "run1.ckpt"
    trainer.save_checkpoint(path)

    checkpoint = torch.load(path, weights_only=True)  # primitives only
    (state,) = [v for k, v in checkpoint["callbacks"].items() if "NanGuard" in k]
    assert state["recovery"]["remedies"]["quarantined"] == [11]

    second = guard()
    module = Regressor(lr=0.01)
    trainer = build_trainer("lightning", tmp_path, callbacks=[second], max_epochs=2, logger=logger)
    trainer.fit(module, _loader(Indexed(nan_at=(11,)), shuffle=True), ckpt_path=path)

    assert second.events and second.events[0].to_dict() == first.events[0].to_dict()
    assert len(second.events) == 1  # sample 11 stayed quarantined: no new incident
    assert (second.bad_steps_total, second.skipped_total) == (first.bad_steps_total, first.skipped_total) == (1, 1)
    assert second.recovery.rollbacks_total == 1
    assert second.remedy_book.applied == first.remedy_book.applied
    assert second.remedy_book.clip_threshold == first.remedy_book.clip_threshold is not None
    assert second.remedy_book.quarantined == {11}
    assert module.trained_on(11) == []
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.005)


# ------------------------------------------------------------------------------------ safety contract


def _boom(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("boom inside the guard")


@pytest.mark.parametrize(("where", "dropped"), [("_healthy", 0), ("after_optimizer_step", 1), ("_check_step", 0)])
def test_internal_failure_never_kills_training(
    where: str, dropped: int, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug in the core: the step it could not vouch for is dropped (at its check), then the guard is off."""
    guard = NanGuard(verbose=False)
    setattr(guard.controller, where, _boom)  # a bug in the guard's own per-step code (inside its failsafe)
    recorder = StepRecorder()
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard, recorder])
    with caplog.at_level(logging.WARNING, logger="lightning_nanguard"):
        trainer.fit(Regressor(), _loader(Indexed()))
    assert trainer.global_step == 4
    assert not guard.active
    disabled = [r for r in caplog.records if "NanGuard's own check failed" in r.getMessage()]
    assert len(disabled) == 1
    assert "boom" in disabled[0].getMessage()
    assert [r.global_step for r in recorder.records if not r.changed_params()] == [dropped]  # the rest trained
    ((step, part, action),) = [(e.global_step, e.details["part"], e.action) for e in guard.events]
    assert (step, part, action) == (dropped, "core", "skipped")


def test_a_bad_lbfgs_step_is_undone_without_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    guard = _quiet()
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard])
    module = Regressor(optimizer="lbfgs")
    with caplog.at_level(logging.WARNING, logger="lightning_nanguard"):
        trainer.fit(module, _loader(Indexed(nan_at=(11,))))
    assert trainer.global_step == 4
    assert guard.active
    first = guard.events[0]
    assert (first.global_step, first.action, first.dataset_indices) == (1, "skipped", (11,))
    assert _finite(module)  # the step holding sample 11 was undone: the later steps are healthy
    assert [e.global_step for e in guard.events] == [1] and guard.skipped_total == 1
    assert not any("LBFGS" in r.getMessage() for r in caplog.records)


def test_lbfgs_reports_one_event_per_step(tmp_path: Path) -> None:
    guard = _quiet(bisect=False, localize=False)
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard])
    trainer.fit(Regressor(optimizer="lbfgs"), _loader(Indexed(nan_at=(11,))))
    # one event for the many closure evaluations of step 1, which is undone: no later step is bad
    assert [e.global_step for e in guard.events] == [1]
    assert guard.bad_steps_total == 1


class ManualRegressor(Regressor):
    """Manual optimisation; with ``skip_bad`` it asks ``guard.check`` before each ``optimizer.step()``."""

    def __init__(self, guard: NanGuard, skip_bad: bool) -> None:
        super().__init__(optimizer="sgd")
        self.automatic_optimization = False
        self.guard, self.skip_bad = guard, skip_bad
        self.checks: list[NanEvent | None] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        opt.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        event = self.guard.check(self, loss)
        self.checks.append(event)
        if event is None or not self.skip_bad:
            opt.step()
        return loss


def _manual_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> tuple[NanGuard, ManualRegressor]:
    guard = _quiet()
    module = ManualRegressor(guard, skip_bad=True)
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard], max_epochs=2)
    with caplog.at_level(logging.WARNING, logger="lightning_nanguard"):
        trainer.fit(module, _loader(Indexed(nan_at=(11,))))
    return guard, module


def _same_but_action(checked: NanEvent | None, recorded: NanEvent) -> bool:
    return checked is not None and checked.replace(action=recorded.action) == recorded


def test_manual_optimisation_check_api(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    guard, module = _manual_run(tmp_path, caplog)
    assert [i for i, e in enumerate(module.checks) if e is not None] == [1, 5]  # sample 11, both epochs
    event = module.checks[1]
    assert event is not None
    assert event.kinds == ("loss", "grad")
    assert set(event.nonfinite_grads) == {"inp.weight", "head.weight", "head.bias"}
    assert event.nonfinite_params == ()
    assert event.loss is not None and math.isnan(event.loss)
    # recorded at the batch's end, as skipped: the user did not take the step
    assert [e.action for e in guard.events] == ["skipped", "skipped"]
    assert _same_but_action(module.checks[1], guard.events[0]) and _same_but_action(module.checks[5], guard.events[1])
    assert _finite(module)  # the user skipped the bad steps
    assert guard.skipped_total == 2
    assert not any("manual optimisation" in r.getMessage() for r in caplog.records)  # nothing left to warn about


def test_manual_optimisation_a_step_taken_despite_check_is_dropped_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The user steps although ``guard.check`` found the step bad: the guard drops it, and reports it once."""
    guard = _quiet()
    module = ManualRegressor(guard, skip_bad=False)
    build_trainer("lightning", tmp_path, callbacks=[guard]).fit(module, _loader(Indexed(nan_at=(11,))))
    assert module.checks[1] is not None and guard.skipped_total == 1
    assert [(e.global_step, e.action) for e in guard.events] == [(1, "skipped")]
    assert _finite(module)


def test_manual_optimisation_user_skip_leaves_no_stale_event(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    guard, module = _manual_run(tmp_path, caplog)
    assert len(guard.events) == 2
    assert all(_same_but_action(c, e) for c, e in zip([module.checks[1], module.checks[5]], guard.events, strict=True))


class TwoOptimizers(pl.LightningModule):
    """A GAN-like manual loop: the critic's step is asked about and skipped, the generator's is not."""

    def __init__(self, guard: NanGuard) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.guard = guard
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 4))
        self.critic = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.critic_checks: list[NanEvent | None] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x = batch[0]
        generator_opt, critic_opt = self.optimizers()
        z = torch.randn(x.shape[0], 2)
        critic_loss = nn.functional.softplus(-self.critic(x)).mean()  # NaN for a batch holding NaN
        critic_loss = critic_loss + nn.functional.softplus(self.critic(self.generator(z).detach())).mean()
        critic_opt.zero_grad()
        self.manual_backward(critic_loss)
        self.critic_checks.append(self.guard.check(self.critic, critic_loss))
        if self.critic_checks[-1] is None:
            critic_opt.step()
        generator_loss = nn.functional.softplus(-self.critic(self.generator(z))).mean()  # finite: the critic is
        generator_opt.zero_grad()
        self.manual_backward(generator_loss)
        generator_opt.step()  # the critic's NaN gradients are still there, but this optimizer does not apply them

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.generator.parameters()), torch.optim.Adam(self.critic.parameters())


def test_manual_optimisation_checks_each_optimizer_on_its_own(tmp_path: Path) -> None:
    """The hook at ``generator_opt.step()`` looks at that optimizer's gradients and the losses since its check."""
    guard = _quiet()
    module = TwoOptimizers(guard)
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    x[11, 0] = float("inf")
    build_trainer("lightning", tmp_path, callbacks=[guard]).fit(module, DataLoader(TensorDataset(x), batch_size=8))
    assert [i for i, e in enumerate(module.critic_checks) if e is not None] == [1]
    (event,) = guard.events  # one report of the critic's step, none of the generator's
    assert _same_but_action(module.critic_checks[1], event) and event.action == "skipped"
    assert event.nonfinite_grads == ("0.weight", "0.bias", "2.weight", "2.bias")  # of the critic
    assert _finite(module)


def test_manual_optimisation_is_skipped_automatically(tmp_path: Path) -> None:
    guard = _quiet()
    module = ManualRegressor(guard, skip_bad=False)
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard])
    trainer.fit(module, _loader(Indexed(nan_at=(11,))))
    assert _finite(module)  # the guard dropped the bad optimizer.step() the user took
    assert guard.skipped_total == 1
    assert {e.action for e in guard.events} == {"skipped"}
    assert guard.active
