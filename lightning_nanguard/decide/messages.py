"""What ``NonFiniteTrainingError`` says when the guard stops training, and which events it carries.

Every rank raises with the same rule at the same step; the message names the rule and the limit,
and says what to do next.

Example:
    >>> from lightning_nanguard.decide.policy import Counters, Policy, StepDecision
    >>> decision = StepDecision("incident", action="raise", escalation="max_events")
    >>> stop_message(decision, Counters(bad_steps_total=3), Policy(max_events=3), None, None)[:58]
    'NanGuard: 3 bad steps in total reached max_events=3; last:'
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.decide.policy import Counters, Policy, StepDecision

__all__ = ["checkpoint_refusal", "stop_history", "stop_message"]


def stop_message(
    decision: StepDecision, counters: Counters, policy: Policy, event: NanEvent | None, events_path: Any
) -> str:
    """The message of the ``NonFiniteTrainingError`` a decision with ``action="raise"`` raises."""
    where = f" Events are in {events_path}." if events_path is not None else ""
    if decision.escalation is None:
        what = event.headline() if event is not None else "another rank saw NaN/Inf (see its event)"
        return (
            f"NanGuard: {what}. The optimizer step was not applied, so the weights are still finite. "
            "Inspect the event (error.event), then use action='skip' to train past bad batches or fix the "
            f"origin.{where}"
        )
    if decision.escalation == "max_consecutive_bad_steps":
        rule = (
            f"{counters.consecutive_bad_steps} consecutive bad steps reached max_consecutive_bad_steps="
            f"{policy.max_consecutive_bad_steps}"
        )
    else:
        rule = f"{counters.bad_steps_total} bad steps in total reached max_events={policy.max_events}"
    last = event.headline() if event is not None else "on another rank (see its events)"
    return (
        f"NanGuard: {rule}; last: {last}. Skipping no longer helps: the weights, the learning rate or the data "
        "pipeline is at fault, not single batches. Use action='rollback' with remedies=['clip_grad', "
        f"'lr_backoff'], lower the learning rate, or inspect the events.{where}"
    )


def stop_history(
    decision: StepDecision, events: Sequence[NanEvent], policy: Policy, event: NanEvent | None
) -> list[NanEvent]:
    """The events the error carries: this one, or the run of bad steps (all of them for ``max_events``)."""
    if decision.escalation is None:
        return list(events[-1:]) if event is not None else []
    if decision.escalation == "max_events":
        return list(events)
    return list(events[-policy.max_consecutive_bad_steps :])


def checkpoint_refusal(bad: Sequence[str], action: str | None) -> str:
    """Why a checkpoint with non-finite weights is not saved, and what to do, for the run's own ``action``.

    Example:
        >>> checkpoint_refusal(["net.1.running_var"], "skip")[:98]
        "NanGuard refuses to save a checkpoint with non-finite weights (['net.1.running_var']): with action"
        >>> "action='skip' or 'rollback'" in checkpoint_refusal(["w"], "warn")
        True
    """
    shown = list(bad[:5]) if bad else "on some rank's shards"
    head = f"NanGuard refuses to save a checkpoint with non-finite weights ({shown})"
    if action == "warn":
        return f"{head}: action='warn' lets bad steps update them. Use action='skip' or 'rollback'."
    buffers = bool(bad) and all(name.rsplit(".", 1)[-1].startswith(("running_", "num_batches")) for name in bad)
    written = (
        "code outside the optimizer step wrote them (a callback or hook assigning BatchNorm buffers)"
        if buffers
        else "code outside the optimizer step wrote them (a callback, a hook, or loading a state)"
    )
    return (
        f"{head}: with action={action!r} no bad step reaches the weights, so {written}. action='rollback' keeps a "
        "last good state that is saved instead; or find that code with guard.check(model) after it runs."
    )
