"""In-memory "last good state" of a training run, restored bitwise on demand.

:class:`TrainingSnapshot` keeps, off the accelerator, everything needed to continue training as
if the bad steps never happened: the module's ``state_dict`` (weights and every buffer), each
optimizer's state, the GradScaler, the LR schedulers and the RNG streams. Tensors are copied into
host buffers allocated once (pinned on CUDA, copied with ``non_blocking=True`` so the step is not
blocked) and refreshed in place; on restore they are copied back into the live tensors.

Sharded tensors (``DTensor``: FSDP2, tensor parallelism) are kept as their local shard, with the
mesh and placements to rebuild them: each rank snapshots and restores its own shards, bitwise,
and nothing is gathered.

Example:
    >>> net = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> snapshot = TrainingSnapshot()
    >>> snapshot.capture(net, [opt])
    >>> with torch.no_grad():
    ...     _ = net.weight.fill_(float("nan"))
    >>> snapshot.restore(net, [opt])
    >>> bool(torch.isfinite(net.weight).all())
    True
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from lightning_nanguard.core.dtensor import is_dtensor, local_tensor
from lightning_nanguard.core.rng import RngState

__all__ = ["HostCopy", "TrainingSnapshot"]


def _clone_tensor(value: Any) -> Any:
    return value.clone() if isinstance(value, Tensor) else value


class HostCopy:
    """A nested structure (state dict) whose tensors are mirrored in reusable host buffers.

    Example:
        >>> live = {"w": torch.ones(2), "step": 3}
        >>> mirror = HostCopy()
        >>> mirror.update(live)
        >>> live["w"].add_(1.0)
        tensor([2., 2.])
        >>> mirror.value()["w"].tolist(), mirror.value()["step"]
        ([1.0, 1.0], 3)
    """

    def __init__(self) -> None:
        self._spec: Any = None
        self._leaves: list[Any] = []
        self._buffers: list[Tensor] = []
        self._sharding: list[tuple[Any, ...] | None] = []  # per tensor: (mesh, placements, shape, stride) of a DTensor

    def update(self, structure: Any) -> None:
        """Copy ``structure``'s tensors into the host buffers (reallocated only if shapes change).

        A ``DTensor`` is copied as its local shard (see module docs).
        """
        leaves, spec = tree_flatten(structure)
        tensors = [leaf for leaf in leaves if isinstance(leaf, Tensor)]
        self._sharding = [
            (t.device_mesh, t.placements, t.shape, t.stride()) if is_dtensor(t) else None  # type: ignore[attr-defined]
            for t in tensors
        ]
        sources = [local_tensor(t.detach()) for t in tensors]
        if not self._compatible(sources):
            self._buffers = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda) for t in sources]
        if self._buffers:
            non_blocking = any(t.is_cuda for t in sources)
            with torch.no_grad():
                for target, source in zip(self._buffers, sources, strict=True):
                    target.copy_(source, non_blocking=non_blocking)
        buffers = iter(self._buffers)
        self._leaves = [next(buffers) if isinstance(leaf, Tensor) else copy.deepcopy(leaf) for leaf in leaves]
        self._spec = spec

    def _compatible(self, tensors: Sequence[Tensor]) -> bool:
        return len(tensors) == len(self._buffers) and all(
            b.shape == t.shape and b.dtype == t.dtype for b, t in zip(self._buffers, tensors, strict=True)
        )

    def value(self) -> Any:
        """The mirrored structure (host tensors; do not modify); a sharded tensor comes back as a ``DTensor`` shard."""
        if self._spec is None:
            raise RuntimeError("HostCopy.value() before update()")
        if not any(self._sharding):
            return tree_unflatten(self._leaves, self._spec)
        sharding = iter(self._sharding)
        leaves = [_sharded(leaf, next(sharding)) if isinstance(leaf, Tensor) else leaf for leaf in self._leaves]
        return tree_unflatten(leaves, self._spec)

    def copy_into(self, structure: Any) -> None:
        """Copy the mirrored values into the tensors of ``structure`` (same layout), in place; shards into shards."""
        leaves, _ = tree_flatten(structure)
        targets = [local_tensor(leaf.detach()) for leaf in leaves if isinstance(leaf, Tensor)]
        if len(targets) != len(self._buffers):
            raise RuntimeError(f"HostCopy.copy_into: {len(targets)} tensors, {len(self._buffers)} saved")
        with torch.no_grad():
            for target, saved in zip(targets, self._buffers, strict=True):
                target.copy_(saved)

    @property
    def nbytes(self) -> int:
        """Host memory held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers)


