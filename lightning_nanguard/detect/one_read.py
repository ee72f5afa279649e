"""A healthy step's check in one buffer: the gradients and the loss summed into its last slot, read once.

On a step that is checked without the gradient norm, in one process, the question is only "is
everything finite?" and "what was the loss?". :func:`loss_and_total` answers both with the fewest
kernels: the small gradients (staged as in :mod:`~lightning_nanguard.detect.staging`), the norms
of the large ones (one ``_foreach_norm``) and the loss are copied into one float32 buffer, summed
into its last slot, and the loss and the total are read together: ``[foreach_norm], [a stack per
repeated shape], one _foreach_copy_, one sum, one read``. On a CPU the largest gradients (from
:data:`~lightning_nanguard.detect.check.CPU_SUM_NUMEL` elements) are summed one call each instead:
a CPU launches no kernel, and its sum reads faster than its norm where the reading outweighs a
Python call (:func:`~lightning_nanguard.detect.check.cpu_totals`). A sum or a norm is NaN or
+/-Inf if some element is, so a finite total vouches for every gradient and for the loss; a
non-finite total (or a finite value that overflowed) is only a candidate, which the caller checks
again in full (:func:`~lightning_nanguard.detect.check.fused_health_check`), as the step is then
bad or nearly.

Example:
    >>> net = torch.nn.Linear(2, 1)
    >>> loss = net(torch.ones(4, 2)).pow(2).mean()
    >>> loss.backward()
    >>> params = list(net.parameters())
    >>> value, total = loss_and_total([p.grad for p in params], loss.detach(), params)
    >>> value == loss.item(), math.isfinite(total)
    (True, True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from lightning_nanguard.detect.check import CPU_SUM_NUMEL, SMALL_NUMEL
from lightning_nanguard.detect.staging import LayoutPlans, Selector, Staging, pick, selector

__all__ = ["BatchNormTotals", "loss_and_total", "staged_loss_and_total"]

_FLOAT32 = torch.float32


class _Buffer(NamedTuple):
    """One read's float32 buffer: the staged small gradients, then the tail (see :class:`_OneReadPlan`)."""

    staging: Staging
    addends: Tensor  # everything but the last slot
    total: Tensor  # the last slot, where they are summed
    read: Tensor  # [loss, total]


class _OneReadPlan:
    """The buffer and selectors for gradients laid out as ``layout`` (float32, one device, dense): made once."""

    def __init__(self, layout: list[Tensor]) -> None:
        first = layout[0]
        self.device = first.device
        self.usable = all(t.dtype == _FLOAT32 and t.device == self.device and t.layout is torch.strided for t in layout)
        if not self.usable:
            return
        self._small = [at for at, t in enumerate(layout) if t.numel() < SMALL_NUMEL]
        self._small_like = [layout[at] for at in self._small]
        large = [at for at, t in enumerate(layout) if t.numel() >= SMALL_NUMEL]
        # on a CPU the largest are summed one call each, as cpu_totals does (a sum reads faster than a norm)
        huge = CPU_SUM_NUMEL if self.device.type == "cpu" else math.inf
        normed = [at for at in large if layout[at].numel() < huge]
        summed = [at for at in large if layout[at].numel() >= huge]
        self.normed: Selector | None = selector(normed) if normed else None
        self.summed: Selector | None = selector(summed) if summed else None
        self._large = len(large)
        self._buffers: dict[int, _Buffer] = {}

    def buffer(self, extra: int) -> _Buffer:
        """The buffer whose tail takes a total per large gradient, ``extra`` more totals, the loss and the total."""
        buffer = self._buffers.get(extra)
        if buffer is None:
            tail = self._large + extra + 2
            staging = Staging(self._small_like, self._small, tail=tail, kind=(self.device, _FLOAT32))
            flat = staging.flat
            buffer = self._buffers[extra] = _Buffer(staging, flat[:-1], flat[-1:], flat[-2:])
        return buffer

    def staged(self, grads: list[Tensor], loss: Tensor, extra: Sequence[Tensor]) -> Tensor:
        """``[loss, total]`` on the device: a view of this plan's buffer, overwritten by its next use."""
        totals: list[Tensor] = []
        if self.normed is not None:
            totals = list(torch._foreach_norm(pick(grads, self.normed)))
        if self.summed is not None:
            totals += [t.sum() for t in pick(grads, self.summed)]
        staging, addends, total, read = self._buffers.get(len(extra)) or self.buffer(len(extra))
        staging.load(grads, [*totals, *extra, loss])
        torch.sum(addends, 0, keepdim=True, out=total)
        return read


