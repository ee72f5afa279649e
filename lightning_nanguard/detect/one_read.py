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

import torch
from torch import Tensor

from lightning_nanguard.detect.check import CPU_SUM_NUMEL, SMALL_NUMEL
from lightning_nanguard.detect.staging import LayoutPlans, Selector, Staging, pick, selector

__all__ = ["loss_and_total"]

_FLOAT32 = torch.float32


class _OneReadPlan:
    """The buffer and selectors for gradients laid out as ``layout`` (float32, one device, dense): made once."""

    def __init__(self, layout: list[Tensor]) -> None:
        first = layout[0]
        self.usable = all(
            t.dtype == _FLOAT32 and t.device == first.device and t.layout is torch.strided for t in layout
        )
        if not self.usable:
            return
        small = [at for at, t in enumerate(layout) if t.numel() < SMALL_NUMEL]
        large = [at for at, t in enumerate(layout) if t.numel() >= SMALL_NUMEL]
        # on a CPU the largest are summed one call each, as cpu_totals does (a sum reads faster than a norm)
        huge = CPU_SUM_NUMEL if first.device.type == "cpu" else math.inf
        normed = [at for at in large if layout[at].numel() < huge]
        summed = [at for at in large if layout[at].numel() >= huge]
        self.normed: Selector | None = selector(normed) if normed else None
        self.summed: Selector | None = selector(summed) if summed else None
        # the tail: a total per large gradient, the loss, the total of everything
        self.staging = Staging([layout[at] for at in small], small, tail=len(large) + 2, kind=(first.device, _FLOAT32))
        self.addends = self.staging.flat[:-1]
        self.total = self.staging.flat[-1:]
        self.read = self.staging.flat[-2:]  # [loss, total]

    def loss_and_total(self, grads: list[Tensor], loss: Tensor) -> list[float]:
        totals: list[Tensor] = []
        if self.normed is not None:
            totals = list(torch._foreach_norm(pick(grads, self.normed)))
        if self.summed is not None:
            totals += [t.sum() for t in pick(grads, self.summed)]
        self.staging.load(grads, [*totals, loss])
        torch.sum(self.addends, 0, keepdim=True, out=self.total)
        return self.read.tolist()


_PLANS: LayoutPlans[_OneReadPlan] = LayoutPlans(_OneReadPlan)


def loss_and_total(grads: list[Tensor], loss: Tensor, layout: list[Tensor]) -> list[float] | None:
    """``[loss, total]`` read to the host at once; ``None`` where the plan does not apply (see module docs).

    ``total`` is finite only if every element of ``grads`` and the loss is finite (non-finite: a
    candidate, to check in full). ``layout``: the parameters whose gradients ``grads`` are (the same
    shapes, dtypes and devices in order), kept from step to step: the plan is made once per layout.
    Applies to float32 gradients on one device and a one-element loss on that device (any float dtype:
    read as float32); not to sparse gradients, or a list laid out otherwise than ``layout``.

    Args:
        grads: the step's gradients, laid out as ``layout``.
        loss: the step's loss (detached), one element.
        layout: the parameters of ``grads``.
    """
    if not layout or len(grads) != len(layout) or loss.numel() != 1 or not loss.is_floating_point():
        return None
    plan = _PLANS.of(layout)
    if not plan.usable or loss.device != plan.staging.flat.device:
        return None
    try:
        return plan.loss_and_total(grads, loss if loss.dim() == 0 else loss.reshape(()))
    except (RuntimeError, NotImplementedError, IndexError):  # sparse gradients, other shapes: the full check
        plan.usable = False
        return None
