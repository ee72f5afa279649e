"""Diagnose a bad batch: which samples, which module, which op, which line.

:func:`diagnose` combines the pieces: it re-runs the LightningModule's ``training_step`` on
sub-batches (:mod:`~lightning_nanguard.batching`), each run fully isolated
(:mod:`~lightning_nanguard.isolation`), searches the offending samples by adaptive group testing
(:mod:`~lightning_nanguard.bisection`) and localises the origin on the smallest bad group
(:mod:`~lightning_nanguard.localization`). It needs no Trainer, so ``replay`` uses it too.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_nanguard.batching import BatchSlicer, batch_size, slice_batch
from lightning_nanguard.bisection import BisectionResult, find_offending
from lightning_nanguard.detection import bad_batchnorm_names, fused_health_check, nonfinite_names
from lightning_nanguard.events import NanEvent
from lightning_nanguard.isolation import isolated
from lightning_nanguard.localization import Localization, localize
from lightning_nanguard.snapshot import batchnorm_buffers, batchnorm_running_vars

__all__ = ["Diagnosis", "SubBatchRunner", "diagnose", "event_with_diagnosis", "loss_from_output"]

log = logging.getLogger("lightning_nanguard")

StepFn = Callable[[Any, int], Any]


def loss_from_output(output: Any) -> Tensor | None:
    """The loss in what ``training_step`` returned: a tensor, a mapping with ``"loss"``, or ``None``.

    Example:
        >>> loss_from_output({"loss": torch.tensor(1.0), "extra": 2}).item()
        1.0
    """
    if isinstance(output, Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    return None


@dataclass(frozen=True)
class Diagnosis:
    """What :func:`diagnose` found.

    Attributes:
        batch_size: samples in the batch.
        offending: positions of offending samples (``None``: not attributable).
        reason: why not attributable, or notes on partial results.
        passes: forward/backward passes the bisection used.
        localization: origin of the first non-finite value (``None`` if not localised).
        error: the exception text if a re-run failed (diagnosis then stops, training goes on).
        smallest_bad: the smallest group of positions that re-ran non-finite (localised on).
        known_good: positions that re-ran finite; with BatchNorm in train mode a single sample is
            re-run next to the first of them, so a repro bundle saves it as a reference sample.
    """

    batch_size: int | None
    offending: list[int] | None
    reason: str = ""
    passes: int = 0
    localization: Localization | None = None
    error: str | None = None
    smallest_bad: list[int] = field(default_factory=list)
    known_good: list[int] = field(default_factory=list)


class SubBatchRunner:
    """Runs ``training_step`` on sub-batches and tells whether each produces NaN/Inf.

    A sub-batch is bad when its loss, its gradients (``torch.autograd.grad``, ``.grad`` untouched)
    or the BatchNorm statistics its forward produces are non-finite. Every run is isolated.
    BatchNorm in train mode refuses a single sample, so a single sample is run next to a sample
    already known to be good when there is one, and with BatchNorm in eval mode otherwise.

    Args:
        module: the LightningModule (or any module).
        batch: the full batch, as ``training_step`` received it.
        step_fn: ``step_fn(batch, batch_idx) -> output`` (default: ``module.training_step``).
        batch_idx: passed to ``step_fn``.
        slicer: cuts a batch to given positions (default :func:`slice_batch`). When the built-in
            :func:`batch_size` cannot read the batch size (e.g. sequence-first tensors), the slicer
            may provide it as a ``slicer.batch_size(batch)`` attribute, or the module as a
            ``nanguard_batch_size(batch)`` method.
        context: returns a context manager entered around each run (e.g. autocast).
    """

    def __init__(
        self,
        module: nn.Module,
        batch: Any,
        step_fn: StepFn | None = None,
        batch_idx: int = 0,
        slicer: BatchSlicer | None = None,
        context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    ) -> None:
        self.module = module
        self.batch = batch
        self.step_fn: StepFn = step_fn if step_fn is not None else module.training_step  # type: ignore[assignment]
        self.batch_idx = batch_idx
        self.slicer: BatchSlicer = slicer if slicer is not None else slice_batch
        self.context = context if context is not None else contextlib.nullcontext
        self.size = batch_size(batch) if slicer is None else _user_batch_size(batch, slicer, module)
        self.params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.has_train_bn = any(isinstance(m, _BatchNorm) and m.training for m in module.modules())
        self.known_good: list[int] = []
        self.passes = 0

    def padded(self, positions: Sequence[int]) -> tuple[list[int], bool]:
        """Positions to run and whether BatchNorm must run in eval mode."""
        positions = list(positions)
        if len(positions) == 1 and self.has_train_bn:
            if self.known_good:
                return [*positions, self.known_good[0]], False
            return positions, True
        return positions, False

    def sub_batch(self, positions: Sequence[int]) -> Any:
        if len(positions) == self.size and list(positions) == list(range(self.size)):
            return self.batch
        return self.slicer(self.batch, list(positions))

    @contextlib.contextmanager
    def _mode(self, bn_eval: bool) -> Iterator[None]:
        if bn_eval:
            for child in self.module.modules():
                if isinstance(child, _BatchNorm):
                    child.eval()
        with self.context(), torch.enable_grad():
            yield

    def forward(self, positions: Sequence[int]) -> Tensor | None:
        """Loss of the sub-batch (call inside :func:`isolated`); padding and BN mode applied."""
        run, bn_eval = self.padded(positions)
        with self._mode(bn_eval):
            return loss_from_output(self.step_fn(self.sub_batch(run), self.batch_idx))

    def is_bad(self, positions: Sequence[int]) -> bool:
        """One isolated forward/backward pass of ``positions``."""
        self.passes += 1
        with isolated(self.module):
            loss = self.forward(positions)
            if loss is None:
                return False
            grads: Sequence[Tensor | None] = ()
            if loss.requires_grad and self.params:
                grads = torch.autograd.grad(loss.sum(), [p for _, p in self.params], allow_unused=True)
            bad = self._nonfinite(loss, [g for g in grads if g is not None])
        if not bad:
            self.known_good.extend(p for p in positions if p not in self.known_good)
        return bad

    def _nonfinite(self, loss: Tensor, grads: list[Tensor]) -> bool:
        buffers = [(n, t) for n, t in batchnorm_buffers(self.module) if t.is_floating_point()]
        flag = fused_health_check(
            grads, [loss.detach(), *(t for _, t in buffers)], batchnorm_running_vars(buffers)
        ).tolist()[0]
        if not flag:
            return False
        named = [("loss", loss.detach()), *((str(i), g) for i, g in enumerate(grads))]
        return bool(nonfinite_names(named) or bad_batchnorm_names(buffers))


def _user_batch_size(batch: Any, slicer: BatchSlicer, module: nn.Module) -> int:
    """The batch size for a custom slicer: its ``batch_size`` attribute, the module's hook, or the built-in rule."""
    for size_of in (getattr(slicer, "batch_size", None), getattr(module, "nanguard_batch_size", None)):
        if callable(size_of):
            return int(size_of(batch))
    try:
        return batch_size(batch)
    except TypeError as error:
        raise TypeError(
            f"{error}; with a custom batch_slicer, give it a `batch_size(batch)` attribute (or define "
            "`nanguard_batch_size(batch)` on the module) when the batch size cannot be read from the batch"
        ) from error


