"""The lockstep protocol: one process (a plain diagnosis), and two gloo processes (``lockstep_workers.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from launcher import launch
from torch import nn

from lightning_nanguard.diagnose.batch_diagnosis import diagnose
from lightning_nanguard.diagnose.lockstep import Lockstep, LockstepAborted, LockstepRunner
from lightning_nanguard.diagnose.runner import SubBatchRunner

TIMEOUT_S = 120


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def training_step(self, x: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return (self.w * x).sum(dim=1).log().sum()


def test_one_process_lockstep_is_a_plain_diagnosis() -> None:
    x = torch.tensor([[1.0, 1, 1], [0, 0, 0], [2, 2, 2], [1, 2, 3]])
    lockstep = Lockstep([0], dummy=lambda: pytest.fail("no dummy pass without other ranks"))
    found = diagnose(Net(), x, runner_factory=lambda *a, **k: LockstepRunner(*a, lockstep=lockstep, **k))
    plain = diagnose(Net(), x)
    assert (found.cause, found.offending, found.passes) == (plain.cause, plain.offending, plain.passes)
    assert found.localization is not None and found.localization.op == plain.localization.op == "LogBackward0"
    assert lockstep.passes == found.passes + 1  # and one localisation pass
    lockstep.finish()
    assert lockstep.passes == found.passes + 1


def test_a_failure_stops_every_later_tick_without_running_it() -> None:
    lockstep = Lockstep([0], dummy=lambda: None)
    with pytest.raises(LockstepAborted, match="could not run its pass"):
        lockstep.tick(lambda: (False, False), failure=ValueError("unsliceable"))
    with pytest.raises(LockstepAborted):
        lockstep.tick(lambda: pytest.fail("ran after the abort"))
    assert "unsliceable" in (lockstep.failure or "")


def test_a_runner_whose_sub_batch_cannot_be_cut_ends_the_diagnosis_with_the_reason() -> None:
    def refuse(batch: Any, positions: Any) -> Any:
        raise ValueError("no slicing here")

    refuse.batch_size = lambda batch: 4  # type: ignore[attr-defined]
    lockstep = Lockstep([0], dummy=lambda: None)
    x = torch.tensor([[1.0, 1, 1], [0, 0, 0], [2, 2, 2], [1, 2, 3]])
    found = diagnose(Net(), x, slicer=refuse, runner_factory=lambda *a, **k: LockstepRunner(*a, lockstep=lockstep, **k))
    assert found.error is not None and "no slicing here" in found.error


def test_the_runner_differentiates_the_graphs_leaves() -> None:
    runner = LockstepRunner(Net(), torch.ones(2, 3), lockstep=Lockstep([0], dummy=lambda: None))
    assert runner.grads_from_graph and isinstance(runner, SubBatchRunner)
    loss = runner.forward([0, 1])
    assert loss is not None and len(runner.gradients(loss)) == 1


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    out = tmp_path_factory.mktemp("lockstep")
    # a mismatched collective would hang: the timeout turns that into a failure
    return launch("lockstep_workers.py", out, nprocs=2, out_dir=out, timeout=TIMEOUT_S).results()


@pytest.mark.slow  # two processes
def test_ranks_with_different_numbers_of_passes_leave_together(two_ranks: dict[int, dict[str, Any]]) -> None:
    assert two_ranks[0]["uneven_passes"] == two_ranks[1]["uneven_passes"] == 3  # rank 0: one pass, two dummy ones


@pytest.mark.slow  # two processes
def test_ranks_sharing_a_batch_share_its_pass_results(two_ranks: dict[int, dict[str, Any]]) -> None:
    assert two_ranks[0]["shared_result"] == two_ranks[1]["shared_result"] == [True, False]


@pytest.mark.slow  # two processes
def test_a_pass_that_cannot_run_on_one_rank_stops_both_at_the_same_tick(two_ranks: dict[int, dict[str, Any]]) -> None:
    for rank in (0, 1):
        failure = two_ranks[rank]["failure"]
        assert failure["seen"] == ["ok", "aborted", "aborted", "aborted"]
        assert failure["passes_run"] == 1  # the second pass ran nowhere, and nothing after it
        assert "rank 1 could not run its pass" in failure["reason"]
    assert "cannot cut the batch" in two_ranks[1]["failure"]["reason"]


@pytest.mark.slow  # two processes
def test_one_rank_diagnoses_while_the_other_runs_dummy_passes(two_ranks: dict[int, dict[str, Any]]) -> None:
    helper, searcher = two_ranks[0]["diagnosis"], two_ranks[1]["diagnosis"]
    assert (searcher["offending"], searcher["cause"], searcher["op"]) == ([2], "data", "LogBackward0")
    assert helper["passes_run"] == searcher["passes_run"] == searcher["passes"] + 1  # and the localisation pass


@pytest.mark.slow  # two processes
def test_a_helper_without_a_dummy_batch_says_so_before_the_search_passes(two_ranks: dict[int, dict[str, Any]]) -> None:
    for rank in (0, 1):
        seen = two_ranks[rank]["unrunnable_dummy"]
        assert seen["passes_run"] == 0 and "rank 0 could not run its pass" in seen["reason"]
    assert two_ranks[1]["unrunnable_dummy"]["entered"] == []  # the searching rank never entered its pass
    assert two_ranks[0]["unrunnable_dummy"]["reason"].endswith("(RuntimeError: no batch)")
    assert [two_ranks[r]["unrunnable_dummy_unneeded"] for r in (0, 1)] == [{"passes_run": 0, "reason": None}] * 2
