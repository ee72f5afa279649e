"""Recovery on its own: remedies by cause, rollbacks that keep remedies, state round trips, configuration."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_nanguard.recover.recovery import Recovery, RecoverySettings, TrainingParts


def training_parts(run: SimpleNamespace, module: nn.Module) -> TrainingParts:
    """What a front-end hands a recovery, built from the stand-in's fields (no Trainer in this stage's tests)."""
    schedulers = [config.scheduler for config in run.lr_scheduler_configs]
    scaler = getattr(run.precision_plugin, "scaler", None)
    return TrainingParts(module, run.optimizers, schedulers, scaler, run.global_step)


def _stand_in(module: nn.Module, lr: float = 0.1, sched: bool = False) -> SimpleNamespace:
    opt = torch.optim.Adam(module.parameters(), lr=lr)
    configs = [SimpleNamespace(scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))] if sched else []
    return SimpleNamespace(
        optimizers=[opt], lr_scheduler_configs=configs, precision_plugin=SimpleNamespace(), global_step=0
    )


def test_recovery_picks_remedies_by_incident() -> None:
    module = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2, eps=1e-5))
    parts = training_parts(_stand_in(module), module)
    recovery = Recovery(("clip_grad", "raise_eps", "lr_backoff", "quarantine"), max_remedy_applications=2)
    recovery.book.reach.acts(None)  # the training loader removes quarantined records (the front-end says so)
    for norm in (4.0, 1.0, 2.0):
        recovery.remember_healthy_norm(norm)

    data = {"cause": "data", "quarantine": (9,)}
    assert recovery.apply(parts, **data, culprit_module="1") == [
        "quarantine: dataset indices [9] will not be trained on again",
        "raise_eps: LayerNorm eps 1e-05 -> 0.0001, optimizer 0 group 0 eps 1e-08 -> 1e-07",
    ]
    assert recovery.apply(parts, **data) == []  # already quarantined
    assert recovery.apply(parts, cause="input", quarantine=(9, 10)) == [
        "quarantine: dataset indices [10] will not be trained on again"
    ]

    assert recovery.apply(parts, cause="state") == [
        "clip_grad: gradient norm clipped at 2",
        "lr_backoff: learning rate x0.5 (group 0: 0.1 -> 0.05)",
    ]
    assert recovery.apply(parts, cause=None) == [  # not investigated: samples are not to blame
        "clip_grad: gradient norm clipped at 1",
        "lr_backoff: learning rate x0.5 (group 0: 0.05 -> 0.025)",
    ]
    assert recovery.apply(parts, cause="state") == []  # every cap reached
    assert recovery.book.applied == {"quarantine": 2, "raise_eps": 1, "clip_grad": 2, "lr_backoff": 2}
    assert recovery.book.quarantined == {9, 10}


def test_a_quarantine_no_loader_acts_on_says_its_records_are_not_removed() -> None:
    """The claim follows the loaders: none registered (a loop the guard has no loader of), or one that cannot act."""
    module = nn.Linear(2, 1)
    parts = training_parts(_stand_in(module), module)
    recovery = Recovery(("quarantine",))
    assert recovery.apply(parts, cause="data", quarantine=(9,)) == [
        "quarantine: dataset indices [9] will NOT be removed from training: the guard holds no training loader that "
        "removes records (a Trainer fit or a Fabric loop gives it theirs)"
    ]
    recovery.book.reach.cannot(None, "the training loader streams an IterableDataset and no index_key= is set")
    assert recovery.apply(parts, cause="data", quarantine=(3,)) == [
        "quarantine: dataset indices [3] will NOT be removed from training: the training loader streams an "
        "IterableDataset and no index_key= is set"
    ]
    assert recovery.book.quarantined == {3, 9}  # kept (and saved): a later fit whose loader can remove them does


def test_recovery_keeps_optimizer_remedies_through_rollbacks() -> None:
    """The snapshot holds the LR and eps of its time: remedies decided after it are applied again on rollback."""
    module = nn.Linear(2, 1)
    trainer = _stand_in(module, lr=0.1, sched=True)
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    parts = training_parts(trainer, module)
    recovery = Recovery(("lr_backoff", "raise_eps"), max_remedy_applications=5)
    recovery.apply(parts, cause=None, rolled_back=True)  # before the snapshot: part of it
    recovery.capture(parts)
    recovery.apply(parts, cause=None, culprit_module="", rolled_back=True)  # after it
    description = recovery.rollback(parts)
    assert description == "rollback: restored the state of step 0 (0.0 MiB snapshot, kept raise_eps, lr_backoff)"
    group = trainer.optimizers[0].param_groups[0]
    assert group["lr"] == pytest.approx(0.025)
    assert scheduler.base_lrs == pytest.approx([0.025])
    assert group["eps"] == pytest.approx(1e-7)
    recovery.rollback(parts)  # a second rollback to the same snapshot: same result
    assert (group["lr"], group["eps"]) == (pytest.approx(0.025), pytest.approx(1e-7))
    trainer.optimizers[0].step()  # no gradients: a no-op, keeps the scheduler's order check quiet
    scheduler.step()
    assert group["lr"] == pytest.approx(0.025)  # LambdaLR recomputes from the backed-off base
    recovery.capture(parts)
    assert recovery.rollback(parts).endswith("MiB snapshot)")  # nothing to re-apply any more
    assert group["lr"] == pytest.approx(0.025)
    assert recovery.rollbacks_total == 3


def test_recovery_state_round_trip() -> None:
    recovery = Recovery(("quarantine",))
    recovery.book.quarantined.add(4)
    recovery.book.record("quarantine")
    recovery.rollbacks_total = 2
    other = Recovery(("quarantine",))
    other.load_state_dict(recovery.state_dict())
    assert other.state_dict() == recovery.state_dict()
    assert other.state_dict()["rollbacks_total"] == 2


def test_configure_changes_the_factors_and_keeps_the_state() -> None:
    recovery = Recovery(("quarantine", "clip_grad"), max_remedy_applications=2)
    quarantined = recovery.book.quarantined
    recovery.book.quarantined.add(4)
    recovery.book.record("quarantine")
    recovery.book.clip_threshold = 1.5
    recovery.configure(RecoverySettings(("lr_backoff",), 7, 0.25, 3.0, 0.5))
    assert (recovery.book.enabled, recovery.book.max_applications) == (("lr_backoff",), 7)
    assert (recovery.lr_backoff_factor, recovery.eps_factor, recovery.max_eps) == (0.25, 3.0, 0.5)
    assert recovery.book.quarantined is quarantined and quarantined == {4}  # the samplers hold this very set
    assert recovery.book.applied == {"quarantine": 1} and recovery.book.clip_threshold == 1.5


def test_a_checkpoint_with_nonfinite_weights_gets_the_snapshot_or_is_refused() -> None:
    from lightning_nanguard import NonFiniteTrainingError

    net = nn.Linear(2, 1)
    recovery = Recovery()
    bad = {"state_dict": {"weight": torch.full((1, 2), float("nan")), "bias": torch.zeros(1)}}
    with pytest.raises(NonFiniteTrainingError, match="refuses to save a checkpoint"):
        recovery.make_checkpoint_finite_(dict(bad))
    recovery.capture(TrainingParts(net, [torch.optim.SGD(net.parameters(), lr=0.1)], global_step=3))
    checkpoint = dict(bad)
    assert recovery.make_checkpoint_finite_(checkpoint) is not None
    assert checkpoint["nanguard_substituted_step"] == 3
    assert torch.equal(checkpoint["state_dict"]["weight"], net.weight.detach())
    assert recovery.make_checkpoint_finite_({"state_dict": net.state_dict()}) is None  # finite: untouched


def test_a_degenerate_batch_neither_clips_nor_backs_off_the_learning_rate() -> None:
    module = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    recovery = Recovery(("clip_grad", "lr_backoff", "quarantine"))
    for norm in (1.0, 2.0, 3.0):
        recovery.remember_healthy_norm(norm)
    assert recovery.apply(TrainingParts(module, [optimizer], []), cause="batch") == []
    assert optimizer.param_groups[0]["lr"] == 0.1 and recovery.book.clip_threshold is None
    assert recovery.apply(TrainingParts(module, [optimizer], []), cause="state") != []
