"""The files of one incident: its context directory (source, stack, thumbnails) and its repro bundle.

Paths are built from the run directory, the event's step and rank, and fixed names (see
:mod:`lightning_nanguard_tensorboard.layout`); the ``repro_path`` written in an event is never opened.
Works the same on a log directory copied from another machine.
"""

from __future__ import annotations

import json
import os
import shlex
from typing import Any

from lightning_nanguard_tensorboard.incidents import DASHBOARD_KEY, step_and_rank
from lightning_nanguard_tensorboard.layout import (
    CONTEXT_FILENAME,
    INCIDENTS_DIRNAME,
    MAX_OCCURRENCES,
    bundle_dirname,
    incident_dirname,
    thumbnail_filename,
)
from lightning_nanguard_tensorboard.runs import RunLocation

__all__ = ["bundle_info", "find_context", "thumbnail_path"]

MAX_CONTEXT_BYTES = 1 << 20


def _read_json(run: RunLocation, *parts: str) -> dict[str, Any] | None:
    """The JSON object at ``<run>/nanguard/<parts...>`` (inside the run, at most 1 MiB), else ``None``."""
    path = run.path(*parts)
    if path is None:
        return None
    try:
        if os.path.getsize(path) > MAX_CONTEXT_BYTES:
            return None
        with open(path, encoding="utf-8") as handle:
            found = json.load(handle)
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _read_context(run: RunLocation, name: str) -> dict[str, Any] | None:
    return _read_json(run, INCIDENTS_DIRNAME, name, CONTEXT_FILENAME)


def _same_event(context: dict[str, Any], event: dict[str, Any]) -> bool:
    written = context.get("event")
    if not isinstance(written, dict):
        return False
    return all(
        written.get(key) == event.get(key, 0 if key == "rank" else None) for key in ("global_step", "rank", "epoch")
    )


def find_context(run: RunLocation, events: list[dict[str, Any]], index: int) -> tuple[str, dict[str, Any]] | None:
    """``(directory name, context.json)`` of ``events[index]``, or ``None`` when it has none.

    Several events may share a step and rank (a resumed run appending to the same folder): the
    incident directories ``step-N``, ``step-N-2``, ... that were written for this step, epoch and
    rank are matched to those events in order.
    """
    key = step_and_rank(events[index])
    if key is None:
        return None
    event = events[index]
    same = [i for i, e in enumerate(events) if step_and_rank(e) == key and e.get("epoch") == event.get("epoch")]
    ordinal = same.index(index)
    candidates = []
    for occurrence in range(1, MAX_OCCURRENCES + 1):
        name = incident_dirname(key[0], key[1], occurrence)
        directory = run.path(INCIDENTS_DIRNAME, name)
        if directory is None or not os.path.isdir(directory):
            break
        context = _read_context(run, name)
        if context is not None and _same_event(context, event):
            candidates.append((name, context))
    return candidates[ordinal] if ordinal < len(candidates) else None


def thumbnail_path(run: RunLocation, directory_name: str, position: int) -> str | None:
    """The thumbnail file of the sample at ``position`` in an incident directory, if it exists."""
    path = run.path(INCIDENTS_DIRNAME, directory_name, thumbnail_filename(position))
    return path if path is not None and os.path.isfile(path) else None


def bundle_info(run: RunLocation, event: dict[str, Any]) -> dict[str, Any]:
    """What the incident view says about the repro bundle: status, path and replay command.

    The path is the run directory as the log directory was given to TensorBoard, plus the bundle's
    fixed name: ``<run>/nanguard/step-<N>[-rank<R>]``.

    Example:
        >>> run = RunLocation("exp/version_0", "/data/logs/exp/version_0", "logs/exp/version_0")
        >>> bundle_info(run, {"global_step": 7, "rank": 1, "_dashboard": {"bundle": "present"}})["command"]
        'python -m lightning_nanguard replay logs/exp/version_0/nanguard/step-7-rank1'
        >>> bundle_info(run, {"global_step": 3, "rank": 0, "_dashboard": {"bundle": "pruned"}})
        {'status': 'pruned', 'name': 'step-3'}
    """
    step, rank = step_and_rank(event) or (0, 0)
    status = event.get(DASHBOARD_KEY, {}).get("bundle", "none")
    name = bundle_dirname(step, rank)
    info: dict[str, Any] = {"status": status, "name": name}
    if status == "present":
        shown = os.path.join(run.shown, "nanguard", name)
        info["path"] = shown
        trust = " --trust" if _needs_trust(run, name) else ""
        info["command"] = f"python -m lightning_nanguard replay {shlex.quote(shown)}{trust}"
    return info


def _needs_trust(run: RunLocation, name: str) -> bool:
    """What the bundle's ``module.json`` says: its replay needs ``--trust`` (the run's own model class in a script)."""
    meta = _read_json(run, name, "module.json")  # <run>/nanguard/<bundle>/module.json
    return meta is not None and bool(meta.get("replay_needs_trust"))
