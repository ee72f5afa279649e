"""Fused, device-side detection of NaN/Inf in many tensors at once.

The healthy path is :func:`fused_health_check`: one ``torch._foreach_norm`` kernel per
(device, dtype) group over every gradient, plus one over the loss and BatchNorm statistics,
reduced on the device to a two-element tensor ``[flag, grad_norm]``. The caller reads it to the
host once per step. Only when the flag is set does :func:`nonfinite_names` look tensor by tensor,
so the cost of naming the culprits is paid on bad steps only.

Why norms: the L2 norm of a tensor is NaN if any element is NaN and +Inf if any element is +/-Inf,
and the same kernel gives the global gradient norm for logging. A finite tensor can also overflow
to an infinite norm (e.g. fp16 values near 65504, or float32 values above 1e19); the flag is
therefore a *candidate* and :func:`nonfinite_names` confirms element-wise, so a step is reported
bad iff some element is NaN or +/-Inf.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

__all__ = [
    "all_finite",
    "bad_batchnorm_names",
    "fused_health_check",
    "grouped_norms",
    "negative_names",
    "nonfinite_names",
]

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


def _count_nonfinite_(tensors: Sequence[Tensor], device: torch.device) -> Tensor:
    """1-element float32 tensor on ``device``, > 0 iff some element of ``tensors`` is NaN/Inf.

    Uses GradScaler's fused kernel ``_amp_foreach_non_finite_check_and_unscale_`` with a scale of 1
    (multiplying by 1.0 leaves every value bitwise equal): one call for all tensors when they share
    a device, else one per (device, dtype) group. On this CPU it is cheaper than any norm (it only
    tests, it does not multiply and add). Complex tensors fall back to norms, sparse ones to their
    stored values.
    """
    if not tensors:
        return torch.zeros(1, dtype=_FLOAT32, device=device)
    one = _constant(1.0, device)
    total = torch.zeros(1, dtype=_FLOAT32, device=device)
    try:  # common case, one device: a single call, no grouping (which costs ~60% of the kernel on CPU)
        torch._amp_foreach_non_finite_check_and_unscale_(list(tensors), total, one)
        return total
    except (RuntimeError, NotImplementedError):  # several devices, complex or sparse tensors
        total.zero_()
    found: dict[torch.device, Tensor] = {}
    grouped = _group_tensors_by_device_and_dtype([list(tensors)])
    for (group_device, dtype), ([group], _) in grouped.items():
        if group_device not in found:
            found[group_device] = torch.zeros(1, dtype=_FLOAT32, device=group_device)
        flag = found[group_device]
        if dtype.is_complex:
            flag.add_((~torch.isfinite(torch.stack(_foreach_norm(group, dtype))).all()).to(_FLOAT32))  # type: ignore[arg-type]
            continue
        one = torch.ones(1, dtype=_FLOAT32, device=group_device)
        try:
            torch._amp_foreach_non_finite_check_and_unscale_(group, flag, one)  # type: ignore[arg-type]
        except (NotImplementedError, RuntimeError):  # sparse gradients (rare): their stored values
            torch._amp_foreach_non_finite_check_and_unscale_(_dense(group), flag, one)  # type: ignore[arg-type]
    if not found:
        return torch.zeros(1, dtype=_FLOAT32, device=device)
    flags = [f if f.device == device else f.to(device, non_blocking=True) for f in found.values()]
    return flags[0] if len(flags) == 1 else torch.stack(flags).sum(0)


def fused_health_check(
    grads: Sequence[Tensor],
    others: Sequence[Tensor] = (),
    nonnegative: Sequence[Tensor] = (),
    device: torch.device | None = None,
    with_norm: bool = True,
) -> Tensor:
    """Check many tensors for NaN/Inf in one fused pass; return ``[flag, grad_norm, others_flag]``.

    Nothing is read to the host: the caller decides when to pay the one synchronisation
    (``result.tolist()``), and may first reduce the tensor across processes.

    Args:
        grads: gradients; their global L2 norm is the second element of the result.
        others: further tensors to check (loss, BatchNorm running statistics).
        nonnegative: tensors that must also have no negative element (``running_var``).
        device: where the result lives; defaults to the device of the first tensor given.
        with_norm: compute the global gradient norm with ``_foreach_norm``; otherwise ``grad_norm``
            is -1 and the test uses GradScaler's cheaper fused kernel.

    Returns:
        float32 tensor ``[flag, grad_norm, others_flag]``. ``flag`` is > 0 when some tensor *may*
        hold a NaN/Inf (confirm with :func:`nonfinite_names`: with norms, a finite tensor can
        overflow its norm) or a negative value where none is allowed; ``others_flag`` is the same
        for ``others`` and ``nonnegative`` alone.
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
        first = next((t for t in (*grads, *others, *nonnegative)), None)
        device = first.device if first is not None else torch.device("cpu")
    nonempty = [t for t in nonnegative if t.numel()]
    if not with_norm:  # the fast path: a handful of kernels whatever the number of tensors
        # sqrt of a negative value is NaN: negativity joins the same non-finite test
        others_found = _count_nonfinite_([*others, *(torch._foreach_sqrt(nonempty) if nonempty else [])], device)
        grads_found = _count_nonfinite_(grads, device)
        return torch.cat((grads_found + others_found, _constant(-1.0, device), others_found))
    grad_norms = grouped_norms(grads, device)
    grads_bad = ~torch.isfinite(grad_norms).all()
    grad_norm = torch.linalg.vector_norm(grad_norms) if grads else torch.zeros((), dtype=_FLOAT32, device=device)
    others_bad = ~torch.isfinite(grouped_norms(others, device)).all()
    if nonempty:
        negated_maxima = torch._foreach_max(torch._foreach_neg(nonempty))
        others_bad = others_bad | (torch.stack(negated_maxima).to(device=device, dtype=_FLOAT32) > 0).any()
    return torch.stack(((grads_bad | others_bad).to(_FLOAT32), grad_norm, others_bad.to(_FLOAT32)))


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
