"""Skip on the device now, read the flags later (:mod:`lightning_nanguard.detect.syncfree` at a step).

In the default mode the guard reads one small tensor to the host per step; on a GPU that read
stalls the CPU until the step's kernels have run. In the sync-free mode the decision to drop the
update stays on the device:

- the step's flags (reduced over ranks, still on the device) become a skip flag, handed to torch's
  *fused* optimizer as ``found_inf`` (:class:`~lightning_nanguard.detect.syncfree.DeviceSkip`; combined
  with a GradScaler's own), so the update is skipped inside the optimizer kernel;
- BatchNorm buffers are put back with a device-side select
  (:class:`~lightning_nanguard.detect.syncfree.SelectRestore`);
- the loss-spike history is fed on the device;
- the flags are copied to pinned host memory without waiting
  (:class:`~lightning_nanguard.detect.syncfree.DeferredRead`), and the guard reads them before the next
  step's forward (or at the end of training), when they have long arrived. A bad step is then
  diagnosed and reported exactly as in the default mode: its update was skipped, so the weights
  are still those of the bad step.

This module keeps the pending step; the controller resolves it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_nanguard.decide.policy import LOCAL_FIELDS, Policy, StepHealth, shared_part
from lightning_nanguard.detect.syncfree import DeferredRead, DeviceSkip, SelectRestore, device_skip_unsupported
from lightning_nanguard.engine.frontend import StepView
from lightning_nanguard.engine.step.window import MicroBatch, StepWindow
from lightning_nanguard.recover.remedies import clip_gradients_

__all__ = ["DeferredStep", "SyncFreeSteps"]


@dataclass
class DeferredStep:
    """A step whose flags are on their way to the host."""

    global_step: int
    epoch: int
    batch_idx: int
    micro_batches: list[MicroBatch]
    losses: list[Tensor]
    optimizer: Any
    logging_due: bool
    grads: list[Tensor] = field(default_factory=list)
    one_read: bool = False  # its values are a one read's ``[loss, total]``, not the flags of LOCAL_FIELDS


Resolve = Callable[[Any, Any, list[Tensor], list[float]], None]
"""Decides a step from its values read to the host: ``(front-end, optimizer, gradients, values)``."""


class SyncFreeSteps:
    """The device-side skip, BatchNorm select, deferred read and the one pending step (see module docs)."""

    def __init__(self) -> None:
        self.reader = DeferredRead()
        self.pending: DeferredStep | None = None
        self.resolving: DeferredStep | None = None  # the step being decided a step late (resolve_pending)
        self._skips: dict[int, DeviceSkip] = {}
        self._batchnorm: SelectRestore | None = None  # the buffers before the step's forward
        self._stepped: SelectRestore | None = None  # the buffers as the step left them (for its diagnosis)

    def attach(self, batchnorm_buffers: Sequence[Tensor]) -> None:
        """Track these BatchNorm buffers (at ``on_train_start``)."""
        buffers = list(batchnorm_buffers)
        self._batchnorm = SelectRestore(buffers) if buffers else None
        self._stepped = SelectRestore(buffers) if buffers else None
        self.pending = None
        self.reader.clear()

    @staticmethod
    def unsupported(optimizer: Any, scaler: Any) -> str | None:
        """Why this optimizer cannot skip on the device (a warning), or ``None``."""
        return device_skip_unsupported(optimizer, scaler)

    def capture(self) -> None:
        """BatchNorm buffers before the step's first forward."""
        if self._batchnorm is not None:
            self._batchnorm.capture()

    def skip_on_device(self, optimizer: Any, scaler: Any, flag: Tensor, exact: bool = False) -> bool:
        """Arm the optimizer to skip its coming update iff ``flag``; BatchNorm restored where set.

        Returns ``False`` when this optimizer cannot skip on the device at this step (then nothing
        changed and the caller decides on the host). ``exact``: see :meth:`DeviceSkip.arm`.
        """
        key = id(getattr(optimizer, "_optimizer", optimizer))
        skip = self._skips.get(key)
        if skip is None:
            skip = self._skips[key] = DeviceSkip(optimizer, scaler)
        if not skip.arm(flag, exact):
            return False
        if self._batchnorm is not None and self._stepped is not None:
            self._stepped.capture()  # kept so that the step is diagnosed as it was
            self._batchnorm.restore_where_(flag)
        return True

    def show_step_batchnorm(self) -> None:
        """Put the BatchNorm buffers back as the pending step left them (before it is diagnosed)."""
        if self._stepped is not None:
            self._stepped.restore_where_(torch.ones(1))

    def defer_step(
        self,
        front: Any,
        optimizer: Any,
        grads: list[Tensor],
        vector: Tensor,
        policy: Policy,
        window: StepWindow,
        clip_threshold: float | None,
        logging_due: bool,
    ) -> bool:
        """Arm the device-side skip from the step's flags and keep the step to resolve later.

        ``vector`` holds the step's flags (and their sums over ranks); the update is skipped where
        they say a bad step (unless ``action="warn"``) or a spike to skip. With ``clip_threshold``
        the gradients are clipped by the norm in ``vector``, on the device. Returns ``False`` when this
        optimizer cannot skip on the device (nothing changed: the caller decides on the host).
        """
        shared = vector[len(LOCAL_FIELDS) :] if vector.numel() > len(LOCAL_FIELDS) else shared_part(vector)
        nonfinite, spike, failed = shared[0:1], shared[2:3], shared[3:4]
        skip = failed  # a rank whose core failed cannot vouch for the step: every rank drops it
        if policy.action != "warn":
            skip = skip + nonfinite
        if policy.spike_action == "skip":
            skip = skip + spike
        if not self.skip_on_device(optimizer, front.grad_scaler, skip):
            return False
        if clip_threshold is not None:
            clip_gradients_(grads, vector[1], clip_threshold)
        self._keep(front, optimizer, grads, window, vector, logging_due)
        return True

    def defer_one_read(
        self, front: Any, optimizer: Any, grads: list[Tensor], read: Tensor, spike: Tensor | None, window: StepWindow
    ) -> bool:
        """Arm the device-side skip from a one read's ``[loss, total]`` and keep the step to resolve later.

        The update is skipped where the total is not finite (some gradient, the loss or a BatchNorm
        statistic may be NaN/Inf: :func:`~lightning_nanguard.detect.one_read.staged_loss_and_total`) or
        where ``spike`` (one element, bool or 0/1) is set: two kernels make the flag (``total - total``
        is 0 exactly when the total is finite, NaN otherwise), one more with ``spike``. The host reads
        ``read`` a step later and decides the step as the default mode decides it from the same read.
        Returns ``False`` when this optimizer cannot skip on the device (nothing changed).
        """
        total = read[1:2]
        skip = torch.nan_to_num(total - total, nan=1.0)
        if spike is not None:
            skip = torch.maximum(skip, spike)
        if not self.skip_on_device(optimizer, front.grad_scaler, skip.view(()), exact=True):
            return False
        self._keep(front, optimizer, grads, window, read, logging_due=False, one_read=True)
        return True

    def _keep(
        self,
        front: Any,
        optimizer: Any,
        grads: list[Tensor],
        window: StepWindow,
        values: Tensor,
        logging_due: bool,
        one_read: bool = False,
    ) -> None:
        """Keep the step in hand (its batches and losses taken from ``window``) and start reading ``values``."""
        step = DeferredStep(
            global_step=front.global_step,
            epoch=front.current_epoch,
            batch_idx=window.batch_idx,
            micro_batches=window.micro_batches,
            losses=window.losses,
            optimizer=optimizer,
            logging_due=logging_due,
            grads=grads,
            one_read=one_read,
        )
        self.defer(step, values)
        window.forget_batches()  # the deferred step holds them until it is resolved

    def defer(self, step: DeferredStep, values: Tensor) -> None:
        """Start copying ``values`` to the host; resolve ``step`` later with :meth:`take`."""
        self.reader.start(values)
        self.pending = step

    def take(self) -> tuple[DeferredStep, list[float]] | None:
        """The pending step and its values (waits for the copy if it has not arrived); ``None`` if none."""
        if self.pending is None:
            return None
        step, self.pending = self.pending, None
        return step, self.reader.result()

    def resolve_pending(self, front: Any, window: StepWindow, resolve: Resolve) -> None:
        """Read the pending step's flags and decide it (``resolve(view, optimizer, grads, values)``), if any.

        The window holds that step's batches and losses meanwhile (as at its check), and the
        front-end is seen at that step (:class:`~lightning_nanguard.engine.frontend.StepView`).
        """
        taken = self.take()
        if taken is None:
            return
        step, values = taken
        if not step.one_read and not StepHealth.from_values(values).healthy:  # a one read's: the resolver shows them
            self.show_step_batchnorm()  # as at the check: the diagnosis sees what the default mode sees
        window.micro_batches, window.losses, window.batch_idx = step.micro_batches, step.losses, step.batch_idx
        self.resolving = step
        try:
            resolve(StepView(front, step.global_step, step.epoch), step.optimizer, step.grads, values)
        finally:
            self.resolving = None
            window.forget_batches()
            window.losses = []

    def remove(self) -> None:
        """Remove the optimizer hooks."""
        for skip in self._skips.values():
            skip.remove()
        self._skips.clear()

    def __getstate__(self) -> dict[str, Any]:
        return {
            "reader": DeferredRead(),
            "pending": None,
            "resolving": None,
            "_skips": {},
            "_batchnorm": None,
            "_stepped": None,
        }
