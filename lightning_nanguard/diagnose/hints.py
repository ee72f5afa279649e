"""One-line fixes for well-known origins of NaN/Inf, keyed by autograd op name."""

from __future__ import annotations

__all__ = ["hint_for"]

_ROOT = "sqrt/pow/norm at exactly 0 has an infinite derivative: add eps inside the root or use a safe norm"
_DIVISION = "division by zero: add eps to the denominator or mask it before dividing"
_MASKED_DIVISION = (
    "division masked after the fact (torch.where/mask after a/b): the masked branch still back-propagates "
    "NaN; mask the denominator before dividing, e.g. a / torch.where(mask, b, 1)"
)
_MASKED_DOMAIN = (
    "op applied outside its domain and masked after the fact (torch.where/mask after sqrt/log/pow/acos): the "
    "masked branch still back-propagates NaN; keep the input inside the domain before the op, e.g. "
    "torch.where(mask, x, 1).sqrt() or x.clamp_min(eps).sqrt()"
)
_CTC = (
    "CTC loss is infinite when a target cannot be aligned with its input (a target longer than its input, or "
    "too many repeated labels): pass zero_infinity=True to F.ctc_loss / nn.CTCLoss, or drop such samples"
)
_CHECKPOINT = (
    "the NaN/Inf was born inside a block under reentrant activation checkpointing (use_reentrant=True), whose "
    "recomputed backward cannot be followed op by op: checkpoint with use_reentrant=False to name the op inside"
)
_ARC = "acos/asin at exactly +/-1 has an infinite derivative: clamp the argument to [-1+eps, 1-eps]"
_LOG = "log(0): clamp the argument (x.clamp_min(eps)) or use log-softmax / log-sum-exp / the built-in losses"
_BATCHNORM = "BatchNorm running statistics overflowed: check the input data for huge or non-finite values"
_INPUT = "the batch itself holds NaN/Inf: check the data pipeline (dataset, transforms, collate)"
_PARAMS = "the weights are already non-finite: roll back to a finite checkpoint and lower the learning rate"
_EXP = "exp overflow: subtract the maximum first (log-sum-exp) or clamp the argument"
_ALL_MASKED = (
    "softmax over a row masked entirely (every position -inf) is NaN: keep at least one position per row "
    "unmasked (e.g. drop or skip empty sequences), mask with a large finite value (torch.finfo(dtype).min), "
    "or use F.scaled_dot_product_attention / MultiheadAttention(need_weights=False), which return zeros there"
)
_INFINITY = (
    "NaN made of infinities (inf - inf, 0 * inf, inf / inf): a deliberate -inf/+inf (a mask or padding value) "
    "met another infinity or a zero; mask with a large finite value (torch.finfo(dtype).min) or select with "
    "torch.where instead of multiplying by a mask"
)
_CUSTOM_FORWARD = (
    "a custom autograd Function's forward produced NaN/Inf from finite inputs: check its forward at the edge "
    "of its domain"
)
_CUSTOM_BACKWARD = (
    "a custom autograd Function's backward returned NaN/Inf from finite gradients: its hand-written derivative "
    "is infinite or undefined here (e.g. 1/x at 0); guard it with eps or clamp its input"
)
_STATE = (
    "the model state diverged (every sample fails): lower the learning rate, clip gradients "
    '(remedies=["clip_grad", "lr_backoff"]) or roll back to a good state (action="rollback")'
)
_BATCH = (
    "the batch as a whole is degenerate (its samples fail alone or together, but not beside healthy samples): "
    "a mean over zero targets (every label ignore_index or masked out: clamp the count, e.g. "
    "loss.sum() / mask.sum().clamp_min(1)) or a statistic over a degenerate batch (one sample, identical rows: "
    "drop_last=True, or a per-sample statistic with eps)"
)

_SOFTMAX = ("Softmax", "LogSoftmax", "SafeSoftmax")
_BY_PREFIX: tuple[tuple[tuple[str, ...], str], ...] = (
    (("Sqrt", "Rsqrt", "Pow", "Norm", "LinalgVectorNorm", "Cdist"), _ROOT),
    (("Div", "Reciprocal"), _DIVISION),
    (("Acos", "Asin"), _ARC),
    (("Log", "Xlogy"), _LOG),
    (("Exp",), _EXP),
    (("CtcLoss",), _CTC),
    (("CheckpointFunction",), _CHECKPOINT),
)


def hint_for(
    op: str | None,
    phase: str | None,
    masked_forward: bool = False,
    from_infinity: bool = False,
    custom_function: bool = False,
) -> str | None:
    """A one-line fix for ``op`` (an autograd node name such as ``"SqrtBackward0"``), if known.

    Args:
        op: autograd node name, torch function name, ``"<input>"``, ``"<parameters>"``, ``"running_var"``,
            ``"<state>"`` (a diverged model whose origin has no hint of its own) or ``"<batch>"`` (a batch
            that fails as a whole, no sample at fault).
        phase: ``"forward"`` or ``"backward"``.
        masked_forward: the op's forward output was non-finite but the loss was not (it was masked).
        from_infinity: the op made NaN of inputs holding infinities (a mask, a padding value).
        custom_function: the op is a custom autograd Function.

    Example:
        >>> hint_for("AcosBackward0", "backward")
        'acos/asin at exactly +/-1 has an infinite derivative: clamp the argument to [-1+eps, 1-eps]'
        >>> hint_for("MmBackward0", "backward") is None
        True
        >>> hint_for("SoftmaxBackward0", "forward", from_infinity=True)[:40]
        'softmax over a row masked entirely (ever'
        >>> hint_for("SubBackward0", "forward", from_infinity=True)[:40]
        'NaN made of infinities (inf - inf, 0 * i'
        >>> hint_for("SqrtBackward0", "backward", masked_forward=True)[:40]
        'op applied outside its domain and masked'
        >>> hint_for("<batch>", "forward")[:46]
        'the batch as a whole is degenerate (its sample'
    """
    if op is None:
        return None
    if from_infinity:
        return _ALL_MASKED if op.startswith(_SOFTMAX) or "softmax" in op else _INFINITY
    if custom_function:
        return _CUSTOM_BACKWARD if phase == "backward" else _CUSTOM_FORWARD
    if op == "<input>":
        return _INPUT
    if op == "<parameters>":
        return _PARAMS
    if op == "<state>":
        return _STATE
    if op == "<batch>":
        return _BATCH
    if op in ("running_var", "running_mean"):
        return _BATCHNORM
    name = op[0].upper() + op[1:] if op else op
    for prefixes, hint in _BY_PREFIX:
        if name.startswith(prefixes):
            if hint is _DIVISION and masked_forward:
                return _MASKED_DIVISION
            if masked_forward and phase == "backward" and hint in (_ROOT, _ARC, _LOG):
                return _MASKED_DOMAIN  # the forward was non-finite already: the input left the domain
            return hint
    return None
