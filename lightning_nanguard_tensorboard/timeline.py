"""What the Timeline view draws: one marker per incident, over the run's own TensorBoard scalars.

Scalars are read through TensorBoard's data provider (the same data the Scalars tab shows): the
gradient norm (``nanguard/grad_norm``), the training loss when the run logs one, and the NanGuard
counters, of which the timeline shows the increments (AMP overflows, rollbacks, remedies, skipped
steps) at the steps where they happen.

Example:
    >>> pick_loss_tag(["val_loss", "train_loss_epoch", "train_loss_step", "nanguard/grad_norm"])
    'train_loss_step'
    >>> increments([(0, 0.0), (5, 0.0), (6, 2.0), (9, 3.0)])
    [[6, 2.0], [9, 1.0]]
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["GRAD_NORM_TAG", "COUNTER_TAGS", "increments", "loss_tags", "markers", "pick_loss_tag", "points"]

GRAD_NORM_TAG = "nanguard/grad_norm"
COUNTER_TAGS = {
    "amp_overflow": "nanguard/amp_overflow_total",
    "rollbacks": "nanguard/rollbacks_total",
    "remedies": "nanguard/remedies_total",
    "skipped": "nanguard/skipped_total",
    "spikes": "nanguard/spikes_total",
}
MAX_POINTS = 2000
_HELD_OUT = ("val", "valid", "test", "eval")


def loss_tags(tags: Iterable[str]) -> list[str]:
    """Scalar tags that look like a loss (not NanGuard's own), best candidate for training first."""
    found = [t for t in tags if "loss" in t.lower() and not t.startswith("nanguard/")]
    return sorted(found, key=_loss_rank)


def _loss_rank(tag: str) -> tuple[int, int, str]:
    low = tag.lower()
    score = 0
    score += 4 if any(word in low for word in _HELD_OUT) else 0
    score -= 2 if "train" in low else 0
    score += 1 if "epoch" in low else 0
    score -= 1 if "step" in low else 0
    return score, len(tag), tag


def pick_loss_tag(tags: Iterable[str]) -> str | None:
    """The most likely per-step training loss among ``tags`` (``None`` when none looks like a loss)."""
    candidates = [t for t in loss_tags(tags) if not any(word in t.lower() for word in _HELD_OUT)]
    return candidates[0] if candidates else None


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def points(data: Iterable[Any]) -> list[list[Any]]:
    """``[[step, value], ...]`` from scalar data; non-finite values become ``None`` (a gap)."""
    return [[int(d.step), _finite(d.value)] for d in data]


def increments(series: Sequence[tuple[int, float]]) -> list[list[Any]]:
    """``[[step, increase], ...]`` where a counter grew (the first point counts from zero)."""
    out: list[list[Any]] = []
    previous = 0.0
    for step, value in series:
        if value is None or not math.isfinite(value):
            continue
        if value > previous:
            out.append([int(step), value - previous])
        previous = value
    return out


def _short_number(value: Any) -> Any:
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.6g}")
    return value


def markers(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One compact marker per event, for the timeline (the incident list carries the rest)."""
    out = []
    for event in events:
        dashboard = event.get("_dashboard", {})
        out.append(
            {
                "index": dashboard.get("index"),
                "step": event.get("global_step"),
                "rank": event.get("rank", 0),
                "epoch": event.get("epoch"),
                "kinds": event.get("kinds") or [],
                "action": event.get("action"),
                "cause": event.get("cause"),
                "remedies": len(event.get("remedies") or []),
                "loss": _short_number(event.get("loss")),
                "grad_norm": _short_number(event.get("grad_norm")),
            }
        )
        if "precursor" in out[-1]["kinds"]:  # an early warning's lane shows where and what
            details = event.get("details") or {}
            out[-1].update(
                module=event.get("culprit_module"),
                signal=details.get("signal"),
                value=_short_number(details.get("value")),
            )
    return out
