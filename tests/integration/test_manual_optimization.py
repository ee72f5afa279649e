"""Manual optimisation under ``Trainer(callbacks=[NanGuard()])`` (issue 34), one process.

With ``automatic_optimization = False`` the guard checks every ``opt.step()`` on the gradients of the
parameters *that optimizer* updates and drops a bad one (a true no-op for that optimizer only, its
BatchNorm statistics put back), with no ``guard.check`` call. Each run is compared bit for bit with
the same loop dropping the bad step by hand (``drop_by_hand=True``: no ``opt.step()``, no scheduler
step, BatchNorm buffers put back, ``opt.zero_grad()``). The loops are in ``tests/helpers/manual_loops.py``.

Decisions these tests fix (issue 34's brief):

- ``event.optimizer`` is the index of the stepped optimizer in ``trainer.optimizers``;
- a step's loss is recomputed, to name records, from ``NanGuard(loss_fn=fn)`` with ``fn(model, batch)``
  or ``fn(model, batch, optimizer)``, or the module's ``nanguard_loss(batch, optimizer)``; the
  optimizer is the one being stepped, as the user holds it (see ``manual_loops.optimizer_index``);
- LBFGS (a closure optimizer): a bad step is undone (weights and optimizer state as before it);
- ``max_consecutive_bad_steps`` counts each optimizer's own streak.

Runs are one epoch (not ``max_steps``: in manual optimisation ``global_step`` counts ``opt.step()``
calls, so a guarded run, whose dropped steps still count, would stop at another batch than its
reference).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from fitting import build_trainer
from manual_loops import (
    DCGAN,
    WGANGP,
    BatchStates,
    LbfgsRegressor,
    ManualLoop,
    ManualRegressor,
    NamedReinforce,
    NamedTwoTasks,
    Reinforce,
    TwoTasks,
    dcgan_data,
    dcgan_loss_fn,
    lbfgs_data,
    loader,
    regression_data,
    regression_loss_fn,
    reinforce_data,
    two_task_data,
    two_task_loss_fn,
    wgan_data,
    wgan_loss_fn,
)
from states import bitwise_equal, states_equal
from torch.utils.data import TensorDataset

from lightning_nanguard import NanEvent, NanGuard, NonFiniteTrainingError

NO_FIELD = "<NanEvent has no `optimizer` field>"
VALUES = {"nan": math.nan, "+inf": math.inf, "-inf": -math.inf}


@pytest.fixture(autouse=True)
def _events_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NANGUARD_DIR", str(tmp_path))


def _guard(**kwargs: Any) -> NanGuard:
    return NanGuard(verbose=False, save_repro=False, **kwargs)


def _fit(module: Any, data: TensorDataset, root: Path, *callbacks: Any, may_raise: bool = False) -> Any:
    """One epoch of ``module`` on ``data`` (4 records a batch, in order); returns the trainer.

    A guarded run that stops with ``NonFiniteTrainingError`` fails the test with the guard's events
    (the bad steps were not dropped, so NaN/Inf kept coming), unless ``may_raise``.
    """
    trainer = build_trainer("lightning", root, callbacks=list(callbacks))
    stopped: str | None = None
    try:
        trainer.fit(module, loader(data))
    except NonFiniteTrainingError as error:
        if may_raise:
            raise
        stopped = str(error).split(" -> ")[0]
    if stopped is not None:
        guards = [c for c in callbacks if isinstance(c, NanGuard)]
        events = _summary(guards[0].events) if guards else []
        pytest.fail(f"the guarded run stopped: {stopped}; events (batch, action, optimizer): {events}", pytrace=False)
    return trainer


def _optimizer_of(event: NanEvent) -> Any:
    return getattr(event, "optimizer", NO_FIELD)


def _summary(events: list[NanEvent]) -> list[tuple[int, str, Any]]:
    """``(batch_idx, action, optimizer)`` of each event."""
    return [(e.batch_idx, e.action, _optimizer_of(e)) for e in events]


def _finite(module: torch.nn.Module) -> dict[str, bool]:
    return {name: bool(torch.isfinite(p).all()) for name, p in module.named_parameters()}


def _state(trainer: Any, module: torch.nn.Module) -> dict[str, Any]:
    return {
        "params": {n: p.detach().clone() for n, p in module.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in module.named_buffers()},
        "optimizers": [opt.state_dict() for opt in trainer.optimizers],
    }


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """What differs between two :func:`_state` (or ``BatchStates``) records, by name."""
    found = [f"param {n}" for n in a["params"] if not bitwise_equal(a["params"][n], b["params"][n])]
    found += [f"buffer {n}" for n in a["buffers"] if not bitwise_equal(a["buffers"][n], b["buffers"][n])]
    for i, (x, y) in enumerate(zip(a["optimizers"], b["optimizers"], strict=True)):
        if x["state"].keys() != y["state"].keys():
            found.append(f"optimizer {i}: state of params {sorted(x['state'])} vs {sorted(y['state'])}")
            continue
        for key, fields in x["state"].items():
            found += [
                f"optimizer {i} param {key} {field}"
                for field in sorted(fields.keys() | y["state"][key].keys())
                if not states_equal(fields.get(field), y["state"][key].get(field))
            ]
        if not states_equal(x["param_groups"], y["param_groups"]):
            found.append(f"optimizer {i} param_groups")
    return found


def _assert_same_as_hand_dropped(
    guarded: torch.nn.Module, guarded_trainer: Any, reference: torch.nn.Module, reference_trainer: Any
) -> None:
    """Parameters, buffers and optimizer states of the two runs are bitwise equal (the differing ones listed)."""
    differences = _differences(_state(guarded_trainer, guarded), _state(reference_trainer, reference))
    dropped = getattr(reference, "dropped_by_hand", getattr(reference, "skip_batches", None))
    assert differences == [], f"the guarded run differs from the run dropping {dropped} by hand in: {differences}"


def _moved(states: BatchStates, batch: int, prefix: str) -> list[str]:
    """Parameters under ``prefix`` that batch ``batch`` changed."""
    before, after = states.before[batch]["params"], states.after[batch]["params"]
    return [n for n in before if n.startswith(prefix) and not bitwise_equal(before[n], after[n])]


def _optimizer_steps(states: dict[str, Any], index: int) -> list[float]:
    """Adam's ``step`` of each parameter of optimizer ``index`` in a recorded state."""
    return [float(s["step"]) for s in states["optimizers"][index]["state"].values()]


