"""A stateful gradient check that sums large gradients while backward runs. Not on the guard's path.

:class:`GradientCheck` gives :func:`~lightning_nanguard.detect.check.fused_health_check`'s result
for a fixed parameter list: each large gradient is summed by a ``register_post_accumulate_grad_hook``
as soon as autograd has written it (on a GPU overlapped with the rest of backward) into its slot of
a device-side buffer; small gradients are staged into the same buffer after backward, by a plan
built once. Usable in custom loops.

Why the guard does not use it (``bash scripts/bench.sh``, docs/benchmarks.md, 2-core CPU): the
check alone costs 2.05x / 2.57x one read of every gradient byte on the ResNet-18- and GPT-2-shaped
models against 2.93x / 2.84x for the stateless check, but 7.67x against 5.58x on the 2-layer
transformer, where a Python hook per parameter costs more than it saves; wired into the guard it
lowered ResNet-18 from 2.8% to 2.3% of a step and raised GPT-2 (2.3% to 2.6%) and the transformer
(3.1% to 4.0%). The benchmark keeps measuring it side by side.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_nanguard.detect.check import (
    _FLOAT32,
    SMALL_NUMEL,
    _fast_summary,
    _first_device,
    _group_total,
    _nonfinite_total,
    _others_total,
    _sum,
    fused_health_check,
)

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from lightning_nanguard.core.timing import GuardClock

__all__ = ["GradientCheck"]

log = logging.getLogger(__name__)

_USELESS_CHECKS_BEFORE_UNHOOKING = 3


class _GradientStaging:
    """Copies the gradients of small parameters (one device and dtype) into one flat buffer, on the device.

    Parameters of the same shape are copied by one ``torch.stack`` each (a plain copy per element,
    ~4x cheaper per tensor than ``_foreach_copy_`` on a CPU), the others by one ``_foreach_copy_``.
    Missing gradients read as 0. The buffer starts with ``slots`` extra elements (the hooks' sums
    of large gradients), so one reduction covers both.
    """

    def __init__(self, params: list[Tensor], device: torch.device, dtype: torch.dtype, slots: int = 0) -> None:
        self.flat = torch.zeros(slots + sum(p.numel() for p in params), dtype=dtype, device=device)
        self.slots = self.flat[:slots]
        by_shape: dict[torch.Size, list[Tensor]] = {}
        for param in params:
            by_shape.setdefault(param.shape, []).append(param)
        self.stacks: list[tuple[list[Tensor], Tensor, list[Tensor]]] = []  # params, (n, *shape) view, item views
        self.single_params: list[Tensor] = []
        self.single_views: list[Tensor] = []
        offset = slots
        for shape, group in by_shape.items():
            size = group[0].numel() * len(group)
            stacked = self.flat[offset : offset + size].view(len(group), *shape)
            offset += size
            if len(group) > 1:
                self.stacks.append((group, stacked, list(stacked.unbind(0))))
            else:
                self.single_params.append(group[0])
                self.single_views.append(stacked[0])

    def load(self) -> Tensor | None:
        """The buffer holding every current gradient; ``None`` when none of them exists."""
        present = 0
        for params, stacked, items in self.stacks:
            grads = [p.grad for p in params]
            try:
                torch.stack(grads, out=stacked)  # type: ignore[arg-type]
                present += len(grads)
            except TypeError:  # some gradient is None
                present += self._copy_present(grads, items)
        if self.single_params:
            present += self._copy_present([p.grad for p in self.single_params], self.single_views)
        return self.flat if present or self.slots.numel() else None

    @staticmethod
    def _copy_present(grads: list[Tensor | None], views: list[Tensor]) -> int:
        present = [g for g in grads if g is not None]
        if len(present) < len(grads):
            torch._foreach_zero_([v for v, g in zip(views, grads, strict=True) if g is None])
        if present:
            torch._foreach_copy_([v for v, g in zip(views, grads, strict=True) if g is not None], present)
        return len(present)


class GradientCheck:
    """Read-only NaN/Inf check of the gradients of a fixed parameter list, mostly done during backward.

    Parameters with at least :data:`SMALL_NUMEL` elements get a ``register_post_accumulate_grad_hook``
    that sums the gradient, as soon as autograd has accumulated it, into the parameter's slot of a
    device-side vector (one kernel per parameter, no host read). The others are copied into one
    staging buffer per (device, dtype) after backward and summed once. :meth:`health_check` then
    gives :func:`fused_health_check`'s result.

    A gradient replaced or modified in place after its hook ran (the user's ``on_after_backward``,
    DDP's all-reduce, a GradScaler's unscale, FSDP, ...) is recognised by its identity and version
    counter and read again after backward, so the check is always of the gradients as they are.
    When every hooked gradient had to be read again in 3 checks in a row, the hooks are removed and
    everything is checked after backward.

    Args:
        params: the parameters whose ``.grad`` is checked.
        stream: hook large gradients (default); ``False`` checks everything after backward.
        clock: time spent in the hooks is added to ``clock`` under ``"gradient_hooks"`` while
            ``clock.enabled``.

    Attributes:
        enabled: while ``False`` the hooks do nothing (set it on micro-batches or steps that are not
            checked; the last micro-batch's hooks see the accumulated gradient).
        rechecked: how many hooked gradients the last check had to read again.

    Example:
        >>> layer = torch.nn.Linear(128, 64)
        >>> check = GradientCheck(layer.parameters())
        >>> layer(torch.randn(4, 128)).sum().backward()
        >>> check.health_check(with_norm=False).tolist()
        [0.0, -1.0, 0.0]
        >>> with torch.no_grad():
        ...     layer.weight.grad[0, 0] = float("nan")  # after backward: read again, still caught
        >>> check.health_check(with_norm=False).tolist()[0]
        1.0
        >>> check.remove()
    """

    def __init__(self, params: Iterable[Tensor], stream: bool = True, clock: GuardClock | None = None) -> None:
        self.params = list(params)
        self.enabled = True
        self.clock = clock
        self.rechecked = 0
        self._large = [p for p in self.params if p.numel() >= SMALL_NUMEL]
        self._seen: list[Tensor | None] = [None] * len(self._large)
        self._versions = [0] * len(self._large)
        self._handles: list[RemovableHandle] = []
        self._useless_checks = 0
        large_per_device: dict[torch.device, int] = {}
        for param in self._large:
            large_per_device[param.device] = large_per_device.get(param.device, 0) + 1
        by_group: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {(d, _FLOAT32): [] for d in large_per_device}
        for param in self.params:
            if param.numel() < SMALL_NUMEL:
                by_group.setdefault((param.device, param.dtype), []).append(param)
        self._small = [
            (group, _GradientStaging(group, device, dtype, large_per_device.get(device, 0) if dtype == _FLOAT32 else 0))
            for (device, dtype), group in by_group.items()
        ]
        self._slots = {s.flat.device: s.slots for _, s in self._small if s.slots.numel()}
        if stream:
            self._hook_large_params()

    @property
    def streaming(self) -> bool:
        """Whether the hooks are installed."""
        return bool(self._handles)

    def _hook_large_params(self) -> None:
        positions: dict[torch.device, int] = {}
        for index, param in enumerate(self._large):
            position = positions.get(param.device, 0)
            positions[param.device] = position + 1
            hook = self._hook(index, self._slots[param.device][position], tuple(range(param.dim())))
            self._handles.append(param.register_post_accumulate_grad_hook(hook))

    def _hook(self, index: int, slot: Tensor, dims: tuple[int, ...]) -> Callable[[Tensor], None]:
        seen, versions = self._seen, self._versions  # mutated in place, never rebound

        def check_gradient(param: Tensor) -> None:
            if not self.enabled:
                return
            grad = param.grad
            if grad is None:
                return
            try:
                if grad.layout is torch.strided and not grad.requires_grad and not grad.is_complex():
                    torch.sum(grad, dims, dtype=_FLOAT32, out=slot)  # float64 too: an overflow is only a candidate
                else:  # sparse, complex, or a graph of gradients (create_graph=True)
                    total = _group_total([grad.detach()], grad.dtype)
                    if total is None:
                        slot.zero_()
                    else:
                        slot.copy_(total)
            except Exception:  # never break backward: the gradient is read again after it
                seen[index] = None
                return
            seen[index] = grad
            versions[index] = grad._version

        clock = self.clock
        if clock is None:
            return check_gradient

        def timed_check_gradient(param: Tensor) -> None:
            if not clock.enabled:
                check_gradient(param)
                return
            with clock.measure("gradient_hooks"):
                check_gradient(param)

        return timed_check_gradient

    def remove(self) -> None:
        """Remove the hooks (the check keeps working, after backward)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for slots in self._slots.values():
            slots.zero_()

    def grads(self) -> list[Tensor]:
        """The gradients that exist now, in parameter order."""
        return [g for p in self.params if (g := p.grad) is not None]

    def health_check(
        self,
        others: Sequence[Tensor] = (),
        nonnegative: Sequence[Tensor] = (),
        device: torch.device | None = None,
        with_norm: bool = False,
    ) -> Tensor:
        """:func:`fused_health_check` of the current gradients; hooked gradients are not read again.

        Also resets the slots for the next step. With ``with_norm`` every gradient is read (the
        global norm needs them all).

        Example:
            >>> check = GradientCheck([torch.nn.Parameter(torch.ones(3))], stream=False)
            >>> check.params[0].grad = torch.tensor([3.0, 4.0, 0.0])
            >>> check.health_check(others=[torch.tensor(1.0)], with_norm=True).tolist()
            [0.0, 5.0, 0.0]
        """
        if device is None:
            device = _first_device(self.params, others, nonnegative)
        if with_norm:
            self._forget_step()
            return fused_health_check(self.grads(), others, nonnegative, device, with_norm=True)
        return _fast_summary(self._grads_total(device), _others_total(others, nonnegative, device), device)

    def _grads_total(self, device: torch.device) -> Tensor | None:
        """0-dim float32, non-finite if some current gradient may hold NaN/Inf; resets the slots."""
        parts: list[Tensor] = []
        if self._handles:
            recheck: list[Tensor] = []
            present = 0
            seen, versions = self._seen, self._versions
            for index, param in enumerate(self._large):
                grad = param.grad
                if grad is None:
                    continue
                present += 1
                if grad is not seen[index] or grad._version != versions[index]:
                    recheck.append(grad)
            self._note_usefulness(present, len(recheck))  # the slots are summed with the staged gradients
        else:
            recheck = [g for p in self._large if (g := p.grad) is not None]
        self.rechecked = len(recheck)
        late = _nonfinite_total(recheck, device)
        if late is not None:
            parts.append(late)
        for params, staging in self._small:
            try:
                flat = staging.load()
            except (RuntimeError, NotImplementedError):  # sparse or mismatched gradients: the generic path
                late = _nonfinite_total([g for p in params if (g := p.grad) is not None], device)
                if late is not None:
                    parts.append(late)
                if staging.slots.numel():  # the hooks' sums share the buffer
                    parts.append(staging.slots.sum())
                continue
            if flat is not None:
                total = _sum(flat)
                parts.append(total if not total.is_complex() else torch.view_as_real(total).sum())
        self._forget_step()
        if not parts:
            return None
        moved = [t.to(device=device, dtype=_FLOAT32, non_blocking=True) for t in parts]
        return moved[0] if len(moved) == 1 else torch.stack(moved).sum()

    def _note_usefulness(self, present: int, rechecked: int) -> None:
        useless = present > 0 and rechecked == present
        self._useless_checks = self._useless_checks + 1 if useless else 0
        if self._useless_checks >= _USELESS_CHECKS_BEFORE_UNHOOKING:
            log.debug("NanGuard: gradients are rewritten after backward; checking them after backward only.")
            self._forget_step()
            self.remove()

    def _forget_step(self) -> None:
        for slots in self._slots.values():
            slots.zero_()
        self._seen[:] = [None] * len(self._seen)
