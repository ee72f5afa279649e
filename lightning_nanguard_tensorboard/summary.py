"""The run summary: counts by kind, cause and action, recurring dataset items and origins, steps lost.

Works on events as ``events.jsonl`` holds them; keys that older files lack (``cause``) or that a
field may leave empty are counted as ``"not investigated"`` / skipped, never an error.

Example:
    >>> events = [
    ...     {"global_step": 3, "rank": 0, "kinds": ["loss", "grad"], "action": "skipped", "cause": "data",
    ...      "dataset_indices": [100], "culprit_module": "net.0", "culprit_op": "DivBackward0",
    ...      "source_line": "demo.py:76", "phase": "forward"},
    ...     {"global_step": 9, "rank": 0, "kinds": ["grad"], "action": "skipped", "cause": "data",
    ...      "dataset_indices": [100, 7], "culprit_module": "net.0", "culprit_op": "DivBackward0",
    ...      "source_line": "demo.py:76", "phase": "forward"},
    ...     {"global_step": 12, "rank": 0, "kinds": ["loss_spike"], "action": "warned"},
    ... ]
    >>> summary = run_summary(events)
    >>> summary["by_kind"]
    [['grad', 2], ['loss', 1], ['loss_spike', 1]]
    >>> summary["dataset_indices"][0]
    {'index': 100, 'count': 2, 'steps': [3, 9]}
    >>> summary["origins"][0]["count"], summary["steps_skipped"]
    (2, 2)

With several training loaders an index is an item of one loader's dataset: ranked with its loader.

    >>> two = {"global_step": 4, "rank": 0, "kinds": ["grad"], "action": "skipped", "cause": "data",
    ...        "dataset_indices": [100], "sample_loaders": ["b"]}
    >>> run_summary([events[0], two])["dataset_indices"]
    [{'index': 100, 'count': 1, 'steps': [3]}, {'index': 100, 'loader': 'b', 'count': 1, 'steps': [4]}]

Rows that hold several records (``sample_records``) count each record. ``verified`` says whether
every incident naming an item verified both its index and its blame (``indices_verified``,
``blame_verified``): ``False`` as soon as one did not, absent when no incident says.

    >>> packed = {"global_step": 5, "rank": 0, "kinds": ["loss"], "action": "skipped", "cause": "data",
    ...           "sample_records": [[100, 8]], "indices_verified": True, "blame_verified": False}
    >>> run_summary([events[0], packed])["dataset_indices"]
    [{'index': 100, 'verified': False, 'count': 2, 'steps': [3, 5]}, {'index': 8, 'verified': False, \
'count': 1, 'steps': [5]}]
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["origin_key", "run_summary"]

TOP = 25
MAX_STEPS_LISTED = 12
NOT_INVESTIGATED = "not investigated"
STEP_LOST_ACTIONS = ("skipped", "rolled_back")


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, Sequence):
        return [str(item) for item in value]
    return []


def _ints(value: Any) -> list[int]:
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [item for item in value if isinstance(item, int) and not isinstance(item, bool)]
    return []


def _rows(event: dict[str, Any]) -> list[list[int]]:
    """The dataset indices of each offending row: one each, or each row's records (``sample_records``)."""
    records = event.get("sample_records")
    if isinstance(records, list) and records:
        return [_ints(row) for row in records]
    return [[i] for i in _ints(event.get("dataset_indices"))]


def _items(event: dict[str, Any]) -> list[tuple[str | int | None, int]]:
    """``(loader, dataset index)`` of an event's samples; the loader is ``None`` with one training loader."""
    rows = _rows(event)
    loaders = event.get("sample_loaders")
    if not (isinstance(loaders, list) and len(loaders) == len(rows)):
        loaders = [None] * len(rows)
    return [
        (loader if loader is None or isinstance(loader, str | int) else str(loader), i)
        for loader, row in zip(loaders, rows, strict=True)
        for i in row
    ]


def _verified(event: dict[str, Any]) -> bool | None:
    """Whether an event verified both the indices and the blame of what it names (``None``: it does not say)."""
    marks = [event.get(key) for key in ("indices_verified", "blame_verified")]
    known = [mark for mark in marks if isinstance(mark, bool)]
    return all(known) if known else None


def _index_entry(item: tuple[str | int | None, int], steps: list[int], verified: bool | None) -> dict[str, Any]:
    loader, index = item
    entry: dict[str, Any] = {"index": index}
    if loader is not None:
        entry["loader"] = loader
    if verified is not None:
        entry["verified"] = verified
    entry.update(count=len(steps), steps=sorted(set(steps))[:MAX_STEPS_LISTED])
    return entry


