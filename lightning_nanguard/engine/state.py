"""What the guard knows between hooks: the shared counters and the flags that carry a step into the next hook.

One :class:`GuardState` is shared by the step controller (which decides a step) and the
after-step work (which runs once the optimizer has stepped); its :meth:`GuardState.state_dict`
(the counters and the last gradient norm) is part of the guard's checkpoint state.

Example:
    >>> state = GuardState()
    >>> state.counters.bad_steps_total, state.failing, state.pending_rollback
    (0, False, False)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_nanguard.decide.policy import Counters

__all__ = ["CounterView", "GuardState", "composed_state", "load_composed_state"]


@dataclass
class GuardState:
    """Mutable per-run state of one rank's guard (identical on every rank except where noted).

    Attributes:
        counters: the shared counts (see :class:`~lightning_nanguard.decide.policy.Counters`).
        last_grad_norm: the gradient norm of the last step where it was computed.
        failing: this rank's guard failed internally; it keeps joining the collectives until every
            rank disables at the same step.
        disabled: the guard no longer acts (after a failure seen by every rank, or set by the user).
        pending_rollback: a rollback was decided at this step, to run after the optimizer step.
        step_was_bad: this step was an incident (no snapshot is taken after it).
        reported_step: the global step of the last incident (LBFGS calls the check many times per step).
        dropped_by_check: ``guard.check`` found this batch bad (manual optimisation: the caller skips the
            step); its logged values and metric updates are undone at the batch's end.
        unreported_checks: the events ``guard.check`` found in this batch, not yet recorded: the step's own
            check reports a step the caller takes anyway (once), the batch's end one the caller skipped.
    """

    counters: Counters = field(default_factory=Counters)
    last_grad_norm: float | None = None
    failing: bool = False
    disabled: bool = False
    pending_rollback: bool = False
    step_was_bad: bool = False
    reported_step: int | None = None
    dropped_by_check: bool = False
    unreported_checks: list[Any] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (primitives): every :class:`Counters` field, flat, and ``last_grad_norm``.

        The per-step flags are not kept: a checkpoint is saved between steps.

        Example:
            >>> GuardState(Counters(bad_steps_total=2), last_grad_norm=0.5).state_dict()["bad_steps_total"]
            2
        """
        return {**dataclasses.asdict(self.counters), "last_grad_norm": self.last_grad_norm}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output; a missing counter reads as 0, a missing norm as ``None``."""
        self.counters = Counters(**{name: int(state.get(name, 0)) for name in Counters.__dataclass_fields__})
        norm = state.get("last_grad_norm")
        self.last_grad_norm = float(norm) if norm is not None else None


class CounterView:
    """A read-only attribute of ``NanGuard`` showing one of ``guard.counters`` (the same on every rank).

    Example:
        >>> class Guard:
        ...     counters = Counters(skipped_total=3)
        ...     skipped_total = CounterView("skipped_total", "Updates dropped.")
        >>> Guard().skipped_total, Guard.skipped_total.__doc__
        (3, 'Updates dropped.')
    """

    def __init__(self, name: str, doc: str) -> None:
        self.name, self.__doc__ = name, doc

    def __get__(self, guard: Any, owner: type) -> int:
        if guard is None:
            return self  # type: ignore[return-value]  # on the class: for help() and documentation tools
        return int(getattr(guard.counters, self.name))


def composed_state(
    state: GuardState, spikes: Any, spike_state: dict[str, Any], recorder: Any, recovery: Any
) -> dict[str, Any]:
    """The guard's checkpoint state, composed from its parts' (primitives; the layout of 0.2.0 and 0.3).

    The counters (flat) and ``last_grad_norm`` (``state``), ``spikes`` (the spike statistic; the
    state loaded before the detectors exist, ``spike_state``, while they do not), ``events`` (the
    recorder's last ones) and ``recovery`` (remedy state and rollback count).
    """
    saved_spikes = spikes.state_dict() if spikes is not None else spike_state
    return {**state.state_dict(), "spikes": saved_spikes, **recorder.state_dict(), "recovery": recovery.state_dict()}


def load_composed_state(
    saved: dict[str, Any], state: GuardState, spikes: Any, recorder: Any, recovery: Any
) -> dict[str, Any]:
    """Restore :func:`composed_state` output into the parts; the spike state (kept until a watch exists)."""
    state.load_state_dict(saved)
    recorder.load_state_dict(saved)
    spike_state = dict(saved.get("spikes", {}))
    if spikes is not None:
        spikes.load_state_dict(spike_state)
    recovery.load_state_dict(saved.get("recovery", {}))
    return spike_state
