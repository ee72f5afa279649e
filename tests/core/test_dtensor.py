from __future__ import annotations

import torch
from fake_mesh import fake_world
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_nanguard.core.dtensor import any_dtensor, is_dtensor, local_tensor, local_tensors, replicas


def test_plain_tensors_are_their_own_local_tensor_and_held_by_every_rank() -> None:
    t = torch.ones(3)
    assert local_tensor(t) is t and local_tensors([t]) == [t]
    assert not is_dtensor(t) and not any_dtensor([t, 1.0])
    assert replicas(t, world_size=8) == 8


def test_the_local_shard_is_a_view_and_replicas_count_replicated_dimensions() -> None:
    with fake_world(8) as world:
        mesh = world.mesh((2, 2, 2), ("pp", "data_parallel", "tensor_parallel"))
        both = DTensor.from_local(torch.ones(2, 3), mesh["data_parallel", "tensor_parallel"], [Shard(0), Shard(1)])
        half = DTensor.from_local(torch.ones(2, 3), mesh["data_parallel", "tensor_parallel"], [Shard(0), Replicate()])
        tp_only = DTensor.from_local(torch.ones(4), mesh["tensor_parallel"], [Replicate()])
        assert is_dtensor(both) and any_dtensor([torch.ones(1), both])
        # 8 ranks: the 2x2 mesh is held twice (the ranks outside it), each replicated dimension doubles it
        assert (replicas(both, 8), replicas(half, 8), replicas(tp_only, 8)) == (2, 4, 8)
        local = local_tensor(half)
        assert local.shape == (2, 3) and half.shape == (4, 3)
        local.mul_(3.0)  # a view: writing to it writes to the shard
        assert torch.equal(half.to_local(), torch.full((2, 3), 3.0))
