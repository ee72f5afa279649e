"""The Lightning side of :mod:`lightning_nanguard.recover.recovery`: what a recovery acts on, read off the Trainer.

Example:
    >>> from lightning.pytorch import Trainer
    >>> grad_scaler(Trainer(logger=False, enable_checkpointing=False)) is None  # 32-bit: no GradScaler
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_nanguard.recover.recovery import TrainingParts

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

__all__ = ["grad_scaler", "lr_schedulers", "next_loss_scale", "training_parts"]


def grad_scaler(trainer: Trainer) -> Any:
    """The Trainer's GradScaler (``16-mixed``), or ``None`` (32-bit, bf16)."""
    return getattr(trainer.precision_plugin, "scaler", None)


def next_loss_scale(trainer: Trainer, updated: bool = False) -> float | None:
    """The loss scale the GradScaler uses after this step's overflow (``None``: no active scaler).

    ``updated``: the scaler has updated since the step (a step resolved one step late): its scale now.
    """
    scaler = grad_scaler(trainer)
    if scaler is None or not scaler.is_enabled():
        return None
    if updated:
        return float(scaler.get_scale())
    return float(scaler.get_scale()) * scaler.get_backoff_factor()  # what update() sets after an overflow


def lr_schedulers(trainer: Trainer) -> list[Any]:
    """The Trainer's LR schedulers, in the order of ``trainer.lr_scheduler_configs``."""
    return [config.scheduler for config in getattr(trainer, "lr_scheduler_configs", [])]


def training_parts(trainer: Trainer, pl_module: LightningModule) -> TrainingParts:
    """The module, optimizers, LR schedulers, GradScaler and global step of a fit, for a recovery."""
    return TrainingParts(
        module=pl_module,
        optimizers=trainer.optimizers,
        schedulers=lr_schedulers(trainer),
        scaler=grad_scaler(trainer),
        global_step=trainer.global_step,
    )