def diagnose(
    module: nn.Module,
    batch: Any,
    step_fn: StepFn | None = None,
    batch_idx: int = 0,
    slicer: BatchSlicer | None = None,
    context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    bisect: bool = True,
    localize_origin: bool = True,
    max_passes: int = 64,
    known_good: Sequence[int] = (),
) -> Diagnosis:
    """Find the offending samples of ``batch`` and localise the origin, leaving no trace.

    Args:
        module: the model whose ``training_step`` (or ``step_fn``) produced NaN/Inf.
        batch: the batch to examine.
        step_fn: ``step_fn(batch, batch_idx)`` returning the loss or a dict with ``"loss"``.
        batch_idx: passed to ``step_fn``.
        slicer: custom batch slicer ``slicer(batch, positions)``.
        context: context manager factory entered around each run (autocast).
        bisect: search the offending samples (otherwise only localise on the whole batch). Skipped
            when the weights are already non-finite: no sample is then to blame.
        localize_origin: name module, op and source line.
        max_passes: cap on forward/backward passes of the search.
        known_good: positions known to be finite (a repro bundle's reference sample): single
            samples are re-run next to the first one when BatchNorm is in train mode.

    Example:
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = nn.Parameter(torch.ones(3))
        ...     def training_step(self, x, batch_idx):
        ...         return (self.w * x).sum(dim=1).log().sum()
        >>> x = torch.tensor([[1.0, 1, 1], [0, 0, 0], [2, 2, 2], [1, 2, 3]])
        >>> found = diagnose(Net(), x)
        >>> found.offending, found.localization.op
        ([1], 'LogBackward0')
    """
    try:
        runner = SubBatchRunner(module, batch, step_fn, batch_idx, slicer, context)
    except Exception as error:  # an unsliceable batch or a failing user hook: report, never raise
        return Diagnosis(None, None, reason=str(error), error=str(error) or repr(error))
    runner.known_good = [int(p) for p in known_good]
    result = BisectionResult(None, 0, "bisection disabled", list(range(runner.size)))
    bad_weights = nonfinite_names((n, p.detach()) for n, p in module.named_parameters())
    if bad_weights:  # every sample fails on such weights: the samples are not the cause
        shown = ", ".join(bad_weights[:3]) + (f" (+{len(bad_weights) - 3} more)" if len(bad_weights) > 3 else "")
        reason = f"the weights are already non-finite ({shown}): every sample fails, whatever the data"
        result = BisectionResult(None, 0, reason, list(range(runner.size)))
    try:
        if bisect and not bad_weights:
            result = find_offending(runner.size, runner.is_bad, max_passes=max_passes)
    except Exception as error:  # the guard must never kill training
        log.warning("NanGuard: re-running training_step for diagnosis failed: %r", error, exc_info=True)
        return Diagnosis(
            runner.size,
            None,
            reason=f"re-running training_step failed: {error!r}",
            passes=runner.passes,
            error=repr(error),
        )
    localization = None
    localization_error = None
    group = result.smallest_bad or (result.offending[:1] if result.offending else [])
    if localize_origin and group:
        try:
            localization = _localize_group(runner, group)
        except Exception as error:  # keep the samples found: only the origin is unknown
            log.warning("NanGuard: localising the origin failed: %r", error, exc_info=True)
            localization_error = f"localisation failed: {error!r}"
    return Diagnosis(
        batch_size=runner.size,
        offending=result.offending,
        reason=result.reason,
        passes=result.passes,
        localization=localization,
        error=localization_error,
        smallest_bad=result.smallest_bad,
        known_good=list(runner.known_good),
    )


