"""Diagnosis as a collective: every rank runs one pass per tick, in the same order, until every rank is done.

Under FSDP2 every forward all-gathers the parameters of each sharded module and every backward
gathers them again; under tensor parallelism activations are all-reduced inside the forward and
the backward. A re-run of ``training_step`` on one rank alone therefore hangs: every rank must
run a pass at the same moment, through the same modules (and, for ranks that share a batch, on
the same sub-batch).

:class:`Lockstep` is the protocol. Time is cut into *ticks*. In each tick every rank of the world
says whether it can run its pass and whether it is done (one small ``all_gather``), runs exactly
one forward/backward pass, and shares its pass result (a second one, of ``[bad, non-finite, has loss,
done, failed]`` per rank):

- a rank that *searches* (its batch holds the incident) runs the pass its diagnosis asks for
  (:class:`LockstepRunner` is the :class:`~lightning_nanguard.diagnose.runner.SubBatchRunner` whose
  every pass is a tick) and reads back the pass results of the ranks sharing its batch (tensor-parallel
  ranks search one batch together: a NaN/Inf in any of their shards makes the sub-batch bad for
  all of them, so they follow the same search);
- a rank that does not search, or has finished, runs a *dummy* pass (a healthy reference
  sub-batch) in :meth:`Lockstep.finish`; when every rank says it is done, all leave together,
  before another pass;
- a rank whose pass cannot be prepared (the sub-batch cannot be cut) says so before the pass:
  every rank sees it in the same tick and no rank runs that pass (its tensor-parallel peers
  would otherwise wait in a collective of another shape); every diagnosis stops there
  (:class:`LockstepAborted`), without another collective, and the reason goes into the event.
  A pass that raises after its first collective cannot be matched by the other ranks: they wait
  in that collective until the process group's timeout (the user's step raising on one rank only).

The gradients of a pass are this rank's own: they are taken with respect to the leaves of the
loss's graph (under FSDP2 the unsharded parameters the forward used), so nothing is
reduce-scattered and no rank's pass result mixes in another's samples.

Example (one process: a lockstep of one rank is a plain diagnosis):
    >>> step = Lockstep(peers=[0], dummy=lambda: None)
    >>> step.tick(lambda: (True, True)), step.passes
    ((True, True), 1)
    >>> step.finish(), step.passes  # nobody to wait for
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

PassResult = tuple[bool, bool]  # what one pass gave: (bad, non-finite)
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
        max_passes: a safety cap; past it a rank's next pass counts as one that cannot run.
        dummy_failure: why ``dummy`` cannot run, when that is known before any pass (no healthy
            sub-batch to run): said in the exchange before the pass, so no rank enters it.

    Attributes:
        passes: forward/backward passes this rank ran in lockstep (the same on every rank).
        aborted: why the diagnosis stopped on every rank (``None``: it did not).
        failure: this rank's own reason, when it could not run a pass.
    """

    def __init__(
        self,
        peers: Sequence[int],
        dummy: Callable[[], Any],
        group: Any = None,
        device: torch.device | None = None,
        max_passes: int = 10_000,
        dummy_failure: BaseException | None = None,
    ) -> None:
        self.peers = sorted(set(peers))
        self.dummy = dummy
        self.dummy_failure = dummy_failure
        self.group = group
        self.device = device if device is not None else torch.device("cpu")
        self.max_passes = max_passes
        self.passes = 0
        self.aborted: str | None = None
        self.failure: str | None = None

    @property
    def distributed(self) -> bool:
        """Whether other ranks take part."""
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1

    def tick(self, run: Callable[[], PassResult | None], failure: BaseException | None = None) -> PassResult | None:
        """Run ``run`` (one pass) with every rank; the pass result of the ranks sharing this batch.

        ``failure``: this rank cannot run its pass (then no rank runs it, and every rank stops).
        Returns ``None`` when no rank sharing the batch got a loss out of the step.

        Raises:
            LockstepAborted: some rank could not run its pass (in this tick or an earlier one).
        """
        if self.aborted is not None:
            raise LockstepAborted(self.aborted)
        if failure is None and self.passes >= self.max_passes:
            failure = RuntimeError(f"more than {self.max_passes} passes")
        self._stop_if_failed(self._exchange(None, done=False, failed=failure is not None), failure)
        result: PassResult | None = None
        try:
            result = run()
        except Exception as error:  # said to every rank in the exchange, re-raised as LockstepAborted
            failure = error
        self.passes += 1
        table = self._exchange(result, done=False, failed=failure is not None)
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
            cannot = self.dummy_failure  # said before the pass: a rank still searching does not enter it
            table = self._exchange(None, done=True, failed=cannot is not None)
            if bool(table[:, _DONE].all()):
                return  # nobody needs another pass, runnable or not
            try:
                self._stop_if_failed(table, cannot)
            except LockstepAborted:
                return
            failure: BaseException | None = None
            try:
                self.dummy()
            except Exception as error:  # reported to every rank
                failure = error
            self.passes += 1
            try:
                self._stop_if_failed(self._exchange(None, done=True, failed=failure is not None), failure)
            except LockstepAborted:
                return

    # ------------------------------------------------------------------ internals

    def _peer_rows(self) -> list[int]:
        if not self.distributed:
            return [0]
        return self.peers

    def _exchange(self, result: PassResult | None, done: bool, failed: bool) -> torch.Tensor:
        """Every rank's flags, one row per rank (one ``all_gather`` and one host read)."""
        bad, nonfinite = result if result is not None else (False, False)
        flags = [float(bad), float(nonfinite), float(result is not None), float(done), float(failed)]
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
            f"the diagnosis stopped on every rank after {self.passes} passes: rank {ranks} could not run its pass"
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
        except Exception as error:  # said before the pass: no rank runs it, every rank stops
            failure = error
        result = self.lockstep.tick(lambda: self.run(*prepared) if prepared is not None else None, failure)
        return self.note(positions, result)

    def instrumented(self, localize: Callable[[], Any]) -> Any:
        """The localisation pass, as a tick; whether any rank sharing the batch found an origin is kept."""
        found: list[Any] = []

        def run() -> PassResult:
            localization = localize()
            found.append(localization)
            origin = getattr(localization, "phase", None) is not None
            return origin, origin

        result = self.lockstep.tick(run)
        localization = found[0] if found else None
        self._found[id(localization)] = result is not None and result[0]
        return localization

    def found(self, localization: Any) -> bool:
        """Whether the localisation pass that gave ``localization`` found an origin on any rank sharing the batch."""
        return self._found.get(id(localization), super().found(localization))
