"""Diagnose a bad batch: what caused it (the data, the batch itself, the model state), which samples, where.

:func:`diagnose` combines the pieces. It re-runs the LightningModule's ``training_step`` on
sub-batches (:mod:`~lightning_nanguard.diagnose.runner`), each run fully isolated
(:mod:`~lightning_nanguard.diagnose.isolation`), and decides the cause in this order:

1. the weights are already non-finite: ``"state"`` (0 passes);
2. the batch itself holds NaN/Inf: ``"input"`` (:func:`~lightning_nanguard.diagnose.cause.check_input`);
3. a reference sub-batch of a recent healthy step fails too, or every sample tried fails on its
   own: ``"state"`` (:func:`~lightning_nanguard.diagnose.cause.check_state`, at most 4 passes);
4. otherwise the offending samples are searched by adaptive group testing
   (:mod:`~lightning_nanguard.diagnose.bisection`), and each sample found is checked to fail beside
   known-healthy samples too (:mod:`~lightning_nanguard.diagnose.blame`, typically 0 or 1 pass):
   ``"data"`` when samples reproduce it there, ``"batch"`` when they fail only without healthy
   company (the batch as a whole: a mean over zero targets, a statistic of a degenerate batch),
   ``"interaction"`` when samples only fail together.

The origin is then localised on the *full* batch, following the offending samples' rows
(:mod:`~lightning_nanguard.diagnose.localization`), so the op named is one that happens in the real batch.
It needs no Trainer, so ``replay`` uses it too.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from lightning_nanguard.core.defaults import default_of
from lightning_nanguard.core.events import EventCause
from lightning_nanguard.detect.confirm import nonfinite_names
from lightning_nanguard.diagnose.batching import BatchField, BatchSlicer
from lightning_nanguard.diagnose.bisection import NOT_REPRODUCED, BisectionResult, find_offending
from lightning_nanguard.diagnose.blame import BlameCheck, check_blame
from lightning_nanguard.diagnose.cause import InputCheck, StateCheck, check_input, check_state, describe_fields
from lightning_nanguard.diagnose.combined import CombinedLayout, LoaderSplit
from lightning_nanguard.diagnose.hints import hint_for
from lightning_nanguard.diagnose.isolation import eagerly
from lightning_nanguard.diagnose.localization import Localization
from lightning_nanguard.diagnose.origin import localized, spike_localizes
from lightning_nanguard.diagnose.runner import StepFn, SubBatchRunner, finite_threshold, loss_from_output

__all__ = ["Diagnosis", "SubBatchRunner", "diagnose", "loss_from_output"]

log = logging.getLogger("lightning_nanguard")


@dataclass(frozen=True)
class Diagnosis:
    """What :func:`diagnose` found.

    Attributes:
        batch_size: samples in the batch.
        offending: positions of offending samples (``None``: not attributable).
        reason: why not attributable, or notes on partial results.
        passes: forward/backward passes used in all (the state check's included, the localisation
            pass not).
        localization: origin of the first non-finite value (``None`` if not localised).
        error: the exception text if a re-run failed (diagnosis then stops, training goes on).
        smallest_bad: the smallest group of positions that re-ran bad.
        known_good: positions that re-ran finite; with BatchNorm in train mode a single sample is
            re-run next to the first of them, so a repro bundle saves it as a reference sample.
        cause: ``"data"``, ``"input"``, ``"state"``, ``"interaction"``, or ``None`` (not investigated:
            bisection off, or nothing reproduced).
        state_passes: passes spent deciding whether the model state is at fault (at most 4).
        input_fields: batch fields holding NaN/Inf (cause ``"input"``, or noted next to another cause).
        source_root: the directory source paths are shown relative to (``None``: the working directory).
        loss_threshold: the loss above which a (sub-)batch counted as bad (loss-spike mode).
        reproduced: ``False`` when the whole batch re-ran finite on the same weights. The re-run
            does not scale the loss: under a GradScaler that says the NaN/Inf came from the scaling.
        loaders: with several training loaders, the loaders holding samples and their sizes:
            positions (``offending``, ``smallest_bad``, ``known_good``) are flat over their parts
            (:mod:`~lightning_nanguard.diagnose.combined`); ``None`` for one loader.
        blame_verified: whether each offending sample fails beside known-healthy samples too
            (:mod:`~lightning_nanguard.diagnose.blame`; a sample holding NaN/Inf itself counts);
            ``None`` when no sample is named.
        blame_note: what the blame check found besides (samples that failed only alone, the
            reason a sample could not be checked).
        verify_passes: passes the blame check added (not counted in ``passes``).
    """

    batch_size: int | None
    offending: list[int] | None
    reason: str = ""
    passes: int = 0
    localization: Localization | None = None
    error: str | None = None
    smallest_bad: list[int] = field(default_factory=list)
    known_good: list[int] = field(default_factory=list)
    cause: EventCause | None = None
    state_passes: int = 0
    input_fields: tuple[BatchField, ...] = ()
    source_root: str | None = None
    loss_threshold: float | None = None
    reproduced: bool = True
    loaders: LoaderSplit | None = None
    blame_verified: bool | None = None
    blame_note: str = ""
    verify_passes: int = 0

    @property
    def full_details(self) -> dict[str, Any]:
        """Details too long for an event (every non-finite BatchNorm channel), for the repro bundle.

        Example:
            >>> Diagnosis(8, [1], localization=Localization(bn_channels={"bn": [0, 1]})).full_details
            {'bn_channels': {'bn': [0, 1]}}
        """
        full: dict[str, Any] = {}
        if self.localization is not None and self.localization.bn_channels:
            full["bn_channels"] = {name: list(c) for name, c in self.localization.bn_channels.items()}
        return full


RunnerFactory = Callable[..., SubBatchRunner]
"""``factory(module, batch, step_fn, batch_idx, slicer, context, loss_threshold) -> SubBatchRunner``."""


@eagerly
def diagnose(
    module: nn.Module,
    batch: Any,
    step_fn: StepFn | None = None,
    batch_idx: int = 0,
    slicer: BatchSlicer | None = None,
    context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    bisect: bool = True,
    localize_origin: bool = True,
    max_passes: int = default_of(find_offending, "max_passes"),
    known_good: Sequence[int] = (),
    reference_batch: Any | None = None,
    loss_threshold: float | None = None,
    source_root: str | None = None,
    state_check: bool = True,
    runner_factory: RunnerFactory | None = None,
    nonfinite_weights: Sequence[str] | None = None,
    layout: CombinedLayout | None = None,
) -> Diagnosis:
    """Decide the cause of a bad ``batch``, find its offending samples and localise the origin, leaving no trace.

    Args:
        module: the model whose ``training_step`` (or ``step_fn``) produced NaN/Inf.
        batch: the batch to examine.
        step_fn: ``step_fn(batch, batch_idx)`` returning the loss or a dict with ``"loss"``.
        batch_idx: passed to ``step_fn``.
        slicer: custom batch slicer ``slicer(batch, positions)``.
        context: context manager factory entered around each run (autocast).
        bisect: decide the cause and search the offending samples (otherwise only localise on the
            whole batch; the cause is then ``None``).
        localize_origin: name module, op and source line.
        max_passes: cap on forward/backward passes (state check and search together).
        known_good: positions known to be finite (a repro bundle's reference sample): single
            samples are re-run next to the first one when BatchNorm is in train mode.
        reference_batch: a small sub-batch (>= 2 samples) of a recent healthy step, cut with the
            same slicer: if it is bad with the current weights, the cause is ``"state"`` (1 pass).
        loss_threshold: loss-spike mode: a (sub-)batch is also bad when its loss exceeds this value;
            the origin is localised only if some run turned non-finite.
        source_root: show source paths relative to this directory when under it (the working
            directory at ``fit`` start); default: the current working directory.
        state_check: decide whether the model state is at fault (off for a batch already known to
            be a subset of the samples at fault, e.g. a repro bundle's).
        runner_factory: builds the :class:`SubBatchRunner` of the batch and of the reference batch
            (same arguments); a sharded model's runs every pass with the other ranks
            (:class:`~lightning_nanguard.diagnose.lockstep.LockstepRunner`).
        nonfinite_weights: the names of the non-finite weights, when the caller knows them (a
            sharded model: any rank's shards); default: read off ``module``.
        layout: where each training loader's part sits in a batch of several loaders: each part is
            cut on its own and positions are flat over the parts (``Diagnosis.loaders`` maps them
            back to loaders); ``None`` for one loader.

    Compiled code (``torch.compile``) runs eagerly throughout (see :func:`eager`).

    Example:
        >>> import torch
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = nn.Parameter(torch.ones(3))
        ...     def training_step(self, x, batch_idx):
        ...         return (self.w * x).sum(dim=1).log().sum()
        >>> x = torch.tensor([[1.0, 1, 1], [0, 0, 0], [2, 2, 2], [1, 2, 3]])
        >>> found = diagnose(Net(), x)
        >>> found.cause, found.offending, found.localization.op, found.localization.function
        ('data', [1], 'LogBackward0', 'torch.log')
    """
    threshold = finite_threshold(loss_threshold)
    if loss_threshold is not None and threshold is None:
        log.warning("NanGuard: loss_threshold=%r is not a finite number; diagnosing NaN/Inf only", loss_threshold)
    common: dict[str, Any] = {"source_root": source_root, "loss_threshold": threshold}
    factory: RunnerFactory = runner_factory if runner_factory is not None else SubBatchRunner
    try:
        runner = factory(module, batch, step_fn, batch_idx, slicer, context, threshold, layout)
    except Exception as error:  # an unsliceable batch or a failing user hook: report, never raise
        return Diagnosis(None, None, reason=str(error), error=str(error) or repr(error), **common)
    common["loaders"] = runner.loaders
    runner.known_good = [int(p) for p in known_good]
    whole = list(range(runner.size))
    if runner.size == 0:
        return Diagnosis(0, None, reason="the batch is empty", **common)
    if nonfinite_weights is not None:
        bad_weights = list(nonfinite_weights)
    else:
        bad_weights = nonfinite_names((n, p.detach()) for n, p in module.named_parameters())
    if bad_weights or not bisect:
        if bad_weights:  # every sample fails on such weights: the samples are not the cause
            shown = ", ".join(bad_weights[:3]) + (f" (+{len(bad_weights) - 3} more)" if len(bad_weights) > 3 else "")
            reason = f"the weights are already non-finite ({shown}): every sample fails, whatever the data"
        else:
            reason = "bisection disabled"
        localization, failure = localized(runner, None, localize_origin, source_root, scan_input=True)
        cause: EventCause | None = "state" if bad_weights and bisect else None
        return Diagnosis(runner.size, None, reason, 0, localization, failure, whole, cause=cause, **common)
    reference: SubBatchRunner | None = None
    try:
        inputs = check_input(runner, reference_batch, max_passes)
        if inputs.fields and inputs.confirmed:
            return _input_diagnosis(runner, inputs, common)
        reference = _reference_runner(runner, reference_batch, factory)
        what = "non-finite" if threshold is None else f"non-finite or above the loss threshold {threshold:.6g}"
        state = check_state(runner, reference, max_passes - runner.passes, what) if state_check else StateCheck(False)
        if state.state or state.reproduced is False:
            return _state_diagnosis(runner, reference, state, inputs, localize_origin, common)
        if not runner.find_fillers(max_passes - runner.passes - (reference.passes if reference is not None else 0)):
            return _without_fillers(runner, reference, state, inputs, common)
        spent = runner.passes + (reference.passes if reference is not None else 0)
        result = find_offending(runner.size, runner.is_bad, max_passes=max_passes, known=state.known, spent=spent)
    except Exception as error:  # the guard must never kill training
        log.warning("NanGuard: re-running training_step for diagnosis failed: %r", error, exc_info=True)
        return Diagnosis(
            runner.size,
            None,
            reason=f"re-running training_step failed: {error!r}",
            passes=runner.passes + (reference.passes if reference is not None else 0),
            error=repr(error),
            **common,
        )
    spent = runner.passes + (reference.passes if reference is not None else 0)
    blame = BlameCheck()
    if result.offending:
        try:
            blame = check_blame(runner, result.offending, reference, factory, max_passes - spent)
        except Exception as error:  # the guard must never kill training: the blame stays unchecked
            log.warning("NanGuard: checking the blame of the offending samples failed: %r", error, exc_info=True)
            blame = BlameCheck(unverified=tuple(result.offending), reason=f"the check failed: {error!r}")
    return _search_diagnosis(runner, spent, state, inputs, result, blame, localize_origin, common)


def _reference_runner(runner: SubBatchRunner, reference_batch: Any, factory: RunnerFactory) -> SubBatchRunner | None:
    if reference_batch is None:
        return None
    try:
        reference = factory(
            runner.module,
            reference_batch,
            runner.step_fn,
            runner.batch_idx,
            runner.slicer if runner.custom_slicer else None,
            runner.context,
            runner.loss_threshold,
            runner.layout,
        )
    except Exception as error:  # an unreadable reference: decide without it
        log.warning("NanGuard: the reference sub-batch cannot be used, deciding without it: %r", error)
        return None
    return reference if reference.size > 0 else None


def _input_diagnosis(runner: SubBatchRunner, inputs: InputCheck, common: dict[str, Any]) -> Diagnosis:
    """The batch holds NaN/Inf: its samples are named, the origin is the input before any op."""
    offending = list(inputs.samples) if inputs.samples and not inputs.shared_fields else None
    reason = ""
    if offending is None:
        reason = (
            f"the batch field(s) {describe_fields(inputs.shared_fields)} hold NaN/Inf outside the sample "
            "dimension: no sample is to blame"
        )
    localization = Localization(
        phase="forward",
        op="<input>",
        hint=hint_for("<input>", "forward"),
        input_nonfinite=True,
        input_fields=inputs.fields,
        loss_finite=False,
    )
    return Diagnosis(
        runner.size,
        offending,
        reason,
        runner.passes,
        localization,
        smallest_bad=list(inputs.samples),
        known_good=list(runner.known_good),
        cause="input",
        input_fields=inputs.fields,
        blame_verified=True if offending else None,  # the rows hold the NaN/Inf themselves
        **common,
    )


def _without_fillers(
    runner: SubBatchRunner,
    reference: SubBatchRunner | None,
    state: StateCheck,
    inputs: InputCheck,
    common: dict[str, Any],
) -> Diagnosis:
    """Several loaders, and no group of one sample per loader re-ran finite: no sub-batch can be run cleanly."""
    keys = list(runner.combined.keys) if runner.combined is not None else []
    reason = (
        f"no group of one sample of each training loader ({keys}) re-ran finite, so no loader's part can be "
        "searched next to healthy samples of the others"
    )
    passes = runner.passes + (reference.passes if reference is not None else 0)
    return Diagnosis(
        runner.size,
        None,
        reason,
        passes,
        known_good=list(runner.known_good),
        state_passes=state.passes,
        input_fields=inputs.fields,
        **common,
    )


def _state_diagnosis(
    runner: SubBatchRunner,
    reference: SubBatchRunner | None,
    state: StateCheck,
    inputs: InputCheck,
    localize_origin: bool,
    common: dict[str, Any],
) -> Diagnosis:
    """The model state is at fault (no sample named), or nothing reproduced (no cause)."""
    passes = runner.passes + (reference.passes if reference is not None else 0)
    if not state.state:
        return Diagnosis(
            runner.size,
            None,
            NOT_REPRODUCED,
            passes,
            state_passes=state.passes,
            input_fields=inputs.fields,
            reproduced=False,
            **common,
        )
    nonfinite = runner.saw_nonfinite or (reference is not None and reference.saw_nonfinite)
    localization, error = localized(
        runner, None, localize_origin and spike_localizes(runner, nonfinite), common["source_root"]
    )
    if localization is not None and localization.phase is not None and not localization.from_infinity:
        # every sample fails: an op's own hint ("pow at 0", "check the input data") would mislead;
        # a NaN made of deliberate infinities (a mask met a zero) keeps its own: finite weights cannot make it
        localization = replace(localization, hint=hint_for("<state>", localization.phase))
    return Diagnosis(
        runner.size,
        None,
        state.reason,
        passes,
        localization,
        error,
        list(range(runner.size)),
        list(runner.known_good),
        cause="state",
        state_passes=state.passes,
        input_fields=inputs.fields,
        **common,
    )


def _search_diagnosis(
    runner: SubBatchRunner,
    passes: int,
    state: StateCheck,
    inputs: InputCheck,
    result: BisectionResult,
    blame: BlameCheck,
    localize_origin: bool,
    common: dict[str, Any],
) -> Diagnosis:
    """The samples were searched and their blame checked.

    ``"data"`` when samples fail beside healthy ones, ``"batch"`` when they fail only without healthy
    company, ``"interaction"`` when only groups fail; no cause when no named sample could be checked
    (they stay named, with ``blame_verified=False``: a record or the batch as a whole may be at fault).
    """
    cause: EventCause | None = None
    offending: list[int] | None = None
    reasons = [result.reason] if result.reason else []
    notes: list[str] = []
    blame_verified: bool | None = None
    if blame.batch_fault:
        cause = "batch"
        reasons = [blame.batch_reason]
    elif blame.verified:
        cause, offending = "data", sorted([*blame.verified, *blame.unverified])
        blame_verified = not blame.unverified
        if blame.unverified:
            unchecked = list(blame.unverified)
            notes.append(f"samples {unchecked} could not be checked beside healthy samples: {blame.reason}")
        if blame.failed_alone:
            notes.append(
                f"samples {list(blame.failed_alone)} failed only without healthy company (not named): "
                "the batch's composition, not these records"
            )
    elif blame.unverified:  # named, but not checked: a record or the batch as a whole may be at fault
        offending, blame_verified = sorted(blame.unverified), False
        notes.append(f"not checked beside healthy samples: {blame.reason}")
    elif result.interacting:
        cause = "interaction"
    rows = offending if cause == "data" and not runner.custom_slicer else None
    localization = error = None
    if result.offending or result.smallest_bad:
        localize_here = localize_origin and spike_localizes(runner, runner.saw_nonfinite)
        localization, error = localized(runner, rows, localize_here, common["source_root"])
    if cause == "batch" and localization is not None and localization.phase is not None:
        localization = replace(localization, hint=hint_for("<batch>", localization.phase))
    if inputs.fields:
        reasons.append(f"the batch also holds NaN/Inf in {describe_fields(inputs.fields)}, but other samples fail too")
    return Diagnosis(
        runner.size,
        offending,
        "; ".join(reasons),
        passes,
        localization,
        error,
        result.smallest_bad,
        list(runner.known_good),
        cause=cause,
        state_passes=state.passes,
        input_fields=inputs.fields,
        reproduced=result.reproduced,
        blame_verified=blame_verified,
        blame_note="; ".join(notes),
        verify_passes=blame.passes,
        **common,
    )
