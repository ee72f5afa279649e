"""What the guard writes into a Lightning checkpoint, and reads back on resume.

- :func:`guard_state` / :func:`load_guard_state`: the callback's own state (counters, the last
  gradient norm, the spike statistic, remedy state, the last :data:`EVENTS_KEPT_IN_CHECKPOINT`
  events), as primitives (``torch.load(..., weights_only=True)`` reads it); keys added in later
  versions are read with defaults, so checkpoints of 0.2.0 resume (``tests/adapter/test_checkpoint.py``).
- :func:`make_checkpoint_finite`: a checkpoint never holds NaN/Inf weights: the last good snapshot
  goes in instead (under ``ModelParallelStrategy`` every rank's shards, in the strategy's format),
  or the save is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.decide.policy import Counters
from lightning_nanguard.engine.sharding import make_sharded_checkpoint_finite_, share_rank_states_

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

    from lightning_nanguard.engine.controller import StepController

__all__ = ["EVENTS_KEPT_IN_CHECKPOINT", "guard_state", "load_guard_state", "make_checkpoint_finite"]

EVENTS_KEPT_IN_CHECKPOINT = 100


def guard_state(controller: StepController) -> dict[str, Any]:
    """Counters, the last gradient norm, the spike statistic, remedy state and the last 100 events."""
    spikes = controller.spikes
    return {
        **dataclasses.asdict(controller.state.counters),
        "last_grad_norm": controller.state.last_grad_norm,
        "spikes": spikes.state_dict() if spikes is not None else controller.spike_state,
        "events": [event.to_dict() for event in controller.recorder.events[-EVENTS_KEPT_IN_CHECKPOINT:]],
        "recovery": controller.recovery.state_dict(),
    }


def load_guard_state(controller: StepController, state: Mapping[str, Any]) -> None:
    """Restore :func:`guard_state` output; keys added in later versions default sensibly."""
    controller.state.counters = Counters(**{name: int(state.get(name, 0)) for name in Counters.__dataclass_fields__})
    norm = state.get("last_grad_norm")
    controller.state.last_grad_norm = float(norm) if norm is not None else None
    controller.recorder.events[:] = [NanEvent.from_dict(summary) for summary in state.get("events", [])]
    controller.spike_state = dict(state.get("spikes", {}))
    if controller.spikes is not None:
        controller.spikes.load_state_dict(controller.spike_state)
    controller.recovery.load_state_dict(state.get("recovery", {}))


def make_checkpoint_finite(
    controller: StepController,
    trainer: Trainer,
    pl_module: LightningModule,
    checkpoint: dict[str, Any],
    state_key: str,
) -> str | None:
    """Put the last good snapshot in a checkpoint whose weights hold NaN/Inf; ``None`` when they are finite.

    Under ``ModelParallelStrategy`` every rank takes part (its shards, and every rank's guard state
    next to rank zero's). Raises ``NonFiniteTrainingError`` when there is no snapshot to save instead.
    """
    sharding = controller.sharding
    if sharding is not None and sharding.diagnoses_together:  # every rank's shards, the strategy's format
        substituted = make_sharded_checkpoint_finite_(
            trainer, pl_module, controller.recovery, checkpoint, controller.agreement, controller.policy.action
        )
        share_rank_states_(checkpoint, state_key, guard_state(controller), controller.agreement)
        return substituted
    return controller.recovery.make_checkpoint_finite_(checkpoint, controller.policy.action)
