"""``NanGuard`` in a hand-written Lightning Fabric loop (issue 24, first part): one process, real ``Fabric``.

The loop is the one Fabric's docs show: ``fabric.setup``, ``setup_dataloaders``, ``fabric.backward``,
``fabric.clip_gradients(max_norm=1.0)`` (which raises on a non-finite norm by default),
``optimizer.step()``. The model normalises its input (``x / ||x||``): the all-zero records 5 and 21
make the steps that hold them NaN.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from states import clone_state
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NanGuard

BAD_RECORDS = (5, 21)  # batches 0 and 2 of 8 records each, position 5 in both
BATCH = 8


class Normalised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x / x.norm(dim=-1, keepdim=True)  # FORWARD ORIGIN
        return self.l2(torch.relu(self.l1(x))).squeeze(-1)


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _loop(
    guard: NanGuard, clip: bool = True, accumulate: int = 1, **fabric_args: Any
) -> tuple[nn.Module, list[dict[str, torch.Tensor]]]:
    """One epoch of the loop; the weights after every optimizer step."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, generator=g)
    x[list(BAD_RECORDS)] = 0.0
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[guard], **fabric_args)
    module = Normalised()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=BATCH // accumulate))
    states = []
    for i, batch in enumerate(loader):
        fabric.backward(loss_fn(model, batch) / accumulate)
        if (i + 1) % accumulate:
            continue
        if clip:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        states.append(clone_state(module.state_dict()))
    return module, states


def _unchanged(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(before[k], after[k]) for k in before)


@pytest.fixture(autouse=True)
def _events_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NANGUARD_DIR", str(tmp_path))


def test_the_bad_steps_are_dropped_and_clip_gradients_does_not_raise(tmp_path: Path) -> None:
    guard = NanGuard(verbose=False)
    module, states = _loop(guard)
    assert [(e.global_step, e.action, e.kinds) for e in guard.events] == [
        (0, "skipped", ("loss", "grad")),
        (2, "skipped", ("loss", "grad")),
    ]
    assert _unchanged(states[1], states[2]) and not _unchanged(states[2], states[3])  # step 2 dropped, 3 applied
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())
    assert guard.counters.skipped_total == 2 and guard.active
    assert {e.details.get("samples_not_named") for e in guard.events} == {
        "naming the offending samples needs NanGuard(loss_fn=...), with loss_fn(model, batch) -> loss"
    }
    lines = (tmp_path / "nanguard" / "events.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["global_step"] for line in lines] == [0, 2]


def test_with_loss_fn_the_records_the_module_and_the_line_are_named(tmp_path: Path) -> None:
    guard = NanGuard(verbose=False, loss_fn=loss_fn)
    _loop(guard)
    assert [(e.offending_samples, e.dataset_indices) for e in guard.events] == [((5,), (5,)), ((5,), (21,))]
    for event in guard.events:
        assert (event.cause, event.blame_verified, event.indices_verified) == ("data", True, True)
        assert (event.phase, event.culprit_op, event.details["source_text"]) == (
            "forward",
            "div",
            "x = x / x.norm(dim=-1, keepdim=True)  # FORWARD ORIGIN",
        )
        assert event.repro_path is not None and Path(event.repro_path, "batch.pt").exists()
        assert "samples_not_named" not in event.details


def test_without_clipping_the_weights_stay_finite_too() -> None:
    guard = NanGuard(verbose=False, bisect=False, localize=False, save_repro=False)
    module, states = _loop(guard, clip=False)
    assert [e.global_step for e in guard.events] == [0, 2]
    assert _unchanged(states[1], states[2])
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())


def test_gradient_accumulation_checks_the_whole_step() -> None:
    """Two backward passes per step (half batches): the step holding a bad half is dropped, named by its half."""
    guard = NanGuard(verbose=False, loss_fn=loss_fn)
    module, states = _loop(guard, accumulate=2)
    assert [e.global_step for e in guard.events] == [0, 2]
    assert [(e.offending_samples, e.dataset_indices, e.details.get("micro_batch")) for e in guard.events] == [
        ((1,), (5,), 1),
        ((1,), (21,), 1),
    ]
    assert _unchanged(states[1], states[2])
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())


