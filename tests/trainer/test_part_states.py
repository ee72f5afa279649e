"""Each stateful part owns its checkpoint state; the controller composes them into the 0.2.0/0.3 layout.

The parts: :class:`GuardState` (counters, last gradient norm), :class:`IncidentRecorder` (the last
events), :class:`SpikeWatch` (the spike statistic) and :class:`Recovery` (remedy state, rollbacks).
``StepController.state_dict`` must give, key for key, what ``guard_state`` of 0.3 gave
(``PRE_REFACTOR_STATE``, produced by 0.3's code for the same scenario, ``stateful_guard``).
"""

from __future__ import annotations

import io
from typing import Any

import torch

from lightning_nanguard import NanGuard
from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.decide.policy import Counters
from lightning_nanguard.engine.recording import EVENTS_KEPT_IN_CHECKPOINT, IncidentRecorder
from lightning_nanguard.engine.state import GuardState
from lightning_nanguard.engine.step.spikes import SpikeSettings, SpikeWatch
from lightning_nanguard.recover.recovery import Recovery
from lightning_nanguard.trainer import checkpoint

COUNTERS = Counters(
    bad_steps_total=3,
    skipped_total=2,
    consecutive_bad_steps=1,
    amp_overflow_total=4,
    consecutive_overflows=1,
    spikes_total=1,
    consecutive_spikes=1,
)
SPIKE_STATE_BEFORE_DETECTORS = {
    "loss": {"history": [2.0, 1.5], "consecutive_spikes": 0, "spikes_total": 1, "rebaselines_total": 0}
}


