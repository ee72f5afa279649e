"""The per-step check: NaN/Inf in many tensors at once, on the device, without writing to them.

:func:`fused_health_check` gives a ``[flag, grad_norm, others_flag]`` tensor which the caller
reads to the host once per step (or hands to a fused optimizer as ``found_inf``, see
:mod:`lightning_nanguard.detect.syncfree`). Tensors are grouped by device and dtype; small
tensors (fewer than :data:`SMALL_NUMEL` elements) are copied into one flat staging buffer per
group (one ``torch.stack`` per repeated shape, one ``torch._foreach_copy_`` for the rest) and
summed once; large ones are reduced by ``torch._foreach_norm`` (on a CPU, which launches no kernel,
by one sum each: a sum reads faster than a norm there). Nothing is written to the tensors
checked: ``tensor._version`` is unchanged. (:class:`~lightning_nanguard.detect.streaming.GradientCheck`
is a stateful variant that sums large gradients during backward; the guard does not use it, see
its module.)

Why sums and norms: a sum or a norm is NaN if any element is NaN, and NaN or +/-Inf if any element
is +/-Inf, so a non-finite reduction is necessary for a non-finite element. Finite values can also
overflow a reduction (float32 values above ~1e19 in a norm, ~1e38 in a sum); the flag is therefore a
*candidate*, and :func:`~lightning_nanguard.detect.confirm.nonfinite_names` confirms element-wise
on the bad path only, so a step is reported bad iff some element is NaN or +/-Inf.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from lightning_nanguard.detect.staging import STAGING as _STAGING  # noqa: F401  (tests inspect the cache)
from lightning_nanguard.detect.staging import LayoutPlans, Selector, Staging, pick, selector, staged

# what the torch.utils wrapper calls, without its no_grad decorator (a context manager per call; grouping
# runs no autograd op)
_group_by_device_and_dtype = getattr(torch._C, "_group_tensors_by_device_and_dtype", None)

__all__ = [
    "CPU_SUM_NUMEL",
    "SMALL_NUMEL",
    "cpu_totals",
    "fused_health_check",
    "grouped_norms",
    "nonfinite_candidate",
    "plan_layout",
]

SMALL_NUMEL = 4096
"""Tensors with fewer elements are staged (copied into one flat buffer) and reduced together: on
this scale a kernel launch or a Python hook costs more than reading the values."""

CPU_SUM_NUMEL = 1 << 17
"""On a CPU, tensors with at least this many elements are summed one call each, not normed (:func:`cpu_totals`)."""

_FLOAT32 = torch.float32
_LOW = (torch.float16, torch.bfloat16)


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

    Examples:
        >>> grouped_norms([torch.tensor([3.0, 4.0]), torch.tensor([1.0], dtype=torch.float64)]).sort().values
        tensor([1., 5.])
    """
    if not tensors:
        return torch.zeros(0, dtype=_FLOAT32, device=device)
    target = device if device is not None else tensors[0].device
    grouped = _grouped(tensors)
    parts: list[Tensor] = []
    for (group_device, dtype), ([group], _) in grouped.items():
        norms = _foreach_norm(group, dtype)
        stacked = torch.stack(norms).to(_FLOAT32)
        if group_device != target:
            stacked = stacked.to(target, non_blocking=True)
        parts.append(stacked)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _sum(flat: Tensor) -> Tensor:
    """0-dim sum of a buffer; fp16/bf16 accumulate in float32 (their own range would overflow)."""
    return flat.sum(dtype=_FLOAT32) if flat.dtype in _LOW else flat.sum()