def _two_task_run(
    tmp_path: Path, guard: NanGuard | None, bad: tuple[int, ...] = (13,), value: float = math.nan, **module_args: Any
) -> tuple[Any, TwoTasks, BatchStates]:
    module_class = module_args.pop("module_class", TwoTasks)
    module = module_class(drop_by_hand=guard is None, **module_args)
    states = BatchStates()
    callbacks = [guard, states] if guard is not None else [states]
    trainer = _fit(module, two_task_data(bad=bad, value=value), tmp_path, *callbacks)
    return trainer, module, states


# ------------------------------------------------------------------------------------ 1. drop per optimizer.step()


@pytest.mark.compat(
    feature="automatic_optimization = False",
    kind="optimization",
    status="works",
    note=(
        "each bad opt.step() dropped alone (no guard.check), BatchNorm restored, the optimizer named; "
        "bit for bit with dropping it by hand"
    ),
)
@pytest.mark.parametrize("value", list(VALUES), ids=list(VALUES))
def test_the_bad_optimizer_step_is_dropped_and_the_healthy_one_of_the_same_batch_goes_ahead(
    tmp_path: Path, value: str
) -> None:
    """Record 13 (batch 3) holds NaN/Inf in the features of ``fragile`` (optimizer 1, BatchNorm, stepped first)."""
    guard = _guard()
    trainer, module, states = _two_task_run(tmp_path / "guarded", guard, value=VALUES[value])
    assert _summary(guard.events) == [(3, "skipped", 1)], (
        "one event for fragile's step in batch 3, action 'skipped', event.optimizer == 1 (its index in "
        "trainer.optimizers, although it is stepped first)"
    )
    before, after = states.before[3], states.after[3]
    assert _moved(states, 3, "fragile.") == [], "the dropped step moved fragile's weights"
    bn_changed = [n for n in before["buffers"] if not bitwise_equal(before["buffers"][n], after["buffers"][n])]
    assert bn_changed == [], (
        f"fragile's BatchNorm statistics touched by the bad forward were not restored: {bn_changed}"
    )
    assert states_equal(before["optimizers"][1], after["optimizers"][1]), (
        f"fragile's Adam state changed on the dropped step (step counts {_optimizer_steps(before, 1)} -> "
        f"{_optimizer_steps(after, 1)})"
    )
    steady_moved = _moved(states, 3, "steady.")
    assert len(steady_moved) == 4, f"steady's healthy step in the same batch was not applied: {steady_moved} moved"
    assert _optimizer_steps(after, 0) == [s + 1 for s in _optimizer_steps(before, 0)], "steady's Adam did not step"
    assert all(_finite(module).values()), _finite(module)
    assert guard.skipped_total == 1
    reference_trainer, reference, _ = _two_task_run(tmp_path / "reference", None, value=VALUES[value])
    assert reference.dropped_by_hand == [(3, 1)]
    _assert_same_as_hand_dropped(module, trainer, reference, reference_trainer)


