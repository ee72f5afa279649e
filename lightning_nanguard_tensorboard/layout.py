"""Where NanGuard's files live inside a run directory: the one place both the writer and the dashboard read it.

A run directory (what TensorBoard calls a run, e.g. ``lightning_logs/version_0``) holds::

    nanguard/events.jsonl                      one NanEvent.to_dict() per line, every rank appends
    nanguard/step-<N>[-rank<R>]/               repro bundle of the event at step N (pruned: at most a few)
    nanguard/incidents/<incident dir>/         per-event context, never pruned:
        context.json                             source lines, short user stack, thumbnail list
        sample-<P>.png                           thumbnail of the offending sample at batch position P

This module imports nothing but the standard library: the TensorBoard plugin and the training-side
writer (``lightning_nanguard.reporting.context``) both use it.

Example:
    >>> bundle_dirname(12, 0), bundle_dirname(12, 3)
    ('step-12', 'step-12-rank3')
    >>> incident_dirname(12, 0), incident_dirname(12, 1, occurrence=2)
    ('step-12', 'step-12-rank1-2')
    >>> thumbnail_filename(5)
    'sample-5.png'
"""

from __future__ import annotations

__all__ = [
    "CONTEXT_FILENAME",
    "CONTEXT_FORMAT",
    "EVENTS_FILENAME",
    "INCIDENTS_DIRNAME",
    "MAX_OCCURRENCES",
    "NANGUARD_DIRNAME",
    "bundle_dirname",
    "incident_dirname",
    "thumbnail_filename",
]

NANGUARD_DIRNAME = "nanguard"
EVENTS_FILENAME = "events.jsonl"
INCIDENTS_DIRNAME = "incidents"
CONTEXT_FILENAME = "context.json"
CONTEXT_FORMAT = 1
MAX_OCCURRENCES = 64
"""Events sharing a step and rank (a resumed run appending to the same directory) get numbered
incident directories ``step-N``, ``step-N-2``, ...; this bounds the search."""


def bundle_dirname(global_step: int, rank: int) -> str:
    """Name of the repro bundle directory of an event (as ``lightning_nanguard.reporting.repro`` writes it)."""
    return f"step-{int(global_step)}" + (f"-rank{int(rank)}" if rank else "")


def incident_dirname(global_step: int, rank: int, occurrence: int = 1) -> str:
    """Name of the context directory of the ``occurrence``-th event (1-based) at this step and rank."""
    name = bundle_dirname(global_step, rank)
    return name if occurrence <= 1 else f"{name}-{int(occurrence)}"


def thumbnail_filename(position: int) -> str:
    """File name of the thumbnail of the sample at ``position`` in its batch."""
    return f"sample-{int(position)}.png"
