"""Snapshot and restore of BatchNorm running statistics around one forward pass.

A bad batch can corrupt ``running_mean``/``running_var`` even when every gradient stays finite;
the damage then only shows at validation. :class:`BatchNormSnapshot` copies those buffers (they
are small) before the batch and writes them back when the step is rejected, with one fused
``torch._foreach_copy_`` each way and no host synchronisation.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_nanguard.detect.batchnorm import batchnorm_running_vars, batchnorm_slots
from lightning_nanguard.detect.weights import reassigned

__all__ = ["BatchNormSnapshot"]


class BatchNormSnapshot:
    """Keeps a copy of a module's BatchNorm buffers and puts it back on request.

    The copy lives on the buffers' own device and is allocated once, then refreshed in place.

    Examples:
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
        self._owners: list[dict[str, Tensor | None]] = []
        self._stats: list[str] = []
        self.floating: list[Tensor] = []
        self.running_vars: list[Tensor] = []
        self._live: list[Tensor] = []
        self._saved: list[Tensor] = []
        self.refresh()

    def refresh(self) -> None:
        """Re-discover the buffers (after the module was moved, reloaded or modified)."""
        found = batchnorm_slots(self.module)
        self.named_buffers = [(name, tensor) for name, _, _, tensor in found]
        self._owners = [owner._buffers for _, owner, _, _ in found]  # where an assignment lands
        self._stats = [stat for _, _, stat, _ in found]
        self._live = [tensor for _, tensor in self.named_buffers]
        self.floating = [tensor for tensor in self._live if tensor.is_floating_point()]  # what a check reads
        self.running_vars = batchnorm_running_vars(self.named_buffers)  # must also stay non-negative
        self._saved = [tensor.detach().clone() for tensor in self._live]

    def stale(self) -> bool:
        """Whether some code assigned new tensors to the buffers (``bn.running_var = ...``): identity only, no read.

        Examples:
            >>> net = nn.BatchNorm1d(2)
            >>> snapshot = BatchNormSnapshot(net)
            >>> snapshot.stale()
            False
            >>> net.running_var = torch.ones(2)  # e.g. StochasticWeightAveraging's BatchNorm reset
            >>> snapshot.stale()
            True
        """
        if not self._live:  # no BatchNorm: the usual model
            return False
        return reassigned(self._owners, self._stats, self._live)  # in C: no Python frame per buffer

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