@pytest.mark.parametrize("skip_checked", [True, False], ids=["skipped_by_hand", "stepped_anyway"])
def test_a_user_calling_guard_check_gets_one_event_per_bad_step(tmp_path: Path, skip_checked: bool) -> None:
    """The old documented way: ``guard.check(self, loss)`` after each ``manual_backward``; skip by hand or not.

    Records 13 and 21 (batches 3 and 5) are bad; ``fragile`` has no BatchNorm here (a user skipping by
    hand would have to put it back too). Either way: one event per bad step, and the weights and
    optimizer states of the run without ``guard.check``.
    """
    guard = _guard()
    trainer, module, _ = _two_task_run(
        tmp_path / "checked", guard, bad=(13, 21), batchnorm=False, check_guard=guard, skip_checked=skip_checked
    )
    assert module.checked == [(3, 1), (5, 1)], "guard.check itself must still report the bad steps"
    assert [e.batch_idx for e in guard.events] == [3, 5], (
        f"one event per bad step, not one from guard.check and one from the step: {_summary(guard.events)}"
    )
    if not skip_checked:  # the guard dropped them itself
        assert _summary(guard.events) == [(3, "skipped", 1), (5, "skipped", 1)]
    plain_guard = _guard()
    plain_trainer, plain, _ = _two_task_run(tmp_path / "plain", plain_guard, bad=(13, 21), batchnorm=False)
    assert [e.batch_idx for e in plain_guard.events] == [3, 5], "the run without guard.check: one event per bad step"
    params = {n: p for n, p in module.named_parameters()}
    differing = [n for n, p in plain.named_parameters() if not bitwise_equal(p, params[n])]
    assert differing == [], f"guard.check changed the training: {differing}"
    assert states_equal(trainer.optimizers[1].state_dict(), plain_trainer.optimizers[1].state_dict())
    assert states_equal(trainer.optimizers[0].state_dict(), plain_trainer.optimizers[0].state_dict())


# ------------------------------------------------------------------------------------ 2. naming the records


def _assert_names(event: NanEvent, index: int) -> None:
    assert event.dataset_indices == (index,), (
        f"the event should name record {index}: dataset_indices={event.dataset_indices}, details={event.details}"
    )
    assert event.indices_verified is True, event.details


@pytest.mark.compat(
    feature="automatic_optimization = False",
    kind="optimization",
    status="works",
    note="records named and verified with NanGuard(loss_fn=...) or a nanguard_loss(batch, optimizer) method",
)
@pytest.mark.parametrize("way", ["loss_fn", "nanguard_loss"])
def test_a_loss_given_with_the_optimizer_names_the_record(tmp_path: Path, way: str) -> None:
    """``loss_fn(module, batch, optimizer)`` (it branches on which optimizer) or ``nanguard_loss(batch, optimizer)``."""
    if way == "loss_fn":
        guard = _guard(loss_fn=two_task_loss_fn)
        trainer, module, _ = _two_task_run(tmp_path / "guarded", guard)
    else:
        guard = _guard()
        trainer, module, _ = _two_task_run(tmp_path / "guarded", guard, module_class=NamedTwoTasks)
    assert _summary(guard.events) == [(3, "skipped", 1)]
    _assert_names(guard.events[0], 13)
    assert "samples_not_named" not in guard.events[0].details
    reference_trainer, reference, _ = _two_task_run(tmp_path / "reference", None)
    _assert_same_as_hand_dropped(module, trainer, reference, reference_trainer)  # the re-runs changed nothing


