"""The per-event files the NanGuard TensorBoard tab shows: source lines, short stack, thumbnails.

Written during training, one directory per event, never pruned (a few KB, plus at most
``max_thumbnails`` small PNGs)::

    <log_dir>/nanguard/incidents/step-<N>[-rank<R>][-<k>]/
        context.json      {"format", "event", "source", "stack", "thumbnails", "image_batch", "notes"}
        sample-<P>.png    thumbnail of the offending sample at batch position P (image batches only)

The dashboard never opens a path written in an event or in these files: it derives every path
from the run directory (see :mod:`lightning_nanguard_tensorboard.layout`). The source lines are
copied here while training, so the tab works on a log directory copied to another machine.

``context.json``:

- ``event``: ``global_step``, ``rank``, ``epoch``, ``batch_idx``, ``kinds`` of the event (to match
  the directory to its line in ``events.jsonl``);
- ``source``: ``{"file", "line", "first_line", "lines"}``, the culprit line and up to
  ``context_lines`` lines either side, or ``null`` when no source line is known or readable;
- ``stack``: the short user stack, innermost frame last, each ``{"file", "line", "function",
  "text"}`` (``text``: that line of code, when readable), from ``event.details["stack"]``;
- ``thumbnails``: ``{"position", "dataset_index", "file", "width", "height", "source_size",
  "nonfinite_values", "value_range"}`` per offending sample shown, and ``"records"`` (the dataset
  indices the row holds) when the event's rows hold several records (``sample_records``);
- ``image_batch``: ``{"layout", "shape", "dtype"}`` of the image tensor found, or ``null``;
- ``notes``: why something is missing (no image tensor in the batch, unreadable source, ...).

Example:
    >>> import tempfile
    >>> import torch
    >>> from lightning_nanguard.core.events import NanEvent
    >>> event = NanEvent(3, 0, 3, 0, ("loss",), "skipped", offending_samples=(1,), dataset_indices=(41,))
    >>> images = torch.rand(4, 3, 16, 16)
    >>> path = save_incident_context(tempfile.mkdtemp(), event, None, (images, torch.zeros(4)), [1])
    >>> path.name, sorted(p.name for p in path.iterdir())
    ('step-3', ['context.json', 'sample-1.png'])
"""

from __future__ import annotations

import json
import linecache
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.reporting.thumbnails import find_image_tensor, thumbnail
from lightning_nanguard_tensorboard.layout import (
    CONTEXT_FILENAME,
    CONTEXT_FORMAT,
    INCIDENTS_DIRNAME,
    MAX_OCCURRENCES,
    incident_dirname,
    thumbnail_filename,
)

__all__ = ["read_source_window", "save_incident_context"]

log = logging.getLogger("lightning_nanguard")

MAX_STACK_FRAMES = 16
MAX_LINE_CHARS = 240


def _split_source_line(source_line: str | None) -> tuple[str, int] | None:
    """``"path/to/file.py:12"`` -> ``("path/to/file.py", 12)`` (``None`` if it has no line number)."""
    if not source_line or ":" not in source_line:
        return None
    path, _, number = source_line.rpartition(":")
    return (path, int(number)) if number.strip().isdigit() and path else None


def _clip(text: str) -> str:
    text = text.rstrip("\r\n")
    return text if len(text) <= MAX_LINE_CHARS else text[: MAX_LINE_CHARS - 1] + "…"


def read_source_window(path: str, line: int, context_lines: int = 5) -> dict[str, Any] | None:
    """The ``line`` of ``path`` and up to ``context_lines`` lines either side, via ``linecache``.

    Returns ``{"line", "first_line", "lines"}`` or ``None`` when the file or the line cannot be read.

    Example:
        >>> window = read_source_window(__file__, 1, context_lines=2)
        >>> window["first_line"], len(window["lines"])
        (1, 3)
    """
    lines = linecache.getlines(path)
    if not lines or not 1 <= line <= len(lines):
        return None
    first = max(1, line - context_lines)
    last = min(len(lines), line + context_lines)
    return {"line": line, "first_line": first, "lines": [_clip(text) for text in lines[first - 1 : last]]}


def _source(event: NanEvent, source_path: str | None, context_lines: int) -> tuple[dict[str, Any] | None, str | None]:
    located = _split_source_line(event.source_line)
    stack = _stack_frames(event)
    if located is None and stack:  # no culprit line: the innermost user frame is the best we have
        located = (str(stack[-1]["file"]), int(stack[-1]["line"]))
    if located is None:
        return None, "no source line in the event"
    shown, line = located
    for candidate in (source_path, shown):
        if candidate:
            window = read_source_window(candidate, line, context_lines)
            if window is not None:
                return {"file": shown, **window}, None
    return None, f"source file not readable: {source_path or shown}"


def _stack_frames(event: NanEvent) -> list[dict[str, Any]]:
    stack = event.details.get("stack") if isinstance(event.details, Mapping) else None
    if not isinstance(stack, Sequence) or isinstance(stack, (str, bytes)):
        return []
    frames = []
    for frame in list(stack)[-MAX_STACK_FRAMES:]:
        if isinstance(frame, Mapping) and frame.get("file") is not None and str(frame.get("line", "")).isdigit():
            frames.append({"file": str(frame["file"]), "line": int(frame["line"]), "function": frame.get("function")})
    return frames


