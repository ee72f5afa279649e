"""The guard's collectives: how ranks agree on a step. Without a process group every call is local.

Every rank calls the same methods in the same order, whatever it found, so no rank ever waits
alone in a collective:

- :meth:`RankAgreement.sum` once per checked step (the flags of the fused check, one reduce);
- :meth:`RankAgreement.gather` on steps that were not healthy somewhere (one small object per
  rank: what it found);
- :meth:`RankAgreement.any` where a rank-local fact must become a shared decision (the check of
  the weights after the update);
- :meth:`RankAgreement.max` after a sampled step's update when QK-clip is on (the max logits).

Example:
    >>> agreement = RankAgreement(strategy=None, world_size=1)
    >>> agreement.sum(torch.tensor([1.0, 0.0])).tolist(), agreement.gather("mine"), agreement.any(True)
    ([1.0, 0.0], ['mine'], True)
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["RankAgreement"]

_T = TypeVar("_T")


class RankAgreement:
    """Collectives over a Lightning strategy, the Trainer's or Fabric's (see module docs).

    Args:
        strategy: the strategy: the Trainer's sums a tensor over ranks with ``reduce``, Fabric's
            with ``all_reduce``.
        world_size: number of processes; 1 makes every call local.
    """

    def __init__(self, strategy: Any, world_size: int) -> None:
        self.strategy = strategy
        self.world_size = world_size
        self.distributed = world_size > 1
        """Whether there are other ranks to agree with (read several times a step: an attribute)."""

    def sum(self, flags: Tensor) -> Tensor:
        """``flags`` summed over ranks, on the device (no host read)."""
        if not self.distributed:
            return flags
        reduce = getattr(self.strategy, "reduce", None) or self.strategy.all_reduce  # Trainer's, else Fabric's
        return reduce(flags.clone(), reduce_op="sum")

    def max(self, values: Tensor) -> Tensor:
        """``values``' element-wise max over ranks, on the device (no host read)."""
        if not self.distributed:
            return values
        reduce = getattr(self.strategy, "reduce", None) or self.strategy.all_reduce
        return reduce(values.clone(), reduce_op="max")

    def gather(self, item: _T) -> list[_T]:
        """Every rank's ``item`` (a small picklable object), in rank order."""
        if not self.distributed or not (dist.is_available() and dist.is_initialized()):
            return [item]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, item)
        return gathered

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on some rank (one reduce; every rank must call it)."""
        if not self.distributed:
            return flag
        device = getattr(self.strategy, "root_device", torch.device("cpu"))
        total = self.sum(torch.tensor([1.0 if flag else 0.0], device=device))
        return bool(total.item() > 0)