def _ranked(counter: Counter[Any]) -> list[list[Any]]:
    return [[key, count] for key, count in sorted(counter.items(), key=lambda kv: (-kv[1], str(kv[0])))]


def origin_key(event: dict[str, Any]) -> tuple[str, str, str, str] | None:
    """``(source_line, module, op, phase)`` of an event's origin, or ``None`` when it was not localised.

    Example:
        >>> origin_key({"culprit_module": "", "culprit_op": "LogBackward0", "source_line": None, "phase": "forward"})
        ('', '<LightningModule>', 'LogBackward0', 'forward')
    """
    module, op, line = event.get("culprit_module"), event.get("culprit_op"), event.get("source_line")
    if module is None and op is None and not line:
        return None
    return (
        str(line or ""),
        str(module) if module else "<LightningModule>",
        str(op or ""),
        str(event.get("phase") or ""),
    )


def _steps(events: Iterable[dict[str, Any]]) -> list[int]:
    return sorted({int(e["global_step"]) for e in events})


def run_summary(events: Sequence[dict[str, Any]], skipped_total: float | None = None) -> dict[str, Any]:
    """Summarise a run's events.

    Args:
        events: the run's events (``events.jsonl`` objects).
        skipped_total: the last ``nanguard/skipped_total`` scalar, when the run logged it (it also
            counts steps skipped because another DDP rank was bad).

    Returns:
        A JSON-ready dict: ``incidents``, ``first_step``, ``last_step``, ``ranks``, ``by_kind``,
        ``by_cause``, ``by_action``, ``remedies`` (``[[name, count]]``), ``steps_skipped`` (distinct
        steps whose update was dropped: action ``skipped`` or ``rolled_back``), ``skipped_total``,
        ``rollbacks``, ``dataset_indices`` (``{"index", "count", "steps"}`` ranked by count, with
        ``"loader"`` for an item of one of several training loaders and ``"verified"`` when the
        events say) and
        ``origins`` (``{"source_line", "module", "op", "phase", "function", "count", "steps"}``).
    """
    kinds: Counter[str] = Counter()
    causes: Counter[str] = Counter()
    actions: Counter[str] = Counter()
    remedies: Counter[str] = Counter()
    ranks: Counter[int] = Counter()
    index_steps: dict[tuple[str | int | None, int], list[int]] = {}
    index_verified: dict[tuple[str | int | None, int], bool] = {}
    origin_steps: dict[tuple[str, str, str, str], list[int]] = {}
    functions: dict[tuple[str, str, str, str], str] = {}
    for event in events:
        step = int(event["global_step"])
        kinds.update(set(_strings(event.get("kinds"))))
        causes[str(event.get("cause") or NOT_INVESTIGATED)] += 1
        actions[str(event.get("action") or "unknown")] += 1
        remedies.update(remedy.split(":", 1)[0].strip() for remedy in _strings(event.get("remedies")))
        ranks[int(event.get("rank", 0))] += 1
        verified = _verified(event)
        for item in set(_items(event)):
            index_steps.setdefault(item, []).append(step)
            if verified is not None:
                index_verified[item] = index_verified.get(item, True) and verified
        origin = origin_key(event)
        if origin is not None:
            origin_steps.setdefault(origin, []).append(step)
            details = event.get("details")
            if isinstance(details, dict) and isinstance(details.get("function"), str):
                functions.setdefault(origin, details["function"])
    ranked_indices = sorted(index_steps.items(), key=lambda kv: (-len(kv[1]), kv[0][1], str(kv[0][0] or "")))[:TOP]
    ranked_origins = sorted(origin_steps.items(), key=lambda kv: (-len(kv[1]), kv[0]))[:TOP]
    steps = _steps(events)
    return {
        "incidents": len(events),
        "first_step": steps[0] if steps else None,
        "last_step": steps[-1] if steps else None,
        "ranks": _ranked(ranks),
        "by_kind": _ranked(kinds),
        "by_cause": _ranked(causes),
        "by_action": _ranked(actions),
        "remedies": _ranked(remedies),
        "steps_skipped": len(_steps(e for e in events if e.get("action") in STEP_LOST_ACTIONS)),
        "skipped_total": skipped_total,
        "rollbacks": actions.get("rolled_back", 0),
        "dataset_indices": [_index_entry(item, steps, index_verified.get(item)) for item, steps in ranked_indices],
        "dataset_indices_total": len(index_steps),
        "origins": [
            {
                "source_line": key[0],
                "module": key[1],
                "op": key[2],
                "phase": key[3],
                "function": functions.get(key),
                "count": len(steps),
                "steps": sorted(set(steps))[:MAX_STEPS_LISTED],
            }
            for key, steps in ranked_origins
        ],
    }