class BodyAndFrozenHead(nn.Module):
    """A body, and a head frozen (and outside the optimizer) until the loop unfreezes it."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(4, 4), nn.Linear(4, 1).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return h, self.head(h.detach()).squeeze(-1)


def head_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """A finite loss; a flagged row gives a NaN gradient to the head only (a division masked after the fact)."""
    x, y, flag = batch
    h, out = model(x)
    return (h.sum(-1) - y).pow(2).mean() + torch.where(flag > 0, torch.zeros_like(out), out / (1 - flag)).mean()


def test_a_parameter_group_added_mid_loop_is_checked_from_its_first_step() -> None:
    """The loop adds the head to the optimizer at step 3, whose batch holds the flagged row 13."""
    g = torch.Generator().manual_seed(0)
    x, y, flag = torch.randn(32, 4, generator=g), torch.randn(32, generator=g), torch.zeros(32)
    flag[13] = 1.0
    guard = NanGuard(verbose=False, save_repro=False)
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[guard])
    torch.manual_seed(0)
    module = BodyAndFrozenHead()
    initial_head = clone_state(module.head.state_dict())
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.body.parameters(), lr=0.1))
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(x, y, flag), batch_size=4))
    for step, batch in enumerate(loader):
        if step == 3:
            module.head.requires_grad_(True)
            optimizer.add_param_group({"params": list(module.head.parameters())})
            before = clone_state(module.state_dict())
        fabric.backward(head_loss(model, batch))
        optimizer.step()
        optimizer.zero_grad()
        if step == 3:
            after = clone_state(module.state_dict())
    assert [(e.global_step, e.kinds, e.action) for e in guard.events] == [(3, ("grad",), "skipped")]
    assert set(guard.events[0].nonfinite_grads) == {"head.weight", "head.bias"}
    assert _unchanged(before, after)  # the step was dropped: neither the head nor the body moved
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())
    assert not _unchanged(initial_head, module.head.state_dict())  # the head trained in the steps after


def test_rollback_restores_the_last_good_snapshot() -> None:
    guard = NanGuard(
        verbose=False, action="rollback", rollback_after_consecutive=1, snapshot_every_n_steps=1, save_repro=False
    )
    module, states = _loop(guard)
    assert [(e.global_step, e.action) for e in guard.events] == [(0, "rolled_back"), (2, "rolled_back")]
    assert guard.controller.recovery.rollbacks_total == 2
    assert _unchanged(states[1], states[2])  # back to the snapshot of step 1, bitwise
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())


def test_raise_stops_the_loop_with_the_event() -> None:
    from lightning_nanguard import NonFiniteTrainingError

    guard = NanGuard(verbose=False, action="raise", bisect=False, localize=False, save_repro=False)
    with pytest.raises(NonFiniteTrainingError) as raised:
        _loop(guard)
    assert [e.global_step for e in raised.value.events] == [0]


# ------------------------------------------------------------------------------------ NANGUARD=1


def test_nanguard_1_adds_one_guard_to_every_fabric(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NANGUARD", "1")
    monkeypatch.setenv("NANGUARD_ARGS", '{"verbose": false, "bisect": false}')
    fabric = L.Fabric(accelerator="cpu", devices=1)
    (guard,) = [cb for cb in fabric._callbacks if isinstance(cb, NanGuard)]
    assert guard.from_environment and (guard.verbose, guard.bisect) == (False, False)
    module = Normalised()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    fabric.backward(loss_fn(model, (torch.zeros(2, 4), torch.zeros(2))))  # 0/0: a NaN step
    optimizer.step()
    assert [e.global_step for e in guard.events] == [0] and all(torch.isfinite(p).all() for p in module.parameters())


def test_without_nanguard_1_fabric_gets_no_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NANGUARD", raising=False)
    assert not [cb for cb in L.Fabric(accelerator="cpu")._callbacks if isinstance(cb, NanGuard)]
    monkeypatch.setenv("NANGUARD", "0")
    assert not [cb for cb in L.Fabric(accelerator="cpu")._callbacks if isinstance(cb, NanGuard)]


def test_the_users_own_guard_wins_over_the_environments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NANGUARD", "1")
    mine = NanGuard(verbose=False, bisect=False, localize=False, save_repro=False)
    _loop(mine)
    fabric_guards = [e.global_step for e in mine.events]
    assert fabric_guards == [0, 2]  # mine recorded both; the environment's stood aside (else 4 events, or a crash)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("[1]", "NANGUARD_ARGS must be a JSON object"),
        ("{bad json", "NANGUARD_ARGS must be a JSON object of NanGuard arguments:"),
        ('{"action": "skp"}', "NANGUARD_ARGS: NanGuard: `action` must be one of"),
        ('{"no_such": 1}', "NANGUARD_ARGS: "),
    ],
)
def test_nanguard_args_are_validated_like_the_constructor(
    monkeypatch: pytest.MonkeyPatch, args: str, message: str
) -> None:
    from lightning_nanguard.entry_points import nanguard_from_environment

    monkeypatch.setenv("NANGUARD", "1")
    monkeypatch.setenv("NANGUARD_ARGS", args)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("`", "`")):
        nanguard_from_environment()


def test_the_guards_state_goes_through_fabric_save_and_load(tmp_path: Path) -> None:
    """``fabric.save(path, {..., "guard": guard})``: the guard is a Stateful object (state_dict/load_state_dict)."""
    guard = NanGuard(verbose=False, bisect=False, localize=False, save_repro=False)
    module, _ = _loop(guard)
    fabric = L.Fabric(accelerator="cpu", devices=1)
    fabric.save(tmp_path / "run.ckpt", {"model": module, "guard": guard})
    resumed = NanGuard(verbose=False)
    fabric.load(tmp_path / "run.ckpt", {"model": Normalised(), "guard": resumed})
    assert resumed.counters == guard.counters and resumed.counters.skipped_total == 2
    assert [e.to_dict() for e in resumed.events] == [e.to_dict() for e in guard.events]
    assert torch.load(tmp_path / "run.ckpt", weights_only=True)["guard"]["skipped_total"] == 2  # primitives only


def test_the_standalone_lightning_fabric_package_too() -> None:
    """``pytorch_lightning`` users have ``lightning_fabric.Fabric``: the same guard holds its strategy."""
    import lightning_fabric

    guard = NanGuard(verbose=False, loss_fn=loss_fn, save_repro=False)
    fabric = lightning_fabric.Fabric(accelerator="cpu", devices=1, callbacks=[guard])
    module = Normalised()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    x = torch.ones(4, 4)
    x[2] = 0.0  # record 2: 0/0
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(x, torch.zeros(4)), batch_size=4))
    for batch in loader:
        fabric.backward(loss_fn(model, batch))
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
    assert type(fabric.strategy).__module__ == "lightning_nanguard.fabric.strategy"
    (event,) = guard.events
    assert (event.action, event.offending_samples, event.dataset_indices) == ("skipped", (2,), (2,))
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())


def test_events_scalars_and_the_dashboard_through_the_fabric_tensorboard_logger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ``NANGUARD_DIR``: events sit with the Fabric logger's run; the NanGuard tab serves them."""
    from lightning.fabric.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from werkzeug.test import Client

    from lightning_nanguard_tensorboard.plugin import NanGuardPlugin

    monkeypatch.delenv("NANGUARD_DIR")
    logger = TensorBoardLogger(str(tmp_path), name="fabric")
    guard = NanGuard(verbose=False, loss_fn=loss_fn)
    _loop(guard, loggers=[logger])
    logger.finalize("success")
    run_dir = Path(logger.log_dir)
    assert run_dir == tmp_path / "fabric" / "version_0"
    lines = (run_dir / "nanguard" / "events.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["dataset_indices"] for line in lines] == [[5], [21]]

    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    skipped = {s.step: s.value for s in accumulator.Scalars("nanguard/skipped_total")}
    assert skipped[0] == 1.0 and skipped[2] == 2.0  # written at each incident (and at logging steps)

    context = SimpleNamespace(logdir=str(tmp_path), flags=SimpleNamespace(logdir=str(tmp_path)), data_provider=None)
    apps = NanGuardPlugin(context).get_plugin_apps()  # type: ignore[arg-type]
    client = Client(lambda environ, start: apps[environ["PATH_INFO"]](environ, start))
    incidents = json.loads(client.get("/incidents?run=fabric/version_0").get_data())
    assert [(e["global_step"], e["dataset_indices"]) for e in incidents] == [(0, [5]), (2, [21])]
    assert all(e["_dashboard"]["context"] for e in incidents)  # the incident view's source and thumbnails
    timeline = json.loads(client.get("/timeline?run=fabric/version_0").get_data())
    assert [m["step"] for m in timeline["markers"]] == [0, 2]


# ------------------------------------------------------------------------------------ the guard's own failures


def test_a_loss_fn_that_fails_on_sub_batches_leaves_the_bad_steps_dropped() -> None:
    def full_batches_only(model: nn.Module, batch: Any) -> torch.Tensor:
        if len(batch[0]) != BATCH:
            raise ValueError("this loss only takes full batches")
        return loss_fn(model, batch)

    guard = NanGuard(verbose=False, loss_fn=full_batches_only)
    module, _ = _loop(guard)
    assert [(e.global_step, e.action, e.offending_samples) for e in guard.events] == [
        (0, "skipped", None),
        (2, "skipped", None),
    ]
    assert guard.active and guard.controller.parts.off == {}
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())