def weights_only_copy(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` through ``torch.save`` and ``torch.load(weights_only=True)``: primitives only, or it raises."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


def stateful_guard(**overrides: Any) -> NanGuard:
    """A guard whose every part holds state (the same code, run with 0.3, made ``PRE_REFACTOR_STATE``)."""
    arguments: dict[str, Any] = {
        "remedies": ["quarantine", "clip_grad"],
        "verbose": False,
        "save_repro": False,
        "spike_warmup_steps": 4,
    }
    guard = NanGuard(**{**arguments, **overrides})
    controller = guard.controller
    controller.state.counters = COUNTERS
    controller.state.last_grad_norm = 1.5
    controller.state.pending_rollback, controller.state.reported_step = True, 7  # per-step flags: never saved
    if controller.spikes is not None:
        for loss, norm in [(2.0, 4.0), (1.5, 3.0), (1.25, 2.5)]:
            controller.spikes.check(torch.tensor(loss), torch.tensor(norm))
            controller.spikes.accept(True, loss=loss, grad_norm=norm)
    else:
        controller.spike_state = SPIKE_STATE_BEFORE_DETECTORS
    controller.recorder.events.append(
        NanEvent(4, 0, 4, 0, ("loss", "grad"), "skipped", loss=float("nan"), dataset_indices=(9,), cause="data")
    )
    controller.recorder.events.append(
        NanEvent(7, 1, 2, 0, ("loss_spike",), "skipped", loss=12.5, details={"ratio": 6.25})
    )
    book = guard.recovery.book
    book.quarantine([9])
    book.record("quarantine")
    book.clip_threshold = 0.75
    book.record("clip_grad")
    book.healthy_norms.extend([4.0, 3.0, 2.5])
    guard.recovery.rollbacks_total = 2
    return guard


def _event(step: int, epoch: int, batch_idx: int, kinds: list[str], loss: Any, **fields: Any) -> dict[str, Any]:
    """One event as 0.3's ``NanEvent.to_dict`` wrote it (every field, defaults where not given)."""
    return {
        "global_step": step,
        "epoch": epoch,
        "batch_idx": batch_idx,
        "rank": 0,
        "kinds": kinds,
        "action": "skipped",
        "nonfinite_grads": [],
        "nonfinite_buffers": [],
        "loss": loss,
        "offending_samples": None,
        "dataset_indices": fields.get("dataset_indices"),
        "culprit_module": None,
        "culprit_op": None,
        "source_line": None,
        "phase": None,
        "remedies": [],
        "repro_path": None,
        "grad_norm": None,
        "nonfinite_params": [],
        "details": fields.get("details", {}),
        "cause": fields.get("cause"),
    }


# What lightning_nanguard 0.3 (commit 00bc8c1: ``lightning_nanguard.adapter.checkpoint.guard_state``)
# returned for ``stateful_guard()``, printed with pprint and pasted here, in its key order.
PRE_REFACTOR_STATE: dict[str, Any] = {
    "bad_steps_total": 3,
    "skipped_total": 2,
    "consecutive_bad_steps": 1,
    "amp_overflow_total": 4,
    "consecutive_overflows": 1,
    "spikes_total": 1,
    "consecutive_spikes": 1,
    "last_grad_norm": 1.5,
    "spikes": {
        "loss": {"history": [2.0, 1.5, 1.25], "consecutive_spikes": 0, "spikes_total": 0, "rebaselines_total": 0},
        "grad_norm": {"history": [4.0, 3.0, 2.5], "consecutive_spikes": 0, "spikes_total": 0, "rebaselines_total": 0},
    },
    "events": [
        _event(4, 0, 4, ["loss", "grad"], "nan", dataset_indices=[9], cause="data"),
        _event(7, 1, 2, ["loss_spike"], 12.5, details={"ratio": 6.25}),
    ],
    "recovery": {
        "remedies": {
            "applied": {"quarantine": 1, "clip_grad": 1},
            "clip_threshold": 0.75,
            "quarantined": [9],
            "module_eps": {},
            "healthy_norms": [4.0, 3.0, 2.5],
            "quarantined_by_loader": [],
        },
        "rollbacks_total": 2,
    },
}


# ---------------------------------------------------------------------------------- GuardState


def test_guard_state_saves_the_counters_flat_and_the_last_norm() -> None:
    state = GuardState(COUNTERS, last_grad_norm=1.5, pending_rollback=True, reported_step=7, dropped_by_check=True)
    assert state.state_dict() == {
        "bad_steps_total": 3,
        "skipped_total": 2,
        "consecutive_bad_steps": 1,
        "amp_overflow_total": 4,
        "consecutive_overflows": 1,
        "spikes_total": 1,
        "consecutive_spikes": 1,
        "last_grad_norm": 1.5,
    }  # the per-step flags are not part of it
    fresh = GuardState()
    fresh.load_state_dict(weights_only_copy(state.state_dict()))
    assert fresh.counters == COUNTERS and fresh.last_grad_norm == 1.5
    assert fresh.state_dict() == state.state_dict()
    assert not fresh.pending_rollback and fresh.reported_step is None and not fresh.dropped_by_check


def test_guard_state_reads_missing_keys_as_zero_and_none() -> None:
    state = GuardState(COUNTERS, last_grad_norm=1.5)
    state.load_state_dict({"bad_steps_total": 2, "consecutive_spikes": 1.0})  # no last_grad_norm, most counters
    assert state.counters == Counters(bad_steps_total=2, consecutive_spikes=1) and state.last_grad_norm is None
    assert type(state.counters.consecutive_spikes) is int
    state.load_state_dict({})
    assert state.counters == Counters() and state.last_grad_norm is None


# ---------------------------------------------------------------------------------- IncidentRecorder


def test_the_recorder_saves_its_events_as_dicts() -> None:
    recorder = IncidentRecorder(verbose=False)
    recorder.events.extend(
        [
            NanEvent(4, 0, 4, 0, ("loss", "grad"), "skipped", loss=float("nan"), dataset_indices=(9,), cause="data"),
            NanEvent(7, 1, 2, 0, ("loss_spike",), "skipped", loss=12.5, details={"ratio": 6.25}),
        ]
    )
    state = recorder.state_dict()
    assert list(state) == ["events"] and state["events"] == PRE_REFACTOR_STATE["events"]
    fresh = IncidentRecorder(verbose=False)
    kept = fresh.events
    fresh.load_state_dict(weights_only_copy(state))
    assert fresh.events is kept  # restored in place
    assert [e.to_dict() for e in fresh.events] == state["events"]
    assert [(e.global_step, e.kinds, e.dataset_indices) for e in fresh.events] == [
        (4, ("loss", "grad"), (9,)),
        (7, ("loss_spike",), None),
    ]


def test_the_recorder_keeps_only_the_last_events_in_a_checkpoint() -> None:
    assert EVENTS_KEPT_IN_CHECKPOINT == 100 and checkpoint.EVENTS_KEPT_IN_CHECKPOINT == EVENTS_KEPT_IN_CHECKPOINT
    recorder = IncidentRecorder(verbose=False)
    recorder.events.extend(NanEvent(step, 0, step, 0, ("loss",), "skipped") for step in range(130))
    saved = recorder.state_dict()["events"]
    assert [event["global_step"] for event in saved] == list(range(30, 130))
    assert len(recorder.events) == 130  # the recorder itself keeps them all


def test_the_recorder_without_events_in_its_state_has_none() -> None:
    recorder = IncidentRecorder(verbose=False)
    recorder.events.append(NanEvent(1, 0, 1, 0, ("loss",), "skipped"))
    recorder.load_state_dict({"bad_steps_total": 1})
    assert recorder.events == [] and recorder.state_dict() == {"events": []}


# ---------------------------------------------------------------------------------- SpikeWatch


def test_the_spike_watch_round_trips_both_statistics() -> None:
    watch = SpikeWatch(SpikeSettings(warmup=4), watch_grad_norm=True)
    for loss, norm in [(2.0, 4.0), (1.5, 3.0), (1.25, 2.5)]:
        watch.check(torch.tensor(loss), torch.tensor(norm))
        watch.accept(True, loss=loss, grad_norm=norm)
    state = watch.state_dict()
    assert state == PRE_REFACTOR_STATE["spikes"]
    fresh = SpikeWatch(SpikeSettings(warmup=4), watch_grad_norm=True)
    fresh.load_state_dict(weights_only_copy(state))
    assert fresh.state_dict() == state


def test_the_spike_watch_leaves_a_missing_statistic_empty() -> None:
    watch = SpikeWatch(SpikeSettings(warmup=4), watch_grad_norm=True)
    watch.load_state_dict({"loss": PRE_REFACTOR_STATE["spikes"]["loss"]})  # a checkpoint without the norm's
    assert watch.state_dict()["loss"]["history"] == [2.0, 1.5, 1.25]
    assert watch.state_dict()["grad_norm"]["history"] == []
    watch.load_state_dict({})
    assert watch.state_dict()["loss"]["history"] == []


# ---------------------------------------------------------------------------------- Recovery


def test_recovery_round_trips_remedy_state_and_rollbacks() -> None:
    recovery = stateful_guard().recovery
    state = recovery.state_dict()
    assert state == PRE_REFACTOR_STATE["recovery"]
    fresh = Recovery(("quarantine", "clip_grad"))
    fresh.load_state_dict(weights_only_copy(state))
    assert fresh.state_dict() == state
    assert fresh.book.quarantined == {9} and fresh.book.clip_threshold == 0.75 and fresh.rollbacks_total == 2


def test_recovery_reads_missing_keys_as_nothing_applied() -> None:
    recovery = stateful_guard().recovery
    recovery.load_state_dict({})
    assert recovery.rollbacks_total == 0 and recovery.state_dict() == Recovery().state_dict()
    recovery.load_state_dict({"remedies": {"applied": {"quarantine": 1}, "quarantined": [5]}})  # as 0.2.0 wrote it
    assert recovery.book.quarantined == {5} and recovery.book.applied == {"quarantine": 1}
    assert recovery.book.clip_threshold is None and recovery.rollbacks_total == 0


# ---------------------------------------------------------------------------------- the composed state


def test_the_composed_state_is_the_pre_refactor_guard_state_key_for_key() -> None:
    state = stateful_guard().controller.state_dict()
    assert state == PRE_REFACTOR_STATE
    assert list(state) == list(PRE_REFACTOR_STATE)  # the same keys, in the same order
    assert checkpoint.guard_state(stateful_guard().controller) == PRE_REFACTOR_STATE
    assert weights_only_copy(state) == PRE_REFACTOR_STATE


def test_before_the_detectors_exist_the_loaded_spike_state_is_saved() -> None:
    controller = stateful_guard(spike_action="off").controller
    assert controller.spikes is None
    state = controller.state_dict()
    assert state == {**PRE_REFACTOR_STATE, "spikes": SPIKE_STATE_BEFORE_DETECTORS}  # 0.3 wrote exactly this
    fresh = NanGuard(spike_action="off", verbose=False).controller
    fresh.load_state_dict(weights_only_copy(state))
    assert fresh.spike_state == SPIKE_STATE_BEFORE_DETECTORS and fresh.state_dict() == state


def test_the_controller_restores_every_part() -> None:
    state = weights_only_copy(stateful_guard().controller.state_dict())
    guard = NanGuard(remedies=["quarantine", "clip_grad"], verbose=False, save_repro=False, spike_warmup_steps=4)
    controller = guard.controller
    checkpoint.load_guard_state(controller, state)
    assert controller.state.counters == COUNTERS and controller.state.last_grad_norm == 1.5
    assert [(e.global_step, e.kinds) for e in controller.recorder.events] == [
        (4, ("loss", "grad")),
        (7, ("loss_spike",)),
    ]
    assert controller.spikes is not None and controller.spikes.state_dict() == PRE_REFACTOR_STATE["spikes"]
    assert controller.spike_state == PRE_REFACTOR_STATE["spikes"]
    assert guard.recovery.state_dict() == PRE_REFACTOR_STATE["recovery"]
    assert controller.state_dict() == PRE_REFACTOR_STATE


def test_the_controller_reads_missing_keys_as_defaults() -> None:
    controller = stateful_guard().controller
    controller.load_state_dict({"bad_steps_total": 2})
    fresh = NanGuard(remedies=["quarantine", "clip_grad"], verbose=False, save_repro=False, spike_warmup_steps=4)
    assert controller.state_dict() == {**fresh.controller.state_dict(), "bad_steps_total": 2}
    assert controller.state.last_grad_norm is None and controller.recorder.events == []
    assert controller.spike_state == {} and controller.spikes is not None
    assert controller.spikes.state_dict()["loss"]["history"] == []
    assert controller.recovery.state_dict() == Recovery().state_dict()
