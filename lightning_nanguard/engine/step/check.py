"""The Lightning side of :mod:`lightning_nanguard.detect.check`: this rank's flags for one optimizer step.

:func:`step_flags` runs the fused check on what a Trainer's step produced: the gradients the
optimizer is about to apply, the step's losses and BatchNorm statistics (kept by the
:class:`~lightning_nanguard.engine.step.window.StepWindow`), the GradScaler's own NaN/Inf flag where it
has one, and the loss-spike flag. The result stays on the device (the controller reduces it over
ranks and reads it once).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_nanguard.decide.policy import local_vector
from lightning_nanguard.detect.check import fused_health_check
from lightning_nanguard.detect.syncfree import scaler_found_inf
from lightning_nanguard.trainer.parts import grad_scaler

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer
    from torch.optim import Optimizer

    from lightning_nanguard.engine.recording import IncidentRecorder
    from lightning_nanguard.engine.sharding import ShardingLayout
    from lightning_nanguard.engine.step.spikes import SpikeWatch
    from lightning_nanguard.engine.step.window import StepWindow

__all__ = ["loss_scale", "step_flags"]


def step_flags(
    trainer: Trainer,
    pl_module: LightningModule,
    optimizer: Optimizer,
    grads: list[Tensor],
    window: StepWindow,
    spikes: SpikeWatch | None,
    with_norm: bool,
    recorder: IncidentRecorder,
    sharding: ShardingLayout | None = None,
) -> Tensor:
    """This rank's flags from the fused check, laid out as :data:`~lightning_nanguard.decide.policy.LOCAL_FIELDS`.

    No host read. The gradient norm is computed when ``with_norm`` (``clip_grad``) or on the
    Trainer's logging steps. Under a GradScaler that has unscaled this optimizer's gradients
    (Lightning does so before ``on_before_optimizer_step`` for optimizers that are not fused) the
    scaler has just tested every gradient for NaN/Inf: its flag is used, and the gradients are not
    read a second time (unless the norm is due). Under sharding (``sharding``) the check reads local
    shards and slot 1 holds this rank's share of the squared norm, completed by the step's reduce.
    """
    bn = window.batchnorm_buffers
    norm_due = with_norm or recorder.logging_due(trainer)
    scaler_flag = None if norm_due else scaler_found_inf(grad_scaler(trainer), optimizer)
    check = sharding.check if sharding is not None else fused_health_check
    summary = check(
        grads if scaler_flag is None else [],
        others=[*window.losses, *(t for _, t in bn if t.is_floating_point())],
        nonnegative=window.running_vars,
        device=pl_module.device,
        with_norm=norm_due,
    )
    if scaler_flag is not None:
        flag = scaler_flag.reshape(1).to(device=summary.device, dtype=summary.dtype)
        summary = torch.cat((summary[0:1] + flag, summary[1:]))
    spike = loss = None
    if spikes is not None and pl_module.automatic_optimization:
        loss = window.step_loss(loss_scale(trainer))
        # sharded: slot 1 holds this rank's share of the squared norm, not the norm (its spikes are not watched)
        spike = spikes.check(loss, summary[1:2] if with_norm and sharding is None else None)
    return local_vector(summary, spike, loss=loss)


def loss_scale(trainer: Trainer) -> Tensor | None:
    """The GradScaler's scale as a device tensor (no host read), ``None`` without one."""
    scaler = grad_scaler(trainer)
    if scaler is None or not scaler.is_enabled():
        return None
    scale = getattr(scaler, "_scale", None)  # the device tensor behind get_scale(), which reads it to the host
    return scale if isinstance(scale, Tensor) else None
