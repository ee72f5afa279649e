"""``NanGuard`` in Fabric DDP and FSDP2 loops (issue 24): 2 CPU processes, gloo, ``helpers/fabric_ddp_script.py``.

Rank 0's batch of step 1 holds the all-zero record 10: its loss is NaN, and DDP's gradient
all-reduce carries the NaN into rank 1's gradients. Both ranks must drop that update together (one
agreed decision), the weights must stay finite and equal on both ranks, and only rank 0, whose data
it was, records the event, naming record 10 with ``loss_fn``. Under FSDP2 (Fabric's
``ModelParallelStrategy``, every layer ``fully_shard``ed) the diagnosis runs in lockstep on both ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from launcher import launch

pytestmark = pytest.mark.slow

RANKS = (0, 1)


STRATEGIES = {"ddp": "NanGuardDDPStrategy", "fsdp2": "NanGuardModelParallelStrategy"}


@pytest.fixture(scope="module", params=list(STRATEGIES))
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    out = tmp_path_factory.mktemp(f"fabric_{request.param}")
    run = launch("fabric_ddp_script.py", out, request.param, nprocs=len(RANKS), out_dir=out, timeout=240)
    return {rank: {**data, "asked": request.param} for rank, data in run.results().items()}


def test_both_ranks_drop_the_bad_update_and_stay_equal(ranks: dict[int, dict[str, Any]]) -> None:
    assert sorted(ranks) == list(RANKS)
    for data in ranks.values():
        assert data["strategy"] == STRATEGIES[data["asked"]]
        assert data["dropped"] == [1] and data["finite"]
    assert ranks[0]["hash"] == ranks[1]["hash"]


def test_the_rank_whose_data_it_was_names_the_record(ranks: dict[int, dict[str, Any]]) -> None:
    assert ranks[1]["events"] == []  # its gradients only received rank 0's NaN through the all-reduce
    (event,) = ranks[0]["events"]
    assert (event["global_step"], event["action"], event["rank"]) == (1, "skipped", 0)
    assert (event["dataset_indices"], event["cause"], event["culprit_op"]) == ([10], "data", "div")
    assert event["source_line"].endswith(f"fabric_ddp_script.py:{_line('FABRIC DDP ORIGIN')}")
    if ranks[0]["asked"] == "fsdp2":
        assert event["details"]["sharding"]["kind"] == "fsdp2"  # diagnosed in lockstep on both ranks


def _line(marker: str) -> int:
    lines = (Path(__file__).parent.parent / "helpers" / "fabric_ddp_script.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, start=1) if line.rstrip().endswith(f"# {marker}"))
