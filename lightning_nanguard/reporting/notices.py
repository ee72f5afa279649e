"""Warnings the guard gives once per run, prefixed with the process rank.

The pattern of Lightning's ``WarningCache`` and ``rank_prefixed_message``, but on every rank
(a rank-local problem, such as a diagnosis failing on rank 1, must be visible where it happens)
and through the ``lightning_nanguard`` logger, so users can silence or redirect it.

Example:
    >>> notices = RankNotices()
    >>> notices.rank = 1
    >>> notices.warn("fsdp", "bisection is off under FSDP")
    True
    >>> notices.warn("fsdp", "bisection is off under FSDP")
    False
"""

from __future__ import annotations

import logging

from lightning_utilities.core.rank_zero import rank_prefixed_message

__all__ = ["RankNotices", "log"]

log = logging.getLogger("lightning_nanguard")


class RankNotices:
    """Warn once per key, the message prefixed with ``[rank: N]`` under DDP."""

    def __init__(self) -> None:
        self.rank: int | None = None  # set when the Trainer is known; None: no prefix
        self.world_size = 1
        self._given: set[str] = set()

    def warn(self, key: str, message: str) -> bool:
        """Log ``message`` at WARNING level unless ``key`` was warned about already; True if logged."""
        if key in self._given:
            return False
        self._given.add(key)
        rank = self.rank if self.world_size > 1 else None
        log.warning(rank_prefixed_message(message, rank))
        return True

    def reset(self) -> None:
        """Forget what was warned about (a new ``fit``)."""
        self._given.clear()