def test_a_two_parameter_loss_fn_names_the_record_of_a_single_optimizer(tmp_path: Path) -> None:
    guard = _guard(loss_fn=regression_loss_fn)
    module = ManualRegressor()
    trainer = _fit(module, regression_data(bad=(9,)), tmp_path / "guarded", guard)
    assert _summary(guard.events) == [(2, "skipped", 0)]
    _assert_names(guard.events[0], 9)
    reference = ManualRegressor(drop_by_hand=True)
    reference_trainer = _fit(reference, regression_data(bad=(9,)), tmp_path / "reference")
    assert reference.dropped_by_hand == [(2, 0)]
    _assert_same_as_hand_dropped(module, trainer, reference, reference_trainer)


def test_without_a_loss_the_step_is_still_dropped_and_the_event_says_why_no_record_is_named(tmp_path: Path) -> None:
    guard = _guard()
    _, module, states = _two_task_run(tmp_path, guard)
    assert _summary(guard.events) == [(3, "skipped", 1)]
    assert _moved(states, 3, "fragile.") == [], "fragile's step in batch 3 was not dropped"
    assert all(_finite(module).values()), _finite(module)
    why = guard.events[0].details.get("samples_not_named")
    assert why is not None, f"details must say why no record is named: {guard.events[0].details}"
    assert "loss_fn" in why or "nanguard_loss" in why, f"the reason should point to loss_fn/nanguard_loss: {why!r}"


# ------------------------------------------------------------------------------------ 3. closure optimizers (LBFGS)


def _lbfgs_run(tmp_path: Path, guard: NanGuard | None, manual: bool) -> tuple[Any, LbfgsRegressor, BatchStates]:
    module = LbfgsRegressor(manual=manual, skip_batches=() if guard is not None else (2,))
    states = BatchStates()
    callbacks = [guard, states] if guard is not None else [states]
    return _fit(module, lbfgs_data(bad=(9,)), tmp_path, *callbacks), module, states


@pytest.mark.compat(
    feature="torch.optim.LBFGS (closure optimizers)",
    kind="optimization",
    status="works",
    note="a bad step is undone (weights and optimizer state as before it), automatic and manual",
)
@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_a_bad_lbfgs_step_is_undone(tmp_path: Path, manual: bool) -> None:
    """Record 9 (batch 2) is all zeros: ``x / ||x||`` is NaN in the closure; LBFGS would step on it several times."""
    guard = _guard()
    trainer, module, states = _lbfgs_run(tmp_path / "guarded", guard, manual)
    seen = [(e.batch_idx, e.action) for e in guard.events]
    assert seen == [(2, "skipped")], f"one event for the bad LBFGS step, action 'skipped' (undone): {seen}"
    moved = [n for n, p in states.before[2]["params"].items() if not bitwise_equal(p, states.after[2]["params"][n])]
    assert moved == [], f"the bad LBFGS step was not undone: {moved} differ from before the step"
    assert states_equal(states.before[2]["optimizers"], states.after[2]["optimizers"]), (
        "LBFGS's state (history, counters) after the undone step differs from before it"
    )
    assert all(_finite(module).values()), _finite(module)
    reference_trainer, reference, _ = _lbfgs_run(tmp_path / "reference", None, manual)
    _assert_same_as_hand_dropped(module, trainer, reference, reference_trainer)


# ------------------------------------------------------------------------------------ 4. counting per optimizer


@pytest.mark.compat(
    feature="several optimizers (GANs, actor-critic)",
    kind="optimization",
    status="works",
    note="each optimizer's own streak of bad steps escalates; a healthy generator does not hide a failing critic",
)
def test_a_discriminator_failing_three_steps_in_a_row_raises_although_the_generator_is_healthy(tmp_path: Path) -> None:
    """D is bad at batches 3, 4, 5, 6; G steps healthy between them: D's own streak reaches 3 at batch 5."""
    guard = _guard(max_consecutive_bad_steps=3)
    module = DCGAN()
    with pytest.raises(NonFiniteTrainingError) as info:
        _fit(module, dcgan_data(bad=(13, 17, 21, 25)), tmp_path, guard, may_raise=True)
    assert module.d_steps[-1] == 5, (
        f"the raise should come at D's step of batch 5, the last D step was {module.d_steps[-1]}"
    )
    assert _summary(guard.events) == [(3, "skipped", 1), (4, "skipped", 1), (5, "raised", 1)]
    assert "3 consecutive bad steps" in str(info.value)
    assert all(_finite(module).values()), f"a bad step reached the weights before the raise: {_finite(module)}"


