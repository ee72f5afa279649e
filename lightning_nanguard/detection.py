"""Device-side detection of NaN/Inf in many tensors at once, without writing to them.

Two entry points give the same ``[flag, grad_norm, others_flag]`` tensor, which the caller reads to
the host once per step (or hands to a fused optimizer as ``found_inf``, see
:mod:`lightning_nanguard.syncfree`):

- :func:`fused_health_check` (stateless): tensors are grouped by device and dtype; small tensors
  (fewer than :data:`SMALL_NUMEL` elements) are copied into one flat staging buffer per group (one
  ``torch.stack`` per repeated shape, one ``torch._foreach_copy_`` for the rest) and summed once;
  large ones are reduced by ``torch._foreach_norm``.
- :class:`GradientCheck` (stateful, for a fixed parameter list): each large gradient is summed by a
  ``register_post_accumulate_grad_hook`` as soon as autograd has written it (on a GPU overlapped with
  the rest of backward) into its slot of a device-side buffer; small gradients are staged into the
  same buffer after backward, by a plan built once. On this project's 2-core CPU benchmarks
  (docs/benchmarks.md) it costs 1.5-2x one read of every gradient byte on the ResNet-18- and
  GPT-2-shaped models, against 2.3-2.7x for the stateless function (whose ``_foreach_norm`` is
  slower than a sum on a CPU).

Neither writes to the tensors it checks: ``tensor._version`` is unchanged.

Why sums and norms: a sum or a norm is NaN if any element is NaN, and NaN or +/-Inf if any element
is +/-Inf, so a non-finite reduction is necessary for a non-finite element. Finite values can also
overflow a reduction (float32 values above ~1e19 in a norm, ~1e38 in a sum); the flag is therefore a
*candidate*, and :func:`nonfinite_names` confirms element-wise on the bad path only, so a step is
reported bad iff some element is NaN or +/-Inf.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from lightning_nanguard.timing import GuardClock

__all__ = [
    "SMALL_NUMEL",
    "GradientCheck",
    "all_finite",
    "bad_batchnorm_names",
    "fused_health_check",
    "grouped_norms",
    "negative_names",
    "nonfinite_candidate",
    "nonfinite_names",
]

log = logging.getLogger(__name__)

SMALL_NUMEL = 4096
"""Tensors with fewer elements are staged (copied into one flat buffer) and reduced together: on
this scale a kernel launch or a Python hook costs more than reading the values."""

_FLOAT32 = torch.float32
_LOW = (torch.float16, torch.bfloat16)
_STAGING_CACHE_SIZE = 32
_USELESS_CHECKS_BEFORE_UNHOOKING = 3


def _dense(tensors: Iterable[Tensor]) -> list[Tensor]:
    """Replace sparse tensors by their stored values (the only elements that can be non-finite)."""
    return [t.coalesce().values() if t.is_sparse else t for t in tensors]


def _foreach_norm(group: list[Tensor], dtype: torch.dtype) -> list[Tensor]:
    """L2 norm of each tensor of one (device, dtype) group; fp16/bf16 accumulate in float32."""
    norm_dtype = _FLOAT32 if dtype in _LOW else None
    try:
        return list(torch._foreach_norm(group, 2, dtype=norm_dtype))
    except (NotImplementedError, RuntimeError):  # sparse gradients (rare): norms of their stored values
        return list(torch._foreach_norm(_dense(group), 2, dtype=norm_dtype))


def grouped_norms(tensors: Sequence[Tensor], device: torch.device | None = None) -> Tensor:
    """Per-tensor L2 norms as one float32 vector, one ``_foreach_norm`` kernel per (device, dtype).

    Order of the result follows the grouping, not the input: use it for reductions (any
    non-finite, global norm), not to index back into ``tensors``.

    Args:
        tensors: floating-point (or complex) tensors on any devices and dtypes.
        device: where to gather the result; defaults to the device of the first tensor.

    Example:
        >>> grouped_norms([torch.tensor([3.0, 4.0]), torch.tensor([1.0], dtype=torch.float64)]).sort().values
        tensor([1., 5.])
    """
    if not tensors:
        return torch.zeros(0, dtype=_FLOAT32, device=device)
    target = device if device is not None else tensors[0].device
    grouped = _group_tensors_by_device_and_dtype([list(tensors)])
    parts: list[Tensor] = []
    for (group_device, dtype), ([group], _) in grouped.items():
        norms = _foreach_norm(group, dtype)  # type: ignore[arg-type]
        stacked = torch.stack(norms).to(_FLOAT32)
        if group_device != target:
            stacked = stacked.to(target, non_blocking=True)
        parts.append(stacked)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


_CONSTANTS: dict[tuple[float, torch.device], Tensor] = {}


def _constant(value: float, device: torch.device) -> Tensor:
    """A cached, never-modified 1-element float32 tensor (saves an allocation per step and device)."""
    key = (value, device)
    if key not in _CONSTANTS:
        _CONSTANTS[key] = torch.full((1,), value, dtype=_FLOAT32, device=device)
    return _CONSTANTS[key]


def _sum(flat: Tensor) -> Tensor:
    """0-dim sum of a buffer; fp16/bf16 accumulate in float32 (their own range would overflow)."""
    return flat.sum(dtype=_FLOAT32) if flat.dtype in _LOW else flat.sum()


class _Staging:
    """A flat buffer of one device and dtype that many tensors are copied into, with a few kernels.

    Built for a list of tensor shapes: tensors of a shape that occurs more than once are copied by
    one ``torch.stack`` per shape (a plain copy per tensor, ~4x cheaper than ``_foreach_copy_`` on
    a CPU), the others by one ``_foreach_copy_``. The sources are only read. :meth:`load` raises
    ``RuntimeError`` for a list of other shapes.
    """

    def __init__(self, like: Sequence[Tensor]) -> None:
        first = like[0]
        self.flat = torch.empty(sum(t.numel() for t in like), dtype=first.dtype, device=first.device)
        by_shape: dict[torch.Size, list[int]] = {}
        for index, tensor in enumerate(like):
            by_shape.setdefault(tensor.shape, []).append(index)
        self.stacks: list[tuple[list[int], torch.Size, Tensor]] = []
        self.single_indices: list[int] = []
        self.single_views: list[Tensor] = []
        offset = 0
        for shape, indices in by_shape.items():
            size = like[indices[0]].numel() * len(indices)
            view = self.flat[offset : offset + size].view(len(indices), *shape)
            offset += size
            if len(indices) > 1:
                self.stacks.append((indices, shape, view))
            else:
                self.single_indices.append(indices[0])
                self.single_views.append(view[0])

    def load(self, tensors: Sequence[Tensor]) -> Tensor:
        for indices, shape, view in self.stacks:
            if tensors[indices[0]].shape != shape:
                raise RuntimeError("other shapes than the staging buffer was built for")
            torch.stack([tensors[i] for i in indices], out=view)
        if self.single_indices:
            torch._foreach_copy_(self.single_views, [tensors[i] for i in self.single_indices])
        return self.flat


_STAGING: OrderedDict[tuple[torch.device, torch.dtype, tuple[int, ...]], _Staging] = OrderedDict()


def _staged(tensors: list[Tensor], sizes: list[int]) -> Tensor:
    """A flat copy of ``tensors`` (one device and dtype, dense; ``sizes`` their numels) through a cached buffer."""
    key = (tensors[0].device, tensors[0].dtype, tuple(sizes))
    staging = _STAGING.get(key)
    if staging is not None:
        _STAGING.move_to_end(key)
        try:
            return staging.load(tensors)
        except RuntimeError:  # the same sizes in other shapes: rebuild
            pass
    staging = _STAGING[key] = _Staging(tensors)
    while len(_STAGING) > _STAGING_CACHE_SIZE:
        _STAGING.popitem(last=False)
    return staging.load(tensors)


def _group_total(group: list[Tensor], dtype: torch.dtype, sqrt: bool = False) -> Tensor | None:
    """0-dim float32 that is non-finite if some element of ``group`` (one device and dtype) may be NaN/Inf.

    With ``sqrt``, negative values count too (their square root is NaN). ``None``: nothing to check.
    """
    if not (dtype.is_floating_point or dtype.is_complex):
        return None  # integers are always finite
    sizes = [t.numel() for t in group]
    if max(sizes) < SMALL_NUMEL:
        small, small_sizes, large = group, sizes, []
    else:
        small = [t for t, n in zip(group, sizes, strict=True) if n < SMALL_NUMEL]
        small_sizes = [n for n in sizes if n < SMALL_NUMEL]
        large = [t for t, n in zip(group, sizes, strict=True) if n >= SMALL_NUMEL]
    total: Tensor | None = None
    if small:
        try:
            flat = _staged(small, small_sizes)
            if sqrt:
                flat.sqrt_()  # of the staged copy: a negative value becomes NaN
            total = _sum(flat)
            if total.is_complex():
                total = torch.view_as_real(total).sum()
        except (RuntimeError, NotImplementedError):  # sparse tensors cannot be copied into a dense buffer
            large = large + small
    if large:
        if sqrt:
            large = list(torch._foreach_sqrt(_dense(large)))
        norms = torch.stack(_foreach_norm(large, dtype)).sum()
        total = norms if total is None else total + norms
    return total.to(_FLOAT32) if total is not None and total.dtype != _FLOAT32 else total


def _nonfinite_total(tensors: Sequence[Tensor], device: torch.device, sqrt: bool = False) -> Tensor | None:
    """0-dim float32 on ``device``, non-finite if some element of ``tensors`` may be NaN/Inf; ``None`` if none."""
    if not tensors:
        return None
    total: Tensor | None = None
    for (group_device, dtype), ([group], _) in _group_tensors_by_device_and_dtype([list(tensors)]).items():
        part = _group_total(group, dtype, sqrt)  # type: ignore[arg-type]
        if part is None:
            continue
        if group_device != device:
            part = part.to(device, non_blocking=True)
        total = part if total is None else total + part
    return total


def nonfinite_candidate(tensors: Sequence[Tensor], device: torch.device | None = None, sqrt: bool = False) -> Tensor:
    """1-element float32 tensor: 1.0 if some element of ``tensors`` *may* be NaN/Inf, else 0.0.

    Read-only, on the device, a few kernels per (device, dtype) whatever the number of tensors. A
    finite tensor can overflow a reduction: confirm a 1.0 with :func:`nonfinite_names`.

    Args:
        tensors: tensors of any devices, dtypes (integers are always finite) and layouts (sparse: their
            stored values).
        device: where the result lives; defaults to the device of the first tensor.
        sqrt: also flag negative values (as ``sqrt`` would make them NaN); for ``running_var``.

    Example:
        >>> nonfinite_candidate([torch.ones(3), torch.tensor([1.0, float("-inf")])]).tolist()
        [1.0]
        >>> nonfinite_candidate([torch.tensor([4.0, -1.0])], sqrt=True).tolist()
        [1.0]
    """
    target = device if device is not None else _first_device(tensors)
    total = _nonfinite_total(tensors, target, sqrt)
    if total is None:
        return torch.zeros(1, dtype=_FLOAT32, device=target)
    return (~torch.isfinite(total)).to(_FLOAT32).reshape(1)


def _others_total(others: Sequence[Tensor], nonnegative: Sequence[Tensor], device: torch.device) -> Tensor | None:
    """Non-finite if ``others`` may hold NaN/Inf, or ``nonnegative`` a negative value or NaN/Inf."""
    total = _nonfinite_total(others, device)
    nonempty = [t for t in nonnegative if t.numel()]
    if nonempty:
        negative = _nonfinite_total(nonempty, device, sqrt=True)
        total = negative if total is None else (total if negative is None else total + negative)
    return total


_SUMMARY_BASE: dict[torch.device, tuple[Tensor, Tensor, Tensor]] = {}


def _fast_summary(grads_total: Tensor | None, others_total: Tensor | None, device: torch.device) -> Tensor:
    """``[flag, -1 (no norm), others_flag]`` from two totals (non-finite: bad; ``None``: nothing checked)."""
    if device not in _SUMMARY_BASE:
        _SUMMARY_BASE[device] = (
            torch.zeros((), dtype=_FLOAT32, device=device),
            torch.tensor([0.0, -1.0, 0.0], dtype=_FLOAT32, device=device),
            torch.ones(3, dtype=_FLOAT32, device=device),
        )
    zero, healthy, bad = _SUMMARY_BASE[device]
    if grads_total is None and others_total is None:
        return healthy.clone()
    grads_total = zero if grads_total is None else grads_total
    others_total = zero if others_total is None else others_total
    totals = torch.stack((grads_total + others_total, zero, others_total))  # the middle one is always finite
    return torch.where(torch.isfinite(totals), healthy, bad)


def _first_device(*groups: Sequence[Tensor]) -> torch.device:
    first = next((t for group in groups for t in group), None)
    return first.device if first is not None else torch.device("cpu")


def fused_health_check(
    grads: Sequence[Tensor],
    others: Sequence[Tensor] = (),
    nonnegative: Sequence[Tensor] = (),
    device: torch.device | None = None,
    with_norm: bool = True,
) -> Tensor:
    """Check many tensors for NaN/Inf in one fused pass; return ``[flag, grad_norm, others_flag]``.

    Nothing is read to the host and nothing is written to the tensors: the caller decides when to
    pay the one synchronisation (``result.tolist()``), and may first reduce the tensor across
    processes. :class:`GradientCheck` gives the same result for a fixed parameter list at a lower cost.

    Args:
        grads: gradients; their global L2 norm is the second element of the result.
        others: further tensors to check (loss, BatchNorm running statistics).
        nonnegative: tensors that must also have no negative element (``running_var``).
        device: where the result lives; defaults to the device of the first tensor given.
        with_norm: compute the global gradient norm with ``_foreach_norm``; otherwise ``grad_norm``
            is -1 and the test uses the cheaper staged sums of :func:`nonfinite_candidate`.

    Returns:
        float32 tensor ``[flag, grad_norm, others_flag]``. ``flag`` is > 0 when some tensor *may*
        hold a NaN/Inf (confirm with :func:`nonfinite_names`: a finite tensor can overflow its norm
        or sum) or a negative value where none is allowed; ``others_flag`` is the same for
        ``others`` and ``nonnegative`` alone.
        ``grad_norm`` is NaN when a gradient holds a NaN, +Inf when one holds +/-Inf (and no NaN).

    Example:
        >>> fused_health_check([torch.ones(4)], others=[torch.tensor(0.5)]).tolist()
        [0.0, 2.0, 0.0]
        >>> fused_health_check([torch.tensor([1.0, float("nan")])]).tolist()[:2]
        [1.0, nan]
        >>> fused_health_check([torch.tensor([1.0, float("inf")])], with_norm=False).tolist()
        [1.0, -1.0, 0.0]
    """
    if device is None:
        device = _first_device(grads, others, nonnegative)
    if not with_norm:  # the fast path: a handful of kernels whatever the number of tensors
        return _fast_summary(_nonfinite_total(grads, device), _others_total(others, nonnegative, device), device)
    grad_norms = grouped_norms(grads, device)
    grads_bad = ~torch.isfinite(grad_norms).all()
    grad_norm = torch.linalg.vector_norm(grad_norms) if grads else torch.zeros((), dtype=_FLOAT32, device=device)
    others_bad = ~torch.isfinite(grouped_norms(others, device)).all()
    nonempty = [t for t in nonnegative if t.numel()]
    if nonempty:
        negated_maxima = torch._foreach_max(torch._foreach_neg(nonempty))
        others_bad = others_bad | (torch.stack(negated_maxima).to(device=device, dtype=_FLOAT32) > 0).any()
    return torch.stack(((grads_bad | others_bad).to(_FLOAT32), grad_norm, others_bad.to(_FLOAT32)))


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


def nonfinite_names(named_tensors: Iterable[tuple[str, Tensor]]) -> list[str]:
    """Names of the tensors holding at least one NaN or +/-Inf element (one host read in all).

    Example:
        >>> nonfinite_names([("a", torch.ones(2)), ("b", torch.tensor([float("-inf")]))])
        ['b']
    """
    names, tensors = _unzip(named_tensors)
    if not tensors:
        return []
    finite = _to_host([torch.isfinite(t).all() for t in _dense(tensors)])
    return [name for name, ok in zip(names, finite, strict=True) if not ok]


def negative_names(named_tensors: Iterable[tuple[str, Tensor]]) -> list[str]:
    """Names of the tensors holding at least one negative element (e.g. a corrupted ``running_var``).

    Example:
        >>> negative_names([("var", torch.tensor([1.0, -2.0])), ("ok", torch.ones(1))])
        ['var']
    """
    names, tensors = _unzip(named_tensors)
    if not tensors:
        return []
    negative = _to_host([(t < 0).any() for t in tensors])
    return [name for name, bad in zip(names, negative, strict=True) if bad]


def bad_batchnorm_names(named_buffers: Iterable[tuple[str, Tensor]]) -> list[str]:
    """BatchNorm buffers holding NaN/Inf, then ``running_var`` buffers holding a negative value.

    Example:
        >>> bad_batchnorm_names([("bn.running_mean", torch.tensor([float("nan")])),
        ...                      ("bn.running_var", torch.tensor([-1.0]))])
        ['bn.running_mean', 'bn.running_var']
    """
    floats = [(name, tensor) for name, tensor in named_buffers if tensor.is_floating_point()]
    bad = nonfinite_names(floats)
    negative = negative_names((name, tensor) for name, tensor in floats if name.endswith("running_var"))
    return bad + [name for name in negative if name not in bad]


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """Element-wise: no NaN/Inf in any of ``tensors`` (floating/complex; others are ignored).

    One fused norm pass and one host read; only when a norm is non-finite (which a finite tensor
    can also cause, by overflowing its norm) are the tensors checked element by element.

    Example:
        >>> all_finite([torch.ones(2), torch.full((4,), 1e30)])  # the float32 norm overflows
        True
        >>> all_finite([torch.tensor([1.0, float("nan")]), torch.arange(3)])
        False
    """
    floats = [t.detach() for t in tensors if t.is_floating_point() or t.is_complex()]
    if not floats or bool(torch.isfinite(grouped_norms(floats)).all()):
        return True
    return not nonfinite_names((str(i), t) for i, t in enumerate(floats))


def _to_host(flags: Sequence[Tensor]) -> list[bool]:
    """Read 0-dim boolean tensors to the host with one synchronisation per device."""
    by_device: dict[torch.device, list[int]] = {}
    for position, flag in enumerate(flags):
        by_device.setdefault(flag.device, []).append(position)
    values = [False] * len(flags)
    for positions in by_device.values():
        for position, value in zip(positions, torch.stack([flags[i] for i in positions]).tolist(), strict=True):
            values[position] = bool(value)
    return values


def _unzip(named_tensors: Iterable[tuple[str, Tensor]]) -> tuple[list[str], list[Tensor]]:
    pairs = list(named_tensors)
    return [name for name, _ in pairs], [tensor.detach() for _, tensor in pairs]
