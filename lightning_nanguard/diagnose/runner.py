"""Re-run ``training_step`` on a sub-batch, isolated, and tell whether it is bad.

:class:`SubBatchRunner` is the predicate the diagnosis is built on: one call of
:meth:`SubBatchRunner.is_bad` is one forward/backward pass, and it leaves no trace on training
(:func:`~lightning_nanguard.diagnose.isolation.isolated`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_nanguard.core.dtensor import local_tensor, local_tensors
from lightning_nanguard.detect.batchnorm import batchnorm_buffers, batchnorm_running_vars
from lightning_nanguard.detect.check import fused_health_check
from lightning_nanguard.detect.confirm import bad_batchnorm_names, nonfinite_names
from lightning_nanguard.diagnose.batching import BatchField, BatchSlicer, batch_size, nonfinite_fields, slice_batch
from lightning_nanguard.diagnose.combined import CombinedBatch, CombinedLayout, LoaderSplit
from lightning_nanguard.diagnose.finiteness import Rows
from lightning_nanguard.diagnose.isolation import gradients as gradients_of
from lightning_nanguard.diagnose.isolation import isolated
from lightning_nanguard.diagnose.tracing import graph_leaves

__all__ = ["StepFn", "SubBatchRunner", "graph_leaves", "loss_from_output"]

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


class SubBatchRunner:
    """Runs ``training_step`` on sub-batches and tells whether each is bad.

    A sub-batch is bad when its loss, its gradients (``torch.autograd.grad``, ``.grad`` untouched)
    or the BatchNorm statistics its forward produces are non-finite, or, with ``loss_threshold``,
    when its loss exceeds that threshold (a loss spike). Every run is isolated. BatchNorm in train
    mode refuses a single sample, so a single sample is run next to a sample already known to be
    good when there is one, and with BatchNorm in eval mode otherwise.

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
        loss_threshold: also call a sub-batch bad when its (finite) loss exceeds this value.
        layout: where each training loader's part sits in a combined batch (``None``: one loader).
        grads_from_graph: differentiate with respect to the leaves of the loss's graph
            (:func:`graph_leaves`) instead of ``module``'s parameters: the parameters a sharded
            forward really used (FSDP2).

    Example:
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = nn.Parameter(torch.ones(1))
        ...     def training_step(self, x, batch_idx):
        ...         return (self.w * x).log().mean()
        >>> runner = SubBatchRunner(Net(), torch.tensor([1.0, 0.0, 2.0]))
        >>> runner.is_bad([0, 2]), runner.is_bad([1]), runner.passes, runner.known_good
        (False, True, 2, [0, 2])
    """

    def __init__(
        self,
        module: nn.Module,
        batch: Any,
        step_fn: StepFn | None = None,
        batch_idx: int = 0,
        slicer: BatchSlicer | None = None,
        context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        loss_threshold: float | None = None,
        layout: CombinedLayout | None = None,
        grads_from_graph: bool = False,
    ) -> None:
        self.module = module
        self.grads_from_graph = grads_from_graph
        self.batch = batch
        self.step_fn: StepFn = step_fn if step_fn is not None else module.training_step  # type: ignore[assignment]
        self.batch_idx = batch_idx
        self.custom_slicer = slicer is not None
        self.slicer: BatchSlicer = slicer if slicer is not None else slice_batch
        self.context = context if context is not None else contextlib.nullcontext
        self.layout = layout
        self.combined: CombinedBatch | None = None
        if layout is not None:
            user = slicer
            size_of = (lambda part: _user_batch_size(part, user, module)) if user is not None else None
            self.combined = CombinedBatch(batch, layout, slicer, size_of)
            self.size = self.combined.total
        else:
            self.size = batch_size(batch) if slicer is None else _user_batch_size(batch, slicer, module)
        self.params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.has_train_bn = any(isinstance(m, _BatchNorm) and m.training for m in module.modules())
        self.loss_threshold = loss_threshold
        self.known_good: list[int] = []
        self.groups: list[tuple[tuple[int, ...], bool]] = []  # every group run, as run (padded), and whether bad
        self.passes = 0
        self.saw_nonfinite = False  # some run was non-finite (not only above the loss threshold)

    @property
    def loaders(self) -> LoaderSplit | None:
        """The loaders holding samples and their sizes (``None``: one loader)."""
        return self.combined.split if self.combined is not None else None

    def padded(self, positions: Sequence[int]) -> tuple[list[int], bool]:
        """Positions to run and whether BatchNorm must run in eval mode."""
        positions = list(positions)
        if self.combined is not None:
            return self._padded_parts(positions)
        if len(positions) == 1 and self.has_train_bn:
            if self.known_good:
                return [*positions, self.known_good[0]], False
            return positions, True
        return positions, False

    def _padded_parts(self, positions: list[int]) -> tuple[list[int], bool]:
        """Every loader's part gets samples: fillers where it has none, two under BatchNorm in train mode."""
        assert self.combined is not None
        run, bn_eval = list(positions), False
        need = 2 if self.has_train_bn else 1
        for part, mine in enumerate(self.combined.group(positions)):
            if len(mine) >= need:
                continue
            taken = [self.combined.flat(part, p) for p in mine]
            fillers = self.fillers(part, need - len(mine), exclude=taken)
            if not mine and not fillers:
                fillers = [self.combined.flat(part, 0)]  # no sample of this loader known to be good yet
            run.extend(fillers)
            bn_eval = bn_eval or len(mine) + len(fillers) < need
        return run, bn_eval

    def fillers(self, part: int, count: int = 1, exclude: Sequence[int] = ()) -> list[int]:
        """Up to ``count`` samples of loader ``part`` known to be good (flat positions), not in ``exclude``."""
        assert self.combined is not None
        good = [g for g in self.known_good if self.combined.part_of(g) == part and g not in exclude]
        return good[:count]

    def fillers_known(self) -> bool:
        """Whether every loader's part has a sample known to be good (always true for one loader)."""
        return self.combined is None or all(self.fillers(part) for part in range(len(self.combined.sizes)))

    def find_fillers(self, max_passes: int) -> bool:
        """Run groups of one sample per loader until one is good: its samples are fillers. ``False``: none found.

        At most ``max_passes`` passes (and 3): a group is bad when it holds a bad sample, so with few
        bad samples the first group is good.
        """
        if self.combined is None or self.fillers_known():
            return True
        start = self.passes
        for group in self.combined.rows(3, spread=False):
            if self.passes - start >= max_passes or self.fillers_known():
                break
            self.is_bad(group)
        return self.fillers_known()

    def nonfinite_fields(self, batch: Any = None) -> dict[BatchField, list[int] | None]:
        """Fields of the batch (or of ``batch``: a reference) holding NaN/Inf, with the samples holding it."""
        slicer = self.slicer if self.custom_slicer else None
        if self.layout is not None:
            combined = self.combined if batch is None else CombinedBatch(batch, self.layout, slicer)
            assert combined is not None
            return combined.nonfinite_fields(slicer)
        if batch is not None:
            return nonfinite_fields(batch, None, slicer)
        return nonfinite_fields(self.batch, self.size, slicer)

    def rows(self, positions: Sequence[int] | None) -> Rows | list[int] | None:
        """What a localisation follows for the samples ``positions`` (``None``: the whole batch)."""
        if positions is None or self.combined is None:
            return list(positions) if positions is not None else None
        return Rows.per_size(self.combined.rows_by_size(positions))

    def sub_batch(self, positions: Sequence[int]) -> Any:
        """The batch cut to ``positions`` (the batch itself for every position in order)."""
        if len(positions) == self.size and list(positions) == list(range(self.size)):
            return self.batch
        if self.combined is not None:
            return self.combined.cut(positions)
        return self.slicer(self.batch, list(positions))

    @contextlib.contextmanager
    def mode(self, bn_eval: bool) -> Iterator[None]:
        """BatchNorm in eval mode when asked, the user's context (autocast) and grad mode on."""
        if bn_eval:
            for child in self.module.modules():
                if isinstance(child, _BatchNorm):
                    child.eval()
        with self.context(), torch.enable_grad():
            yield

    def prepare(self, positions: Sequence[int]) -> tuple[Any, bool]:
        """The sub-batch to run for ``positions`` (padded) and whether BatchNorm runs in eval mode; no pass."""
        run, bn_eval = self.padded(positions)
        return self.sub_batch(run), bn_eval

    def forward(self, positions: Sequence[int]) -> Tensor | None:
        """Loss of the sub-batch (call inside :func:`isolated`); padding and BN mode applied."""
        return self.loss_of(*self.prepare(positions))

    def loss_of(self, batch: Any, bn_eval: bool) -> Tensor | None:
        """Loss of a prepared sub-batch (call inside :func:`isolated`)."""
        with self.mode(bn_eval):
            return loss_from_output(self.step_fn(batch, self.batch_idx))

    def gradients(self, loss: Tensor) -> list[Tensor]:
        """The gradients of ``loss`` (``.grad`` untouched): of the parameters, or of the graph's leaves."""
        if not loss.requires_grad:
            return []
        targets = graph_leaves(loss) if self.grads_from_graph else [p for _, p in self.params]
        if not targets:
            return []
        with torch.enable_grad():  # the caller may run under no_grad: the forward had grad on
            grads = gradients_of(loss.sum(), targets)  # also under reentrant checkpointing
        return [g for g in grads if g is not None]

    def run(self, batch: Any, bn_eval: bool) -> tuple[bool, bool] | None:
        """One isolated forward/backward pass of a prepared sub-batch: ``(bad, non-finite)``; ``None``: no loss."""
        with isolated(self.module):
            loss = self.loss_of(batch, bn_eval)
            if loss is None:
                return None
            nonfinite = self._nonfinite(loss, self.gradients(loss))
        bad = nonfinite
        if not bad and self.loss_threshold is not None:
            bad = float(loss.detach().float().sum()) > self.loss_threshold
        return bad, nonfinite

    def is_bad(self, positions: Sequence[int]) -> bool:
        """One isolated forward/backward pass of ``positions``."""
        self.passes += 1
        return self.note(positions, self.run(*self.prepare(positions)))

    def note(self, positions: Sequence[int], result: tuple[bool, bool] | None) -> bool:
        """Record the pass result ``(bad, non-finite)`` of ``positions`` (``None``: no loss); return ``bad``."""
        if result is None:
            return False
        bad, nonfinite = result
        self.groups.append((tuple(self.padded(positions)[0]), bad))  # the padding of this very pass
        self.saw_nonfinite = self.saw_nonfinite or nonfinite
        if not bad:
            self.known_good.extend(p for p in positions if p not in self.known_good)
        return bad

    def instrumented(self, localize: Callable[[], Any]) -> Any:
        """Run a localisation pass (one instrumented forward/backward); a lockstep runner runs it with every rank."""
        return localize()

    def found(self, localization: Any) -> bool:
        """Whether a localisation pass found an origin (a lockstep runner: on any rank sharing the batch)."""
        return getattr(localization, "phase", None) is not None

    def _nonfinite(self, loss: Tensor, grads: list[Tensor]) -> bool:
        buffers = [(n, local_tensor(t)) for n, t in batchnorm_buffers(self.module) if t.is_floating_point()]
        others = [local_tensor(loss.detach()), *(t for _, t in buffers)]
        flag = fused_health_check(local_tensors(grads), others, batchnorm_running_vars(buffers)).tolist()[0]
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


def finite_threshold(value: float | None) -> float | None:
    """``value`` if it is a usable loss threshold (a finite number), else ``None``.

    Example:
        >>> finite_threshold(2.5), finite_threshold(float("nan")), finite_threshold(None)
        (2.5, None, None)
    """
    if value is None or not math.isfinite(float(value)):
        return None
    return float(value)