def cpu_totals(large: list[Tensor], dtype: torch.dtype) -> list[Tensor]:
    """0-dim float32 totals of large tensors of one CPU ``dtype``, each non-finite if one of its tensors may be.

    A CPU launches no kernel; what costs is reading, and a Python call per tensor. A sum reads faster
    than a norm (ResNet-18's gradients: 2.12 against 2.63 ms, one flat read 1.98 ms) but costs a call
    each, which is more than the norm's extra reading below :data:`CPU_SUM_NUMEL` elements (nine
    transformer gradients of 16K-65K: 124 us summed, 93 us normed): those share one ``_foreach_norm``.

    Example:
        >>> [float(t) for t in cpu_totals([torch.full((CPU_SUM_NUMEL,), 0.5), torch.full((4096,), 0.5)], torch.float32)]
        [32.0, 65536.0]
    """
    normed = [t for t in large if t.numel() < CPU_SUM_NUMEL]
    totals = _foreach_norm(normed, dtype) if normed else []
    for tensor in _dense([t for t in large if t.numel() >= CPU_SUM_NUMEL]):
        total = _sum(tensor)
        totals.append(torch.view_as_real(total).sum() if total.is_complex() else total)
    return totals


def _group_total(group: list[Tensor], dtype: torch.dtype, sqrt: bool = False, norm: bool = False) -> Tensor | None:
    """0-dim float32 that is non-finite if some element of ``group`` (one device and dtype) may be NaN/Inf.

    With ``sqrt``, negative values count too (their square root is NaN); with ``norm`` the total is
    the group's L2 norm (NaN with a NaN, +Inf with an Inf). ``None``: nothing to check.
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
    flat: Tensor | None = None
    if small:
        try:
            flat = staged(small, small_sizes)
        except (RuntimeError, NotImplementedError):  # sparse tensors cannot be copied into a dense buffer
            large = large + small
    return _reduced(flat, large, dtype, sqrt, norm)


def _reduced(flat: Tensor | None, large: list[Tensor], dtype: torch.dtype, sqrt: bool, norm: bool) -> Tensor | None:
    """The total (or L2 norm) of a staged buffer and of ``large`` tensors of one device and ``dtype``, in float32."""
    total: Tensor | None = None
    if flat is not None:
        if sqrt:
            flat.sqrt_()  # of the staged copy: a negative value becomes NaN
        if norm:
            total = torch.linalg.vector_norm(flat, dtype=_FLOAT32 if dtype in _LOW else None)
        else:
            total = _sum(flat)
            if total.is_complex():
                total = torch.view_as_real(total).sum()
    if large:
        if sqrt:
            large = list(torch._foreach_sqrt(_dense(large)))
        if not norm and large[0].device.type == "cpu":
            part = torch.stack(cpu_totals(large, dtype)).sum()
        else:
            norms = torch.stack(_foreach_norm(large, dtype))
            part = torch.linalg.vector_norm(norms) if norm else norms.sum()
        if total is None:
            total = part
        else:
            total = torch.linalg.vector_norm(torch.stack((total.to(part.dtype), part))) if norm else total + part
    return total.to(_FLOAT32) if total is not None and total.dtype != _FLOAT32 else total


def _grouped(tensors: Sequence[Tensor], with_indices: bool = False) -> dict[Any, Any]:
    listed = tensors if isinstance(tensors, list) else list(tensors)
    if _group_by_device_and_dtype is not None:
        return _group_by_device_and_dtype([listed], with_indices)
    return _group_tensors_by_device_and_dtype([listed], with_indices)


def _combined(parts: list[Tensor], norm: bool) -> Tensor | None:
    """One total of several groups' (on one device): their sum, or with ``norm`` the norm of their norms."""
    if len(parts) < 2:
        return parts[0] if parts else None
    return torch.linalg.vector_norm(torch.stack(parts)) if norm else torch.stack(parts).sum()


class _LayoutPlan:
    """How a list laid out like ``layout`` (shapes, dtypes, devices in order) is totalled: worked out once.

    The gradients of a model's parameters have their parameters' layout: built from the parameter
    list, the plan's grouping by device and dtype, sizes and staging selectors serve every step, so
    a step costs a few kernels and no Python per tensor (:func:`fused_health_check`'s ``layout``).
    """

    def __init__(self, layout: list[Tensor]) -> None:
        self.usable = True
        self.groups: list[tuple[torch.device, torch.dtype, Staging | None, Selector | None]] = []
        for (device, dtype), ([group], positions) in _grouped(layout, with_indices=True).items():
            if not (dtype.is_floating_point or dtype.is_complex):
                continue
            small = [(t, at) for t, at in zip(group, positions, strict=True) if t.numel() < SMALL_NUMEL]
            large = [at for t, at in zip(group, positions, strict=True) if t.numel() >= SMALL_NUMEL]
            staging = Staging([t for t, _ in small], [at for _, at in small]) if small else None
            self.groups.append((device, dtype, staging, selector(large) if large else None))

    def total(self, tensors: list[Tensor], device: torch.device, norm: bool) -> Tensor | None:
        parts = []
        for group_device, dtype, staging, large in self.groups:
            flat = staging.load(tensors) if staging is not None else None
            part = _reduced(flat, pick(tensors, large) if large is not None else [], dtype, False, norm)
            if part is not None:
                parts.append(part if group_device == device else part.to(device, non_blocking=True))
        return _combined(parts, norm)


