"""The optimizer step being accumulated: its micro-batches, losses and BatchNorm state.

A step's window opens at the first micro-batch of an optimizer step (``on_train_batch_start``)
and closes at the check (``on_before_optimizer_step``). It owns everything the guard needs to
keep, or to undo, about that step, and is the only place that touches the BatchNorm snapshot:

- the micro-batches (for the diagnosis) and their dataset indices (per loader with several);
- the losses (for the check and the loss-spike statistic);
- the BatchNorm buffers as they were before the first forward: captured when the window opens,
  restored when the step is discarded or diagnosed;
- what the step's training step adds to what users monitor: the states of the module's
  torchmetrics metrics (:class:`~lightning_nanguard.recover.metrics.MetricStates`) and, through the
  front-end, what the loop logged (the Trainer's ``self.log`` epoch aggregates), captured when the
  window opens and put back when the step is dropped;
- a small known-good reference sub-batch, refreshed rarely from a healthy step (a diagnosis runs
  it to tell "the model state is at fault" from "these samples are").

Example:
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    >>> window = StepWindow()
    >>> window.attach(net, track_batchnorm=True)
    >>> window.begin(checking=True)
    >>> _ = net(torch.tensor([[float("nan"), 1.0], [2.0, 3.0]]))
    >>> window.restore_batchnorm()
    >>> net[1].running_mean.tolist()
    [0.0, 0.0]
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_nanguard.detect.one_read import BatchNormTotals
from lightning_nanguard.diagnose.batching import slice_batch
from lightning_nanguard.diagnose.combined import CombinedBatch, CombinedIndices
from lightning_nanguard.engine.data.readers import RecordReader
from lightning_nanguard.engine.parts import GuardParts
from lightning_nanguard.recover.batchnorm import BatchNormSnapshot
from lightning_nanguard.recover.metrics import MetricStates

if TYPE_CHECKING:
    from lightning_nanguard.engine.frontend import FrontEnd

__all__ = ["MicroBatch", "StepWindow"]

Slicer = Callable[[Any, Sequence[int]], Any]
REFERENCE_SIZE = 2  # BatchNorm in train mode refuses a single sample


@dataclass
class MicroBatch:
    """A (micro-)batch of the current optimizer step, kept until the step is checked.

    ``loaders``: with several training loaders, where each loader's part sits and its dataset indices
    (``dataset_indices`` is then ``None``); ``loaders_note``: why the loader of a sample is unknown.
    ``readers``: each training loader's record reader (layout order), to check the indices at an
    incident; ``row_indices``: the dataset index of each row that check named (by position, flat over
    the loaders' parts; ``None`` entries: unknown), set when the event is filled, read by the bundle.
    """

    batch: Any
    batch_idx: int
    dataset_indices: list[int] | None
    loaders: CombinedIndices | None = None
    loaders_note: str | None = None
    readers: tuple[RecordReader, ...] = ()
    row_indices: dict[int, int | None] | None = None


class StepWindow:
    """Micro-batches, losses and BatchNorm state of the optimizer step in progress (see module docs)."""

    def __init__(self, parts: GuardParts | None = None) -> None:
        self.parts = parts if parts is not None else GuardParts()  # what the monitors see is an optional part
        self.open = False
        self.checking = False
        self.batch_idx = 0
        self.losses: list[Tensor] = []
        self.micro_batches: list[MicroBatch] = []
        self.reference: Any = None
        self.reference_step: int | None = None
        self._bn: BatchNormSnapshot | None = None
        self._bn_totals: BatchNormTotals | None = None  # the statistics' share of a step's one read
        self._track_batchnorm = True
        self.metrics: MetricStates | None = None
        self.metrics_changed = False  # a metric's state became unrestorable at the last capture
        self.logged_unsupported: str | None = None  # why the loop's logged values cannot be put back

    def attach(self, module: nn.Module, track_batchnorm: bool) -> None:
        """Find the BatchNorm buffers and torchmetrics metrics of ``module`` (once the model sits on its device)."""
        self._bn = BatchNormSnapshot(module)
        self._bn_totals = None
        self._track_batchnorm = track_batchnorm
        self.metrics = MetricStates(module)
        self.open = False

    def follow(self) -> bool:
        """Re-find the BatchNorm buffers when code assigned new tensors to them; True if it did.

        An identity check of each tracked buffer (no read of a value): a callback or hook that
        replaces ``running_mean``/``running_var`` (``StochasticWeightAveraging``'s BatchNorm reset,
        ``load_state_dict(assign=True)``) is followed from the next check on.
        """
        if self._bn is None or not self._bn.stale():
            return False
        self._bn.refresh()
        self._bn_totals = None
        return True

    def rediscover(self, module: nn.Module) -> None:
        """Find the BatchNorm buffers and metrics of ``module`` again (modules added or changed since)."""
        if self._bn is not None:
            self._bn.module = module
            self._bn.refresh()
            self._bn_totals = None
        self.metrics = MetricStates(module)

    # ------------------------------------------------------------------ one optimizer step

    def begin(self, checking: bool, front: FrontEnd | None = None) -> None:
        """Open the window of a new optimizer step; if it is checked (it may be dropped), capture its state.

        The BatchNorm buffers, the torchmetrics states and (with a ``front``) what the loop logs: no
        host read, a fused device copy of the metric states, references otherwise.
        """
        self.open = True
        self.checking = checking
        self.losses = []
        self.micro_batches = []
        if not checking:
            return
        if self._bn is not None:
            self._bn.capture()
        self.parts.run("logged_values", self._keep_logged, front)

    def _keep_logged(self, front: FrontEnd | None) -> None:
        metrics = self.metrics
        if metrics is not None and metrics.metrics and metrics.capture():  # most models hold no metric
            self.metrics_changed = True
        if front is not None:
            self.logged_unsupported = front.keep_logged()

    def add_batch(
        self,
        batch: Any,
        batch_idx: int,
        dataset_indices: list[int] | CombinedIndices | None,
        keep: bool,
        readers: tuple[RecordReader, ...] = (),
    ) -> None:
        """Note a micro-batch (kept by reference for a diagnosis when ``keep``); indices per loader with several."""
        self.batch_idx = batch_idx
        if not (keep and self.checking):
            return
        if isinstance(dataset_indices, CombinedIndices):
            if dataset_indices.mismatch:
                micro = MicroBatch(batch, batch_idx, None, loaders_note=dataset_indices.mismatch, readers=readers)
            else:
                micro = MicroBatch(batch, batch_idx, None, loaders=dataset_indices, readers=readers)
        else:
            micro = MicroBatch(batch, batch_idx, dataset_indices, readers=readers)
        self.micro_batches.append(micro)

    def next_optimizer_step(self) -> None:
        """Manual optimisation: the next ``optimizer.step()`` starts here, with its own losses and BatchNorm updates."""
        self.losses = []
        if self.checking and self._bn is not None:
            self._bn.capture()

    def add_loss(self, loss: Tensor) -> None:
        """Keep a micro-batch's loss for the check (no host read)."""
        if self.checking:
            self.losses.append(loss.detach())

    def close(self) -> None:
        """The step is being checked: the next batch opens a new window."""
        self.open = False

    def forget_batches(self) -> None:
        """Drop the references to the step's batches (a healthy step needs no diagnosis)."""
        self.micro_batches = []

    def step_loss(self, scale: Tensor | None = None) -> Tensor | None:
        """The step's loss summed over micro-batches, divided by the loss scale, on the device."""
        if not self.losses:
            return None
        if len(self.losses) == 1:
            only = self.losses[0]  # a 0-dim float32 loss is its own total: no kernel
            total = only.float() if only.dim() == 0 else only.float().sum()
        else:
            total = torch.stack([loss.float().sum() for loss in self.losses]).sum()
        return total / scale if scale is not None else total

    # ------------------------------------------------------------------ BatchNorm

    @property
    def batchnorm_buffers(self) -> list[tuple[str, Tensor]]:
        """The BatchNorm buffers the check covers (none when BatchNorm checks are off)."""
        return self._bn.named_buffers if self._bn is not None and self._track_batchnorm else []

    @property
    def others(self) -> list[Tensor]:
        """What the check reads beside the gradients: the step's losses and floating-point BatchNorm buffers."""
        bn = self._bn
        return [*self.losses, *bn.floating] if bn is not None and self._track_batchnorm and bn.floating else self.losses

    def batchnorm_totals(self) -> list[Tensor] | None:
        """The BatchNorm statistics' totals for a step's one read (no host read; none without BatchNorm checks).

        ``None`` where they cannot share it (buffers of several devices or dtypes): the step is then
        checked by the general path. See :class:`~lightning_nanguard.detect.one_read.BatchNormTotals`.
        """
        bn = self._bn
        if bn is None or not self._track_batchnorm or not bn.floating:
            return []
        totals = self._bn_totals
        if totals is None:
            totals = self._bn_totals = BatchNormTotals(bn.floating, bn.running_vars)
        if not totals.usable:
            return None
        try:
            return totals.totals()
        except RuntimeError:  # a buffer resized in place: the general path from now on
            totals.usable = False
            return None

    @property
    def running_vars(self) -> list[Tensor]:
        """The ``running_var`` buffers among :attr:`batchnorm_buffers`."""
        bn = self._bn
        return bn.running_vars if bn is not None and self._track_batchnorm else []

    def capture_batchnorm(self) -> None:
        """Copy the BatchNorm buffers as they are now (a forward-only batch: no step window opens)."""
        if self._bn is not None:
            self._bn.capture()

    def restore_batchnorm(self) -> None:
        """Put the BatchNorm buffers back as they were before the step's first forward."""
        if self._bn is not None:
            self._bn.restore()

    @contextlib.contextmanager
    def before_step_batchnorm(self, keep_after: bool) -> Iterator[None]:
        """BatchNorm buffers as before the step inside the block; with ``keep_after`` the step's own after.

        A diagnosis re-runs the step from the state before it; when the step is kept (``action="warn"``)
        its BatchNorm updates are put back afterwards.
        """
        current = [t.detach().clone() for _, t in self._bn.named_buffers] if keep_after and self._bn else []
        self.restore_batchnorm()
        try:
            yield
        finally:
            if current and self._bn is not None:
                with torch.no_grad():
                    torch._foreach_copy_([t for _, t in self._bn.named_buffers], current)

    def discard_update(self, optimizer: Any, front: FrontEnd | None = None) -> None:
        """Make the coming ``optimizer.step`` a no-op and undo the step's BatchNorm updates, metrics and logs.

        The loop's own gradient clipping, which runs between the check and the step, is off for this
        step (the front-end's ``resume_clipping`` after it): there is nothing to clip, and
        ``clip_grad_value_`` of torch fails on a step without gradients.
        """
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = None  # optimizers skip parameters without grad: no state change at all
        self.restore_batchnorm()
        if front is not None:
            front.suspend_clipping()
        self.parts.run("logged_values", self.drop_logged, front)

    def drop_logged(self, front: FrontEnd | None = None) -> None:
        """Undo what the step added to the torchmetrics states and (with a ``front``) what the loop logged."""
        if self.metrics:
            self.metrics.restore()
        if front is not None:
            front.drop_logged()

    # ------------------------------------------------------------------ reference sample

    def reference_due(self, global_step: int, every_n_steps: int) -> bool:
        """Whether :meth:`refresh_reference` takes a new reference at this healthy step (most steps: no)."""
        step = self.reference_step
        return bool(self.micro_batches) and (step is None or global_step - step >= every_n_steps)

    def refresh_reference(self, global_step: int, every_n_steps: int, slicer: Slicer | None) -> None:
        """Keep the first samples of this healthy step as the reference, every ``every_n_steps`` steps.

        A slice of :data:`REFERENCE_SIZE` samples (a small device copy, no host read) taken from the
        step's first micro-batch, only when the last one is ``every_n_steps`` old or missing
        (:meth:`reference_due`). A batch that cannot be sliced leaves no reference (the diagnosis
        then does without).
        """
        if not self.reference_due(global_step, every_n_steps):
            return
        self.reference_step = global_step
        first = self.micro_batches[0]
        try:
            if first.loaders is not None:  # several training loaders: the first samples of each
                combined = CombinedBatch(first.batch, first.loaders.layout, slicer)
                self.reference = combined.cut(combined.first_rows(REFERENCE_SIZE))
            else:
                self.reference = (slicer or slice_batch)(first.batch, list(range(REFERENCE_SIZE)))
        except Exception:  # unsliceable, or fewer than two samples: no reference
            self.reference = None
