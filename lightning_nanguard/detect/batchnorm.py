"""The BatchNorm running statistics of a module: the buffers the per-step check covers.

A bad batch can corrupt ``running_mean``/``running_var`` even when every gradient stays finite;
the damage then only shows at validation, so the check reads them every step
(:class:`~lightning_nanguard.recover.batchnorm.BatchNormSnapshot` restores them).
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["batchnorm_buffers", "batchnorm_running_vars", "batchnorm_slots"]

_STAT_NAMES = ("running_mean", "running_var", "num_batches_tracked")


def batchnorm_buffers(module: nn.Module) -> list[tuple[str, Tensor]]:
    """Qualified names and tensors of every BatchNorm running statistic in ``module``.

    Covers every ``_BatchNorm`` subclass (``BatchNorm1d/2d/3d``, ``SyncBatchNorm``, lazy
    variants once initialised) that tracks running statistics.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        >>> [name for name, _ in batchnorm_buffers(net)]
        ['1.running_mean', '1.running_var', '1.num_batches_tracked']
    """
    return [(name, tensor) for name, _, _, tensor in batchnorm_slots(module)]


def batchnorm_slots(module: nn.Module) -> list[tuple[str, nn.Module, str, Tensor]]:
    """:func:`batchnorm_buffers` with where each tensor sits: ``(name, owner module, attribute, tensor)``.

    The owner and attribute tell when code assigned another tensor there (``bn.running_var = ...``).

    Example:
        >>> net = nn.Sequential(nn.BatchNorm1d(2))
        >>> [(name, stat) for name, _, stat, _ in batchnorm_slots(net)][0]
        ('0.running_mean', 'running_mean')
    """
    found: list[tuple[str, nn.Module, str, Tensor]] = []
    for module_name, child in module.named_modules():
        if not isinstance(child, _BatchNorm) or not child.track_running_stats:
            continue
        for stat in _STAT_NAMES:
            tensor = getattr(child, stat, None)
            if isinstance(tensor, Tensor) and not isinstance(tensor, nn.parameter.UninitializedBuffer):
                found.append((f"{module_name}.{stat}" if module_name else stat, child, stat, tensor))
    return found


def batchnorm_running_vars(buffers: list[tuple[str, Tensor]]) -> list[Tensor]:
    """The ``running_var`` tensors among :func:`batchnorm_buffers` (they must stay non-negative)."""
    return [tensor for name, tensor in buffers if name.endswith("running_var")]