_PLANS: LayoutPlans[_LayoutPlan] = LayoutPlans(_LayoutPlan)


def plan_layout(layout: list[Tensor]) -> None:
    """Work out the plan of ``layout`` now (grouping, sizes, staging buffers; nothing is read).

    A check later given this list as its ``layout`` then finds its plan made: for a caller that
    knows its list ahead of the check (e.g. at an epoch's start).
    """
    if layout:
        _PLANS.of(layout)


def _planned_total(tensors: list[Tensor], layout: list[Tensor], device: torch.device, norm: bool) -> Tensor | None:
    """:func:`_nonfinite_total` through the plan of ``layout``; raises ``RuntimeError`` where it does not apply."""
    plan = _PLANS.of(layout)
    if not plan.usable:
        raise RuntimeError("this layout's tensors cannot be staged")
    try:
        return plan.total(tensors, device, norm)
    except (RuntimeError, NotImplementedError, IndexError):  # sparse, or other shapes: the general path from now on
        plan.usable = False
        raise RuntimeError("this layout's tensors cannot be staged") from None


def _plain_float(tensor: Tensor) -> bool:
    """Dense, real floating point, outside autograd: usable as it is in the flags' arithmetic."""
    return tensor.is_floating_point() and tensor.layout is torch.strided and not tensor.requires_grad


def _nonfinite_total(
    tensors: Sequence[Tensor],
    device: torch.device,
    sqrt: bool = False,
    norm: bool = False,
    layout: list[Tensor] | None = None,
) -> Tensor | None:
    """0-dim float32 on ``device``, non-finite if some element of ``tensors`` may be NaN/Inf; ``None`` if none.

    ``norm``: the L2 norm of all elements (not with ``sqrt``). ``layout``: tensors laid out as
    ``tensors`` (see :class:`_LayoutPlan`), used when as many.
    """
    if not tensors:
        return None
    scalar = tensors[0]  # one dense 0-dim float (the step's loss) is its own total: nothing staged
    if len(tensors) == 1 and not (sqrt or norm) and scalar.dim() == 0 and _plain_float(scalar):
        own = scalar if scalar.dtype == _FLOAT32 else scalar.to(_FLOAT32)
        return own if own.device == device else own.to(device, non_blocking=True)
    if layout is not None and not sqrt and len(layout) == len(tensors) and isinstance(tensors, list):
        with contextlib.suppress(RuntimeError):
            return _planned_total(tensors, layout, device, norm)
    parts = []
    for (group_device, dtype), ([group], _) in _grouped(tensors).items():
        part = _group_total(group, dtype, sqrt, norm)
        if part is not None:
            parts.append(part if group_device == device else part.to(device, non_blocking=True))
    return _combined(parts, norm)


def nonfinite_candidate(
    tensors: Sequence[Tensor],
    device: torch.device | None = None,
    sqrt: bool = False,
    layout: list[Tensor] | None = None,
) -> Tensor:
    """1-element float32 tensor: 1.0 if some element of ``tensors`` *may* be NaN/Inf, else 0.0.

    Read-only, on the device, a few kernels per (device, dtype) whatever the number of tensors. A
    finite tensor can overflow a reduction: confirm a 1.0 with :func:`nonfinite_names`.

    Args:
        tensors: tensors of any devices, dtypes (integers are always finite) and layouts (sparse: their
            stored values).
        device: where the result lives; defaults to the device of the first tensor.
        sqrt: also flag negative values (as ``sqrt`` would make them NaN); for ``running_var``.
        layout: a list laid out as ``tensors``, kept from call to call: its plan is made once and a
            call runs no Python per tensor (as :func:`fused_health_check`'s ``layout``; not with ``sqrt``).

    Examples:
        >>> nonfinite_candidate([torch.ones(3), torch.tensor([1.0, float("-inf")])]).tolist()
        [1.0]
        >>> nonfinite_candidate([torch.tensor([4.0, -1.0])], sqrt=True).tolist()
        [1.0]
    """
    target = device if device is not None else _first_device(tensors)
    total = _nonfinite_total(tensors, target, sqrt, layout=layout)
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