def test_a_discriminator_whose_streak_is_broken_by_its_own_healthy_steps_finishes(tmp_path: Path) -> None:
    """D is bad at batches 3, 5, 7 (healthy at 4 and 6), limit 2: D's streak never passes 1."""
    guard = _guard(max_consecutive_bad_steps=2)
    module = DCGAN()
    trainer = _fit(module, dcgan_data(bad=(13, 21, 29)), tmp_path / "guarded", guard)
    assert module.d_steps[-1] == 11, "the run did not finish its 12 batches"
    assert _summary(guard.events) == [(3, "skipped", 1), (5, "skipped", 1), (7, "skipped", 1)]
    assert all(_finite(module).values()), _finite(module)
    reference = DCGAN(drop_by_hand=True)
    reference_trainer = _fit(reference, dcgan_data(bad=(13, 21, 29)), tmp_path / "reference")
    _assert_same_as_hand_dropped(module, trainer, reference, reference_trainer)


# ------------------------------------------------------------------------------------ 5. manual-loop patterns


@pytest.mark.compat(
    feature="several optimizers (GANs, actor-critic)",
    kind="optimization",
    status="works",
    note="toggle_optimizer/untoggle_optimizer",
)
def test_toggle_optimizer_with_several_optimizers(tmp_path: Path) -> None:
    guard = _guard()
    trainer, module, _ = _two_task_run(tmp_path / "guarded", guard, toggle=True)
    assert _summary(guard.events) == [(3, "skipped", 1)]
    assert not any(p.requires_grad is False for p in module.parameters()), "untoggle_optimizer left parameters frozen"
    reference_trainer, reference, _ = _two_task_run(tmp_path / "reference", None, toggle=True)
    assert reference.dropped_by_hand == [(3, 1)]
    _assert_same_as_hand_dropped(module, trainer, reference, reference_trainer)


def _regressor_runs(
    tmp_path: Path, **module_args: Any
) -> tuple[NanGuard, Any, ManualRegressor, BatchStates, Any, ManualRegressor]:
    """A guarded run and its hand-dropped reference of ``ManualRegressor(**module_args)``; record 9 (batch 2) is NaN."""
    guard, states = _guard(), BatchStates()
    module = ManualRegressor(**module_args)
    trainer = _fit(module, regression_data(bad=(9,)), tmp_path / "guarded", guard, states)
    reference = ManualRegressor(drop_by_hand=True, **module_args)
    reference_trainer = _fit(reference, regression_data(bad=(9,)), tmp_path / "reference")
    return guard, trainer, module, states, reference_trainer, reference


@pytest.mark.compat(
    feature="automatic_optimization = False",
    kind="optimization",
    status="works",
    note="manual gradient accumulation: the step of every batch it accumulated dropped",
)
def test_manual_gradient_accumulation_drops_the_whole_step(tmp_path: Path) -> None:
    """``manual_backward`` every batch, ``opt.step()`` every 2: the NaN of batch 2 (first of a pair) spoils step 2-3."""
    guard, trainer, module, states, reference_trainer, reference = _regressor_runs(tmp_path, accumulate=2)
    assert reference.dropped_by_hand == [(3, 0)]
    assert _summary(guard.events) == [(3, "skipped", 0)], "the pair's step (taken at batch 3) is dropped"
    assert not _differences(states.before[2], states.after[3]), "weights moved over the dropped pair"
    _assert_same_as_hand_dropped(module, trainer, reference, reference_trainer)


@pytest.mark.compat(
    feature="automatic_optimization = False",
    kind="optimization",
    status="works",
    note="self.clip_gradients before a bad step does not raise",
)
def test_clip_gradients_before_a_bad_step_does_not_raise_and_the_step_is_dropped(tmp_path: Path) -> None:
    guard, trainer, module, _, reference_trainer, reference = _regressor_runs(tmp_path, clip=1.0)
    assert reference.dropped_by_hand == [(2, 0)]
    assert _summary(guard.events) == [(2, "skipped", 0)]
    assert all(_finite(module).values()), _finite(module)
    _assert_same_as_hand_dropped(module, trainer, reference, reference_trainer)


