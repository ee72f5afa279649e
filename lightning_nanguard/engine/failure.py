"""The last line of the guard's promise: an error that escapes every part reaches the core's failure path.

The optional parts fail alone (:mod:`lightning_nanguard.engine.parts`). :func:`failsafe` wraps every
hook ``NanGuard`` installs: it times the hook with the guard's
:class:`~lightning_nanguard.core.timing.GuardClock` and turns an error that escaped into
``StepController.fail``: the rank's next check drops its step and every rank turns its guard off at
that step (it keeps joining the per-step reduce until then). A ``NonFiniteTrainingError`` is the
guard's decision, not a failure, and passes through, as does a ``GuardInternalError``
(``on_internal_error="raise"``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from lightning_nanguard.core.events import GuardInternalError, NonFiniteTrainingError
from lightning_nanguard.engine.parts import CORE, GuardParts

log = logging.getLogger("lightning_nanguard")

if TYPE_CHECKING:
    from lightning_nanguard.core.timing import GuardClock
    from lightning_nanguard.engine.state import GuardState


class Guarded(Protocol):
    """What :func:`failsafe` needs of the callback (``NanGuard``), without importing it."""

    controller: Any
    clock: GuardClock


__all__ = ["Guarded", "UnguardableSetupError", "fail", "failsafe"]

_F = TypeVar("_F", bound=Callable[..., Any])


def fail(state: GuardState, parts: GuardParts, distributed: bool, error: BaseException, where: str) -> None:
    """An error of the guard's core in ``where``: log it once with its traceback and stop guarding soon.

    The core cannot vouch for a step any more: the rank marks itself ``failing``. Its next check
    votes "failed", so every rank drops that step and turns its guard off at the same step (the
    controller records the ``guard_error`` event). With ``on_internal_error="raise"`` one process
    raises :class:`~lightning_nanguard.core.events.GuardInternalError` now; under DDP every rank raises
    at that agreed step instead (no rank is left waiting in a collective).
    """
    if state.failing or state.disabled:
        return
    failure = parts.core_failed(error)
    log.warning(
        "NanGuard's own check failed in %s: %r. The step in hand is dropped and the guard turns itself off "
        "(every rank at the same step): later steps are not checked. Please report this with the traceback.",
        where,
        error,
        exc_info=(type(error), error, error.__traceback__),
    )
    state.failing = True  # the next check votes "failed" (every rank takes part in its reduce)
    if parts.mode == "raise" and not distributed and failure is not None:
        raise GuardInternalError(CORE, failure.error, failure.where) from error


class UnguardableSetupError(ValueError):
    """A Trainer setting under which the guard cannot work, refused at setup (:func:`failsafe` lets it through)."""


def failsafe(hook: _F) -> _F:
    """Run a hook, timed, so that the guard's own failure never kills training (see ``StepController.fail``)."""
    name = hook.__name__

    @functools.wraps(hook)
    def wrapper(self: Guarded, *args: Any, **kwargs: Any) -> Any:
        state = self.controller.state  # `not self.active`, without the property's call (every hook)
        if state.disabled and not state.failing:
            return None
        try:
            if not self.clock.enabled:  # the usual run: no context manager to enter and leave (every hook)
                return hook(self, *args, **kwargs)
            with self.clock.measure(name):
                return hook(self, *args, **kwargs)
        except (NonFiniteTrainingError, GuardInternalError, UnguardableSetupError):
            raise
        except Exception as error:
            self.controller.fail(error, hook.__name__)
            return None

    return wrapper  # type: ignore[return-value]
