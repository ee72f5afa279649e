"""engine/shard_layout.py and engine/incident/sharded_inspector.py: the parts that need no second process."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from fake_mesh import fake_world

from lightning_nanguard.decide.policy import StepHealth, local_vector
from lightning_nanguard.engine.shard_layout import (
    ShardingLayout,
    own_rank_state,
    sharding_notice,
    share_rank_states_,
)


class SummingAgreement:
    """Two ranks whose other rank sent ``other`` (a stand-in for the reduce)."""

    distributed = True

    def __init__(self, other: torch.Tensor) -> None:
        self.other = other
        self.sent: list[torch.Tensor] = []

    def sum(self, flags: torch.Tensor) -> torch.Tensor:
        self.sent.append(flags)
        return flags + self.other

    def gather(self, item: Any) -> list[Any]:
        return [item, item]


def _layout(peers: tuple[int, ...] = (0,)) -> ShardingLayout:
    return ShardingLayout("fsdp2", 0, 2, peers, 2, 1, torch.device("cpu"))


def test_agree_sends_the_norm_share_with_the_flags_in_one_reduce() -> None:
    """Rank 0's share 9, rank 1's 16: the global norm 5 replaces the share; the flags are summed as under DDP."""
    mine = local_vector(torch.tensor([0.0, 9.0, 0.0]), loss=torch.tensor(0.5))
    other = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 16.0])  # rank 1: bad, others bad, share 16
    agreement = SummingAgreement(other)
    vector = _layout().agree(mine, agreement, collective=True)  # type: ignore[arg-type]
    assert len(agreement.sent) == 1
    health = StepHealth.from_values(vector.tolist())
    assert (health.grad_norm, health.bad, health.ranks_bad, health.ranks_others_bad) == (5.0, False, 1, 1)
    assert health.loss == 0.5


def test_agree_without_other_ranks_takes_the_square_root_of_its_own_share() -> None:
    vector = _layout().agree(local_vector(torch.tensor([0.0, 4.0, 0.0])), SummingAgreement(torch.zeros(6)), False)  # type: ignore[arg-type]
    assert vector.tolist()[:2] == [0.0, 2.0] and len(vector) == 7


def test_a_norm_not_computed_stays_minus_one() -> None:
    mine = local_vector(torch.tensor([0.0, -1.0, 0.0]))
    vector = _layout().agree(mine, SummingAgreement(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, -1.0])), True)  # type: ignore[arg-type]
    assert StepHealth.from_values(vector.tolist()).grad_norm == -1.0


def test_the_layout_reads_the_tensor_parallel_peers_off_the_mesh() -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    with fake_world(4, rank=3) as world:
        mesh = world.mesh((2, 2), ("data_parallel", "tensor_parallel"))
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
        strategy._device_mesh = mesh
        strategy.parallel_devices = [torch.device("cpu")] * 4
        trainer = SimpleNamespace(strategy=strategy, global_rank=3, world_size=4)
        layout = ShardingLayout.detect(trainer, [])  # type: ignore[arg-type]
    assert layout is not None
    assert (layout.kind, layout.peers, layout.leader) == ("fsdp2+tensor_parallel", (2, 3), 2)
    assert (layout.data_parallel_size, layout.tensor_parallel_size) == (2, 2)


def test_no_layout_without_model_parallel_or_dtensors() -> None:
    from lightning.pytorch.strategies import DDPStrategy

    trainer = SimpleNamespace(strategy=DDPStrategy(), global_rank=0, world_size=2)
    assert ShardingLayout.detect(trainer, [torch.nn.Parameter(torch.ones(1))]) is None  # type: ignore[arg-type]


def test_each_strategy_kind_gets_its_notice() -> None:
    assert sharding_notice("single") is None and sharding_notice("ddp") is None
    level, text = sharding_notice("fsdp")  # type: ignore[misc]
    assert level == "warning" and "FSDP1" in text and "bisection" in text
    level, text = sharding_notice("model_parallel")  # type: ignore[misc]
    assert level == "info" and "lockstep" in text


# ------------------------------------------------------------------------------------ per-rank state in checkpoints


def test_each_rank_gets_its_own_spike_statistic_and_events_back() -> None:
    checkpoint: dict[str, Any] = {"callbacks": {"NanGuard": {"spikes": {"loss": {"history": [0.0]}}, "events": []}}}
    mine = {"spikes": {"loss": {"history": [1.0]}}, "events": [{"global_step": 3}], "bad_steps_total": 1}
    share_rank_states_(checkpoint, "NanGuard", mine, SummingAgreement(torch.zeros(1)))  # type: ignore[arg-type]
    saved = checkpoint["callbacks"]["NanGuard"]
    assert saved["per_rank"] == [{"spikes": mine["spikes"], "events": mine["events"]}] * 2
    with fake_world(2, rank=1):
        restored = own_rank_state(saved)
    assert restored["spikes"] == {"loss": {"history": [1.0]}} and restored["events"] == [{"global_step": 3}]


def test_a_checkpoint_of_another_world_size_keeps_rank_zeros_state() -> None:
    saved = {"spikes": {"loss": {}}, "per_rank": [{"spikes": {"loss": {"history": [1.0]}}}] * 4}
    assert own_rank_state(saved)["spikes"] == {"loss": {}}  # one process here, four saved
    assert own_rank_state({"spikes": 1}) == {"spikes": 1}


# ------------------------------------------------------------------------------------ who searches, who records
