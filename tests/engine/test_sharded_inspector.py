"""inspector_for: every rank in lockstep under ModelParallelStrategy, each rank alone otherwise."""

from __future__ import annotations

import torch

from lightning_nanguard import NanGuard
from lightning_nanguard.decide.agreement import RankAgreement
from lightning_nanguard.engine.incident.inspector import IncidentInspector
from lightning_nanguard.engine.incident.sharded_inspector import ShardedIncidentInspector, inspector_for
from lightning_nanguard.engine.shard_layout import ShardingLayout


def parts() -> tuple[object, ...]:
    controller = NanGuard(verbose=False).controller
    return (controller.diagnosis, controller.window, [], controller.recorder, controller.spikes)


def test_without_sharding_each_rank_inspects_alone() -> None:
    inspector = inspector_for(*parts(), sharding=None, agreement=RankAgreement(None, 1))
    assert type(inspector) is IncidentInspector


def test_a_sharded_layout_that_diagnoses_together_gets_the_lockstep_inspector() -> None:
    layout = ShardingLayout("fsdp2", 0, 2, (0,), 2, 1, torch.device("cpu"))
    assert layout.diagnoses_together
    agreement = RankAgreement(None, 1)
    inspector = inspector_for(*parts(), sharding=layout, agreement=agreement)
    assert isinstance(inspector, ShardedIncidentInspector)
    assert inspector.layout is layout and inspector.agreement is agreement
