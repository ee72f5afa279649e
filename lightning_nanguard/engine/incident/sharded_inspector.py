"""A bad step under sharding: every rank inspects, searches or helps, in lockstep; the ranks that hold it report.

:class:`ShardedIncidentInspector` replaces :class:`~lightning_nanguard.engine.incident.inspector.IncidentInspector`
under ``ModelParallelStrategy``. It runs on every rank when some rank's check flagged the step
(the flags are shared), and differs in three ways:

1. **Who searches** is decided together. Each rank confirms its own shards and says what it found
   (:class:`Finding`, one ``all_gather_object``). A non-finite loss or BatchNorm statistic can only
   come from the batch of the ranks that computed it, so those batches are searched. A NaN/Inf
   found in gradients only can come from *any* batch (the gradient reduction spreads it to the
   shards of ranks whose data is fine, and spares the shards of the rank whose data is at fault),
   so every batch is searched. A loss spike is searched by the ranks whose loss spiked.
   Tensor-parallel ranks share their batch and search it together (:mod:`~lightning_nanguard.diagnose.lockstep`).
2. **Every rank takes part in every pass**: searching ranks run their diagnosis through a
   :class:`~lightning_nanguard.diagnose.lockstep.LockstepRunner`; the others, and those done early,
   run dummy passes of a healthy reference sub-batch until all are done. A diagnosis that cannot
   finish on one rank ends on all, with the reason in the event.
3. **Who reports** is decided from every rank's search result (:class:`SearchResult`, a second
   ``all_gather_object``): the lowest rank of each batch that reproduced the incident records the
   event (with the gradient names every rank found); ranks whose own shards only received another
   batch's NaN/Inf record nothing. When no batch reproduces it, ranks keep their own events as
   under DDP. A bundle's model state is gathered from the shards (every rank takes part) when the
   model is small enough (:data:`GATHER_LIMIT_BYTES`), else the bundle says why it has none.

The collectives run on every rank whatever it found, in the same order; the rank-local work
between them never raises (a failure becomes this rank's ``failed`` report).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor

from lightning_nanguard.core.dtensor import gathered_state
from lightning_nanguard.core.event_builder import EventSections, Found, build_event, with_sections
from lightning_nanguard.core.events import (
    SPIKE_KINDS,
    EventKind,
    GuardInternalError,
    NanEvent,
    NonFiniteTrainingError,
)
from lightning_nanguard.decide.agreement import RankAgreement
from lightning_nanguard.decide.policy import RankVote, StepHealth
from lightning_nanguard.decide.search_plan import Finding, SearchResult, plan_search, recorders
from lightning_nanguard.detect.confirm import nonfinite_names
from lightning_nanguard.diagnose.batching import slice_batch
from lightning_nanguard.diagnose.combined import CombinedBatch
from lightning_nanguard.diagnose.lockstep import Lockstep
from lightning_nanguard.diagnose.runner import SubBatchRunner
from lightning_nanguard.engine.incident.files import save_incident_files
from lightning_nanguard.engine.incident.inspector import (
    IncidentInspector,
    event_cause,
    quarantine_items_of,
    quarantine_of,
    with_rerun_note,
)
from lightning_nanguard.engine.incident.step_diagnosis import StepDiagnosis, diagnose_micro_batches
from lightning_nanguard.engine.shard_layout import ShardingLayout

if TYPE_CHECKING:
    from lightning_nanguard.engine.frontend import FrontEnd

__all__ = ["ShardedIncidentInspector", "inspector_for"]

log = logging.getLogger("lightning_nanguard")

DUMMY_SIZE = 2  # samples of a dummy pass (BatchNorm in train mode refuses one)


class ShardedIncidentInspector(IncidentInspector):
    """This rank's side of a step that some rank flagged, under sharding (see module docs).

    Takes the :class:`IncidentInspector` arguments, the :class:`ShardingLayout` and the ranks' agreement.
    """

    def __init__(self, *args: Any, layout: ShardingLayout, agreement: RankAgreement, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.layout = layout
        self.agreement = agreement

    def inspect(self, front: FrontEnd, health: StepHealth, grads: list[Tensor]) -> tuple[RankVote, NanEvent | None]:
        """This rank's report and the event it records (``None``: another rank records it, or none)."""
        rank = front.global_rank
        # a failing rank skips this inspector altogether: with a failure anywhere, no collective here
        # (without other ranks every collective below is local, and the diagnosis runs as usual)
        together = not health.ranks_failed
        grad_norm = health.grad_norm
        if grad_norm < 0 and together:  # not computed this step: the global norm (the same test on every rank)
            grad_norm = self.layout.global_norm_now(grads, self.agreement, self.layout.device)
        failed = False
        event: NanEvent | None = None
        spiked = False
        try:
            event, spiked = self._own_event(front, health, grads, grad_norm)
        except Exception as error:  # never skip the collectives below: this rank fails the step instead
            log.warning("NanGuard: the check of a bad step failed on rank %d: %r", rank, error, exc_info=True)
            self.parts.core_failed(error)  # the confirmation is the core's: every rank drops the step, then stops
            failed = True
        if not together:
            event = with_rerun_note(front, event)
            return self._report(rank, event, spiked, failed), event
        finding = self._finding(rank, health, event, spiked)
        findings = self.agreement.gather(finding)
        plan = plan_search(findings) if self._may_diagnose(front) else {}
        if plan:
            event, spiked = self._diagnose_together(front, plan, findings, event, spiked, grad_norm)
        event = with_rerun_note(front, event)
        return self._report(rank, event, spiked, failed), event

    # ------------------------------------------------------------------ before the search

    def _own_event(
        self, front: FrontEnd, health: StepHealth, grads: list[Tensor], grad_norm: float
    ) -> tuple[NanEvent | None, bool]:
        """This rank's confirmed NaN/Inf event, or its spike event (rank-local: no collective)."""
        event: NanEvent | None = None
        # a NaN/Inf born in another rank's loss or BatchNorm statistics reaches this rank's gradient shards
        someone_elses = health.ranks_others_bad > 0 and not health.others_bad
        if health.bad and not someone_elses:
            event = self._nonfinite_event(front, grads, grad_norm)
        if event is None and health.spike and self.spikes is not None:
            spike = self._spike_event(front, grad_norm)
            if spike is not None:
                return spike[0], True
        return event, False

    def _finding(self, rank: int, health: StepHealth, event: NanEvent | None, spiked: bool) -> Finding:
        """What this rank found, for the others; never raises (the gather must happen)."""
        try:
            threshold = self.spikes.loss_threshold() if spiked and self.spikes is not None else None
            weights = tuple(nonfinite_names((n, p.detach()) for n, p in self.named_params))
        except Exception as error:  # decide without them
            log.warning("NanGuard: rank %d could not describe its bad step: %r", rank, error)
            threshold, weights = None, ()
        return Finding(
            rank,
            self.layout.peers,
            nonfinite=event is not None and not spiked,
            origin=health.others_bad,
            spike=spiked,
            threshold=threshold,
            kinds=tuple(event.kinds) if event is not None and not spiked else (),
            nonfinite_grads=tuple(event.nonfinite_grads) if event is not None and not spiked else (),
            nonfinite_weights=weights,
        )

    def _report(self, rank: int, event: NanEvent | None, spiked: bool, failed: bool) -> RankVote:
        return RankVote(
            rank,
            incident=event is not None and not spiked,
            spike=spiked and event is not None,
            failed=failed,
            cause=event_cause(event),
            quarantine=quarantine_of(event),
            culprit_module=event.culprit_module if event is not None and event.phase is not None else None,
            quarantine_items=quarantine_items_of(event),
        )

    # ------------------------------------------------------------------ the search, on every rank

    def _diagnose_together(
        self,
        front: FrontEnd,
        plan: Mapping[tuple[int, ...], float | None],
        findings: Sequence[Finding],
        event: NanEvent | None,
        spiked: bool,
        grad_norm: float,
    ) -> tuple[NanEvent | None, bool]:
        """Search (or help) in lockstep, share the outcomes, record where the incident is; every rank."""
        # the same plan on every rank; everything rank-local below is inside a try, so that every rank
        # reaches every collective (the ticks, the gathers) whatever happens on it
        searching = self.layout.peers in plan
        threshold = plan.get(self.layout.peers)
        weights = sorted({name for f in findings for name in f.nonfinite_weights})
        dummy, cannot_run = self._dummy(front)
        lockstep = Lockstep(self.layout.peers, dummy, device=self.layout.device, dummy_failure=cannot_run)
        outcome = SearchResult(front.global_rank, self.layout.peers, searched=searching, event=event)
        with self.window.before_step_batchnorm(keep_after=True):
            found: StepDiagnosis | None = None
            error: str | None = None
            try:
                if searching:
                    base = self._base_event(front, findings, event, spiked, threshold, grad_norm)
                    found = diagnose_micro_batches(
                        front,
                        base,
                        self.window.micro_batches,
                        self.settings,
                        reference_batch=self.window.reference,
                        loss_threshold=threshold,
                        lockstep=lockstep,
                        nonfinite_weights=weights,
                    )
                    outcome = self._result(front.global_rank, found, threshold)
            except Exception as caught:  # a bug on this rank: it stops searching, the others carry on
                log.warning("NanGuard: the sharded diagnosis failed on this rank: %r", caught, exc_info=True)
                error = repr(caught)
            finally:
                lockstep.finish()
            outcome = dataclasses.replace(outcome, error=lockstep.failure or error, own=event is not None)
            outcomes = self.agreement.gather(outcome)
            chosen_events = recorders(outcomes)
            mine = chosen_events.get(front.global_rank)
            if mine is not None:
                try:
                    mine = self._merged(mine, findings, outcomes, lockstep)
                except Exception as caught:  # the event as found is recorded instead
                    log.warning("NanGuard: could not merge the ranks' findings: %r", caught, exc_info=True)
            mine = self._save_bundles(front, mine, chosen_events, found)
        if mine is None:
            return None, False
        return mine, set(mine.kinds) <= set(SPIKE_KINDS)

    def _base_event(
        self,
        front: FrontEnd,
        findings: Sequence[Finding],
        event: NanEvent | None,
        spiked: bool,
        threshold: float | None,
        grad_norm: float,
    ) -> NanEvent:
        """The event this rank's search fills: its own, or one made from what every rank found."""
        if threshold is not None:  # a spike search: the rank's own spike event (its peers' are the same)
            if event is not None and spiked:
                return event
            return build_event(self._where(front), Found(("loss_spike",), grad_norm=grad_norm))
        if event is not None and not spiked:
            return event
        possible: tuple[EventKind, ...] = ("loss", "grad", "bn_stats")
        kinds = [k for k in possible if any(k in f.kinds for f in findings)] or ["grad"]
        names = tuple(sorted({n for f in findings for n in f.nonfinite_grads}))
        losses = [float(loss.double().sum()) for loss in self.window.losses]  # a float64 loss may exceed float32
        found = Found(tuple(kinds), nonfinite_grads=names, loss=losses[-1] if losses else None, grad_norm=grad_norm)
        return build_event(self._where(front), found)

    def _dummy(self, front: FrontEnd) -> tuple[Callable[[], None], BaseException | None]:
        """The pass a rank runs while others search: a healthy reference sub-batch (identical across peers).

        Never raises. Without a batch it can run (no reference yet and the step's batch cannot be
        cut), it returns why: the lockstep says so before any pass, and the diagnosis stops on every rank.
        """
        slicer = self.settings.slicer_for(front.module)
        batch = self.window.reference
        first = self.window.micro_batches[0] if self.window.micro_batches else None
        layout = first.loaders.layout if first is not None and first.loaders is not None else None
        if batch is None and first is not None:
            try:
                if layout is not None:  # several training loaders: the first rows of each loader's part
                    combined = CombinedBatch(first.batch, layout, slicer)
                    batch = combined.cut(combined.first_rows(DUMMY_SIZE))
                else:
                    batch = (slicer or slice_batch)(first.batch, list(range(DUMMY_SIZE)))
            except Exception:  # an unsliceable batch: the whole batch
                batch = first.batch
        try:
            runner = SubBatchRunner(
                front.module,
                batch,
                front.step_fn(),
                self.window.batch_idx,
                slicer,
                front.step_context,
                grads_from_graph=True,
                layout=layout,
            )
        except Exception as error:
            reason = RuntimeError(f"no batch for the passes of a rank that does not search: {error!r}")

            def cannot() -> None:
                raise reason

            return cannot, reason

        def run() -> None:
            runner.run(*runner.prepare(range(runner.size)))

        return run, None

    def _result(self, rank: int, found: StepDiagnosis, threshold: float | None) -> SearchResult:
        """What this rank's search found: whether its batch holds the incident, and the event it filled."""
        diagnosis, peers = found.diagnosis, self.layout.peers
        if diagnosis is None or found.micro_batch is None:
            return SearchResult(rank, peers, True, holds=False, event=found.event)
        located = diagnosis.localization is not None and diagnosis.localization.phase is not None
        holds = (
            diagnosis.error is None
            and diagnosis.reproduced
            and (diagnosis.cause is not None or diagnosis.offending is not None or located)
        )
        if threshold is not None and diagnosis.offending is None and diagnosis.cause is None:
            holds = False
        return SearchResult(rank, peers, True, holds=holds, event=found.event)

    def _merged(
        self, event: NanEvent, findings: Sequence[Finding], outcomes: Sequence[SearchResult], lockstep: Lockstep
    ) -> NanEvent:
        """The recorded event: the gradient names every rank found, the diagnosis's cost and any rank's failure."""
        own = EventSections.of(event)
        details = dict(own.forensics.details)
        grads = sorted({*event.nonfinite_grads, *(n for f in findings for n in f.nonfinite_grads)})
        details["sharding"] = {
            "kind": self.layout.kind,
            "data_parallel": self.layout.data_parallel_size,
            "tensor_parallel": self.layout.tensor_parallel_size,
            "lockstep_passes": lockstep.passes,
            "searched_ranks": [o.rank for o in outcomes if o.searched],
        }
        errors = [f"rank {o.rank}: {o.error}" for o in outcomes if o.error]
        if errors:
            previous = details.get("diagnosis_error")
            details["diagnosis_error"] = "; ".join([*([previous] if previous else []), *errors])
        found = dataclasses.replace(own.found, nonfinite_grads=tuple(grads))
        return with_sections(event, found=found, forensics=dataclasses.replace(own.forensics, details=details))

    # ------------------------------------------------------------------ bundles

    def _save_bundles(
        self,
        front: FrontEnd,
        mine: NanEvent | None,
        chosen_events: Mapping[int, NanEvent],
        found: StepDiagnosis | None,
    ) -> NanEvent | None:
        """The recording ranks' context and bundles (their event, naming the bundle); every rank gathers the state.

        ``found``: this rank's own search (``None`` when it did not search).
        """
        if self.recorder.sinks.nanguard_dir is None or not chosen_events:
            return mine
        settings = self.settings
        state: Mapping[str, Any] | str | None = None
        if settings.save_repro and settings.max_repro_bundles > 0:  # a collective: every rank gathers
            state = gathered_state(front.module, keep=mine is not None)
        if mine is None:
            return None
        diagnosis = found.diagnosis if found is not None else None
        micro = found.micro_batch if found is not None else None
        if micro is None and self.window.micro_batches:
            micro = self.window.micro_batches[-1]
        slicer = settings.slicer_for(front.module)
        recorded = StepDiagnosis(mine, diagnosis, micro, slicer, self.window.reference)
        module_state = state if state is not None else "not gathered"
        files = save_incident_files(self.recorder, front.module, recorded, settings, module_state=module_state)
        return with_sections(mine, files=files)


