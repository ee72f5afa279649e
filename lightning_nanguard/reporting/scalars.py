"""The ``nanguard/`` scalars: what they are, when they are logged, and how they read as steps.

Counters change only at incidents. Logged only at logging steps and incidents, a counter would be
drawn as a slope between its last logging step and the incident; so at an incident the values it
had just before (at ``step - 1``) are logged first, and TensorBoard draws a step at the incident.
Healthy steps that are not logging steps make no logger call at all.

Example:
    >>> scalar_tags(action="rollback", remedies=(), has_scaler=False, spikes=True)
    ['nanguard/grad_norm', 'nanguard/bad_steps_total', 'nanguard/skipped_total', 'nanguard/spikes_total', \
'nanguard/rollbacks_total']
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from lightning_nanguard.decide.policy import Counters

__all__ = ["ScalarLog", "scalar_tags", "scalar_values"]

GRAD_NORM = "nanguard/grad_norm"
COUNTERS = (
    "nanguard/bad_steps_total",
    "nanguard/skipped_total",
    "nanguard/spikes_total",
    "nanguard/amp_overflow_total",
    "nanguard/rollbacks_total",
    "nanguard/remedies_total",
)


def scalar_tags(action: str, remedies: Sequence[str], has_scaler: bool, spikes: bool) -> list[str]:
    """The scalar tags a run with this configuration can log (and nothing else)."""
    tags = [GRAD_NORM, "nanguard/bad_steps_total", "nanguard/skipped_total"]
    if spikes:
        tags.append("nanguard/spikes_total")
    if has_scaler:
        tags.append("nanguard/amp_overflow_total")
    if action == "rollback":
        tags.append("nanguard/rollbacks_total")
    if remedies:
        tags.append("nanguard/remedies_total")
    return tags


def scalar_values(
    counters: Counters, grad_norm: float | None, rollbacks_total: int, remedies_total: int
) -> dict[str, float | None]:
    """The value of every ``nanguard/`` scalar (the :class:`ScalarLog` keeps the tags a run logs).

    Example:
        >>> scalar_values(Counters(bad_steps_total=2), 1.5, 0, 1)["nanguard/bad_steps_total"]
        2.0
    """
    return {
        GRAD_NORM: grad_norm,
        "nanguard/bad_steps_total": float(counters.bad_steps_total),
        "nanguard/skipped_total": float(counters.skipped_total),
        "nanguard/spikes_total": float(counters.spikes_total),
        "nanguard/amp_overflow_total": float(counters.amp_overflow_total),
        "nanguard/rollbacks_total": float(rollbacks_total),
        "nanguard/remedies_total": float(remedies_total),
    }


class ScalarLog:
    """Plans the writes of ``nanguard/`` scalars, with steps at incidents (see module docs).

    Args:
        tags: the tags this run logs (:func:`scalar_tags`); others are dropped.

    Example:
        >>> log = ScalarLog(["nanguard/bad_steps_total"])
        >>> log.plan({"nanguard/bad_steps_total": 1.0}, step=7, previous={"nanguard/bad_steps_total": 0.0})
        [(6, {'nanguard/bad_steps_total': 0.0}), (7, {'nanguard/bad_steps_total': 1.0})]
        >>> log.plan({"nanguard/bad_steps_total": 2.0}, step=8, previous={"nanguard/bad_steps_total": 1.0})
        [(8, {'nanguard/bad_steps_total': 2.0})]
    """

    def __init__(self, tags: Sequence[str]) -> None:
        self.tags = set(tags)
        self._last: dict[str, tuple[int, float]] = {}

    def _last_step(self, tag: str) -> int:
        return self._last[tag][0] if tag in self._last else -1

    def plan(
        self, metrics: Mapping[str, float | None], step: int, previous: Mapping[str, float | None] | None = None
    ) -> list[tuple[int, dict[str, float]]]:
        """The ``(step, values)`` writes for ``metrics`` at ``step``, oldest first.

        Args:
            metrics: tag -> value (``None`` values and tags this run does not log are dropped).
            step: the global step.
            previous: at an incident, the counters' values before it: those that changed are written
                at ``step - 1`` first (unless already written there), so the chart steps at ``step``.
        """
        values = {tag: float(v) for tag, v in metrics.items() if tag in self.tags and v is not None}
        if GRAD_NORM in values and not math.isfinite(values[GRAD_NORM]):
            del values[GRAD_NORM]  # a NaN/Inf norm draws nothing: the incident is in the counters
        writes: list[tuple[int, dict[str, float]]] = []
        if previous and step > 0:
            before = {
                tag: float(value)
                for tag, value in previous.items()
                if value is not None and tag in values and values[tag] != value and self._last_step(tag) < step - 1
            }
            if before:
                writes.append((step - 1, before))
        if values:
            writes.append((step, values))
            self._last.update({tag: (step, value) for tag, value in values.items()})
        return writes
