"""Diagnosis as a collective: every rank runs one pass per tick, in the same order, until every rank is done.

Under FSDP2 every forward all-gathers the parameters of each sharded module and every backward
gathers them again; under tensor parallelism activations are all-reduced inside the forward and
the backward. A re-run of ``training_step`` on one rank alone therefore hangs: every rank must
run a pass at the same moment, through the same modules.

:class:`Lockstep` is the protocol. Time is cut into *ticks*; in each tick every rank of the world
runs exactly one forward/backward pass, then takes part in one small ``all_gather`` of
``[bad, non-finite, has loss, done, failed]``:

- a rank that *searches* (its batch holds the incident) runs the pass its diagnosis asks for
  (:class:`LockstepRunner` is the :class:`~lightning_nanguard.diagnose.runner.SubBatchRunner` whose
  every pass is a tick) and reads back the verdict of the ranks sharing its batch (tensor-parallel
  ranks search one batch together: a NaN/Inf in any of their shards makes the sub-batch bad for
  all of them, so they follow the same search);
- a rank that does not search, or has finished, runs a *dummy* pass (a healthy reference
  sub-batch) in :meth:`Lockstep.finish` and says it is done; when every rank says so in the same
  tick, all leave together;
- a rank whose pass cannot run (the sub-batch cannot be cut, the step raises) runs the dummy pass
  instead and says it failed: every rank sees that in the same tick, and every diagnosis stops
  there (:class:`LockstepAborted`), without another collective.

The gradients of a pass are this rank's own: they are taken with respect to the leaves of the
loss's graph (under FSDP2 the unsharded parameters the forward used), so nothing is
reduce-scattered and no rank's verdict mixes in another's samples.

Example (one process: a lockstep of one rank is a plain diagnosis):
    >>> step = Lockstep(peers=[0], dummy=lambda: None)
    >>> step.tick(lambda: (True, True)), step.ticks
    ((True, True), 1)
    >>> step.finish(), step.ticks  # nobody to wait for
    (None, 1)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_nanguard.diagnose.runner import SubBatchRunner

__all__ = ["Lockstep", "LockstepAborted", "LockstepRunner"]

log = logging.getLogger("lightning_nanguard")

Verdict = tuple[bool, bool]  # (bad, non-finite)
_BAD, _NONFINITE, _HAS_LOSS, _DONE, _FAILED = range(5)


class LockstepAborted(RuntimeError):
    """Some rank could not run its pass: the diagnosis stops on every rank at the same tick."""


class Lockstep:
    """The tick protocol of a collective diagnosis (see module docs).

    Args:
        peers: global ranks that share this rank's batch (itself included): the tensor-parallel group.
        dummy: runs one forward/backward pass of a healthy sub-batch (what a rank with nothing to
            search runs while others search).
        group: the process group every rank of the run belongs to (default: the world).
        device: where the exchanged flags live (the backend's device: CUDA for NCCL).
        max_ticks: a safety cap; a rank past it stops searching (its passes are capped anyway).
    """

    def __init__(
        self,
        peers: Sequence[int],
        dummy: Callable[[], Any],
        group: Any = None,
        device: torch.device | None = None,
        max_ticks: int = 10_000,
    ) -> None:
        self.peers = sorted(set(peers))
        self.dummy = dummy
        self.group = group
        self.device = device if device is not None else torch.device("cpu")
        self.max_ticks = max_ticks
        self.ticks = 0
        self.aborted: str | None = None
        self.failure: str | None = None  # this rank's own reason, when it could not run a pass

    @property
    def distributed(self) -> bool:
        """Whether other ranks take part."""
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1

    def tick(self, run: Callable[[], Verdict | None], failure: BaseException | None = None) -> Verdict | None:
        """Run ``run`` (one pass) with every rank; the verdict of the ranks sharing this batch.

        ``failure``: the pass cannot run here (the dummy pass runs instead, and every rank stops).
        Returns ``None`` when no rank sharing the batch got a loss out of the step.

        Raises:
            LockstepAborted: some rank could not run its pass (in this tick or an earlier one).
        """
        if self.aborted is not None:
            raise LockstepAborted(self.aborted)
        if self.ticks >= self.max_ticks:
            failure = failure or RuntimeError(f"more than {self.max_ticks} passes")
        verdict: Verdict | None = None
        if failure is None:
            try:
                verdict = run()
            except Exception as error:  # said to every rank below, re-raised as LockstepAborted
                failure = error
        else:
            failure = self._dummy(failure)
        table = self._exchange(verdict, done=False, failed=failure is not None)
        self._stop_if_failed(table, failure)
        rows = table[self._peer_rows()]
        if not bool(rows[:, _HAS_LOSS].any()):
            return None
        return bool(rows[:, _BAD].any()), bool(rows[:, _NONFINITE].any())

    def finish(self) -> None:
        """Run dummy passes until every rank is done (every rank calls this once, after its own search)."""
        if not self.distributed:
            return
        while self.aborted is None:
            failure = self._dummy(None)
            table = self._exchange(None, done=True, failed=failure is not None)
            try:
                self._stop_if_failed(table, failure)
            except LockstepAborted:
                return
            if bool(table[:, _DONE].all()):
                return

    # ------------------------------------------------------------------ internals

    def _dummy(self, failure: BaseException | None) -> BaseException | None:
        """Run the dummy pass; return the failure to report (the given one, or the dummy's own)."""
        try:
            self.dummy()
        except Exception as error:  # reported to every rank
            return failure or error
        return failure

    def _peer_rows(self) -> list[int]:
        if not self.distributed:
            return [0]
        return self.peers

    def _exchange(self, verdict: Verdict | None, done: bool, failed: bool) -> torch.Tensor:
        """Every rank's flags, one row per rank (one ``all_gather`` and one host read)."""
        self.ticks += 1
        bad, nonfinite = verdict if verdict is not None else (False, False)
        flags = [float(bad), float(nonfinite), float(verdict is not None), float(done), float(failed)]
        local = torch.tensor(flags, dtype=torch.float32, device=self.device)
        if not self.distributed:
            return local.reshape(1, -1).cpu()
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(gathered, local, group=self.group)
        return torch.stack(gathered).cpu()

    def _stop_if_failed(self, table: torch.Tensor, failure: BaseException | None) -> None:
        failed = [rank for rank, row in enumerate(table.tolist()) if row[_FAILED]]
        if not failed:
            return
        if failure is not None:
            self.failure = f"{type(failure).__name__}: {failure}"
            log.warning("NanGuard: a diagnosis pass could not run on this rank: %r", failure, exc_info=failure)
        ranks = ", ".join(str(r) for r in failed)
        self.aborted = (
            f"the diagnosis stopped on every rank after {self.ticks} passes: rank {ranks} could not run its pass"
            + (f" ({self.failure})" if self.failure else "")
        )
        raise LockstepAborted(self.aborted)


class LockstepRunner(SubBatchRunner):
    """A :class:`SubBatchRunner` whose every pass is a :meth:`Lockstep.tick` (see module docs).

    Takes the :class:`SubBatchRunner` arguments and ``lockstep``; differentiates with respect to the
    leaves of the loss's graph (the unsharded parameters under FSDP2).
    """

    def __init__(self, *args: Any, lockstep: Lockstep, **kwargs: Any) -> None:
        kwargs["grads_from_graph"] = True
        super().__init__(*args, **kwargs)
        self.lockstep = lockstep
        self._found: dict[int, bool] = {}

    def is_bad(self, positions: Sequence[int]) -> bool:
        """One pass of ``positions`` with every rank; bad when bad on any rank sharing the batch."""
        self.passes += 1
        failure: BaseException | None = None
        prepared: tuple[Any, bool] | None = None
        try:
            prepared = self.prepare(positions)
        except Exception as error:  # the dummy pass runs instead, every rank stops
            failure = error
        verdict = self.lockstep.tick(lambda: self.run(*prepared) if prepared is not None else None, failure)
        return self.note(positions, verdict)

    def instrumented(self, localize: Callable[[], Any]) -> Any:
        """The localisation pass, as a tick; whether any rank sharing the batch found an origin is kept."""
        found: list[Any] = []

        def run() -> Verdict:
            localization = localize()
            found.append(localization)
            origin = getattr(localization, "phase", None) is not None
            return origin, origin

        verdict = self.lockstep.tick(run)
        localization = found[0] if found else None
        self._found[id(localization)] = verdict is not None and verdict[0]
        return localization

    def found(self, localization: Any) -> bool:
        """Whether the localisation pass that gave ``localization`` found an origin on any rank sharing the batch."""
        return self._found.get(id(localization), super().found(localization))
