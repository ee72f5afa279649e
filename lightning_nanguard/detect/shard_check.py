"""The per-step check on sharded gradients: local shards only, a global norm from one reduce.

Under FSDP2 and tensor parallelism each rank holds a shard of every gradient (a ``DTensor``). The
check reads the local shards (:func:`~lightning_nanguard.core.dtensor.local_tensor`, never a gather)
with the same fused kernels as :func:`~lightning_nanguard.detect.check.fused_health_check`; a NaN/Inf
in any rank's shard reaches every rank through the flags the guard already sums over ranks.

The global L2 norm (``clip_grad``) cannot be read off one rank: :func:`sharded_health_check` puts
this rank's share of the *squared* norm in the result instead, each shard weighted by
``1 / replicas`` (a tensor replicated over a mesh dimension is held by several ranks and must be
counted once). The caller sums that share over every rank in the same reduce as the flags, and
:func:`global_norm` takes the square root, still on the device.

Example:
    >>> grads = [torch.tensor([3.0, 0.0]), torch.tensor([4.0])]
    >>> summary = sharded_health_check(grads, weights=[1.0, 1.0])
    >>> summary.tolist(), global_norm(summary[1:2]).item()
    ([0.0, 25.0, 0.0], 5.0)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_nanguard.core.dtensor import local_tensors, replicas
from lightning_nanguard.detect.check import fused_health_check, grouped_norms

__all__ = ["global_norm", "shard_weights", "sharded_health_check"]


def shard_weights(tensors: Sequence[Tensor], world_size: int) -> list[float]:
    """``1 / replicas`` of each tensor: a sum of weighted squares over every rank counts each element once.

    Example:
        >>> shard_weights([torch.ones(1)], world_size=2)  # a plain tensor: both ranks hold it
        [0.5]
    """
    return [1.0 / replicas(t, world_size) for t in tensors]


def sharded_health_check(
    grads: Sequence[Tensor],
    others: Sequence[Tensor] = (),
    nonnegative: Sequence[Tensor] = (),
    device: torch.device | None = None,
    with_norm: bool = True,
    weights: Sequence[float] | None = None,
) -> Tensor:
    """``[flag, weighted squared norm, others_flag]`` of this rank's shards; nothing read, nothing gathered.

    Args:
        grads: gradients (``DTensor`` or plain); their local shards are read.
        others: loss, BatchNorm statistics (local tensors, or ``DTensor`` read locally).
        nonnegative: tensors that must hold no negative value (``running_var``).
        device: where the result lives.
        with_norm: compute this rank's share of the squared global norm (else -1, and the cheaper
            staged sums of the fused check are used).
        weights: one weight per gradient (:func:`shard_weights`); default 1 (every shard disjoint).

    Returns:
        float32 ``[flag, share, others_flag]``: ``flag`` > 0 when some local shard *may* hold NaN/Inf
        (confirm element-wise), ``share`` this rank's weighted sum of squared shard norms (NaN/Inf
        when a shard is; -1 without ``with_norm``), ``others_flag`` as in ``fused_health_check``.
    """
    local = local_tensors(grads)
    others, nonnegative = local_tensors(others), local_tensors(nonnegative)
    if not with_norm:
        return fused_health_check(local, others, nonnegative, device=device, with_norm=False)
    summary = fused_health_check([], others, nonnegative, device=device, with_norm=False)
    device = summary.device
    share = torch.zeros((), dtype=torch.float64, device=device)
    by_weight: dict[float, list[Tensor]] = {}
    for tensor, weight in zip(local, weights if weights is not None else [1.0] * len(local), strict=True):
        by_weight.setdefault(weight, []).append(tensor)
    for weight, group in by_weight.items():
        norms = grouped_norms(group, device).double()  # squares of float32 norms above 1e19 overflow float32
        share = share + weight * (norms * norms).sum()
    grads_bad = (~torch.isfinite(share)).to(torch.float32).reshape(1)
    flag = torch.maximum(summary[0:1], grads_bad)
    return torch.cat((flag, share.to(torch.float32).reshape(1), summary[2:3]))


def global_norm(summed_share: Tensor) -> Tensor:
    """The global L2 norm from the squared shares summed over ranks (``-1`` stays ``-1``: not computed)."""
    return torch.where(summed_share < 0, torch.full_like(summed_share, -1.0), summed_share.clamp(min=0).sqrt())
