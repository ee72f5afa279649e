"""Building blocks for checking steps without reading the device on healthy steps (opt-in).

The default guard reads one small tensor to the host per step; on a GPU that read stalls the CPU
until the step's kernels have run, so it cannot queue the next forward meanwhile. These pieces let
the skip decision stay on the device, and the host learn about it one step later:

- :class:`DeviceSkip`: torch's *fused* Adam, AdamW, SGD and Adagrad skip their update inside the
  kernel when ``optimizer.found_inf`` is 1 (the attribute a GradScaler sets). The guard's flag is
  handed over as that tensor, combined with a GradScaler's own when one is active.
- :class:`SelectRestore`: BatchNorm running statistics (or any tensors) captured before the forward
  and put back with ``torch.where(flag, saved, live)`` on the device (a select: NaN-safe, exact, also
  for the int64 ``num_batches_tracked``).
- :class:`DeferredRead`: a non-blocking copy of the step's summary into pinned host memory with a
  CUDA event; the guard reads it before the next step's forward, when it has long arrived.
- :func:`device_skip_unsupported`: whether an optimizer supports the mode; the others keep the one
  host read per step.

Example (CPU, a fused AdamW and a NaN step that the kernel skips):
    >>> param = torch.nn.Parameter(torch.ones(3))
    >>> opt = torch.optim.AdamW([param], lr=0.1, fused=True)
    >>> skip = DeviceSkip(opt)
    >>> param.grad = torch.full((3,), float("nan"))
    >>> skip.arm(torch.tensor([1.0]))  # e.g. fused_health_check(...)[0]
    True
    >>> _ = opt.step()
    >>> param.tolist()
    [1.0, 1.0, 1.0]
    >>> skip.remove()
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype
from torch.utils.hooks import RemovableHandle

__all__ = ["DeferredRead", "DeviceSkip", "SelectRestore", "device_skip_unsupported", "scaler_found_inf"]

_FLOAT32 = torch.float32


def _inner(optimizer: Any) -> Optimizer:
    """The torch optimizer behind a ``LightningOptimizer``."""
    return getattr(optimizer, "_optimizer", optimizer)


def _scaler_active(scaler: Any) -> bool:
    return scaler is not None and bool(getattr(scaler, "is_enabled", lambda: False)())


def _fused(optimizer: Optimizer) -> bool:
    """Every parameter group runs torch's fused kernel, which honours ``found_inf``."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
        bool(group.get("fused")) for group in optimizer.param_groups
    )


def device_skip_unsupported(optimizer: Any, scaler: Any = None) -> str | None:
    """Why ``optimizer`` cannot skip a step on the device (a warning text), or ``None`` if it can.

    Supported: torch's fused Adam, AdamW, SGD and Adagrad (``fused=True``), and any optimizer while
    a GradScaler is active (the scaler then skips; it reads its own flag to the host for non-fused
    optimizers, as it always does).

    Example:
        >>> p = torch.nn.Parameter(torch.ones(1))
        >>> device_skip_unsupported(torch.optim.Adam([p], fused=True)) is None
        True
        >>> print(device_skip_unsupported(torch.optim.Adam([p])))  # doctest: +ELLIPSIS
        Adam is not fused: only torch's fused Adam, AdamW, SGD and Adagrad (fused=True) skip a step on the device...
    """
    optimizer = _inner(optimizer)
    if _scaler_active(scaler) or _fused(optimizer):
        return None
    return (
        f"{type(optimizer).__name__} is not fused: only torch's fused Adam, AdamW, SGD and Adagrad (fused=True) "
        "skip a step on the device; NanGuard reads its flag to the host once per step instead."
    )


def scaler_found_inf(scaler: Any, optimizer: Any) -> Tensor | None:
    """A GradScaler's own NaN/Inf flag for ``optimizer`` (0-dim, on the scaler's device), if computed yet.

    After ``scaler.unscale_(optimizer)`` (Lightning calls it before ``on_before_optimizer_step`` for
    non-fused optimizers) the scaler has already tested every gradient: this sum of its per-device
    flags is a free gradient check. ``None`` before that, or without an active scaler.

    Example:
        >>> scaler = torch.amp.GradScaler("cpu")
        >>> _ = scaler.scale(torch.ones(()))  # the scaler starts with its first scaled loss
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.SGD([p], lr=0.1)
        >>> p.grad = torch.tensor([1.0, float("inf")])
        >>> scaler.unscale_(opt)
        >>> scaler_found_inf(scaler, opt).item()
        1.0
    """
    if not _scaler_active(scaler):
        return None
    state = scaler._per_optimizer_states.get(id(_inner(optimizer)), {})
    per_device = state.get("found_inf_per_device") or {}
    if not per_device:
        return None
    device = scaler._scale.device if scaler._scale is not None else next(iter(per_device))
    flags = [flag.to(device, non_blocking=True) for flag in per_device.values()]
    return flags[0] if len(flags) == 1 else torch.stack(flags).sum()


