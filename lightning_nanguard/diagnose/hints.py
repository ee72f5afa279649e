"""One-line fixes for well-known origins of NaN/Inf, keyed by autograd op name."""

from __future__ import annotations

__all__ = ["hint_for"]

_ROOT = "sqrt/pow/norm at exactly 0 has an infinite derivative: add eps inside the root or use a safe norm"
_DIVISION = "division by zero: add eps to the denominator or mask it before dividing"
_MASKED_DIVISION = (
    "division masked after the fact (torch.where/mask after a/b): the masked branch still back-propagates "
    "NaN; mask the denominator before dividing, e.g. a / torch.where(mask, b, 1)"
)
_ARC = "acos/asin at exactly +/-1 has an infinite derivative: clamp the argument to [-1+eps, 1-eps]"
_LOG = "log(0): clamp the argument (x.clamp_min(eps)) or use log-softmax / log-sum-exp / the built-in losses"
_BATCHNORM = "BatchNorm running statistics overflowed: check the input data for huge or non-finite values"
_INPUT = "the batch itself holds NaN/Inf: check the data pipeline (dataset, transforms, collate)"
_PARAMS = "the weights are already non-finite: roll back to a finite checkpoint and lower the learning rate"
_EXP = "exp overflow: subtract the maximum first (log-sum-exp) or clamp the argument"
_STATE = (
    "the model state diverged (every sample fails): lower the learning rate, clip gradients "
    '(remedies=["clip_grad", "lr_backoff"]) or roll back to a good state (action="rollback")'
)

_BY_PREFIX: tuple[tuple[tuple[str, ...], str], ...] = (
    (("Sqrt", "Rsqrt", "Pow", "Norm", "LinalgVectorNorm", "Cdist"), _ROOT),
    (("Div", "Reciprocal"), _DIVISION),
    (("Acos", "Asin"), _ARC),
    (("Log", "Xlogy"), _LOG),
    (("Exp",), _EXP),
)


def hint_for(op: str | None, phase: str | None, masked_forward: bool = False) -> str | None:
    """A one-line fix for ``op`` (an autograd node name such as ``"SqrtBackward0"``), if known.

    Args:
        op: autograd node name, torch function name, ``"<input>"``, ``"<parameters>"``, ``"running_var"``,
            or ``"<state>"`` (a diverged model whose origin has no hint of its own).
        phase: ``"forward"`` or ``"backward"``.
        masked_forward: the op's forward output was non-finite but the loss was not (it was masked).

    Example:
        >>> hint_for("AcosBackward0", "backward")
        'acos/asin at exactly +/-1 has an infinite derivative: clamp the argument to [-1+eps, 1-eps]'
        >>> hint_for("MmBackward0", "backward") is None
        True
    """
    if op is None:
        return None
    if op == "<input>":
        return _INPUT
    if op == "<parameters>":
        return _PARAMS
    if op == "<state>":
        return _STATE
    if op in ("running_var", "running_mean"):
        return _BATCHNORM
    name = op[0].upper() + op[1:] if op else op
    for prefixes, hint in _BY_PREFIX:
        if name.startswith(prefixes):
            if hint is _DIVISION and masked_forward:
                return _MASKED_DIVISION
            return hint
    return None
