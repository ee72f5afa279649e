"""The remedy functions and ``RemedyBook`` on their own (no Trainer; see ``tests/integration/test_recovery.py``)."""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch
from torch import nn

from lightning_nanguard.recover.remedies import (
    NOT_REACHED,
    REMEDIES,
    ZERO_EPS_START,
    RemedyBook,
    clip_gradients_,
    clip_threshold,
    lr_backoff_,
    raise_eps_,
)


class ScaleNorm(nn.Module):
    """A user layer with an ``eps`` attribute: ``x / sqrt(mean(x^2) + eps)``."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def test_remedy_names() -> None:
    assert REMEDIES == ("clip_grad", "raise_eps", "lr_backoff", "quarantine")


# ------------------------------------------------------------------------------------ clip_grad


def test_clip_threshold_is_the_median_healthy_norm_then_tightens() -> None:
    assert clip_threshold([4.0, 1.0, 3.0, math.nan, math.inf], None) == 3.0
    assert clip_threshold([4.0, 1.0], current=3.0) == 1.5
    assert clip_threshold([4.0], current=3.0, tighten=0.1) == pytest.approx(0.3)
    assert clip_threshold([math.nan], None) is None
    assert clip_threshold([], None) is None


def test_clip_gradients_scales_to_the_threshold_in_place() -> None:
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])]
    assert clip_gradients_(grads, total_norm=5.0, threshold=2.5)
    assert float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))) == pytest.approx(2.5, rel=1e-5)


@pytest.mark.parametrize(("norm", "threshold"), [(1.0, 2.0), (2.0, 2.0), (math.nan, 1.0)])
def test_clip_gradients_leaves_small_or_nan_norms_alone(norm: float, threshold: float) -> None:
    grads = [torch.tensor([1.0, 2.0])]
    assert not clip_gradients_(grads, total_norm=norm, threshold=threshold)
    assert grads[0].tolist() == [1.0, 2.0]
    assert not clip_gradients_([], total_norm=10.0, threshold=1.0)


# ------------------------------------------------------------------------------------ raise_eps


@pytest.mark.parametrize(
    "layer",
    [nn.LayerNorm(4, eps=1e-5), nn.GroupNorm(2, 4, eps=1e-5), nn.BatchNorm1d(4, eps=1e-5), ScaleNorm(1e-5)],
    ids=["LayerNorm", "GroupNorm", "BatchNorm1d", "user_layer"],
)
def test_raise_eps_multiplies_the_layer_eps_up_to_the_cap(layer: nn.Module) -> None:
    name = type(layer).__name__
    assert raise_eps_(layer, [], factor=10.0, max_eps=1e-3) == f"raise_eps: {name} eps 1e-05 -> 0.0001"
    assert layer.eps == pytest.approx(1e-4)
    assert raise_eps_(layer, [], factor=100.0, max_eps=1e-3) == f"raise_eps: {name} eps 0.0001 -> 0.001"
    assert layer.eps == 1e-3
    assert raise_eps_(layer, [], factor=10.0, max_eps=1e-3) is None  # capped: nothing left to do
    assert layer.eps == 1e-3


@pytest.mark.parametrize("zero", [0.0, 0], ids=["float", "int"])
def test_raise_eps_starts_a_zero_eps(zero: float) -> None:
    """0 times any factor is 0: a zero ``eps`` (the classic NaN origin) becomes ``ZERO_EPS_START``, capped."""
    layer = ScaleNorm(zero)
    assert raise_eps_(layer, [], factor=10.0, max_eps=1e-2) == "raise_eps: ScaleNorm eps 0 -> 1e-06"
    assert layer.eps == ZERO_EPS_START
    tiny_cap = ScaleNorm(zero)
    raise_eps_(tiny_cap, [], factor=10.0, max_eps=1e-7)
    assert tiny_cap.eps == 1e-7
    opt = torch.optim.Adam([nn.Parameter(torch.zeros(1))], eps=zero)
    raise_eps_(None, [opt], factor=10.0, max_eps=1e-2)
    assert opt.param_groups[0]["eps"] == ZERO_EPS_START


def test_raise_eps_of_adam_style_optimizers_every_group() -> None:
    a, b = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    adam = torch.optim.Adam([{"params": [a]}, {"params": [b], "eps": 1e-3}], eps=1e-8)
    sgd = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)  # no eps: untouched
    change = raise_eps_(nn.Linear(1, 1), [sgd, adam], factor=10.0, max_eps=5e-3)
    assert change == "raise_eps: optimizer 1 group 0 eps 1e-08 -> 1e-07, optimizer 1 group 1 eps 0.001 -> 0.005"
    assert [g["eps"] for g in adam.param_groups] == [pytest.approx(1e-7), 5e-3]
    assert "eps" not in sgd.param_groups[0]
    assert raise_eps_(None, [sgd], factor=10.0, max_eps=1.0) is None


# ------------------------------------------------------------------------------------ lr_backoff


def _lrs(opt: torch.optim.Optimizer) -> list[float]:
    return [float(g["lr"]) for g in opt.param_groups]


def _two_group_sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD(
        [{"params": [nn.Parameter(torch.zeros(1))]}, {"params": [nn.Parameter(torch.zeros(1))], "lr": 0.4}], lr=0.1
    )


def test_lr_backoff_every_group() -> None:
    opt = _two_group_sgd()
    assert (
        lr_backoff_(opt, [], factor=0.5) == "lr_backoff: learning rate x0.5 (group 0: 0.1 -> 0.05, group 1: 0.4 -> 0.2)"
    )
    assert _lrs(opt) == [0.05, 0.2]


def test_lr_backoff_stays_in_force_under_lambda_lr() -> None:
    """LambdaLR recomputes ``lr = base_lr * lambda(epoch)`` each step: the back-off must scale ``base_lrs``."""
    opt = _two_group_sgd()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.9**epoch)
    for _ in range(3):
        opt.step()
        sched.step()
    lr_backoff_(opt, [sched], factor=0.25)
    assert _lrs(opt) == pytest.approx([0.25 * 0.1 * 0.9**3, 0.25 * 0.4 * 0.9**3])
    assert [g["initial_lr"] for g in opt.param_groups] == pytest.approx([0.025, 0.1])  # a scheduler rebuilt later
    for epoch in range(4, 9):
        opt.step()
        sched.step()
        assert _lrs(opt) == pytest.approx([0.25 * 0.1 * 0.9**epoch, 0.25 * 0.4 * 0.9**epoch])
        assert sched.get_last_lr() == pytest.approx(_lrs(opt))


def test_lr_backoff_stays_in_force_under_step_lr() -> None:
    opt = _two_group_sgd()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    lr_backoff_(opt, [sched], factor=0.5)
    expected = [[0.05, 0.2], [0.05, 0.2], [0.005, 0.02], [0.005, 0.02], [0.0005, 0.002]]
    for lrs in expected:
        assert _lrs(opt) == pytest.approx(lrs)
        opt.step()
        sched.step()


def test_lr_backoff_reaches_schedulers_inside_sequential_lr() -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0)
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warmup, decay], milestones=[2])
    lr_backoff_(opt, [sched], factor=0.1)
    lrs = []
    for _ in range(4):
        opt.step()
        sched.step()
        lrs.append(_lrs(opt)[0])
    assert lrs == pytest.approx([0.1, 0.05, 0.05, 0.05])


def test_lr_backoff_leaves_other_optimizers_schedulers_alone() -> None:
    opt, other = _two_group_sgd(), _two_group_sgd()
    other_sched = torch.optim.lr_scheduler.LambdaLR(other, lambda epoch: 1.0)
    lr_backoff_(opt, [other_sched], factor=0.5)
    assert other_sched.base_lrs == [0.1, 0.4]
    assert _lrs(other) == [0.1, 0.4]
    assert _lrs(opt) == [0.05, 0.2]


# ------------------------------------------------------------------------------------ RemedyBook


def test_remedy_book_caps_each_remedy() -> None:
    book = RemedyBook(enabled=("clip_grad", "lr_backoff"), max_applications=2)
    assert not book.can_apply("quarantine")
    for _ in range(2):
        assert book.can_apply("lr_backoff")
        book.record("lr_backoff")
    assert not book.can_apply("lr_backoff")
    assert book.can_apply("clip_grad")
    assert book.total == 2
    assert RemedyBook(enabled=("clip_grad",), max_applications=0).can_apply("clip_grad") is False


def test_remedy_book_state_round_trips_through_a_weights_only_checkpoint() -> None:
    book = RemedyBook(enabled=("clip_grad", "quarantine"), max_applications=3)
    book.record("clip_grad")
    book.record("quarantine")
    book.clip_threshold = 1.25
    book.quarantined.update({11, 3})
    book.quarantine(items=[("b", 7), (1, 4), ("b", 2)])
    book.healthy_norms.extend([1.0, 2.0])
    buffer = io.BytesIO()
    torch.save(book.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)

    fresh = RemedyBook(enabled=("clip_grad", "quarantine"))
    shared = fresh.quarantined  # the recording batch samplers hold this very set
    shared_b = fresh.quarantined_by_loader.setdefault("b", {99})  # ... and each loader's own
    fresh.quarantined.add(99)
    fresh.load_state_dict(state)
    assert fresh.quarantined is shared and fresh.quarantined_by_loader["b"] is shared_b
    assert (
        fresh.state_dict()
        == book.state_dict()
        == {
            "applied": {"clip_grad": 1, "quarantine": 1},
            "clip_threshold": 1.25,
            "quarantined": [3, 11],
            "healthy_norms": [1.0, 2.0],
            "module_eps": {},
            "quarantined_by_loader": [[1, [4]], ["b", [2, 7]]],
        }
    )
    assert fresh.quarantined_by_loader == {"b": {2, 7}, 1: {4}}  # list positions stay ints
    assert fresh.healthy_norms.maxlen == 100


def test_a_checkpoint_with_the_old_flat_quarantine_list_still_loads() -> None:
    """A state saved before per-loader quarantine: its flat list is the shared one (every loader drops it)."""
    book = RemedyBook(enabled=("quarantine",))
    book.quarantined_by_loader["a"] = {5}
    book.load_state_dict({"applied": {"quarantine": 1}, "quarantined": [8, 2]})
    assert book.quarantined == {2, 8}
    assert book.quarantined_by_loader == {"a": set()}  # emptied in place, not replaced


def test_quarantine_reports_only_what_is_new() -> None:
    book = RemedyBook(enabled=("quarantine",))
    for key in (None, "a", "b"):
        book.reach.acts(key)
    assert book.quarantine([9], [("b", 9)]) == (
        "quarantine: dataset indices [9], [9] of loader 'b' will not be trained on again"
    )
    assert book.quarantine([9], [("b", 9)]) is None
    assert (
        book.quarantine(items=[("a", 9)])
        == "quarantine: dataset indices [9] of loader 'a' will not be trained on again"
    )


def test_quarantine_says_which_loaders_remove_the_records_and_why_the_others_do_not() -> None:
    book = RemedyBook(enabled=("quarantine",))
    book.reach.acts("a")
    book.reach.cannot("b", "training loader 'b' streams an IterableDataset and no index_key= is set")
    assert book.quarantine(items=[("a", 1), ("b", 2), ("c", 3)]) == (
        "quarantine: dataset indices [1] of loader 'a' will not be trained on again; "
        "dataset indices [2] of loader 'b' will NOT be removed from training: training loader 'b' streams an "
        "IterableDataset and no index_key= is set; "
        f"dataset indices [3] of loader 'c' will NOT be removed from training: {NOT_REACHED}"
    )
    book.reach.acts("b")  # a later epoch's loader 'b' removes them (e.g. reloaded as a map-style loader)
    assert (
        book.quarantine(items=[("b", 5)])
        == "quarantine: dataset indices [5] of loader 'b' will not be trained on again"
    )
    book.reach.clear()
    assert book.reach.why_not("a") == NOT_REACHED


def test_the_reach_is_not_saved_in_checkpoints() -> None:
    """Each fit registers its own loaders: a checkpoint's quarantine list applies where the new fit's loaders act."""
    book = RemedyBook(enabled=("quarantine",))
    book.reach.acts(None)
    assert "reach" not in book.state_dict()
    fresh = RemedyBook(enabled=("quarantine",))
    fresh.load_state_dict(book.state_dict())
    assert fresh.reach.why_not(None) == NOT_REACHED


def test_remedy_book_loads_an_empty_state_with_defaults() -> None:
    book = RemedyBook(enabled=("quarantine",))
    book.quarantined.add(1)
    book.load_state_dict({})
    state: dict[str, Any] = book.state_dict()
    assert state == {
        "applied": {},
        "clip_threshold": None,
        "quarantined": [],
        "healthy_norms": [],
        "module_eps": {},
        "quarantined_by_loader": [],
    }


def test_raised_module_eps_survives_a_checkpoint_round_trip(tmp_path) -> None:
    """A module's eps is an attribute, not state: the book keeps it and re-applies it on resume."""
    from lightning_nanguard.recover.recovery import Recovery, TrainingParts, apply_module_eps

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4, eps=1e-5))
    recovery = Recovery(("raise_eps",), eps_factor=10.0, max_eps=1e-2)
    recovery.apply(TrainingParts(net, []), cause="data", culprit_module="1")
    assert net[1].eps == pytest.approx(1e-4)

    torch.save(recovery.state_dict(), tmp_path / "state.pt")
    restored = Recovery(("raise_eps",))
    restored.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4, eps=1e-5))
    apply_module_eps(fresh, restored.book.module_eps)
    assert fresh[1].eps == pytest.approx(1e-4)