def _exact_flag(flag: Tensor, device: torch.device) -> Tensor:
    """0-dim float32 that is exactly 1.0 (skip) or 0.0: fused kernels skip only on ``found_inf == 1``.

    A NaN flag counts as set.
    """
    return (flag.reshape(()) != 0).to(device=device, dtype=_FLOAT32, non_blocking=True)


class DeviceSkip:
    """Hands a device-side flag to ``optimizer`` as ``found_inf``: the coming update is skipped iff it is set.

    Call :meth:`arm` once per optimizer step, after the check and before the update
    (``on_before_optimizer_step``). Where the flag goes:

    - a GradScaler is active and has unscaled this optimizer (Lightning does so for non-fused
      optimizers before ``on_before_optimizer_step``): into the scaler's per-device flags, so
      ``scaler.step`` skips and ``scaler.update`` backs off the loss scale, exactly as for an
      overflow (a NaN step then costs one back-off of the scale);
    - a fused optimizer: into ``optimizer.found_inf``, which the fused kernel reads after the
      closure has run; if a GradScaler then sets its own ``found_inf`` (it does for fused
      optimizers, inside ``scaler.step``), an optimizer step pre-hook combines the two. The kernel
      leaves weights and state bitwise untouched (the step count is incremented and decremented
      again) and the loss scale is not backed off for the guard's flag. A step post-hook removes
      the attribute again;
    - otherwise :meth:`arm` returns ``False`` and changes nothing: the caller reads the flag to the
      host and skips the usual way.

    Args:
        optimizer: the optimizer (a ``LightningOptimizer`` is unwrapped).
        scaler: the Trainer's GradScaler, if any.
    """

    def __init__(self, optimizer: Any, scaler: Any = None) -> None:
        self.optimizer = _inner(optimizer)
        self.scaler = scaler
        self._pending: Tensor | None = None
        self._ours: Tensor | None = None  # the ``found_inf`` this object set (and must remove)
        self._handles: list[RemovableHandle] = []

    def arm(self, flag: Tensor, exact: bool = False) -> bool:
        """Skip the coming update on the device iff ``flag != 0``; ``False``: cannot, nothing changed.

        ``flag`` is any one-element tensor (e.g. ``fused_health_check(...)[0]``, reduced across ranks);
        NaN counts as set. ``exact``: ``flag`` is already a 0-dim float32 of 0 or 1 on the optimizer's
        device, handed to the fused kernel as it is (no conversion kernels).
        """
        optimizer = self.optimizer
        if _scaler_active(self.scaler):
            state = self.scaler._per_optimizer_states.get(id(optimizer), {})
            per_device = state.get("found_inf_per_device") or {}
            if per_device:  # unscaled already: the scaler decides from these flags
                for device, found in per_device.items():
                    torch.maximum(found, _exact_flag(flag, device), out=found)
                return True
        if not _fused(optimizer) or self._first_momentum_step():
            return False
        if not self._handles:
            self._handles = [
                optimizer.register_step_pre_hook(self._before_step),
                optimizer.register_step_post_hook(self._after_step),
            ]
        self._pending = flag
        self._ours = flag if exact else _exact_flag(flag, flag.device)
        optimizer.found_inf = self._ours  # type: ignore[attr-defined]
        return True

    def _first_momentum_step(self) -> bool:
        """Fused SGD with momentum allocates its buffers uninitialised on the first step: a skip would keep garbage."""
        if not isinstance(self.optimizer, torch.optim.SGD):
            return False
        state = self.optimizer.state  # the first step is the one where no parameter has a buffer yet
        return any(
            group.get("momentum", 0) != 0
            and all(state.get(p, {}).get("momentum_buffer") is None for p in group["params"])
            for group in self.optimizer.param_groups
        )

    def _before_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """Inside ``scaler.step``: the scaler has replaced our ``found_inf`` by its own; combine them."""
        theirs = getattr(optimizer, "found_inf", None)
        if self._pending is None or theirs is None or theirs is self._ours:
            return
        combined = torch.maximum(_exact_flag(theirs, theirs.device), _exact_flag(self._pending, theirs.device))
        optimizer.found_inf = combined  # type: ignore[attr-defined]
        self._ours = None  # the scaler removes the attribute after the step

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self._forget(optimizer)

    def _forget(self, optimizer: Optimizer) -> None:
        if self._ours is not None and getattr(optimizer, "found_inf", None) is self._ours:
            del optimizer.found_inf  # type: ignore[attr-defined]
        self._ours = None
        self._pending = None

    def remove(self) -> None:
        """Remove the optimizer hooks and any flag not consumed yet."""
        self._forget(self.optimizer)
        for handle in self._handles:
            handle.remove()
        self._handles = []


