"""Human-readable renderings of a :class:`~lightning_nanguard.NanEvent` (terminal and markdown)."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.diagnose.compact import channels_text
from lightning_nanguard.reporting.explain import (
    blame_text,
    cause_text,
    indices_mark,
    origin_text,
    records_text,
    stack_text,
)
from lightning_nanguard.reporting.repro import replay_command

__all__ = ["event_lines", "event_markdown", "event_text", "loader_samples_text", "samples_text"]

_MAX_NAMES = 8


def _names(names: Sequence[str], quote: str = "") -> str:
    shown = ", ".join(f"{quote}{name}{quote}" for name in names[:_MAX_NAMES])
    hidden = len(names) - _MAX_NAMES
    return shown + (f" (+{hidden} more)" if hidden > 0 else "")


def _records_of(event: NanEvent, places: Sequence[int]) -> str:
    """`` (dataset indices [..])`` or `` (records per row [..], [..])`` of the named samples at ``places``."""
    if event.sample_records is not None:
        return f" (records per row {records_text([event.sample_records[i] for i in places])})"
    if event.dataset_indices is not None:
        return f" (dataset indices {[event.dataset_indices[i] for i in places]})"
    return ""


def loader_samples_text(event: NanEvent) -> str:
    """The offending samples of a batch of several training loaders, loader by loader.

    Example:
        >>> event = NanEvent(3, 0, 3, 0, ("grad",), "skipped", offending_samples=(2, 0, 3),
        ...                  sample_loaders=("b", "a", "b"), dataset_indices=(7, 30, 9),
        ...                  details={"loader_batch_sizes": [["a", 8], ["b", 4]]})
        >>> loader_samples_text(event)
        "loader 'b': [2, 3] of 4 (dataset indices [7, 9]); loader 'a': [0] of 8 (dataset indices [30])"
        >>> loader_samples_text(event.replace(indices_verified=True))[-18:]
        '(indices verified)'
        >>> unknown = {"dataset_indices_unknown": "loader 'b': an IterableDataset"}
        >>> loader_samples_text(event.replace(dataset_indices=None, details=unknown))
        "loader 'b': [2, 3]; loader 'a': [0] (dataset indices unknown: loader 'b': an IterableDataset)"
    """
    sizes = {str(key): size for key, size in event.details.get("loader_batch_sizes", []) or []}
    grouped: dict[str | int, list[int]] = {}
    for position, key in enumerate(event.sample_loaders or ()):
        grouped.setdefault(key, []).append(position)
    parts = []
    for key, places in grouped.items():
        positions = [event.offending_samples[i] for i in places] if event.offending_samples is not None else []
        of_n = f" of {sizes[str(key)]}" if str(key) in sizes else ""
        parts.append(f"loader {key!r}: {positions}{of_n}{_records_of(event, places)}")
    joined = "; ".join(parts)
    unknown = event.details.get("dataset_indices_unknown")
    if event.dataset_indices is None and event.sample_records is None and unknown:
        joined += f" (dataset indices unknown: {unknown})"
    mark = indices_mark(event)
    if mark and (event.dataset_indices is not None or event.sample_records is not None):
        joined += f" (indices {mark})"
    return joined


def samples_text(event: NanEvent) -> str | None:
    """The offending samples: positions in the batch, their dataset indices (or each row's records), verified or not.

    ``None`` when no sample is named.

    Example:
        >>> event = NanEvent(3, 0, 3, 0, ("loss",), "skipped", offending_samples=(3, 5), dataset_indices=(27, 29),
        ...                  details={"batch_size": 8})
        >>> samples_text(event)
        '[3, 5] of 8 (dataset indices [27, 29])'
        >>> samples_text(event.replace(indices_verified=True))
        '[3, 5] of 8 (dataset indices [27, 29]) (verified)'
        >>> samples_text(event.replace(dataset_indices=None, sample_records=((10, 11), (40,))))
        '[3, 5] of 8 (records per row [10, 11], [40])'
    """
    if event.offending_samples is None:
        return None
    if event.sample_loaders is not None:
        return loader_samples_text(event)
    batch_size = event.details.get("batch_size")
    of_n = f" of {batch_size}" if batch_size is not None else ""
    text = f"{list(event.offending_samples)}{of_n}{_records_of(event, range(len(event.offending_samples)))}"
    mark = indices_mark(event)
    if mark and (event.dataset_indices is not None or event.sample_records is not None):
        text += f" ({mark})"
    return text


def _precursor_lines(event: NanEvent, code: str) -> list[tuple[str, str]]:
    """An early warning's rows: where, what was measured, how fast it grows, what usually fixes it.

    Example:
        >>> e = NanEvent(40, 0, 40, 0, ("precursor",), "warned", culprit_module="blocks.1.attn",
        ...              details={"signal": "attention_max_logit", "value": 312.4, "threshold": 50.0,
        ...                       "growth": 6.1, "earlier_value": 51.2, "earlier_step": 20, "entropy": 0.4})
        >>> [label for label, _ in _precursor_lines(e, "")]
        ['early warning', 'module', 'signal', 'growth', 'attention entropy']
    """
    d = event.details
    rows = [("early warning", "attention collapse ahead: no NaN yet, the step was applied")]
    if event.culprit_module:
        rows.append(("module", f"{code}{event.culprit_module}{code}"))
    value, threshold = d.get("value"), d.get("threshold")
    if isinstance(value, int | float):
        signal = str(d.get("signal", "")).replace("_", " ")
        rows.append(
            ("signal", f"{signal} {value:.4g}" + (f" (level {threshold:.3g})" if threshold is not None else ""))
        )
    growth, earlier, earlier_step = d.get("growth"), d.get("earlier_value"), d.get("earlier_step")
    if isinstance(growth, int | float) and isinstance(earlier, int | float):
        rows.append(("growth", f"{growth:.3g}x since step {earlier_step} ({earlier:.4g})"))
    if isinstance(d.get("entropy"), int | float):
        rows.append(("attention entropy", f"{d['entropy']:.3g} nats (min-entropy bound {d.get('min_entropy', 0):.3g})"))
    if d.get("fixes"):
        rows.append(("usual fixes", "; ".join(str(fix) for fix in d["fixes"])))
    return rows


def _guard_error_lines(event: NanEvent, code: str) -> list[tuple[str, str]]:
    """A failure of the guard itself: which part, the error, where, what stops and what still holds.

    Example:
        >>> e = NanEvent(5, 0, 5, 0, ("guard_error",), "warned", details={"part": "tensorboard",
        ...              "error": "OSError(28)", "where": "x.py:3 in f", "stops": "no text", "guard_on": True})
        >>> [label for label, _ in _guard_error_lines(e, "")]
        ['guard error', 'part', 'error', 'where', 'stops', 'still guarded']
    """
    d = event.details
    on = d.get("guard_on", True)
    rows = [
        ("guard error", "a part of NanGuard itself failed"),
        ("part", f"{code}{d.get('part', '?')}{code}"),
        ("error", str(d.get("error", "?"))),
        ("where", str(d.get("where", "?"))),
        ("stops", str(d.get("stops", ""))),
    ]
    if on:
        rows.append(("still guarded", "yes: NaN/Inf steps are still checked and dropped"))
    else:
        rows.append(("still guarded", "no: no later step is checked; restart the run to guard it again"))
    return rows


def event_lines(event: NanEvent, code: str = "") -> list[tuple[str, str]]:
    """The ``(label, value)`` rows shared by the terminal and markdown reports.

    Args:
        event: the event to describe.
        code: quote character for code spans (``"`"`` in markdown, ``""`` in the terminal).

    Example:
        >>> rows = event_lines(NanEvent(3, 0, 3, 0, ("grad",), "skipped", nonfinite_grads=("fc.bias",)))
        >>> rows[0]
        ('non-finite', 'grad')
        >>> rows[1]
        ('parameter grads (1)', 'fc.bias')
        >>> event_lines(NanEvent(3, 0, 3, 0, ("grad",), "skipped", optimizer=1))[1]
        ('optimizer', '#1 (the step of that optimizer)')
    """
    d = event.details
    if event.kinds == ("precursor",):
        return _precursor_lines(event, code)
    if event.kinds == ("guard_error",):
        return _guard_error_lines(event, code)
    rows: list[tuple[str, str]] = [("non-finite", ", ".join(event.kinds))]
    if event.optimizer is not None:
        rows.append(("optimizer", f"#{event.optimizer} (the step of that optimizer)"))
    cause = cause_text(event)
    if cause:
        rows.append(("cause", cause))
    if event.nonfinite_grads:
        rows.append((f"parameter grads ({len(event.nonfinite_grads)})", _names(event.nonfinite_grads, code)))
    if event.nonfinite_buffers:
        rows.append((f"BatchNorm buffers ({len(event.nonfinite_buffers)})", _names(event.nonfinite_buffers, code)))
    if event.nonfinite_params:
        rows.append((f"parameters ({len(event.nonfinite_params)})", _names(event.nonfinite_params, code)))
    if event.loss is not None:
        rows.append(("loss", f"{event.loss:.6g}"))
    if event.grad_norm is not None:
        rows.append(("grad norm", f"{event.grad_norm:.6g}"))
    samples = samples_text(event)
    if samples is not None:
        rows.append(("offending samples", samples))
    elif d.get("not_attributable"):
        rows.append(("offending samples", f"not attributable to individual samples: {d['not_attributable']}"))
    blame = blame_text(event)
    if blame:
        rows.append(("blame", blame))
    if d.get("sample_loaders_unknown"):
        rows.append(("training loaders", str(d["sample_loaders_unknown"])))
    origin = origin_text(event, code)
    if origin:
        rows.append(("origin", origin))
    if event.source_line:
        text = d.get("source_text")
        rows.append(("source", f"{event.source_line}" + (f"  {code}{text}{code}" if text else "")))
    stack = stack_text(event)
    if stack:
        rows.append(("call stack", stack))
    if d.get("bn_channels"):
        rows.append(("BatchNorm channels", channels_text(d["bn_channels"], d.get("bn_channels_summary"))))
    if d.get("hint"):
        rows.append(("hint", str(d["hint"])))
    if event.remedies:
        rows.append(("remedies", "; ".join(event.remedies)))
    if event.repro_path:
        rows.append(("repro bundle", f"{event.repro_path}  ({replay_command(event.repro_path)})"))
    return rows


def event_text(event: NanEvent) -> str:
    """Plain multi-line report for terminals and logs.

    Example:
        >>> print(event_text(NanEvent(7, 0, 7, 0, ("loss",), "skipped", loss=float("nan"))))
        step 7 (epoch 0, batch 7): non-finite loss -> step skipped
          non-finite: loss
          loss: nan
    """
    lines = [event.headline()]
    lines += [f"  {label}: {value}" for label, value in event_lines(event)]
    return "\n".join(lines)


def event_markdown(event: NanEvent) -> str:
    """Markdown report for TensorBoard's text dashboard: a two-column table headed by the headline.

    The headline is the table's header row (a markdown table needs one; an empty one shows as a
    blank row). ``|`` inside a value is escaped so it cannot split a cell.

    Example:
        >>> print(event_markdown(NanEvent(7, 0, 7, 0, ("loss",), "skipped", loss=float("nan"))))
        | **NanGuard** | step 7 (epoch 0, batch 7): non-finite loss -> step skipped |
        |---|---|
        | non-finite | loss |
        | loss | nan |
    """

    def cell(text: str) -> str:
        return text.replace("|", "&#124;").replace("\n", " ")

    rows = [f"| {cell(label)} | {cell(value)} |" for label, value in event_lines(event, code="`")]
    return "\n".join([f"| **NanGuard** | {cell(event.headline())} |", "|---|---|", *rows])