def inspector_for(
    *arguments: Any, sharding: ShardingLayout | None, agreement: RankAgreement, **keywords: Any
) -> IncidentInspector:
    """The inspector of a bad step: every rank in lockstep under ``ModelParallelStrategy``, else each rank alone.

    ``arguments`` and ``keywords`` are :class:`~lightning_nanguard.engine.incident.inspector.IncidentInspector`'s.
    """
    if sharding is not None and sharding.diagnoses_together:  # every rank takes part
        return ShardedIncidentInspector(*arguments, layout=sharding, agreement=agreement, **keywords)
    return IncidentInspector(*arguments, **keywords)


def inspect_rank(
    inspector: IncidentInspector,
    front: FrontEnd,
    health: StepHealth,
    grads: Sequence[Tensor],
    fail: Callable[[BaseException, str], None],
) -> tuple[RankVote, NanEvent | None]:
    """What this rank found; an error confirming the flags (the core) is ``fail``-ed and a ``failed`` report.

    The step is then not vouched for: every rank drops it and the guard turns off (the controller's decision).
    """
    try:
        return inspector.inspect(front, health, list(grads))
    except (NonFiniteTrainingError, GuardInternalError):
        raise
    except Exception as error:
        fail(error, "the check of a bad step")
        return RankVote(front.global_rank, failed=True), None
