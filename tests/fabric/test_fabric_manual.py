"""A closure optimizer in a Lightning Fabric loop under ``NanGuard`` (issue 34, item 3): a bad LBFGS step is undone.

The loop (``manual_loops.lbfgs_fabric_run``): ``fabric.setup(model, LBFGS)``, then per batch
``optimizer.step(closure)`` with ``fabric.backward`` inside the closure. Record 9 (batch 2) is all zeros:
``x / ||x||`` is NaN in the closure, and LBFGS would run its line of iterations on NaN. The guard
(a Fabric callback) cannot skip an update LBFGS makes inside ``step``; it undoes it: the weights and
LBFGS's state are as before the step, and the run continues as if the step had not been taken.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from manual_loops import lbfgs_data, lbfgs_fabric_run
from states import bitwise_equal, states_equal

from lightning_nanguard import NanGuard

BAD_RECORD = 9  # batch 2 of 4 records each
BAD_STEP = 2


@pytest.fixture(autouse=True)
def _events_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NANGUARD_DIR", str(tmp_path))


def test_a_bad_lbfgs_step_in_a_fabric_loop_is_undone() -> None:
    guard = NanGuard(verbose=False, save_repro=False)
    module, states, optimizer = lbfgs_fabric_run(guard, lbfgs_data(bad=(BAD_RECORD,)))
    seen = [(e.global_step, e.action) for e in guard.events]
    assert seen == [(BAD_STEP, "skipped")], f"one event for the bad LBFGS step, action 'skipped' (undone): {seen}"
    before, after = states[BAD_STEP], states[BAD_STEP + 1]  # states[i]: the weights before batch i
    moved = [name for name, value in before.items() if not bitwise_equal(value, after[name])]
    assert moved == [], f"the bad LBFGS step was not undone: {moved} differ from before the step"
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())
    _, reference_states, reference_optimizer = lbfgs_fabric_run(
        None, lbfgs_data(bad=(BAD_RECORD,)), skip_batches=(BAD_STEP,)
    )
    final, reference_final = states[-1], reference_states[-1]
    differing = [name for name, value in final.items() if not bitwise_equal(value, reference_final[name])]
    assert differing == [], f"the guarded loop ends elsewhere than the loop that left the step out: {differing}"
    assert states_equal(optimizer.state_dict(), reference_optimizer.state_dict()), (
        "LBFGS's state (history, counters) differs from the loop that left the bad step out"
    )