class _Constants:
    """Never-written float32 constants of one device, made once: the check allocates nothing for them per step."""

    def __init__(self, device: torch.device) -> None:
        self.zero = torch.zeros((), dtype=_FLOAT32, device=device)
        self.nan = torch.full((), math.nan, dtype=_FLOAT32, device=device)
        self.healthy = torch.tensor([0.0, -1.0, 0.0], dtype=_FLOAT32, device=device)  # [flag, no norm, others]
        self.zeros = torch.zeros(3, dtype=_FLOAT32, device=device)


_CONSTANTS: dict[torch.device, _Constants] = {}


def _constants(device: torch.device) -> _Constants:
    constants = _CONSTANTS.get(device)
    if constants is None:
        constants = _CONSTANTS[device] = _Constants(device)
    return constants


def _fast_summary(grads_total: Tensor | None, others_total: Tensor | None, device: torch.device) -> Tensor:
    """``[flag, -1 (no norm), others_flag]`` from two totals (non-finite: bad; ``None``: nothing checked).

    Four small kernels: the totals side by side, times zero (0 when finite, NaN when not) plus
    ``[0, -1, 0]``, NaN to 1.
    """
    constants = _constants(device)
    zero, healthy, zeros = constants.zero, constants.healthy, constants.zeros
    if grads_total is None and others_total is None:
        return healthy.clone()
    if others_total is None:
        totals = torch.stack((grads_total, zero, zero))  # type: ignore[arg-type]
    elif grads_total is None:
        totals = torch.stack((others_total, zero, others_total))
    else:
        totals = torch.stack((grads_total + others_total, zero, others_total))  # the middle one is always finite
    return torch.nan_to_num(torch.addcmul(healthy, totals, zeros), nan=1.0)


def _raw_totals(
    grads: Sequence[Tensor],
    others: Sequence[Tensor],
    nonnegative: Sequence[Tensor],
    value: Tensor | None,
    device: torch.device,
    with_norm: bool,
    layout: list[Tensor] | None,
) -> Tensor:
    """``[grads_total, others_total, value(, grad_norm)]`` on ``device`` (:func:`fused_health_check`, ``raw=True``)."""
    constants = _constants(device)
    zero, nan = constants.zero, constants.nan
    # with the norm, the gradients' total is their L2 norm: NaN with a NaN, +Inf with an Inf
    grads_total = _nonfinite_total(grads, device, norm=with_norm, layout=layout)
    norm = ((zero if grads_total is None else grads_total),) if with_norm else ()
    others_total = _others_total(others, nonnegative, device)
    if value is not None:
        value = (value if value.dim() == 0 else value.reshape(())).to(device=device, dtype=_FLOAT32)
    totals = (
        zero if grads_total is None else grads_total,
        zero if others_total is None else others_total,
        nan if value is None else value,
    )
    return torch.stack(totals + norm)


def _first_device(*groups: Sequence[Tensor]) -> torch.device:
    first = next((t for group in groups for t in group), None)
    return first.device if first is not None else torch.device("cpu")


