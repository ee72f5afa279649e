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

from lightning_nanguard.detect.batchnorm import batchnorm_buffers, batchnorm_running_vars
from lightning_nanguard.detect.check import fused_health_check
from lightning_nanguard.detect.confirm import bad_batchnorm_names, nonfinite_names
from lightning_nanguard.diagnose.batching import BatchSlicer, batch_size, slice_batch
from lightning_nanguard.diagnose.isolation import gradients, isolated

__all__ = ["StepFn", "SubBatchRunner", "loss_from_output"]

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
    ) -> None:
        self.module = module
        self.batch = batch
        self.step_fn: StepFn = step_fn if step_fn is not None else module.training_step  # type: ignore[assignment]
        self.batch_idx = batch_idx
        self.custom_slicer = slicer is not None
        self.slicer: BatchSlicer = slicer if slicer is not None else slice_batch
        self.context = context if context is not None else contextlib.nullcontext
        self.size = batch_size(batch) if slicer is None else _user_batch_size(batch, slicer, module)
        self.params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.has_train_bn = any(isinstance(m, _BatchNorm) and m.training for m in module.modules())
        self.loss_threshold = loss_threshold
        self.known_good: list[int] = []
        self.passes = 0
        self.saw_nonfinite = False  # some run was non-finite (not only above the loss threshold)

    def padded(self, positions: Sequence[int]) -> tuple[list[int], bool]:
        """Positions to run and whether BatchNorm must run in eval mode."""
        positions = list(positions)
        if len(positions) == 1 and self.has_train_bn:
            if self.known_good:
                return [*positions, self.known_good[0]], False
            return positions, True
        return positions, False

    def sub_batch(self, positions: Sequence[int]) -> Any:
        """The batch cut to ``positions`` (the batch itself for every position in order)."""
        if len(positions) == self.size and list(positions) == list(range(self.size)):
            return self.batch
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

    def forward(self, positions: Sequence[int]) -> Tensor | None:
        """Loss of the sub-batch (call inside :func:`isolated`); padding and BN mode applied."""
        run, bn_eval = self.padded(positions)
        with self.mode(bn_eval):
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
                grads = gradients(loss.sum(), [p for _, p in self.params])
            bad = self._nonfinite(loss, [g for g in grads if g is not None])
        self.saw_nonfinite = self.saw_nonfinite or bad
        if not bad and self.loss_threshold is not None:
            bad = float(loss.detach().float().sum()) > self.loss_threshold
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


def finite_threshold(value: float | None) -> float | None:
    """``value`` if it is a usable loss threshold (a finite number), else ``None``.

    Example:
        >>> finite_threshold(2.5), finite_threshold(float("nan")), finite_threshold(None)
        (2.5, None, None)
    """
    if value is None or not math.isfinite(float(value)):
        return None
    return float(value)