class SelectRestore:
    """A copy of some tensors, put back on the device where a flag is set: ``live = where(flag, saved, live)``.

    Made for BatchNorm running statistics in a step whose flags the host has not read yet. One
    flat buffer per (device, dtype) holds the copy; :meth:`capture` and :meth:`restore_where_` are
    a few foreach kernels per group whatever the number of tensors, and never synchronise. The
    select is exact (bitwise) and NaN-safe, unlike arithmetic blending (``NaN * 0`` is NaN), and
    works for integer tensors (``num_batches_tracked``). On healthy steps the live values are
    written back unchanged.

    Example:
        >>> bn = torch.nn.BatchNorm1d(2)
        >>> restore = SelectRestore([bn.running_mean, bn.running_var, bn.num_batches_tracked])
        >>> restore.capture()
        >>> _ = bn(torch.tensor([[1.0, float("nan")], [2.0, 3.0]]))
        >>> restore.restore_where_(torch.tensor([1.0]))  # the step was bad
        >>> bn.running_mean.tolist(), bn.num_batches_tracked.item()
        ([0.0, 0.0], 0)
    """

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        self.tensors = [t.detach() for t in tensors]
        self._groups: list[tuple[list[Tensor], list[Tensor], Tensor, list[Tensor], Tensor]] = []  # live, saved, scratch
        if not self.tensors:
            return
        tensor_lists: list[list[Tensor | None]] = [list(self.tensors)]
        for (_, _), ([group], _) in _group_tensors_by_device_and_dtype(tensor_lists).items():
            live: list[Tensor] = list(group)  # type: ignore[arg-type]
            saved_flat, saved = self._flat_like(live)
            scratch_flat, scratch = self._flat_like(live)
            self._groups.append((live, saved, saved_flat, scratch, scratch_flat))
        self.capture()

    @staticmethod
    def _flat_like(tensors: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        first = tensors[0]
        flat = torch.empty(sum(t.numel() for t in tensors), dtype=first.dtype, device=first.device)
        parts = torch.split(flat, [t.numel() for t in tensors])
        return flat, [part.view(t.shape) for part, t in zip(parts, tensors, strict=True)]

    def capture(self) -> None:
        """Copy the current values (one ``_foreach_copy_`` per group)."""
        with torch.no_grad():
            for live, saved, _, _, _ in self._groups:
                torch._foreach_copy_(saved, live)

    def restore_where_(self, flag: Tensor) -> None:
        """Put the captured values back if ``flag != 0`` (a one-element tensor, NaN counts as set), on the device."""
        bad: dict[torch.device, Tensor] = {}
        with torch.no_grad():
            for live, _, saved_flat, scratch, scratch_flat in self._groups:
                device = saved_flat.device
                if device not in bad:
                    bad[device] = (flag.reshape(()) != 0).to(device, non_blocking=True)
                torch._foreach_copy_(scratch, live)
                torch.where(bad[device], saved_flat, scratch_flat, out=scratch_flat)
                torch._foreach_copy_(live, scratch)

    @property
    def nbytes(self) -> int:
        """Memory held (the copy and the scratch buffer), in bytes."""
        return sum(2 * g[2].numel() * g[2].element_size() for g in self._groups)


class DeferredRead:
    """Reads small device tensors to the host without waiting: :meth:`start` now, :meth:`result` later.

    On CUDA the values are copied with ``non_blocking=True`` into a reused pinned host buffer and a
    CUDA event is recorded on the current stream; :meth:`result` waits on that event only (by the
    next step's forward the copy has long arrived). Elsewhere (CPU, other devices) the copy is a
    plain one, made at :meth:`start`. Reads come back first in, first out.

    Example:
        >>> reader = DeferredRead()
        >>> reader.start(torch.tensor([0.0, 2.5, 0.0]))
        >>> reader.pending
        1
        >>> reader.result()
        [0.0, 2.5, 0.0]
    """

    def __init__(self) -> None:
        self._queue: deque[tuple[Tensor, Any]] = deque()
        self._free: list[Tensor] = []

    @property
    def pending(self) -> int:
        """Reads started and not yet collected."""
        return len(self._queue)

    def start(self, values: Tensor) -> None:
        """Begin copying ``values`` to the host; nothing waits here."""
        values = values.detach()
        if values.device.type != "cuda":
            self._queue.append((values.to("cpu", copy=True), None))
            return
        host = self._host_buffer(values)
        host.copy_(values.reshape(host.shape), non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(values.device))
        self._queue.append((host, event))

    def _host_buffer(self, like: Tensor) -> Tensor:
        for index, buffer in enumerate(self._free):
            if buffer.numel() == like.numel() and buffer.dtype == like.dtype:
                return self._free.pop(index)
        return torch.empty(like.numel(), dtype=like.dtype, pin_memory=True)

    def ready(self) -> bool:
        """Whether the oldest read has arrived (``True`` when none is pending)."""
        if not self._queue:
            return True
        event = self._queue[0][1]
        return event is None or bool(event.query())

    def result(self) -> list[float]:
        """The oldest read's values, waiting for its copy if needed (on CUDA: for its event only)."""
        if not self._queue:
            raise RuntimeError("DeferredRead.result(): no read was started.")
        host, event = self._queue.popleft()
        if event is None:
            return host.reshape(-1).tolist()
        event.synchronize()
        values = host.tolist()
        self._free.append(host)
        return values

    def clear(self) -> None:
        """Forget every pending read."""
        self._queue.clear()