def _stack(event: NanEvent) -> list[dict[str, Any]]:
    frames = _stack_frames(event)
    for frame in frames:
        text = linecache.getline(frame["file"], frame["line"])
        frame["text"] = _clip(text.strip()) if text else None
    return frames


def _thumbnails(
    directory: Path, event: NanEvent, batch: Any, positions: Sequence[int] | None, max_thumbnails: int, max_size: int
) -> tuple[list[dict[str, Any]], dict[str, Any] | None, str | None]:
    if batch is None:
        return [], None, "no batch given"
    image = find_image_tensor(batch)
    if image is None:
        return [], None, "the batch holds no image-like tensor"
    info = {"layout": image.layout, "shape": list(image.tensor.shape), "dtype": str(image.tensor.dtype)}
    if positions is None:  # a batch at fault as a whole names no sample: the incident view says so already
        return [], info, None if event.cause == "batch" else "no offending samples identified"
    indices = list(event.dataset_indices) if event.dataset_indices is not None else None
    records = list(event.sample_records) if event.sample_records is not None else None
    out = []
    for rank_in_list, position in enumerate(list(positions)[:max_thumbnails]):
        if not 0 <= int(position) < image.batch_size:
            continue
        thumb = thumbnail(image, int(position), max_size=max_size)
        name = thumbnail_filename(int(position))
        (directory / name).write_bytes(thumb.png)
        index = indices[rank_in_list] if indices is not None and rank_in_list < len(indices) else None
        out.append(
            {
                "position": int(position),
                "dataset_index": index,
                "file": name,
                "width": thumb.width,
                "height": thumb.height,
                "source_size": list(thumb.source_size),
                "nonfinite_values": thumb.nonfinite_values,
                "value_range": list(thumb.value_range) if thumb.value_range is not None else None,
            }
        )
        if records is not None:
            out[-1]["records"] = list(records[rank_in_list]) if rank_in_list < len(records) else None
    note = f"first {max_thumbnails} of {len(positions)} samples shown" if len(positions) > max_thumbnails else None
    return out, info, note


def _new_directory(nanguard_dir: Path, event: NanEvent) -> Path:
    root = nanguard_dir / INCIDENTS_DIRNAME
    root.mkdir(parents=True, exist_ok=True)
    for occurrence in range(1, MAX_OCCURRENCES + 1):
        path = root / incident_dirname(event.global_step, event.rank, occurrence)
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"{MAX_OCCURRENCES} incident directories for step {event.global_step} already exist")


def save_incident_context(
    nanguard_dir: str | os.PathLike[str],
    event: NanEvent,
    source_path: str | None = None,
    batch: Any | None = None,
    positions: Sequence[int] | None = None,
    *,
    context_lines: int = 5,
    max_thumbnails: int = 8,
    max_size: int = 64,
) -> Path | None:
    """Write the context files of ``event`` under ``nanguard_dir/incidents/``; never raises.

    Args:
        nanguard_dir: the run's ``nanguard`` folder (``<log_dir>/nanguard``).
        event: the event, with its forensic fields filled (``source_line``, ``offending_samples``,
            ``dataset_indices``, ``details["stack"]``).
        source_path: absolute path of the culprit's source file (read with ``linecache``); without
            it, the path in ``event.source_line`` is tried (relative to the working directory).
        batch: the (micro-)batch the offending samples belong to, for thumbnails.
        positions: positions of the offending samples in ``batch`` (default: ``event.offending_samples``).
        context_lines: lines kept either side of the culprit line.
        max_thumbnails: at most this many samples get a thumbnail.
        max_size: longest side of a thumbnail, in pixels.

    Returns:
        The event's directory, or ``None`` when nothing could be written (the reason is logged).
    """
    try:
        if positions is None and event.offending_samples is not None:
            positions = list(event.offending_samples)
        directory = _new_directory(Path(nanguard_dir), event)
        notes: list[str] = []
        source, note = _source(event, source_path, context_lines)
        notes += [note] if note else []
        try:
            thumbnails, image_batch, note = _thumbnails(directory, event, batch, positions, max_thumbnails, max_size)
            notes += [note] if note else []
        except Exception as error:  # thumbnails are a bonus: keep the source and the stack
            thumbnails, image_batch = [], None
            notes.append(f"thumbnails failed: {error!r}")
        context = {
            "format": CONTEXT_FORMAT,
            "event": {
                "global_step": event.global_step,
                "rank": event.rank,
                "epoch": event.epoch,
                "batch_idx": event.batch_idx,
                "kinds": list(event.kinds),
            },
            "source": source,
            "stack": _stack(event),
            "thumbnails": thumbnails,
            "image_batch": image_batch,
            "notes": notes,
        }
        partial = directory / (CONTEXT_FILENAME + ".tmp")
        partial.write_text(json.dumps(context, indent=1, allow_nan=False, default=str), encoding="utf-8")
        os.replace(partial, directory / CONTEXT_FILENAME)  # readers never see a half-written file
        return directory
    except Exception as error:  # the dashboard's files must never stop training
        log.warning("NanGuard: could not save the incident context of step %d: %r", event.global_step, error)
        return None