class BatchNormTotals:
    """The BatchNorm statistics' share of the one read: two 0-dim totals, non-finite if a value may be NaN/Inf.

    ``running_var`` must also stay non-negative: its staged copy is square-rooted first (a negative
    value becomes NaN; the live buffers are only read). The running means and the variances are
    staged apart, each in one buffer (one ``torch.stack`` per repeated shape), built once for the
    lists of a :class:`~lightning_nanguard.recover.batchnorm.BatchNormSnapshot`, which keeps them
    while the buffers stay the same tensors.

    Args:
        floating: the floating-point BatchNorm buffers (``running_var`` included).
        running_vars: the ``running_var`` buffers among them.

    Example:
        >>> mean, var = torch.zeros(3), torch.ones(3)
        >>> [float(t) for t in BatchNormTotals([mean, var], [var]).totals()]
        [0.0, 3.0]
        >>> var[0] = -1.0  # corrupted: negative
        >>> math.isnan(BatchNormTotals([mean, var], [var]).totals()[1])
        True
    """

    def __init__(self, floating: list[Tensor], running_vars: list[Tensor]) -> None:
        variances = {id(t) for t in running_vars}
        self._means = [t for t in floating if id(t) not in variances]
        self._variances = running_vars
        kinds = {(t.device, t.dtype, t.layout) for t in floating}
        self.usable = len(kinds) == 1 and all(t.numel() for t in floating)
        self._mean_staging = Staging(self._means) if self._means and self.usable else None
        self._variance_staging = Staging(running_vars) if running_vars and self.usable else None

    def totals(self) -> list[Tensor]:
        """The totals of the means and of the square-rooted variances, on the buffers' device (no host read)."""
        totals = []
        if self._mean_staging is not None:
            totals.append(self._mean_staging.load(self._means).sum(dtype=_FLOAT32))
        if self._variance_staging is not None:
            totals.append(self._variance_staging.load(self._variances).sqrt_().sum(dtype=_FLOAT32))
        return totals


_PLANS: LayoutPlans[_OneReadPlan] = LayoutPlans(_OneReadPlan)


def loss_and_total(
    grads: list[Tensor], loss: Tensor, layout: list[Tensor], extra: Sequence[Tensor] = ()
) -> list[float] | None:
    """``[loss, total]`` read to the host at once; ``None`` where the plan does not apply (see module docs).

    ``total`` is finite only if every element of ``grads``, the loss and the ``extra`` totals are
    finite (non-finite: a candidate, to check in full). ``layout``: the parameters whose gradients
    ``grads`` are (the same shapes, dtypes and devices in order), kept from step to step: the plan is
    made once per layout. Applies to float32 gradients on one device and a one-element loss on that
    device (any float dtype: read as float32); not to sparse gradients, or a list laid out otherwise
    than ``layout``.

    Args:
        grads: the step's gradients, laid out as ``layout``.
        loss: the step's loss (detached), one element.
        layout: the parameters of ``grads``.
        extra: 0-dim totals of further tensors on the same device, summed in (e.g.
            :meth:`BatchNormTotals.totals`).
    """
    read = staged_loss_and_total(grads, loss, layout, extra)
    return None if read is None else read.tolist()


def staged_loss_and_total(
    grads: list[Tensor], loss: Tensor, layout: list[Tensor], extra: Sequence[Tensor] = ()
) -> Tensor | None:
    """:func:`loss_and_total` left on the device: ``[loss, total]`` in float32, not read (``None``: no plan).

    The tensor is a view of a buffer kept for ``layout``: the next call for that layout overwrites
    it, so copy or reduce it before then (a copy to the host queued on the device's stream is in
    time). For a step whose flag stays on the device (the sync-free mode).

    Example:
        >>> net = torch.nn.Linear(2, 1)
        >>> net(torch.full((1, 2), math.inf)).sum().backward()
        >>> params = list(net.parameters())
        >>> read = staged_loss_and_total([p.grad for p in params], torch.tensor(0.5), params)
        >>> read[0].item(), math.isfinite(read[1].item())
        (0.5, False)
    """
    if not layout or len(grads) != len(layout) or loss.numel() != 1 or not loss.is_floating_point():
        return None
    plan = _PLANS.of(layout)
    if not plan.usable or loss.device != plan.device:
        return None
    try:
        return plan.staged(grads, loss if loss.dim() == 0 else loss.reshape(()), extra)
    except (RuntimeError, NotImplementedError, IndexError):  # sparse gradients, other shapes: the full check
        plan.usable = False
        return None