def fused_health_check(
    grads: Sequence[Tensor],
    others: Sequence[Tensor] = (),
    nonnegative: Sequence[Tensor] = (),
    device: torch.device | None = None,
    with_norm: bool = True,
    raw: bool = False,
    value: Tensor | None = None,
    layout: list[Tensor] | None = None,
) -> Tensor:
    """Check many tensors for NaN/Inf in one fused pass; return ``[flag, grad_norm, others_flag]``.

    Nothing is read to the host and nothing is written to the tensors: the caller decides when to
    pay the one synchronisation (``result.tolist()``), and may first reduce the tensor across
    processes.

    Args:
        grads: gradients; their global L2 norm is the second element of the result.
        others: further tensors to check (loss, BatchNorm running statistics).
        nonnegative: tensors that must also have no negative element (``running_var``).
        device: where the result lives; defaults to the device of the first tensor given.
        with_norm: compute the global gradient norm with ``_foreach_norm``; otherwise ``grad_norm``
            is -1 and the test uses the cheaper staged sums of :func:`nonfinite_candidate`.
        raw: return the raw totals ``[grads_total, others_total, value]`` instead, followed by
            ``grad_norm`` with ``with_norm`` (then also the gradients' total): each total is
            non-finite if some element of its tensors may be NaN/Inf (``nonnegative``: also a
            negative value), 0 when there is nothing to check. The cheapest check for a caller
            that reads the result to the host anyway (one process, no collective): the host tests
            the totals with ``math.isfinite`` instead of the device turning them into flags.
        value: with ``raw``, a one-element float (e.g. the step's loss) read with the totals; NaN
            when ``None``.
        layout: a list laid out as ``grads`` (the same shapes, dtypes and devices in order: the
            parameters whose gradients they are), kept from step to step: the grouping, sizes and
            staging of that layout are worked out once, and a step then runs no Python per tensor.
            Used when ``grads`` is a list as long as ``layout``.

    Returns:
        float32 tensor ``[flag, grad_norm, others_flag]``. ``flag`` is > 0 when some tensor *may*
        hold a NaN/Inf (confirm with :func:`nonfinite_names`: a finite tensor can overflow its norm
        or sum) or a negative value where none is allowed; ``others_flag`` is the same for
        ``others`` and ``nonnegative`` alone.
        ``grad_norm`` is NaN when a gradient holds a NaN, +Inf when one holds +/-Inf (and no NaN).

    Examples:
        >>> fused_health_check([torch.ones(4)], others=[torch.tensor(0.5)]).tolist()
        [0.0, 2.0, 0.0]
        >>> fused_health_check([torch.tensor([1.0, float("nan")])]).tolist()[:2]
        [1.0, nan]
        >>> fused_health_check([torch.tensor([1.0, float("inf")])], with_norm=False).tolist()
        [1.0, -1.0, 0.0]
        >>> fused_health_check([torch.ones(4)], others=[torch.tensor(0.5)], raw=True, value=torch.tensor(0.5)).tolist()
        [2.0, 0.5, 0.5, 2.0]
        >>> fused_health_check([torch.ones(4)], raw=True, with_norm=False).tolist()
        [4.0, 0.0, nan]
        >>> totals = fused_health_check([torch.tensor([1.0, float("nan")])], raw=True, with_norm=False).tolist()
        >>> [math.isfinite(t) for t in totals]
        [False, True, False]
    """
    if device is None:
        device = _first_device(grads, others, nonnegative)
    if raw:
        return _raw_totals(grads, others, nonnegative, value, device, with_norm, layout)
    if not with_norm:  # the fast path: a handful of kernels whatever the number of tensors
        grads_total = _nonfinite_total(grads, device, layout=layout)
        return _fast_summary(grads_total, _others_total(others, nonnegative, device), device)
    norm = _nonfinite_total(grads, device, norm=True, layout=layout)  # staged: one kernel for the small ones
    grad_norm = norm if norm is not None else torch.zeros((), dtype=_FLOAT32, device=device)
    grads_bad = ~torch.isfinite(grad_norm)
    others_bad = ~torch.isfinite(grouped_norms(others, device)).all()
    nonempty = [t for t in nonnegative if t.numel()]
    if nonempty:
        negated_maxima = torch._foreach_max(torch._foreach_neg(nonempty))
        others_bad = others_bad | (torch.stack(negated_maxima).to(device=device, dtype=_FLOAT32) > 0).any()
    return torch.stack(((grads_bad | others_bad).to(_FLOAT32), grad_norm, others_bad.to(_FLOAT32)))