@pytest.mark.compat(
    feature="automatic_optimization = False",
    kind="optimization",
    status="works",
    note="a scheduler the user steps after a dropped step does not advance",
)
def test_a_dropped_step_does_not_advance_the_lr_scheduler_the_user_steps(tmp_path: Path) -> None:
    """StepLR(step_size=1, gamma=0.5) stepped after each ``opt.step()``: not after the dropped one."""
    guard, trainer, module, _, reference_trainer, reference = _regressor_runs(tmp_path, scheduler=True)
    assert reference.dropped_by_hand == [(2, 0)]
    assert _summary(guard.events) == [(2, "skipped", 0)]
    assert module.lrs == reference.lrs, f"learning rate per batch: {module.lrs} vs reference {reference.lrs}"
    (scheduler,) = trainer.lr_scheduler_configs
    (reference_scheduler,) = reference_trainer.lr_scheduler_configs
    assert scheduler.scheduler.last_epoch == reference_scheduler.scheduler.last_epoch == 7
    _assert_same_as_hand_dropped(module, trainer, reference, reference_trainer)


# ------------------------------------------------------------------------------------ 6. real loops


def _loop_run(
    tmp_path: Path, module_class: type[ManualLoop], data: TensorDataset, guard: NanGuard | None
) -> tuple[Any, ManualLoop]:
    module = module_class(drop_by_hand=guard is None)
    return _fit(module, data, tmp_path, *([guard] if guard is not None else [])), module


LOOPS: dict[str, dict[str, Any]] = {
    # bad D steps at batches 3 and 7 (records 13 and 30), D is optimizer 1
    "dcgan": {
        "module": DCGAN,
        "named": DCGAN,
        "data": lambda: dcgan_data(bad=(13, 30)),
        "loss_fn": dcgan_loss_fn,
        "dropped": [(3, 1), (7, 1)],
        "records": [13, 30],
    },
    # bad critic steps at batches 4 (a generator batch too) and 7 (records 17 and 31), the critic is optimizer 1
    "wgan_gp": {
        "module": WGANGP,
        "named": WGANGP,
        "data": lambda: wgan_data(bad=(17, 31)),
        "loss_fn": wgan_loss_fn,
        "dropped": [(4, 1), (7, 1)],
        "records": [17, 31],
    },
    # bad policy steps at batches 3 and 6 (records 13 and 26), the policy is optimizer 0; naming by nanguard_loss
    "reinforce": {
        "module": Reinforce,
        "named": NamedReinforce,
        "data": lambda: reinforce_data(bad=(13, 26)),
        "loss_fn": None,
        "dropped": [(3, 0), (6, 0)],
        "records": [13, 26],
    },
}


@pytest.mark.parametrize("loop", list(LOOPS))
@pytest.mark.parametrize("naming", [False, True], ids=["plain_guard", "with_loss"])
def test_a_real_loop_with_a_fault_in_one_network_matches_the_run_dropping_it_by_hand(
    tmp_path: Path, loop: str, naming: bool
) -> None:
    """DCGAN (``D(x) == 0``), WGAN-GP (NaN penalty gradient), REINFORCE (``log(prob = 0)``), each bit for bit.

    ``with_loss``: ``NanGuard(loss_fn=...)`` (GANs) or the module's ``nanguard_loss`` (REINFORCE): the
    bad records are named, and the guard's re-runs leave the training bit for bit as well.
    """
    spec = LOOPS[loop]
    reference_trainer, reference = _loop_run(tmp_path / "reference", spec["module"], spec["data"](), None)
    assert reference.dropped_by_hand == spec["dropped"], "the planted faults are not where the test expects them"
    guard = _guard(loss_fn=spec["loss_fn"]) if naming else _guard()
    module_class = spec["named"] if naming else spec["module"]
    trainer, module = _loop_run(tmp_path / "guarded", module_class, spec["data"](), guard)
    bad_optimizer = spec["dropped"][0][1]
    assert _summary(guard.events) == [(b, "skipped", i) for b, i in spec["dropped"]], (
        f"one 'skipped' event per bad step of optimizer {bad_optimizer} only"
    )
    assert guard.skipped_total == len(spec["dropped"])
    assert all(_finite(module).values()), f"both networks finite at the end: {_finite(module)}"
    _assert_same_as_hand_dropped(module, trainer, reference, reference_trainer)
    if naming:
        for event, record in zip(guard.events, spec["records"], strict=True):
            _assert_names(event, record)
