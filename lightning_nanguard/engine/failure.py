"""The guard's promise: its own failure never kills training, and every rank gives up together.

:func:`failsafe` wraps every hook ``NanGuard`` installs: it times the hook with the guard's
:class:`~lightning_nanguard.core.timing.GuardClock` and turns an internal error into
``StepController.fail`` (one process: the guard disables itself; DDP: it keeps joining the per-step
reduce, which disables every rank at the same step). A ``NonFiniteTrainingError`` is the guard's
decision, not a failure, and passes through.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from lightning_nanguard.core.events import NonFiniteTrainingError

log = logging.getLogger("lightning_nanguard")

if TYPE_CHECKING:
    from lightning_nanguard.core.timing import GuardClock
    from lightning_nanguard.engine.state import GuardState


class Guarded(Protocol):
    """What :func:`failsafe` needs of the callback (``NanGuard``), without importing it."""

    active: bool
    controller: Any
    clock: GuardClock


__all__ = ["Guarded", "UnguardableSetupError", "fail", "failsafe"]

_F = TypeVar("_F", bound=Callable[..., Any])


def fail(state: GuardState, distributed: bool, error: BaseException, where: str) -> None:
    """An internal error in ``where``: log it once with its traceback and give up guarding.

    One process: the guard disables itself now. Under DDP it only marks itself ``failing``: it
    keeps joining the per-step reduce, which tells every rank, and every rank disables at that step.
    """
    if state.failing or state.disabled:
        return
    log.warning(
        "NanGuard disabled itself after an internal error in %s: %r. Training continues unguarded; "
        "please report this with the traceback.",
        where,
        error,
        exc_info=(type(error), error, error.__traceback__),
    )
    if distributed:
        state.failing = True  # still takes part in the per-step reduce, which disables every rank
    else:
        state.disabled = True


class UnguardableSetupError(ValueError):
    """A Trainer setting under which the guard cannot work, refused at setup (:func:`failsafe` lets it through)."""


def failsafe(hook: _F) -> _F:
    """Run a hook, timed, so that the guard's own failure never kills training (see ``StepController.fail``)."""

    @functools.wraps(hook)
    def wrapper(self: Guarded, *args: Any, **kwargs: Any) -> Any:
        if not self.active and not self.controller.state.failing:
            return None
        try:
            with self.clock.measure(hook.__name__):
                return hook(self, *args, **kwargs)
        except (NonFiniteTrainingError, UnguardableSetupError):
            raise
        except Exception as error:
            self.controller.fail(error, hook.__name__)
            return None

    return wrapper  # type: ignore[return-value]
