"""Short sentences for the forensic fields of an event: its cause, what was verified, its origin, its call stack.

Used by the terminal panel and the markdown report (:func:`~lightning_nanguard.reporting.text.event_lines`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning_nanguard.core.events import NanEvent

__all__ = ["blame_text", "cause_text", "indices_mark", "origin_text", "records_text", "stack_text"]

_CAUSES = {
    "data": "data: the offending samples reproduce it on their own",
    "input": "input: the batch itself holds NaN/Inf",
    "state": "model state: the weights/optimizer are at fault, no sample is to blame",
    "interaction": "interaction: samples fail only together",
    "batch": "batch: the batch as a whole, no record is at fault",
}
_MAX_RECORDS = 8  # per row: a packed row may hold dozens of records


def _fields(fields: Sequence[Any]) -> str:
    return ", ".join(f"[{f}]" if isinstance(f, int) else str(f) for f in fields)


def cause_text(event: NanEvent) -> str | None:
    """The cause in words, or ``None`` when the step was not investigated.

    Example:
        >>> cause_text(NanEvent(1, 0, 1, 0, ("loss",), "skipped", cause="input", details={"input_fields": ["x"]}))
        'input: the batch itself holds NaN/Inf (in x)'
    """
    if event.cause is None:
        return None
    text = _CAUSES.get(event.cause, event.cause)
    fields = event.details.get("input_fields")
    if event.cause == "input" and fields:
        text += f" (in {_fields(fields)})"
    return text


def _not_verified(reason: Any) -> str:
    return f"not verified: {reason}" if reason else "not verified"


def indices_mark(event: NanEvent) -> str | None:
    """Whether the dataset indices an event names were verified: ``"verified"``, ``"not verified: <reason>"``.

    ``None`` when the event does not say (no index named, or an event written before the check existed).

    Example:
        >>> event = NanEvent(1, 0, 1, 0, ("loss",), "skipped", offending_samples=(2,), dataset_indices=(9,))
        >>> indices_mark(event.replace(indices_verified=True))
        'verified'
        >>> indices_mark(event.replace(indices_verified=False, details={"indices_unverified": "an IterableDataset"}))
        'not verified: an IterableDataset'
        >>> indices_mark(event) is None
        True
    """
    if event.indices_verified is None:
        return None
    return "verified" if event.indices_verified else _not_verified(event.details.get("indices_unverified"))


def records_text(records: Sequence[Sequence[int]]) -> str:
    """The records of each row (rows holding several records: packed sequences, mixup), at most 8 a row.

    Example:
        >>> records_text([(10, 11), (40,)])
        '[10, 11], [40]'
        >>> records_text([range(20)])
        '[0, 1, 2, 3, 4, 5, 6, 7, +12 more]'
    """

    def row(indices: Sequence[int]) -> str:
        shown = [str(i) for i in list(indices)[:_MAX_RECORDS]]
        hidden = len(indices) - _MAX_RECORDS
        return "[" + ", ".join(shown + ([f"+{hidden} more"] if hidden > 0 else [])) + "]"

    return ", ".join(row(indices) for indices in records)


def blame_text(event: NanEvent) -> str | None:
    """Whether the samples an event names were checked to be at fault, with the passes that took.

    ``None`` when the event does not say (no sample named, or an event written before the check existed).

    Example:
        >>> event = NanEvent(1, 0, 1, 0, ("loss",), "skipped", cause="data", offending_samples=(2,),
        ...                  blame_verified=True, details={"verify_passes": 1})
        >>> blame_text(event)
        'verified: bad beside known-healthy samples (+1 pass)'
        >>> blame_text(event.replace(cause="input", details={}))
        'verified: the samples hold NaN/Inf themselves'
        >>> blame_text(event.replace(blame_verified=False, details={"blame_unverified": "max_bisect_passes reached"}))
        'not verified: max_bisect_passes reached'
    """
    if event.blame_verified is None:
        return None
    d: Mapping[str, Any] = event.details
    if not event.blame_verified:
        text = _not_verified(d.get("blame_unverified"))
    elif event.cause == "input":
        text = "verified: the samples hold NaN/Inf themselves"
    else:
        text = "verified: bad beside known-healthy samples"
    passes = d.get("verify_passes")
    if event.blame_verified and isinstance(passes, int) and passes > 0:
        text += f" (+{passes} pass{'es' if passes > 1 else ''})"
    if d.get("blame_note"):
        text += f"; {d['blame_note']}"
    return text


def origin_text(event: NanEvent, code: str = "") -> str | None:
    """Where the first NaN/Inf appeared: phase, torch function, autograd op, module.

    Example:
        >>> event = NanEvent(1, 0, 1, 0, ("loss",), "skipped", culprit_module="net.0", culprit_op="DivBackward0",
        ...                  phase="forward", details={"function": "torch.div", "module_type": "CosineNormConv2d"})
        >>> origin_text(event)
        'forward: torch.div (DivBackward0) in module net.0 (CosineNormConv2d)'
        >>> origin_text(event.replace(phase="backward", culprit_op="SqrtBackward0", details={"function": "torch.sqrt"}))
        'backward: SqrtBackward0 (gradient of torch.sqrt) in module net.0'
        >>> origin_text(event.replace(culprit_op="<input>", culprit_module=None, details={"input_fields": [0]}))
        'the batch itself (in [0]), before any op'
    """
    d: Mapping[str, Any] = event.details
    if event.culprit_op is None and event.culprit_module is None:
        return None
    if event.culprit_op == "<input>":
        fields = d.get("input_fields")
        return "the batch itself" + (f" (in {code}{_fields(fields)}{code})" if fields else "") + ", before any op"
    module = event.culprit_module if event.culprit_module else "<LightningModule>"
    module_type = f" ({d['module_type']})" if d.get("module_type") else ""
    where = (
        f"in module {code}{module}{code}{module_type}" if event.culprit_module is not None else "in an unknown module"
    )
    op = f"{code}{event.culprit_op or '?'}{code}"
    function = d.get("function")
    if function and event.phase == "forward":
        return f"forward: {code}{function}{code} ({op}) {where}"
    if function and event.phase == "backward":
        return f"backward: {op} (gradient of {code}{function}{code}) {where}"
    return f"{event.phase or '?'} of {op} {where}"


def stack_text(event: NanEvent) -> str | None:
    """The user call stack of the origin, outermost first, when it has more than the source line itself.

    Example:
        >>> stack = [{"file": "train.py", "line": 40, "function": "training_step"},
        ...          {"file": "ops.py", "line": 3, "function": "masked_mean"}]
        >>> stack_text(NanEvent(1, 0, 1, 0, ("loss",), "skipped", details={"stack": stack}))
        'train.py:40 training_step > ops.py:3 masked_mean'
    """
    stack = event.details.get("stack")
    if not isinstance(stack, list) or len(stack) < 2:
        return None
    return " > ".join(f"{f.get('file')}:{f.get('line')} {f.get('function')}" for f in stack if isinstance(f, dict))
