"""The check on shards: local flags, and shares of the squared norm that add up to the global norm over ranks."""

from __future__ import annotations

import math

import pytest
import torch
from fake_mesh import fake_world
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_nanguard.detect.check import fused_health_check
from lightning_nanguard.detect.shard_check import global_norm, shard_weights, sharded_health_check


def _world_norm(shards_per_rank: list[list[torch.Tensor]], weights: list[float]) -> float:
    """What the guard computes: every rank's share, summed (the reduce), then the square root."""
    total = sum(sharded_health_check(shards, weights=weights)[1] for shards in shards_per_rank)
    return float(global_norm(torch.as_tensor(total).reshape(1)))


def test_shares_of_disjoint_and_replicated_shards_add_up_to_the_global_norm() -> None:
    """A weight split over two ranks, a bias replicated on both: each element counted once."""
    torch.manual_seed(0)
    weight, bias = torch.randn(6, 3), torch.randn(5)
    ranks = [[weight[:3], bias], [weight[3:], bias]]
    expected = float(torch.linalg.vector_norm(torch.cat((weight.flatten(), bias))))
    assert _world_norm(ranks, weights=[1.0, 0.5]) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("with_norm", [True, False])
def test_a_nonfinite_local_shard_raises_the_flag(value: float, with_norm: bool) -> None:
    grads = [torch.ones(3), torch.tensor([1.0, value])]
    summary = sharded_health_check(grads, others=[torch.tensor(0.5)], with_norm=with_norm).tolist()
    assert summary[0] == 1.0 and summary[2] == 0.0
    if with_norm:
        assert not math.isfinite(summary[1])
    else:
        assert summary[1] == -1.0


def test_others_and_a_negative_running_var_are_flagged_as_in_the_fused_check() -> None:
    others, variances = [torch.tensor(float("nan"))], [torch.tensor([1.0, -1.0])]
    for with_norm in (True, False):
        sharded = sharded_health_check([torch.ones(2)], others, variances, with_norm=with_norm).tolist()
        fused = fused_health_check([torch.ones(2)], others, variances, with_norm=with_norm).tolist()
        assert (sharded[0], sharded[2]) == (fused[0], fused[2]) == (1.0, 1.0)


def test_a_sum_of_large_finite_squares_is_no_false_alarm() -> None:
    """Two norms of 1.5e19: each square fits float32, their sum does not (it is added in float64)."""
    summary = sharded_health_check([torch.full((1,), 1.5e19), torch.full((1,), 1.5e19)]).tolist()
    assert summary[0] == 0.0 and math.isinf(summary[1])  # healthy; only the share itself overflows float32


def test_global_norm_keeps_not_computed_and_propagates_nan() -> None:
    assert global_norm(torch.tensor([-2.0])).tolist() == [-1.0]  # -1 from each of two ranks
    assert math.isnan(global_norm(torch.tensor([math.nan])).item())
    assert global_norm(torch.tensor([25.0])).tolist() == [5.0]


def test_dtensor_gradients_are_read_on_their_local_shards() -> None:
    with fake_world(4) as world:
        mesh = world.mesh((2, 2), ("data_parallel", "tensor_parallel"))
        sharded = DTensor.from_local(torch.full((2, 2), 3.0), mesh, [Shard(0), Shard(1)])
        replicated = DTensor.from_local(torch.full((2,), 4.0), mesh, [Shard(0), Replicate()])
        weights = shard_weights([sharded, replicated], world_size=4)
        assert weights == [1.0, 0.5]
        summary = sharded_health_check([sharded, replicated], weights=weights).tolist()
        assert summary == [0.0, pytest.approx(4 * 9.0 + 0.5 * 2 * 16.0), 0.0]
        bad = DTensor.from_local(torch.tensor([1.0, math.nan]), mesh, [Shard(0), Replicate()])
        assert sharded_health_check([bad], with_norm=False).tolist()[0] == 1.0
