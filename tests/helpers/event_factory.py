"""One factory for the ``NanEvent`` a test needs: ``make_event(**changes)``.

The default is a complete event, every field set (a diagnosed NaN at step 12: the loss, two
gradients and two BatchNorm buffers non-finite, two offending samples, an origin, a remedy and a
repro bundle), so a test changes only the fields it is about. ``bare=True`` starts instead from
the fields ``NanEvent`` requires, every optional field at its own default.

Example:
    >>> make_event().headline()
    'step 12 (epoch 1, batch 4): non-finite loss, grad, bn_stats (2 parameter grads, 2 BatchNorm buffers, \
1 parameters) -> step skipped'
    >>> make_event(bare=True, global_step=7, batch_idx=7, loss=float("nan")).headline()
    'step 7 (epoch 0, batch 7): non-finite loss -> step skipped'
"""

from __future__ import annotations

import math
from typing import Any

from lightning_nanguard.core.events import NanEvent

__all__ = ["make_event"]

_REQUIRED: dict[str, Any] = {
    "global_step": 12,
    "epoch": 1,
    "batch_idx": 4,
    "rank": 0,
    "kinds": ("loss", "grad", "bn_stats"),
    "action": "skipped",
}
_BARE_REQUIRED: dict[str, Any] = {**_REQUIRED, "epoch": 0, "kinds": ("loss",)}


def _complete() -> dict[str, Any]:
    return {
        **_REQUIRED,
        "nonfinite_grads": ("net.0.weight", "net.0.bias"),
        "nonfinite_buffers": ("net.1.running_mean", "net.1.running_var"),
        "loss": math.nan,
        "offending_samples": (3, 5),
        "dataset_indices": (27, 29),
        "culprit_module": "net.norm",
        "culprit_op": "SqrtBackward0",
        "source_line": "tests/models.py:98",
        "phase": "backward",
        "remedies": ("lowered lr to 1e-4",),
        "repro_path": "/tmp/nanguard/step-12",
        "grad_norm": math.inf,
        "nonfinite_params": ("net.3.weight",),
        "details": {"grads_checked": 6, "batch_size": 8, "bn_channels": {"net.1": [0, 2]}},
        "cause": "data",
    }


def make_event(*, bare: bool = False, **changes: Any) -> NanEvent:
    """A ``NanEvent`` with ``changes`` applied to the default (see module docs); every call builds new objects.

    Args:
        bare: start from the required fields only (``global_step=12, epoch=0, batch_idx=4, rank=0,
            kinds=("loss",), action="skipped"``), every optional field at ``NanEvent``'s default.
        changes: field values that replace the default ones.
    """
    fields = dict(_BARE_REQUIRED) if bare else _complete()
    fields.update(changes)
    return NanEvent(**fields)
