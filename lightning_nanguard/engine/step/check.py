"""This rank's flags for one optimizer step (:mod:`lightning_nanguard.detect.check` on the step), and a check now.

:func:`step_flags` runs the fused check on what a step produced: the gradients the
optimizer is about to apply, the step's losses and BatchNorm statistics (kept by the
:class:`~lightning_nanguard.engine.step.window.StepWindow`), the GradScaler's own NaN/Inf flag where it
has one, and the loss-spike flag. The result stays on the device (the controller reduces it over
ranks and reads it once). :func:`check_module` is the check of ``NanGuard.check``, for manual loops.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.decide.policy import StepHealth, local_vector
from lightning_nanguard.detect.batchnorm import batchnorm_buffers
from lightning_nanguard.detect.check import fused_health_check
from lightning_nanguard.detect.confirm import bad_batchnorm_names, nonfinite_names
from lightning_nanguard.detect.one_read import staged_loss_and_total
from lightning_nanguard.detect.syncfree import scaler_found_inf

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from lightning_nanguard.engine.frontend import FrontEnd
    from lightning_nanguard.engine.parts import GuardParts
    from lightning_nanguard.engine.shard_layout import ShardingLayout
    from lightning_nanguard.engine.step.spikes import SpikeWatch
    from lightning_nanguard.engine.step.window import StepWindow

__all__ = [
    "check_module",
    "decided_health",
    "decided_on_host",
    "host_step_health",
    "loss_scale",
    "next_loss_scale",
    "staged_step_read",
    "step_flags",
]


def step_flags(
    front: FrontEnd,
    optimizer: Optimizer,
    grads: list[Tensor],
    window: StepWindow,
    spikes: SpikeWatch | None,
    with_norm: bool,
    sharding: ShardingLayout | None = None,
    parts: GuardParts | None = None,
    part_failed: bool = False,
    layout: list[Tensor] | None = None,
) -> Tensor:
    """This rank's flags from the fused check, laid out as :data:`~lightning_nanguard.decide.policy.LOCAL_FIELDS`.

    No host read. The gradient norm is computed when ``with_norm`` (``clip_grad``) or on the
    loop's logging steps. Under a GradScaler that has unscaled this optimizer's gradients
    (Lightning does so before ``on_before_optimizer_step`` for optimizers that are not fused) the
    scaler has just tested every gradient for NaN/Inf: its flag is used, and the gradients are not
    read a second time (unless the norm is due). Under sharding (``sharding``) the check reads local
    shards and slot 1 holds this rank's share of the squared norm, completed by the step's reduce.
    The spike check is an optional part: run through ``parts``, it is switched off alone if it fails
    (its flag then reads 0). ``part_failed``: see :func:`~lightning_nanguard.decide.policy.local_vector`.
    """
    norm_due = with_norm or front.logging_due()
    scaler_flag = None if norm_due else scaler_found_inf(front.grad_scaler, optimizer)
    others = window.others
    checked = grads if scaler_flag is None else []
    if sharding is not None:
        summary = sharding.check(checked, others, window.running_vars, front.device, norm_due)
    else:
        summary = fused_health_check(
            checked, others, window.running_vars, front.device, with_norm=norm_due, layout=layout
        )
    if scaler_flag is not None:
        flag = scaler_flag.reshape(1).to(device=summary.device, dtype=summary.dtype)
        summary = torch.cat((summary[0:1] + flag, summary[1:]))
    spiked: tuple[Tensor | None, Tensor | None] | None = None
    if spikes is not None:
        norm = summary[1:2] if with_norm and sharding is None else None
        if parts is None:
            spiked = _spike_flag(spikes, front, window, norm)
        else:
            spiked = parts.run("spikes", _spike_flag, spikes, front, window, norm)
    spike, loss = spiked if spiked is not None else (None, None)
    return local_vector(summary, spike, loss=loss, part_failed=part_failed)


def decided_on_host(front: FrontEnd) -> bool:
    """Whether this rank's step can be decided from raw totals on the host (:func:`host_step_health`).

    In one process (the caller's test: no collective carries the flags) and without a GradScaler
    (whose own NaN/Inf flag stays on the device): the flags :func:`step_flags` would build on the
    device are then plain comparisons the host makes after its one read.
    """
    return front.grad_scaler is None


def host_step_health(
    front: FrontEnd,
    grads: list[Tensor],
    window: StepWindow,
    spikes: SpikeWatch | None,
    with_norm: bool,
    parts: GuardParts,
    layout: list[Tensor] | None = None,
) -> StepHealth:
    """This rank's step health (the values :data:`~lightning_nanguard.decide.policy.LOCAL_FIELDS` names), one host read.

    The same check as :func:`step_flags`, decided on the host: the device computes the raw totals of
    the gradients and of the losses and BatchNorm statistics, the step's loss and, when due, the
    gradient norm (:func:`~lightning_nanguard.detect.check.fused_health_check` with ``raw``: a few
    kernels); one ``tolist`` reads them; the host tests the totals with ``math.isfinite`` and
    compares the loss (and, with ``with_norm``, the norm) with the spike thresholds, in float32 as
    the device would. ``layout``: the parameters whose gradients ``grads`` are, when each has one
    (see ``fused_health_check``). For :func:`decided_on_host` steps of one process only.
    """
    norm_due = with_norm or front.logging_due()
    if not norm_due and layout is not None and len(window.losses) == 1:  # the common step: one read
        batchnorm = window.batchnorm_totals()
        read = None if batchnorm is None else staged_loss_and_total(grads, window.losses[0], layout, batchnorm)
        quick = None if read is None else read.tolist()
        if quick is not None and math.isfinite(quick[1]):  # every gradient, the loss and BatchNorm statistic finite
            loss_value = quick[0] if spikes is not None else None
            return decided_health(spikes, parts, loss_value, -1.0, with_norm, bad=False, others_bad=False)
    bn = window.batchnorm_buffers
    loss = window.step_loss() if spikes is not None else None
    totals = fused_health_check(
        grads,
        others=window.others,
        nonnegative=window.running_vars if bn else (),
        device=front.device,
        with_norm=norm_due,
        raw=True,
        value=loss,
        layout=layout,
    ).tolist()  # the one host read of the step
    grads_total, others_total, loss_value = totals[:3]
    grad_norm = totals[3] if norm_due else -1.0
    others_bad = not math.isfinite(others_total)
    bad = others_bad or not math.isfinite(grads_total)
    loss_value = loss_value if loss is not None else None
    return decided_health(spikes, parts, loss_value, grad_norm, with_norm, bad, others_bad)


def staged_step_read(grads: list[Tensor], window: StepWindow, layout: list[Tensor] | None) -> Tensor | None:
    """The common step's one buffer left on the device: ``[loss, total]`` (``None``: the step needs the full check).

    The sync-free mode's check of a step of one process, read a step later (:func:`host_step_health`
    reads the same buffer at once): one micro-batch, gradients laid out as ``layout``, BatchNorm
    statistics the buffer can take (:func:`~lightning_nanguard.detect.one_read.staged_loss_and_total`).
    """
    if layout is None or len(window.losses) != 1:
        return None
    batchnorm = window.batchnorm_totals()
    return None if batchnorm is None else staged_loss_and_total(grads, window.losses[0], layout, batchnorm)


def decided_health(
    spikes: SpikeWatch | None,
    parts: GuardParts,
    loss: float | None,
    grad_norm: float,
    with_norm: bool,
    bad: bool = False,
    others_bad: bool = False,
) -> StepHealth:
    """The health of a step decided on the host, with its spike check (an optional part)."""
    spike = False
    if spikes is not None:
        spike = bool(parts.run("spikes", spikes.check, loss, grad_norm if with_norm else None))
    return StepHealth.local(bad, grad_norm, others_bad, spike, False, math.nan if loss is None else loss)


def _spike_flag(
    spikes: SpikeWatch, front: FrontEnd, window: StepWindow, grad_norm: Tensor | None
) -> tuple[Tensor | None, Tensor | None]:
    """The step's spike flag and loss on the device (sharded: no norm, slot 1 holds a share of it)."""
    loss = window.step_loss(loss_scale(front.grad_scaler))
    flag = spikes.check(loss, grad_norm)
    return (flag if isinstance(flag, Tensor) else None), loss


