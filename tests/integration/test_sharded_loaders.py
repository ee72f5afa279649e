"""Several training loaders under FSDP2 (issue 23, item 3): ``ModelParallelStrategy`` on CPU (gloo), 2 processes.

``tests/helpers/sharded_script.py fsdp2 loaders`` makes two fits in the same processes of
``multitask_models.MultiTaskModule`` (each loader's ``x`` normalised first, ``x / x.norm()``),
every module a ``fully_shard`` unit, on two loaders given to ``fit`` as a dict, each through the
shuffling ``DistributedSampler`` Lightning puts in: ``loaders`` (``a`` 8 per batch, ``b`` 4) and
``loaders_equal`` (4 and 4: a batch cut as one is cut at the same rows of both parts). Data-parallel
rank 1 meets an all-zero record (a NaN loss) of ``b`` at step 1 and of ``a`` at step 3.

The sharded diagnosis runs in lockstep on both ranks and must cut the batch loader by loader (its
layout). Before it did, the batch was cut as one: no sample was named with its loader and dataset
index (parts of different sizes: the batch size could not even be told). Checked: both bad steps
skipped on every rank, the weights finite and equal on both ranks; each event recorded by rank 1
only, naming the record's loader, its position in that loader's part and its index in that
loader's dataset; ``details["sharding"]`` says FSDP2. About 20 s on two cores.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from launcher import HELPERS, launch

SCRIPT = HELPERS / "sharded_script.py"
TIMEOUT_S = 300  # a rank waiting alone in a collective would hang: this turns it into a failure
RANKS = [0, 1]
BAD_RANK = 1
# fit -> the loaders' batch sizes, and step -> (loader, position in its part) of a zero record
# (as sharded_script.LOADERS_FITS puts them)
FITS: dict[str, tuple[list[list[Any]], dict[int, tuple[str, int]]]] = {
    "loaders": ([["a", 8], ["b", 4]], {1: ("b", 2), 3: ("a", 5)}),
    "loaders_equal": ([["a", 4], ["b", 4]], {1: ("b", 2), 3: ("a", 1)}),
    # a bad first step: no reference sub-batch yet, the helping rank cuts its dummy batch loader by loader
    # (before, it cut it as one batch, failed, and the run died in a collective mismatch)
    "loaders_first_step": ([["a", 8], ["b", 4]], {0: ("b", 2), 3: ("a", 5)}),
}

pytestmark = pytest.mark.slow

Ranks = dict[int, dict[str, Any]]
FIT_PARAMS = pytest.mark.parametrize("fit", list(FITS))


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ranks]:
    """Each fit's result on each rank (``<fit>-rank<N>.json``); one run of the script for the module."""
    out = tmp_path_factory.mktemp("loaders")
    launch(SCRIPT, "fsdp2", "loaders", out, nprocs=len(RANKS), out_dir=out, timeout=TIMEOUT_S)
    found: dict[str, Ranks] = {}
    for path in sorted(out.glob("*-rank*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        found.setdefault(path.name.split("-rank")[0], {})[data["rank"]] = data
    for fit in FITS:
        assert sorted(found.get(fit, {})) == RANKS, f"not every rank finished {fit}"
    return found


def _marker_line(marker: str) -> int:
    lines = SCRIPT.read_text(encoding="utf-8").splitlines()
    return next(i for i, line in enumerate(lines, start=1) if line.rstrip().endswith(f"# {marker}"))


@FIT_PARAMS
def test_the_zero_records_reach_rank_1_where_the_script_put_them(fits: dict[str, Ranks], fit: str) -> None:
    """The ground truth, from the batches ``training_step`` received (not from the guard)."""
    ranks, (_, zero_records) = fits[fit], FITS[fit]
    assert ranks[0]["zero_seen"] == []
    assert ranks[BAD_RANK]["zero_seen"] == [[step, key, position] for step, (key, position) in zero_records.items()]
    assert ranks[0]["zero_index"] == ranks[BAD_RANK]["zero_index"]


@FIT_PARAMS
def test_the_bad_steps_are_skipped_on_every_rank_and_the_weights_stay_equal(fits: dict[str, Ranks], fit: str) -> None:
    ranks, (_, zero_records) = fits[fit], FITS[fit]
    for data in ranks.values():
        assert (data["error"], data["active"], data["global_step"]) == (None, True, 5)
        assert data["skipped_steps"] == sorted(zero_records)  # every local shard bitwise unchanged; others moved
        assert data["finite"]
    assert ranks[0]["full_hashes"] == ranks[BAD_RANK]["full_hashes"]  # the gathered full tensors


@FIT_PARAMS
def test_each_event_names_the_record_by_its_loader_and_dataset_index_on_the_rank_that_held_it(
    fits: dict[str, Ranks], fit: str
) -> None:
    ranks, (sizes, zero_records) = fits[fit], FITS[fit]
    assert ranks[0]["events"] == []  # its shards only received rank 1's NaN: it records nothing
    events = ranks[BAD_RANK]["events"]
    assert [e["global_step"] for e in events] == sorted(zero_records)
    zero_index = ranks[BAD_RANK]["zero_index"]
    line = _marker_line("LOADERS FORWARD ORIGIN")
    for event in events:
        key, position = zero_records[event["global_step"]]
        assert event["rank"] == BAD_RANK
        assert event["details"].get("diagnosis_error") is None
        named = (event.get("sample_loaders"), event.get("offending_samples"), event.get("dataset_indices"))
        assert named == ([key], [position], [zero_index[key]])  # its loader, its row in that loader's part, its index
        assert (event["cause"], event["phase"], event["culprit_op"]) == ("data", "forward", "div")
        assert event["source_line"].endswith(f"sharded_script.py:{line}")
        assert event["action"] == "skipped"
        assert event["details"]["loader_batch_sizes"] == sizes
        assert "sample_loaders_unknown" not in event["details"]


@FIT_PARAMS
def test_the_event_says_the_diagnosis_ran_sharded_under_fsdp2(fits: dict[str, Ranks], fit: str) -> None:
    for event in fits[fit][BAD_RANK]["events"]:
        sharding = event["details"]["sharding"]
        assert sharding["kind"] == "fsdp2"
        assert (sharding["data_parallel"], sharding["tensor_parallel"]) == (2, 1)
        assert sharding["searched_ranks"] == [BAD_RANK]  # a NaN loss: only the batch that computed it
        assert sharding["lockstep_passes"] > 0
