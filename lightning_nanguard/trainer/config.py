"""Trainer settings the guard cannot work under: refused at ``setup``, with the fix.

Example:
    >>> from types import SimpleNamespace
    >>> refuse_what_cannot_be_guarded(SimpleNamespace(_detect_anomaly=False))
"""

from __future__ import annotations

from typing import Any

from lightning_nanguard.engine.failure import UnguardableSetupError

__all__ = ["refuse_what_cannot_be_guarded"]


def refuse_what_cannot_be_guarded(trainer: Any) -> None:
    """Refuse, at setup, Trainer settings under which no bad step can be skipped (with the fix).

    ``Trainer(detect_anomaly=True)``: autograd's anomaly mode raises inside the backward of the first
    step whose gradients hold NaN, before the guard sees the step, so the fit crashes instead of
    skipping it (and anomaly mode slows every healthy step).

    Raises:
        UnguardableSetupError: naming the setting and what to do instead.

    Example:
        >>> from types import SimpleNamespace
        >>> refuse_what_cannot_be_guarded(SimpleNamespace(_detect_anomaly=False))
        >>> refuse_what_cannot_be_guarded(SimpleNamespace(_detect_anomaly=True))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_nanguard...UnguardableSetupError: NanGuard cannot skip bad steps under Trainer(detect_anomaly=True)...
    """
    if getattr(trainer, "_detect_anomaly", False):
        raise UnguardableSetupError(
            "NanGuard cannot skip bad steps under Trainer(detect_anomaly=True): autograd's anomaly mode raises "
            "inside the backward of the first step whose gradients hold NaN, before the guard sees the step, "
            "and it slows every step. Remove detect_anomaly=True (or set detect_anomaly=False): NanGuard names "
            "the module, op and source line of a bad step itself (localize=True). To use anomaly mode alone, "
            "remove NanGuard from the callbacks."
        )
