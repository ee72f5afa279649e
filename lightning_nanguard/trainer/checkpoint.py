"""What the guard writes into a Lightning checkpoint, and reads back on resume.

- :func:`guard_state` / :func:`load_guard_state`: the callback's own state (counters, the last
  gradient norm, the spike statistic, remedy state, the last :data:`EVENTS_KEPT_IN_CHECKPOINT`
  events), as primitives (``torch.load(..., weights_only=True)`` reads it). Each stateful part
  owns its share (``GuardState``, ``IncidentRecorder``, ``SpikeWatch``, ``Recovery``: each a
  ``state_dict``/``load_state_dict``) and ``StepController.state_dict`` composes them; keys added in
  later versions are read with defaults, so checkpoints of 0.2.0 and 0.3 resume
  (``tests/trainer/test_checkpoint.py``, ``tests/integration/test_checkpoint_resume.py``).
- :func:`make_checkpoint_finite`: a checkpoint never holds NaN/Inf weights: the last good snapshot
  goes in instead (under ``ModelParallelStrategy`` every rank's shards, in the strategy's format),
  or the save is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn
from torch.utils._pytree import tree_map

from lightning_nanguard.core.dtensor import local_tensors
from lightning_nanguard.core.events import NonFiniteTrainingError
from lightning_nanguard.decide.messages import checkpoint_refusal
from lightning_nanguard.detect.confirm import all_finite
from lightning_nanguard.engine.recording import EVENTS_KEPT_IN_CHECKPOINT
from lightning_nanguard.engine.shard_layout import share_rank_states_
from lightning_nanguard.recover.snapshot import TrainingSnapshot

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

    from lightning_nanguard.decide.agreement import RankAgreement
    from lightning_nanguard.engine.controller import StepController
    from lightning_nanguard.recover.recovery import Recovery

__all__ = ["EVENTS_KEPT_IN_CHECKPOINT", "guard_state", "load_guard_state", "make_checkpoint_finite"]


def guard_state(controller: StepController) -> dict[str, Any]:
    """Counters, the last gradient norm, the spike statistic, remedy state and the last 100 events."""
    return controller.state_dict()


def load_guard_state(controller: StepController, state: Mapping[str, Any]) -> None:
    """Restore :func:`guard_state` output; keys added in later versions default sensibly."""
    controller.load_state_dict(dict(state))


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


def _clone(value: Any) -> Any:
    return value.clone() if isinstance(value, Tensor) else value


def _finite_here(pl_module: nn.Module) -> bool:
    return all_finite(local_tensors(pl_module.state_dict().values()))


def make_sharded_checkpoint_finite_(
    trainer: Trainer,
    pl_module: LightningModule,
    recovery: Recovery,
    checkpoint: dict[str, Any],
    agreement: RankAgreement,
    action: str | None = None,
) -> str | None:
    """Under sharding: never save non-finite weights; save the last good snapshot's shards instead, or refuse.

    Every rank calls it (``on_save_checkpoint`` runs on every rank). The live shards are checked
    (with ``save_distributed_checkpoint=False`` only rank zero's checkpoint holds tensors) and the
    check's flags are shared. To substitute, the snapshot's shards are put into the live model and
    optimizers, the strategy writes its own state dicts from them (a sharded checkpoint stays
    sharded, a full one is gathered as the strategy gathers it), and the live state is put back.

    Returns:
        ``None`` when every shard is finite, else a description of the substitution.

    Raises:
        NonFiniteTrainingError: non-finite weights and no snapshot (``action`` other than ``"rollback"``).
    """
    finite = not agreement.any(not _finite_here(pl_module))
    if finite:
        return None
    snapshot = recovery.snapshot
    if not snapshot.available:
        raise NonFiniteTrainingError(checkpoint_refusal([], action), [])
    optimizers = list(trainer.optimizers)
    current = TrainingSnapshot()
    current.capture(pl_module, optimizers)
    try:
        snapshot.module.copy_into(pl_module.state_dict())
        for mirror, optimizer in zip(snapshot.optimizers, optimizers, strict=False):
            optimizer.load_state_dict(tree_map(_clone, mirror.value()))  # never alias the snapshot's buffers
        # copies: on a CPU device the strategy's "offloaded" state dicts are the live tensors themselves
        checkpoint["state_dict"] = tree_map(_clone, trainer.strategy.lightning_module_state_dict())
        checkpoint["optimizer_states"] = [tree_map(_clone, trainer.strategy.optimizer_state(o)) for o in optimizers]
    finally:
        current.module.copy_into(pl_module.state_dict())
        for mirror, optimizer in zip(current.optimizers, optimizers, strict=False):
            optimizer.load_state_dict(mirror.value())
    checkpoint["nanguard_substituted_step"] = snapshot.global_step
    return (
        f"the weights hold NaN/Inf; the checkpoint holds the last good snapshot's shards (step {snapshot.global_step})"
    )
