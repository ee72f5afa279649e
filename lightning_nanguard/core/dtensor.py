"""Sharded tensors (``DTensor``): the local shard, and how many ranks hold the same one. Nothing is gathered.

Under FSDP2 (``fully_shard``) and tensor parallelism (``parallelize_module``) every parameter and
gradient is a :class:`torch.distributed.tensor.DTensor`: each rank holds a shard (or a replica) of
a logical tensor. Mixing a plain tensor into a DTensor op raises, and reducing a DTensor may start
a collective. The guard therefore reads the *local* tensor of each DTensor (a view: writing to it
writes to the shard) and never calls ``full_tensor()`` on a healthy step.

:func:`replicas` says how many ranks of the world hold the very same local values (the product of
the mesh dimensions a tensor is replicated over, times the ranks outside its mesh), so that a sum
of squares over every rank's local shards counts each element once: the global gradient norm of
``clip_grad`` without a gather.

Example:
    >>> import torch
    >>> local_tensor(torch.ones(2)).tolist(), is_dtensor(torch.ones(2))
    ([1.0, 1.0], False)
    >>> replicas(torch.ones(2), world_size=4)  # a plain tensor: every rank holds a copy
    4
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "GATHER_LIMIT_BYTES",
    "any_dtensor",
    "dtensor_class",
    "gathered_state",
    "is_dtensor",
    "local_tensor",
    "local_tensors",
    "replicas",
]


def dtensor_class() -> type | None:
    """``torch.distributed.tensor.DTensor``, or ``None`` where torch has no distributed support."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


_DTENSOR = dtensor_class()


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (a sharded or replicated tensor of a device mesh)."""
    return _DTENSOR is not None and isinstance(tensor, _DTENSOR)


def local_tensor(tensor: Tensor) -> Tensor:
    """The local shard of a ``DTensor`` (a view sharing its storage), or ``tensor`` itself.

    No autograd node and no communication: the guard reads (and clips) shards in place.
    """
    if _DTENSOR is not None and isinstance(tensor, _DTENSOR):
        return tensor._local_tensor  # type: ignore[attr-defined]  # ``to_local()`` under no_grad
    return tensor


def local_tensors(tensors: Iterable[Tensor]) -> list[Tensor]:
    """:func:`local_tensor` of each."""
    if _DTENSOR is None:
        return list(tensors)
    return [t._local_tensor if isinstance(t, _DTENSOR) else t for t in tensors]  # type: ignore[attr-defined]


def any_dtensor(tensors: Iterable[Any]) -> bool:
    """Whether any of ``tensors`` is a ``DTensor``."""
    return _DTENSOR is not None and any(isinstance(t, _DTENSOR) for t in tensors)


def replicas(tensor: Tensor, world_size: int) -> int:
    """How many ranks of a world of ``world_size`` hold the same local values as this rank.

    A plain tensor is held whole by every rank (DDP, or a module left unsharded); a ``DTensor`` by
    the ranks outside its mesh and, within the mesh, by the ranks of every dimension it is
    replicated over (``Replicate``). ``Shard`` and ``Partial`` dimensions split it.
    """
    if not is_dtensor(tensor):
        return world_size
    mesh = tensor.device_mesh  # type: ignore[attr-defined]
    count = max(1, world_size // mesh.size())
    for dim, placement in enumerate(tensor.placements):  # type: ignore[attr-defined]
        if placement.is_replicate():
            count *= mesh.size(dim)
    return count


GATHER_LIMIT_BYTES = 2 * 2**30
"""A repro bundle gathers a sharded model's full state only below this size (2 GiB): a model
sharded because it does not fit one device must not be gathered onto one for a bundle."""


def gathered_state(module: nn.Module, keep: bool, limit: int = GATHER_LIMIT_BYTES) -> Mapping[str, Any] | str:
    """The module's full state on the host, gathered from the shards (every rank calls this, in step).

    ``keep``: this rank keeps the tensors (the others take part in the gathers and drop them). A
    model whose full state exceeds ``limit`` bytes is not gathered (the decision is the same on
    every rank: it is read off the global shapes): the reason is returned instead.
    """
    state = module.state_dict()
    total = sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, Tensor))
    if total > limit:
        return (
            f"the sharded model holds {total / 2**30:.1f} GiB in full, above the {limit / 2**30:.0f} GiB a bundle "
            "gathers; every rank's shards are in the run's checkpoints"
        )
    out: dict[str, Any] = {}
    with torch.no_grad():
        for name, tensor in state.items():
            full = tensor.full_tensor() if is_dtensor(tensor) else tensor  # a collective over its mesh
            if keep and isinstance(full, Tensor):
                out[name] = full.detach().to("cpu", copy=True)
    return out if keep else "gathered by another rank"
