"""Early warning of attention collapse: a module's max attention logit growing fast past a level.

A run whose learning rate is too high can fail without any NaN or loss spike: in one layer the
largest pre-softmax attention logit grows from about 1 to hundreds or thousands, that layer's
attention turns one-hot (entropy near zero) and the loss stalls. :class:`LogitGrowthRule` watches
each attention module's max logit, sampled every few steps (:mod:`.attention` measures it), and
fires when it is above ``min_logit`` **and** at least ``growth`` times what it was ``window`` steps
before (or less, when sampling leaves no older value). A level alone does not separate the classes
(healthy runs peak anywhere from about 20 to 600); growth alone fires on tiny logits early in
training. The defaults and the evidence for them are in the user guide (``docs/guide/precursors.md``)
and ``studies/attention_collapse.py``.

Example:
    >>> rule = LogitGrowthRule(min_logit=50.0, growth=3.0, window=20, cooldown=100)
    >>> [rule.observe("attn", step, value) for step, value in [(0, 2.0), (10, 12.0), (20, 60.0)]]
    [None, None, EarlyWarning(module='attn', step=20, value=60.0, earlier=2.0, earlier_step=0, ratio=30.0)]
    >>> rule.observe("attn", 30, 200.0) is None  # at most one warning per module per 100 steps
    True
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

__all__ = ["EarlyWarning", "LogitGrowthRule", "PrecursorSettings"]


@dataclass(frozen=True)
class EarlyWarning:
    """One module whose max attention logit crossed the rule at ``step``."""

    module: str
    step: int
    value: float
    earlier: float
    earlier_step: int
    ratio: float


class LogitGrowthRule:
    """Fire when a module's max logit is above ``min_logit`` and ``growth`` times its value ``window`` steps ago.

    Args:
        min_logit: the level the max logit must exceed.
        growth: how many times larger than ``window`` steps before it must be.
        window: how far back the comparison reaches, in steps (the oldest value kept within it).
        cooldown: at most one finding per module in this many steps.
    """

    def __init__(self, min_logit: float, growth: float, window: int, cooldown: int) -> None:
        self.min_logit, self.growth, self.window, self.cooldown = min_logit, growth, window, cooldown
        self._history: dict[str, deque[tuple[int, float]]] = {}
        self._last: dict[str, int] = {}

    def observe(self, module: str, step: int, value: float) -> EarlyWarning | None:
        """Take one sampled value; the finding when the rule fires for ``module`` now."""
        history = self._history.setdefault(module, deque())
        while history and history[0][0] < step - self.window:
            history.popleft()
        if not math.isfinite(value):  # NaN or inf logits: the guard's other checks; never a reference either
            return None
        earlier = history[0] if history else None
        history.append((step, value))
        if earlier is None or value <= self.min_logit:
            return None
        earlier_step, earlier_value = earlier
        ratio = value / max(earlier_value, 1e-6)
        if ratio < self.growth:
            return None
        last = self._last.get(module)
        if last is not None and step - last < self.cooldown:
            return None
        self._last[module] = step
        return EarlyWarning(module, step, value, earlier_value, earlier_step, ratio)

    def state_dict(self) -> dict[str, dict[str, int]]:
        """The last warning step per module (primitives: ``weights_only``-safe)."""
        return {"last_warning": dict(self._last)}

    def load_state_dict(self, state: dict[str, dict[str, int]]) -> None:
        self._last = dict(state.get("last_warning", {}))


@dataclass(frozen=True)
class PrecursorSettings:
    """How the watch samples and when it warns (``NanGuard``'s ``precursor_*`` arguments; the defaults are here).

    The evidence for ``min_logit``, ``growth``, ``window`` and ``every_n_steps``: ``docs/guide/precursors.md``.
    ``rows`` batch rows are measured per attention call; ``cooldown``: at most one warning per module
    in that many steps; ``qk_clip``: QK-clip's cap (``None``: off); ``max_cost``: the share of the training
    time the watch may cost (``None``: no limit).
    """

    every_n_steps: int = 10
    min_logit: float = 80.0
    growth: float = 2.0
    window: int = 20
    cooldown: int = 100
    rows: int = 4
    qk_clip: float | None = None
    max_cost: float | None = 0.01

    def rule(self) -> LogitGrowthRule:
        """The rule these settings describe."""
        return LogitGrowthRule(self.min_logit, self.growth, self.window, self.cooldown)
