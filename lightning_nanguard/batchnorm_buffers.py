"""Snapshot and restore of BatchNorm running statistics around one forward pass.

A bad batch can corrupt ``running_mean``/``running_var`` even when every gradient stays finite;
the damage then only shows at validation. :class:`BatchNormSnapshot` copies those buffers (they
are small) before the batch and writes them back when the step is rejected, with one fused
``torch._foreach_copy_`` each way and no host synchronisation.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["BatchNormSnapshot", "batchnorm_buffers", "batchnorm_running_vars"]

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
    found: list[tuple[str, Tensor]] = []
    for module_name, child in module.named_modules():
        if not isinstance(child, _BatchNorm) or not child.track_running_stats:
            continue
        for stat in _STAT_NAMES:
            tensor = getattr(child, stat, None)
            if isinstance(tensor, Tensor) and not isinstance(tensor, nn.parameter.UninitializedBuffer):
                found.append((f"{module_name}.{stat}" if module_name else stat, tensor))
    return found


def batchnorm_running_vars(buffers: list[tuple[str, Tensor]]) -> list[Tensor]:
    """The ``running_var`` tensors among :func:`batchnorm_buffers` (they must stay non-negative)."""
    return [tensor for name, tensor in buffers if name.endswith("running_var")]


class BatchNormSnapshot:
    """Keeps a copy of a module's BatchNorm buffers and puts it back on request.

    The copy lives on the buffers' own device and is allocated once, then refreshed in place.

    Example:
        >>> net = nn.Sequential(nn.BatchNorm1d(2))
        >>> snapshot = BatchNormSnapshot(net)
        >>> snapshot.capture()
        >>> _ = net(torch.tensor([[1.0, float("nan")], [2.0, 3.0]]))
        >>> net[0].running_mean.isnan().any().item()
        True
        >>> snapshot.restore()
        >>> net[0].running_mean.tolist(), int(net[0].num_batches_tracked)
        ([0.0, 0.0], 0)
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.named_buffers: list[tuple[str, Tensor]] = []
        self._live: list[Tensor] = []
        self._saved: list[Tensor] = []
        self.refresh()

    def refresh(self) -> None:
        """Re-discover the buffers (after the module was moved, reloaded or modified)."""
        self.named_buffers = batchnorm_buffers(self.module)
        self._live = [tensor for _, tensor in self.named_buffers]
        self._saved = [tensor.detach().clone() for tensor in self._live]

    def capture(self) -> None:
        """Copy the current buffer values into the snapshot (no host synchronisation)."""
        if self._live:
            with torch.no_grad():
                torch._foreach_copy_(self._saved, self._live)

    def restore(self) -> None:
        """Write the snapshot back into the live buffers, in place."""
        if self._live:
            with torch.no_grad():
                torch._foreach_copy_(self._live, self._saved)

    @property
    def nbytes(self) -> int:
        """Memory held by the snapshot, in bytes."""
        return sum(t.numel() * t.element_size() for t in self._saved)