def _localize_group(runner: SubBatchRunner, group: list[int]) -> Localization:
    run, bn_eval = runner.padded(group)
    with isolated(runner.module), runner._mode(bn_eval):
        sub = runner.sub_batch(run)
        return localize(
            runner.module,
            lambda: loss_from_output(runner.step_fn(sub, runner.batch_idx)),
            batch=sub,
            params=runner.params,
        )


def event_with_diagnosis(
    event: NanEvent,
    diagnosis: Diagnosis,
    positions: Sequence[int] | None = None,
    dataset_indices: Sequence[int] | None = None,
    batch_size: int | None = None,
) -> NanEvent:
    """Fill the forensic fields of ``event`` from ``diagnosis``.

    Args:
        event: the event of the bad step.
        diagnosis: what :func:`diagnose` found.
        positions: maps the diagnosed batch's positions to positions of the original batch
            (replay diagnoses a saved sub-batch); identity when ``None``.
        dataset_indices: dataset index of every sample of the diagnosed batch, when known.
        batch_size: size of the original batch (default: the diagnosed batch's size).
    """
    details = dict(event.details)
    details["batch_size"] = batch_size if batch_size is not None else diagnosis.batch_size
    details["bisect_passes"] = diagnosis.passes
    offending: tuple[int, ...] | None = None
    indices: tuple[int, ...] | None = None
    if diagnosis.offending is not None:
        offending = tuple(positions[p] if positions is not None else p for p in diagnosis.offending)
        if dataset_indices is not None and all(p < len(dataset_indices) for p in diagnosis.offending):
            indices = tuple(int(dataset_indices[p]) for p in diagnosis.offending)
    elif diagnosis.reason:
        details["not_attributable"] = diagnosis.reason
    if diagnosis.offending is not None and diagnosis.reason:
        details["bisect_note"] = diagnosis.reason  # partial result or interacting groups next to the samples
    if diagnosis.error:
        details["diagnosis_error"] = diagnosis.error
    loc = diagnosis.localization
    changes: dict[str, Any] = {"offending_samples": offending, "dataset_indices": indices}
    if loc is not None and loc.phase is not None:
        changes.update(culprit_module=loc.module, culprit_op=loc.op, source_line=loc.source_line, phase=loc.phase)
        for key, value in (("module_type", loc.module_type), ("source_text", loc.source_text), ("hint", loc.hint)):
            if value:
                details[key] = value
        if loc.input_nonfinite:
            details["input_nonfinite"] = True
        if loc.bn_channels:
            details["bn_channels"] = {name: list(channels) for name, channels in loc.bn_channels.items()}
    changes["details"] = details
    return event.replace(**changes)
