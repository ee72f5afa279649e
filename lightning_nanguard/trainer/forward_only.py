"""Epochs that run forward passes only, to recompute BatchNorm statistics: no training step to check.

``StochasticWeightAveraging`` ends a fit with an extra epoch over the training data: the averaged
weights are copied into the model, every BatchNorm buffer is reset (new ``running_mean`` /
``running_var`` tensors, ``momentum=None``: a cumulative average) and each batch only runs forward
(``trainer.fit_loop._skip_backward``), so its statistics become those of the averaged model. No
gradient is computed, so the guard's step check has nothing to check, and one bad batch would leave
NaN in the averaged model's statistics for good.

:class:`ForwardOnlyEpoch` guards those batches: the BatchNorm buffers are captured before each
batch and checked after it (one host read per batch, in that epoch only); a batch whose statistics
turned non-finite is left out of them (its buffers, ``num_batches_tracked`` included, are put back)
and reported as an event that says it was no training step.

Example:
    >>> from types import SimpleNamespace
    >>> loop = SimpleNamespace(_skip_backward=True)
    >>> forward_only(SimpleNamespace(fit_loop=loop)), forward_only(SimpleNamespace())
    (True, False)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.detect.check import fused_health_check
from lightning_nanguard.detect.confirm import bad_batchnorm_names

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lightning_nanguard.engine.step.window import StepWindow

__all__ = ["FORWARD_ONLY_NOTE", "ForwardOnlyEpoch", "forward_only"]

FORWARD_ONLY_NOTE = (
    "a batch of a forward-only epoch (StochasticWeightAveraging recomputing the averaged model's BatchNorm "
    "statistics; no training step) gave non-finite BatchNorm statistics: that batch was left out of them"
)


def forward_only(trainer: Any) -> bool:
    """Whether the Trainer runs this epoch's batches forward only (no backward, no real optimizer step)."""
    try:  # what FitLoop._skip_backward returns, without its property (read in three hooks a step)
        return bool(trainer.fit_loop.epoch_loop.automatic_optimization._skip_backward)
    except AttributeError:
        return bool(getattr(getattr(trainer, "fit_loop", None), "_skip_backward", False))


class ForwardOnlyEpoch:
    """Keeps a bad batch out of the BatchNorm statistics a forward-only epoch recomputes (see module docs)."""

    def __init__(self) -> None:
        self.dataset_indices: Any = None  # of the batch in progress

    def before_batch(self, window: StepWindow, dataset_indices: Any = None) -> None:
        """Capture the BatchNorm buffers (followed if replaced: SWA assigns new ones) before the forward.

        ``dataset_indices``: the batch's indices, when known (the batch is not searched: no sample is named).
        """
        self.dataset_indices = dataset_indices
        window.follow()
        window.capture_batchnorm()

    def after_batch(self, trainer: Trainer, window: StepWindow, batch_idx: int) -> NanEvent | None:
        """Check the statistics this batch produced; put them back and return the event when non-finite."""
        dataset_indices = self.dataset_indices
        buffers = window.batchnorm_buffers
        floats = [t for _, t in buffers if t.is_floating_point()]
        if not floats:
            return None
        flags = fused_health_check([], others=floats, nonnegative=window.running_vars, with_norm=False)
        if not float(flags[0]):  # the one host read of the batch
            return None
        bad = bad_batchnorm_names(buffers)
        if not bad:
            return None
        window.restore_batchnorm()
        return NanEvent.at_step(
            trainer,
            batch_idx,
            ("bn_stats",),
            action="skipped",
            nonfinite_buffers=tuple(bad),
            details={
                "forward_only": FORWARD_ONLY_NOTE,
                "hint": "the averaged weights are finite: the data of this batch gives non-finite statistics",
                **({"batch_dataset_indices": list(dataset_indices)} if isinstance(dataset_indices, list) else {}),
            },
        )