def loss_scale(scaler: Any) -> Tensor | None:
    """The GradScaler's scale as a device tensor (no host read), ``None`` without one."""
    if scaler is None or not scaler.is_enabled():
        return None
    scale = getattr(scaler, "_scale", None)  # the device tensor behind get_scale(), which reads it to the host
    return scale if isinstance(scale, Tensor) else None


def next_loss_scale(scaler: Any, updated: bool = False) -> float | None:
    """The loss scale a GradScaler uses after this step's overflow (``None``: no active scaler).

    ``updated``: the scaler has updated since the step (a step resolved one step late): its scale now.
    """
    if scaler is None or not scaler.is_enabled():
        return None
    if updated:
        return float(scaler.get_scale())
    return float(scaler.get_scale()) * scaler.get_backoff_factor()  # what update() sets after an overflow


def check_module(front: Any, module: nn.Module, loss: Tensor | None, batch_idx: int) -> NanEvent | None:
    """The event of ``module``'s NaN/Inf gradients, BatchNorm statistics, weights or ``loss`` now (``None``: none).

    For manual optimisation and custom loops (``NanGuard.check``); one host read per device.

    Example:
        >>> net = nn.Linear(2, 1)
        >>> net(torch.tensor([[float("nan"), 1.0]])).sum().backward()
        >>> check_module(None, net, None, 0).kinds
        ('grad',)
    """
    named = list(module.named_parameters())
    bad_grads = tuple(nonfinite_names((n, p.grad) for n, p in named if p.grad is not None))
    bad_buffers = tuple(bad_batchnorm_names(batchnorm_buffers(module)))
    bad_params = tuple(nonfinite_names(named))
    loss_bad = loss is not None and not bool(torch.isfinite(loss.detach()).all())
    flags = (("loss", loss_bad), ("grad", bad_grads), ("bn_stats", bad_buffers), ("param", bad_params))
    kinds = tuple(kind for kind, bad in flags if bad)
    if not kinds:
        return None
    return NanEvent.at_step(
        front,
        batch_idx,
        kinds,  # type: ignore[arg-type]
        nonfinite_grads=bad_grads,
        nonfinite_buffers=bad_buffers,
        nonfinite_params=bad_params,
        loss=float(loss.detach().double().sum()) if loss is not None else None,
    )
