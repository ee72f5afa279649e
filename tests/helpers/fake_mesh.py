"""A device mesh of several ranks inside one process (torch's ``fake`` process group): DTensors without communication.

Collectives return without exchanging anything, so values that depend on other ranks are
meaningless; placements, shapes and local shards are real. For what depends only on those.

Example:
    >>> with fake_world(4) as world:
    ...     mesh = world.mesh((2, 2), ("data_parallel", "tensor_parallel"))
    ...     mesh["tensor_parallel"].size()
    2
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["FakeWorld", "fake_world"]


@dataclass
class FakeWorld:
    world_size: int

    def mesh(self, shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> DeviceMesh:
        return init_device_mesh("cpu", shape, mesh_dim_names=names)


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[FakeWorld]:
    """A ``fake`` default process group of ``world_size`` ranks (this process is ``rank``), destroyed on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield FakeWorld(world_size)
    finally:
        dist.destroy_process_group()
