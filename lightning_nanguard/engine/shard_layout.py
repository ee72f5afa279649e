"""Sharded training (``ModelParallelStrategy``: FSDP2, tensor parallelism, both): the layout and the per-step check.

Under Lightning's ``ModelParallelStrategy`` every parameter and gradient is a ``DTensor``. What
changes for the guard, and where it is handled:

- the check (:meth:`ShardingLayout.check`) reads each rank's local shards
  (:func:`~lightning_nanguard.detect.shard_check.sharded_health_check`); the flags are summed over every
  rank as under DDP, together with this rank's share of the squared gradient norm, so the norm
  ``clip_grad`` uses is the global one and there is still one reduce and one host read per step
  (:meth:`ShardingLayout.agree`);
- a bad step's diagnosis re-runs sharded forwards, which are collectives: every rank takes part
  (:mod:`~lightning_nanguard.engine.incident.sharded_inspector`, :mod:`~lightning_nanguard.diagnose.lockstep`);
- snapshots, rollback and clipping act on local shards (:mod:`~lightning_nanguard.recover.snapshot`,
  :func:`~lightning_nanguard.recover.remedies.clip_gradients_`);
- a checkpoint that would hold non-finite weights gets the last good snapshot's shards in the
  strategy's own format (:func:`make_sharded_checkpoint_finite_`).

Ranks that share a batch (the tensor-parallel group: Lightning's sampler splits the data over the
data-parallel dimension only) diagnose it together; their peers are read off the device mesh.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_nanguard.core.dtensor import any_dtensor
from lightning_nanguard.decide.agreement import RankAgreement
from lightning_nanguard.decide.policy import shared_part
from lightning_nanguard.detect.shard_check import global_norm, shard_weights, sharded_health_check

if TYPE_CHECKING:
    from lightning_nanguard.engine.frontend import FrontEnd

__all__ = [
    "strategy_kind",
    "ShardingLayout",
    "own_rank_state",
    "share_rank_states_",
    "sharding_notice",
]

log = logging.getLogger("lightning_nanguard")


def sharding_notice(kind: str) -> tuple[str, str] | None:
    """The one message a strategy kind gets at setup: ``(level, text)``; ``None`` where nothing is to say.

    Example:
        >>> sharding_notice("ddp") is None, sharding_notice("fsdp")[0]
        (True, 'warning')
    """
    if kind == "fsdp":
        return (
            "warning",
            "NanGuard: under FSDPStrategy (FSDP1) bad steps are detected and skipped on all ranks, but bisection "
            "and localisation are off (FSDP1's flat parameters are not re-run). ModelParallelStrategy (FSDP2) is "
            "diagnosed in full.",
        )
    if kind == "model_parallel":
        return (
            "info",
            "NanGuard: ModelParallelStrategy: gradients are checked on their local shards (one reduce per step); "
            "a bad step is re-run on every rank in lockstep to find the samples, the op and the line.",
        )
    return None


def announce_sharding(layout: ShardingLayout | None, global_zero: bool) -> None:
    """Say once, at setup, what the guard does under ``ModelParallelStrategy`` (rank zero, info level)."""
    if layout is not None and layout.diagnoses_together and global_zero:
        notice = sharding_notice("model_parallel")
        if notice is not None:
            log.info("%s (%s)", notice[1], layout.kind)


def strategy_kind(strategy: Any) -> str:
    """``"deepspeed"``, ``"fsdp"``, ``"model_parallel"``, ``"ddp"`` or ``"single"`` from the strategy's classes.

    ``"fsdp"`` is Lightning's ``FSDPStrategy`` (FSDP1: flat parameters, GPU only); ``"model_parallel"``
    its ``ModelParallelStrategy`` (FSDP2 ``fully_shard``, tensor parallelism, or both: ``DTensor``
    parameters), where the guard diagnoses as a collective (:mod:`~lightning_nanguard.engine.shard_layout`).

    Example:
        >>> from lightning.pytorch.strategies import SingleDeviceStrategy
        >>> strategy_kind(SingleDeviceStrategy("cpu"))
        'single'
    """
    names = {cls.__name__ for cls in type(strategy).__mro__}
    if "DeepSpeedStrategy" in names:
        return "deepspeed"
    if "ModelParallelStrategy" in names:
        return "model_parallel"
    if "FSDPStrategy" in names:
        return "fsdp"
    if names & {"DDPStrategy", "ParallelStrategy"}:
        return "ddp"
    return "single"


@dataclass(frozen=True)
class ShardingLayout:
    """How the model is sharded over the ranks, as far as the guard is concerned.

    Attributes:
        kind: ``"fsdp2"``, ``"tensor_parallel"``, ``"fsdp2+tensor_parallel"``, ``"sharded"`` (DTensors, no
            mesh), ``"unsharded"`` (one device, no DTensor) or ``"fsdp1"`` (``FSDPStrategy``: plain
            tensors, each rank's flat shard; only the norm is sharded-aware there, the diagnosis is off).
        rank: this rank (global).
        world_size: number of ranks.
        peers: global ranks that share this rank's batch (the tensor-parallel group), itself included.
        data_parallel_size: ranks over which the data is split.
        tensor_parallel_size: ranks that share a batch.
        device: this rank's device (the exchanged flags live there).
    """

    kind: str
    rank: int
    world_size: int
    peers: tuple[int, ...]
    data_parallel_size: int
    tensor_parallel_size: int
    device: torch.device

    @classmethod
    def detect(cls, front: FrontEnd, params: Sequence[Tensor]) -> ShardingLayout | None:
        """The layout of a ``ModelParallelStrategy`` run (or of a model with ``DTensor`` parameters), else ``None``."""
        strategy = front.strategy
        kind = strategy_kind(strategy)
        if kind not in ("model_parallel", "fsdp") and not any_dtensor(params):
            return None
        rank, world = int(front.global_rank), int(front.world_size)
        device = torch.device(getattr(strategy, "root_device", "cpu"))
        if kind == "fsdp" and not any_dtensor(params):
            return cls("fsdp1", rank, world, (rank,), world, 1, device)
        mesh = getattr(strategy, "_device_mesh", None)
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if mesh is None or "tensor_parallel" not in names:
            return cls("sharded", rank, world, (rank,), world, 1, device)
        tp_mesh = mesh["tensor_parallel"]
        peers = tuple(int(r) for r in tp_mesh.mesh.flatten().tolist())
        tp = len(peers)
        dp = mesh["data_parallel"].size() if "data_parallel" in names else max(1, world // tp)
        kind = "fsdp2+tensor_parallel" if dp > 1 and tp > 1 else ("tensor_parallel" if tp > 1 else "fsdp2")
        if dp == 1 and tp == 1:
            kind = "fsdp2" if any_dtensor(params) else "unsharded"
        return cls(kind, rank, world, peers, dp, tp, device)

    @property
    def diagnoses_together(self) -> bool:
        """Whether a bad step is re-run on every rank in lockstep (``DTensor`` models; not FSDP1)."""
        return self.kind != "fsdp1"

    @property
    def leader(self) -> int:
        """The lowest rank sharing this batch: it records the batch's event."""
        return min(self.peers)

    def check(
        self,
        grads: Sequence[Tensor],
        others: Sequence[Tensor],
        nonnegative: Sequence[Tensor],
        device: torch.device,
        with_norm: bool,
    ) -> Tensor:
        """``[flag, share of the squared norm, others_flag]`` of this rank's shards (see module docs).

        FSDP1's gradients are plain tensors, each rank's flat shard: counted once each.
        """
        weights = None
        if with_norm:
            weights = [1.0] * len(grads) if self.kind == "fsdp1" else shard_weights(grads, self.world_size)
        return sharded_health_check(grads, others, nonnegative, device=device, with_norm=with_norm, weights=weights)

    def agree(self, vector: Tensor, agreement: RankAgreement, collective: bool) -> Tensor:
        """The local vector with the global norm in place of the share, then the flags summed over ranks.

        One reduce, as under DDP: the shared flags and the norm share travel in the same tensor.
        """
        share = vector[1:2]
        sums: Tensor | None = None
        if collective:
            summed = agreement.sum(torch.cat((shared_part(vector), share)))
            sums, share = summed[:-1], summed[-1:]
        local = torch.cat((vector[0:1], global_norm(share), vector[2:]))
        return local if sums is None else torch.cat((local, sums))

    def global_norm_now(self, grads: Sequence[Tensor], agreement: RankAgreement, device: torch.device) -> float:
        """The global gradient norm, read now (bad path; every rank must call it)."""
        share = self.check(grads, (), (), device, with_norm=True)[1:2]
        if agreement.distributed:
            share = agreement.sum(share)
        return float(global_norm(share))


PER_RANK_KEY = "per_rank"
PER_RANK_FIELDS = ("spikes", "events")
"""What each rank keeps of its own: the spike statistic of its own losses, the events it recorded."""


def share_rank_states_(
    checkpoint: dict[str, Any], state_key: str, own: dict[str, Any], agreement: RankAgreement
) -> None:
    """Put every rank's own part of the guard's state into the checkpoint (every rank calls it: a gather).

    Each data-parallel rank has its own spike statistic (of its own losses) and its own events, but
    Lightning writes the callbacks' state of rank zero only; :func:`own_rank_state` gives each rank
    its own back on load. ``own``: this rank's ``state_dict()`` (only :data:`PER_RANK_FIELDS` are sent).
    """
    if not agreement.distributed:
        return
    states = agreement.gather({key: own.get(key) for key in PER_RANK_FIELDS})
    guard_state = checkpoint.get("callbacks", {}).get(state_key)
    if isinstance(guard_state, dict):
        guard_state[PER_RANK_KEY] = states


def own_rank_state(state: dict[str, Any]) -> dict[str, Any]:
    """The guard's checkpointed ``state`` with this rank's own parts (when saved per rank, in a world of that size).

    Example:
        >>> saved = {"spikes": {}, "events": [], "per_rank": [{"spikes": {"loss": {"history": [1.0]}}, "events": []}]}
        >>> own_rank_state(saved)["spikes"]
        {'loss': {'history': [1.0]}}
    """
    per_rank = state.get(PER_RANK_KEY)
    if not isinstance(per_rank, list):
        return state
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if initialized else (0, 1)
    if len(per_rank) != world or not isinstance(per_rank[rank], dict):
        return state
    mine = {key: value for key, value in per_rank[rank].items() if key in PER_RANK_FIELDS and value is not None}
    return {**state, **mine}