def test_a_broken_part_in_a_fabric_loop_is_switched_off_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_nanguard.reporting.jsonl import JsonlEventLog

    def full_disk(*args: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(JsonlEventLog, "append", full_disk)
    guard = NanGuard(verbose=False, loss_fn=loss_fn)
    module, states = _loop(guard)
    assert guard.active and set(guard.controller.parts.off) == {"events_file"}
    incidents = [(e.global_step, e.action) for e in guard.events if e.kinds != ("guard_error",)]
    assert incidents == [(0, "skipped"), (2, "skipped")] and _unchanged(states[1], states[2])
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())


def test_a_broken_core_in_a_fabric_loop_drops_the_step_in_hand_then_turns_the_guard_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import lightning_nanguard.engine.step.check as check_module

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("planted core fault")

    monkeypatch.setattr(check_module, "fused_health_check", broken)
    torch.manual_seed(0)
    initial = clone_state(Normalised().state_dict())
    guard = NanGuard(verbose=False)
    _, states = _loop(guard, clip=False)
    assert _unchanged(initial, states[0])  # step 0 could not be vouched for: dropped
    assert not guard.active and not _unchanged(states[0], states[1])  # unguarded from step 1
    ((step, kinds, part, action),) = [(e.global_step, e.kinds, e.details["part"], e.action) for e in guard.events]
    assert (step, kinds, part, action) == (0, ("guard_error",), "core", "skipped")