def _sharded(local: Tensor, sharding: tuple[Any, ...] | None) -> Tensor:
    """A host shard as the ``DTensor`` it was copied from (no communication), or itself."""
    if sharding is None:
        return local
    from torch.distributed.tensor import DTensor

    mesh, placements, shape, stride = sharding
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


class TrainingSnapshot:
    """Last good state of module, optimizers, GradScaler, LR schedulers and RNG (see module docs)."""

    def __init__(self) -> None:
        self.module = HostCopy()
        self.optimizers: list[HostCopy] = []
        self.scaler: dict[str, Any] | None = None
        self.schedulers: list[dict[str, Any]] = []
        self.rng: RngState | None = None
        self.extra: dict[str, Any] = {}
        self.global_step: int | None = None
        self.seconds: float = 0.0
        self.count = 0

    @property
    def available(self) -> bool:
        """Whether a snapshot was taken."""
        return self.global_step is not None

    @property
    def nbytes(self) -> int:
        """Host memory of the snapshot's tensors."""
        return self.module.nbytes + sum(o.nbytes for o in self.optimizers)

    @property
    def sharded(self) -> bool:
        """Whether the module's state holds sharded tensors (each rank keeps its shards)."""
        return any(self.module._sharding)

    def capture(
        self,
        module: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        scaler: Any = None,
        schedulers: Sequence[Any] = (),
        global_step: int = 0,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Record the current state (call after a step known to be healthy)."""
        start = time.perf_counter()
        self.module.update(module.state_dict())
        while len(self.optimizers) < len(optimizers):
            self.optimizers.append(HostCopy())
        del self.optimizers[len(optimizers) :]
        for mirror, optimizer in zip(self.optimizers, optimizers, strict=True):
            mirror.update(optimizer.state_dict())
        self.scaler = copy.deepcopy(scaler.state_dict()) if scaler is not None else None
        self.schedulers = [copy.deepcopy(s.state_dict()) for s in schedulers]
        self.rng = RngState.capture()
        self.extra = copy.deepcopy(extra or {})
        self.global_step = global_step
        self.count += 1
        self.seconds = time.perf_counter() - start

    def restore(
        self,
        module: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        scaler: Any = None,
        schedulers: Sequence[Any] = (),
    ) -> None:
        """Put the recorded state back, in place (weights keep their identity and device)."""
        if not self.available:
            raise RuntimeError("no snapshot to restore")
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # make sure the non-blocking copies have landed
        if self.sharded:  # each shard into its live shard: nothing gathered, no load_state_dict hooks
            self.module.copy_into(module.state_dict())
        else:
            module.load_state_dict(self.module.value())  # copies into the live tensors
        for mirror, optimizer in zip(self.optimizers, optimizers, strict=False):
            # ``Optimizer.load_state_dict`` keeps tensors already on the parameter's device and dtype
            # as they are: without a copy the live state would alias the host buffers (on CPU), the
            # next steps would write into the snapshot, and a second rollback would restore those.
            optimizer.load_state_dict(tree_map(_clone_tensor, mirror.value()))
        if scaler is not None and self.scaler is not None:
            scaler.load_state_dict(copy.deepcopy(self.scaler))
        for scheduler, state in zip(schedulers, self.schedulers, strict=False):
            scheduler.load_state_dict(copy.deepcopy(state))
        if self.rng is not None:
            self.rng.restore()
