"""What the guard knows between hooks: the shared counters and the flags that carry a step into the next hook.

One :class:`GuardState` is shared by the step controller (which decides a step) and the
after-step work (which runs once the optimizer has stepped); ``NanGuard.state_dict`` saves it.

Example:
    >>> state = GuardState()
    >>> state.counters.bad_steps_total, state.failing, state.pending_rollback
    (0, False, False)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_nanguard.decide.policy import Counters

__all__ = ["GuardState"]


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
    """

    counters: Counters = field(default_factory=Counters)
    last_grad_norm: float | None = None
    failing: bool = False
    disabled: bool = False
    pending_rollback: bool = False
    step_was_bad: bool = False
    reported_step: int | None = None
    dropped_by_check: bool = False
