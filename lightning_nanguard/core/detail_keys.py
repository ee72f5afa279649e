"""Every key the guard writes into ``NanEvent.details``, the section of the event that writes it, and its meaning.

:data:`DETAIL_KEYS` is the registry; ``docs/reference/events.md`` lists the same keys, sections and
meanings (``tests/core/test_detail_keys.py`` holds the two equal). The section is the one of
:mod:`~lightning_nanguard.core.event_builder` whose ``details`` carry the key: ``found`` (what the
check found), ``forensics`` (what the diagnosis concluded and what it cost) or ``rows`` (which rows
and records are named, and how sure that is).

:func:`check_detail_keys` runs where an event is built
(:func:`~lightning_nanguard.core.event_builder.build_event`): a key that is not registered, or
written by another section than its own, is kept and logged once (a run never stops over a note);
with ``NANGUARD_STRICT_DETAIL_KEYS=1`` (the guard's own tests set it) it raises
:class:`UnregisteredDetailKeyError` instead, which passes through every part of the guard.

Example:
    >>> DETAIL_KEYS["samples_not_named"].section
    'rows'
    >>> check_detail_keys("rows", {"samples_not_named": "why"})
    []
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lightning_nanguard.core.events import GuardInternalError

__all__ = ["DETAIL_KEYS", "STRICT_ENV", "DetailKey", "DetailSection", "UnregisteredDetailKeyError", "check_detail_keys"]

log = logging.getLogger("lightning_nanguard")

DetailSection = Literal["found", "forensics", "rows"]
STRICT_ENV = "NANGUARD_STRICT_DETAIL_KEYS"


@dataclass(frozen=True)
class DetailKey:
    """One ``details`` key: the section of the event that writes it and what it means (one line)."""

    section: DetailSection
    meaning: str


def _found(meaning: str) -> DetailKey:
    return DetailKey("found", meaning)


def _forensics(meaning: str) -> DetailKey:
    return DetailKey("forensics", meaning)


def _rows(meaning: str) -> DetailKey:
    return DetailKey("rows", meaning)


DETAIL_KEYS: Mapping[str, DetailKey] = {
    # found: what the check found (the confirmation, a spike, a collapsed loss scale, a warning, a guard error)
    "grads_checked": _found("gradients the element-wise confirmation looked at"),
    "buffers_checked": _found("floating-point BatchNorm buffers the element-wise confirmation looked at"),
    "value": _found("a loss spike: the loss; a precursor: the signal's value"),
    "threshold": _found(
        "a loss spike: the loss above which a step is a spike; a precursor: the level the signal passed"
    ),
    "baseline": _found("a loss spike: the loss's recent healthy level"),
    "spread": _found("a loss spike: the robust spread of the step-to-step change the threshold is built on"),
    "spread_scale": _found('a loss spike: `"log"` or `"linear"`, the scale the spread is measured on'),
    "ratio": _found("a loss spike: the loss over its recent level"),
    "history": _found("a loss spike: healthy values the statistic was measured over"),
    "grad_norm_spike": _found("a gradient-norm spike: its `value`, `threshold`, `baseline`, ... as for the loss"),
    "loss_scale": _found("kind `loss_scale`: the GradScaler's scale after the collapse"),
    "consecutive_overflows": _found("kind `loss_scale`: overflowing steps in a row"),
    "signal": _found('a precursor: what was measured (`"attention_max_logit"`)'),
    "growth": _found("a precursor: how many times the value grew since `earlier_step`"),
    "growth_threshold": _found("a precursor: the growth that triggers a warning"),
    "earlier_value": _found("a precursor: the value at `earlier_step`"),
    "earlier_step": _found("a precursor: the step the growth is measured from"),
    "entropy": _found("a precursor: the mean entropy of the module's attention rows, in nats"),
    "min_entropy": _found("a precursor: the mean of `logsumexp - max` over the rows, a lower bound of `entropy`"),
    "fixes": _found("a precursor: the usual fixes, as readable strings"),
    "part": _found("a guard error: the part that failed (`core` or an optional part such as `tensorboard`)"),
    "error": _found("a guard error: the exception's `repr`"),
    "where": _found("a guard error: the guard's frame that raised (and the outermost frame outside the guard)"),
    "stops": _found("a guard error: what no longer happens"),
    "guard_on": _found("a guard error: whether bad steps are still checked and dropped (`false` only for `core`)"),
    "failed_at_step": _found("a guard error of the core in an earlier hook: the step it happened at"),
    "forward_only": _found("a forward-only epoch (weight averaging): what was done with the batch"),
    "batch_dataset_indices": _found("a forward-only epoch: the dataset indices of the whole batch"),
    # forensics: what the diagnosis concluded (the cause, the origin) and what it cost
    "bisect_passes": _forensics("forward/backward passes the search for samples used"),
    "state_passes": _forensics("passes spent deciding whether the weights or optimizer state are at fault"),
    "diagnosis_error": _forensics("why the diagnosis stopped early (under sharding: each rank's error)"),
    "input_fields": _forensics("cause `input`: the batch fields holding NaN/Inf"),
    "loss_threshold": _forensics("a loss spike's diagnosis: the loss above which a sub-batch counted as bad"),
    "module_type": _forensics("the class of `culprit_module`"),
    "source_text": _forensics("the text of `source_line`"),
    "hint": _forensics("what usually causes this origin and what helps"),
    "function": _forensics("the torch function of a forward origin, e.g. `torch.div`"),
    "source_path": _forensics("the absolute path of the file of `source_line`"),
    "stack": _forensics('the short user call stack of the origin, innermost last, as `{"file", "line", "function"}`'),
    "input_nonfinite": _forensics("the batch itself holds NaN/Inf (the origin is the input)"),
    "bn_channels": _forensics("BatchNorm channels holding NaN/Inf: at most a few channels of a few layers"),
    "bn_channels_summary": _forensics(
        "layer and channel counts of `bn_channels` (the full lists: `details_full.json`)"
    ),
    "micro_batch": _forensics("under gradient accumulation: which micro-batch of the step was diagnosed"),
    "sharding": _forensics("under sharding: the layout, the lockstep passes and the ranks that searched"),
    # rows: which rows and records are named, and how sure that is
    "batch_size": _rows("rows of the batch (`offending_samples` are positions in it)"),
    "loader_batch_sizes": _rows("several training loaders: `[[key, size], ...]` of the loaders in the batch"),
    "not_attributable": _rows("why no sample is named"),
    "bisect_note": _rows("next to named samples: the search stopped early or found samples that fail only together"),
    "dataset_indices_unknown": _rows("why `dataset_indices` is null although samples are named"),
    "sample_loaders_unknown": _rows("the batch was not the collection of the loaders' batches: no sample has a loader"),
    "indices_unverified": _rows("why `indices_verified` is false"),
    "indices_note": _rows("how verified indices were found (e.g. the collate reorders rows: corrected)"),
    "blame_unverified": _rows("why `blame_verified` is false"),
    "blame_note": _rows("what the blame check dropped (e.g. samples that failed only alone)"),
    "verify_passes": _rows("passes the blame check added"),
    "samples_not_named": _rows(
        "why no sample is named: the loop cannot re-run a step (e.g. a Fabric loop without `loss_fn`)"
    ),
}
"""Every ``details`` key the guard writes: its section and its meaning (``docs/reference/events.md``)."""


class UnregisteredDetailKeyError(GuardInternalError):
    """A ``details`` key written that :data:`DETAIL_KEYS` does not hold (raised with ``NANGUARD_STRICT_DETAIL_KEYS=1``).

    A :class:`~lightning_nanguard.core.events.GuardInternalError`, so that no part of the guard
    swallows it into a ``guard_error`` event: the test that wrote the key fails.

    Example:
        >>> str(UnregisteredDetailKeyError("found", "colour"))
        "details key 'colour' (section found) is not in DETAIL_KEYS: register it in \
lightning_nanguard/core/detail_keys.py and document it in docs/reference/events.md"
    """

    def __init__(self, section: str, key: str) -> None:
        RuntimeError.__init__(
            self,
            f"details key {key!r} (section {section}) is not in DETAIL_KEYS: register it in "
            "lightning_nanguard/core/detail_keys.py and document it in docs/reference/events.md",
        )
        self.part, self.error, self.where = "events", f"details key {key!r}", section
        self.section, self.key = section, key

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across processes (ddp_spawn)
        return (type(self), (self.section, self.key))


_told: set[tuple[str, str]] = set()


def check_detail_keys(section: str, details: Mapping[str, Any]) -> list[str]:
    """The keys of ``details`` that are not :data:`DETAIL_KEYS` of ``section``: logged once each (see module docs).

    Raises:
        UnregisteredDetailKeyError: for the first such key, with ``NANGUARD_STRICT_DETAIL_KEYS=1``.
    """
    wrong = [key for key in details if key not in DETAIL_KEYS or DETAIL_KEYS[key].section != section]
    if wrong and os.environ.get(STRICT_ENV) == "1":
        raise UnregisteredDetailKeyError(section, wrong[0])
    for key in wrong:
        if (section, key) not in _told:
            _told.add((section, key))
            log.warning("NanGuard: details key %r (section %s) is not in DETAIL_KEYS; it is kept", key, section)
    return wrong
