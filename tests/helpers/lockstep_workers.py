"""Workers of ``diagnose/test_lockstep.py``: two gloo processes running the lockstep protocol.

Usage: ``launcher.launch("lockstep_workers.py", OUTPUT_DIR, nprocs=2, ...)``: each process joins the
process group from its launch environment and writes ``rank<N>.json``.

Each *pass* of these workers makes one ``all_reduce``, as a sharded forward does: if the ranks ever
ran a different number of passes, or a pass against an exchange, the collectives would mismatch
(gloo raises or hangs, and the test's timeout fails it).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from process_group import finish_script
from torch import nn

from lightning_nanguard.diagnose.batch_diagnosis import diagnose
from lightning_nanguard.diagnose.lockstep import Lockstep, LockstepAborted, LockstepRunner

__all__ = ["main"]


def _collective_pass() -> None:
    dist.all_reduce(torch.ones(3))


class _Net(nn.Module):
    """``log(w * x)`` per sample, with an all-reduce in the forward (as a sharded module's all-gather)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def training_step(self, x: torch.Tensor, batch_idx: int) -> torch.Tensor:
        _collective_pass()
        return (self.w * x).log().mean()


def _scenario(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # 1. a different number of passes per rank: the finished rank runs dummy passes until both are done
    lockstep = Lockstep([rank], dummy=_collective_pass)
    for _ in range(1 if rank == 0 else 3):
        lockstep.tick(lambda: (_collective_pass(), (rank == 1, rank == 1))[1])
    lockstep.finish()
    out["uneven_passes"] = lockstep.passes
    # 2. peers share the pass result: bad on rank 1 only, bad for both
    lockstep = Lockstep([0, 1], dummy=_collective_pass)
    out["shared_result"] = lockstep.tick(lambda: (_collective_pass(), (rank == 1, False))[1])
    lockstep.finish()
    # 3. a pass that cannot run on rank 1 at its second tick stops both, at the same tick, without another collective
    lockstep = Lockstep([rank], dummy=_collective_pass)
    seen: list[str] = []
    for tick in range(4):
        failure = ValueError("cannot cut the batch") if rank == 1 and tick == 1 else None
        try:
            lockstep.tick(lambda: (_collective_pass(), (False, False))[1], failure)
            seen.append("ok")
        except LockstepAborted:
            seen.append("aborted")
    lockstep.finish()
    out["failure"] = {"seen": seen, "passes_run": lockstep.passes, "reason": lockstep.aborted}
    # 4. a real diagnosis on rank 1 (sample 2 is 0: log(0)), rank 0 helps with dummy passes
    net = _Net()
    healthy = torch.tensor([1.0, 2.0])
    lockstep = Lockstep([rank], dummy=lambda: net.training_step(healthy, 0).backward())
    found = None
    if rank == 1:
        batch = torch.tensor([1.0, 2.0, 0.0, 3.0, 4.0, 5.0, 6.0, 7.0])
        factory: Any = lambda *args, **kwargs: LockstepRunner(*args, lockstep=lockstep, **kwargs)  # noqa: E731
        found = diagnose(net, batch, runner_factory=factory, reference_batch=healthy)
    lockstep.finish()
    out["diagnosis"] = {
        "passes_run": lockstep.passes,
        "offending": found.offending if found is not None else None,
        "cause": found.cause if found is not None else None,
        "op": found.localization.op if found is not None and found.localization is not None else None,
        "passes": found.passes if found is not None else None,
    }
    # 5. rank 0 has no batch for its dummy passes (known before any pass) while rank 1 searches: it says so
    # before rank 1's first pass, so rank 1 never enters a pass (with its collective) that rank 0 would not match
    lockstep = Lockstep([rank], dummy=_collective_pass, dummy_failure=RuntimeError("no batch") if rank == 0 else None)
    entered: list[int] = []
    if rank == 1:
        with contextlib.suppress(LockstepAborted):
            lockstep.tick(lambda: (entered.append(1), _collective_pass(), (True, True))[2])
    lockstep.finish()
    out["unrunnable_dummy"] = {"entered": entered, "passes_run": lockstep.passes, "reason": lockstep.aborted}
    # 6. the same helper when nobody searches: every rank is done at once, nothing is stopped
    lockstep = Lockstep([rank], dummy=_collective_pass, dummy_failure=RuntimeError("no batch") if rank == 0 else None)
    lockstep.finish()
    out["unrunnable_dummy_unneeded"] = {"passes_run": lockstep.passes, "reason": lockstep.aborted}
    return out


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")  # MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE from the launcher
    rank = dist.get_rank()
    try:
        result = _scenario(rank)
    except BaseException:
        dist.destroy_process_group()
        raise
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    # both results are written: leave without tearing gloo down (under load its teardown aborted a finished
    # rank now and then, "terminate called without an active exception", 1 run in about 50)
    finish_script()


if __name__ == "__main__":
    main(sys.argv[1])
