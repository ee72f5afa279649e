"""The real manual loops of issue 34 (DCGAN, WGAN-GP, REINFORCE) on 2 DDP ranks (gloo, CPU), a fault on rank 1.

Runs ``tests/helpers/manual_ddp_script.py`` once per loop (``launcher.launch``, two processes). Each
rank fits the loop twice: the reference that drops the bad step by hand and the guarded run (with
``loss_fn`` or ``nanguard_loss``, so the record can be named). DDP averages the gradients, so the
NaN/Inf of rank 1's record reaches both ranks' gradients: every rank must drop the same step, and
each rank's guarded run must equal its reference bit for bit (parameters, buffers, optimizer state),
with the same parameters and optimizer state on both ranks. Marked ``slow`` but part of the default run.
"""

from __future__ import annotations

from typing import Any

import pytest
from launcher import HELPERS, launch

SCRIPT = HELPERS / "manual_ddp_script.py"
TIMEOUT_S = 180
LOOPS = {  # loop -> (batch of the bad step on rank 1, the index of the optimizer whose step it is)
    "dcgan": (2, 1),  # the discriminator: D(x) == 0 for the planted record
    "wgan": (4, 1),  # the critic: NaN gradient of the penalty (batch 4 is a generator batch too)
    "reinforce": (2, 0),  # the policy: log(prob == 0) for the planted record
}

pytestmark = pytest.mark.slow

Ranks = dict[int, dict[str, Any]]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    done: dict[str, Ranks] = {}

    def runner(loop: str) -> Ranks:  # each loop runs once per module
        if loop not in done:
            out = tmp_path_factory.mktemp(loop)
            done[loop] = launch(SCRIPT, loop, out, nprocs=2, out_dir=out, timeout=TIMEOUT_S).results()
        return done[loop]

    return runner


def _differing(
    a: dict[str, str], b: dict[str, str], kinds: tuple[str, ...] = ("param", "buffer", "optimizer")
) -> list[str]:
    keys = sorted(key for key in a.keys() | b.keys() if key.startswith(kinds))
    return [key for key in keys if a.get(key) != b.get(key)]


@pytest.mark.parametrize("loop", list(LOOPS))
def test_every_rank_drops_the_same_step_and_ends_where_its_hand_dropped_run_ends(run: Any, loop: str) -> None:
    ranks = run(loop)
    batch, optimizer = LOOPS[loop]
    for rank, data in ranks.items():
        reference, guarded = data["reference"], data["guarded"]
        assert reference["dropped_by_hand"] == [[batch, optimizer]], (
            f"rank {rank}: the reference did not drop exactly the planted step: {reference['dropped_by_hand']}"
        )
        assert guarded["error"] is None, f"rank {rank}: the guarded run stopped: {guarded['error']}"
        assert guarded["finite"], f"rank {rank}: the guarded run ended with non-finite weights"
        differing = _differing(guarded["hashes"], reference["hashes"])
        assert differing == [], f"rank {rank}: the guarded run differs from the hand-dropped run in {differing}"
        assert guarded["skipped_total"] == 1, f"rank {rank}: skipped_total={guarded['skipped_total']}"


@pytest.mark.parametrize("loop", list(LOOPS))
def test_the_weights_and_optimizer_states_are_finite_and_equal_across_ranks(run: Any, loop: str) -> None:
    """Finite and equal (BatchNorm buffers are rank-local and left out); NaN on both ranks would be equal too."""
    ranks = run(loop)
    assert [ranks[r]["guarded"]["finite"] for r in (0, 1)] == [True, True], "non-finite weights after the run"
    differing = _differing(ranks[0]["guarded"]["hashes"], ranks[1]["guarded"]["hashes"], ("param", "optimizer"))
    assert differing == [], f"the ranks' guarded runs ended apart in {differing}"


@pytest.mark.parametrize("loop", list(LOOPS))
def test_the_bad_rank_names_the_optimizer_and_the_record(run: Any, loop: str) -> None:
    ranks = run(loop)
    batch, optimizer = LOOPS[loop]
    guarded = ranks[1]["guarded"]
    seen = [(e["batch_idx"], e["action"]) for e in guarded["events"]]
    assert seen == [(batch, "skipped")], f"rank 1: one 'skipped' event for its bad step, got {seen}"
    assert guarded["event_optimizers"] == [optimizer], f"rank 1: event.optimizer {guarded['event_optimizers']}"
    (event,) = guarded["events"]
    planted = ranks[1]["planted"]
    assert event["dataset_indices"] == [planted], (
        f"rank 1: the event should name record {planted}: dataset_indices={event['dataset_indices']}, "
        f"details={event['details']}"
    )
    assert event.get("indices_verified") is True, event["details"]
