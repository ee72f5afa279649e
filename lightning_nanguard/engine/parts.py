"""The line between the guard's core and its optional parts: an optional part that fails stops alone.

The **core** keeps NaN/Inf out of the weights: the fused check of the loss, the gradients and the
BatchNorm statistics, the agreement of the ranks, and dropping (or raising on, or rolling back) a
bad step. Everything else is an **optional part** (:data:`OPTIONAL_PARTS`): the spike and
precursor watches, QK-clip, the diagnosis, bundles, remedies, the withdrawal of a dropped step's
logged values, dataset-index bookkeeping, the checkpoint check and every place events and scalars
go. :class:`GuardParts` runs each call into an optional part; when one raises, that part (only) is
switched off for the rest of the run, the failure is logged once with its traceback, and a
``guard_error`` event is made of it (:meth:`GuardParts.take_unreported`), which the recorder sends
to every sink still on. Bad steps after it are still dropped.

An error in the core is the only thing that can turn the guard off (see
:meth:`GuardParts.core_failed` and ``docs/guide/recovery.md``); with
``on_internal_error="raise"`` any internal error stops training with
:class:`~lightning_nanguard.core.events.GuardInternalError` instead.

Example:
    >>> parts = GuardParts()
    >>> parts.run("spikes", lambda: 1 / 0) is None, parts.on("spikes"), parts.on("diagnosis")
    (True, False, True)
    >>> parts.run("spikes", lambda: 1) is None  # off for the rest of the run: not called again
    True
    >>> [(failure.part, failure.error) for failure in parts.take_unreported()]
    [('spikes', "ZeroDivisionError('division by zero')")]
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, get_args

from lightning_nanguard.core.event_builder import Decided, Found, Where, build_event
from lightning_nanguard.core.events import EventAction, GuardInternalError, NanEvent, NonFiniteTrainingError

__all__ = [
    "CORE",
    "OPTIONAL_PARTS",
    "GuardParts",
    "InternalErrorMode",
    "OptionalPart",
    "PartFailure",
]

log = logging.getLogger("lightning_nanguard")

InternalErrorMode = Literal["continue", "raise"]
OptionalPart = Literal[
    "spikes",
    "precursors",
    "qk_clip",
    "diagnosis",
    "bundles",
    "remedies",
    "logged_values",
    "dataset_indices",
    "checkpoint_check",
    "events_file",
    "tensorboard",
    "terminal",
    "scalars",
    "progress_bar",
]
CORE = "core"

OPTIONAL_PARTS: dict[str, str] = {
    "spikes": "finite loss and gradient-norm spikes are no longer flagged",
    "precursors": "attention modules are no longer watched for collapse (no early warnings)",
    "qk_clip": "attention logits are no longer capped",
    "diagnosis": "bad steps are dropped without naming samples, the origin or the cause",
    "bundles": "no repro bundle is saved for a bad step",
    "remedies": "no remedy (clip_grad, raise_eps, lr_backoff, quarantine) is applied after incidents",
    "logged_values": "a dropped step's self.log values and metric updates stay in the epoch aggregates",
    "dataset_indices": "samples are named by their position in the batch, without dataset indices",
    "checkpoint_check": "checkpoints are saved without the guard's finite-weights check",
    "events_file": "events are no longer written to events.jsonl (nor seen by the NanGuard tab)",
    "tensorboard": "events are no longer written to TensorBoard's text tab",
    "terminal": "events are no longer printed as panels",
    "scalars": "the nanguard/ scalars are no longer logged",
    "progress_bar": "the progress bar no longer shows nan_skipped",
}
"""Each optional part and what stops when it is off (the ``stops`` detail of its ``guard_error`` event)."""
assert set(OPTIONAL_PARTS) == set(get_args(OptionalPart))

_T = TypeVar("_T")


@dataclass(frozen=True)
class PartFailure:
    """One internal error: which part, what, where, at which step.

    Attributes:
        part: an :data:`OPTIONAL_PARTS` name, or ``"core"``.
        error: ``repr`` of the exception.
        where: the guard's frame that raised (``file.py:LINE in function``) and, when the error came from
            outside the guard (a logger, the file system, the user's code), the outermost frame there.
        step: the global step it happened at.
    """

    part: str
    error: str
    where: str
    step: int

    def event(
        self,
        epoch: int = 0,
        batch_idx: int = 0,
        rank: int = 0,
        core_action: EventAction = "skipped",
        other: bool = False,
        at_step: int | None = None,
    ) -> NanEvent:
        """The ``guard_error`` event: ``action="warned"`` for an optional part (the step went on as decided).

        For the core, ``core_action`` says what happened to the step in hand (``"skipped"``, ``"raised"``,
        or ``"warned"`` where it could not be dropped); ``other``: the failure was another rank's.
        ``at_step``: the step the event is about when not the one it failed at (a core error in an
        earlier hook: the step dropped for it), with ``failed_at_step`` in its details.

        Example:
            >>> failure = PartFailure("tensorboard", "OSError(28, 'No space left on device')", "x.py:3 in f", 7)
            >>> failure.event().headline()
            "step 7 (epoch 0, batch 0): NanGuard's tensorboard part failed (OSError(28, 'No space left on \
device')) -> that part is off; NaN/Inf steps are still skipped"
        """
        core = self.part == CORE
        stops = OPTIONAL_PARTS.get(self.part, "")
        if core:
            stops = "the guard: no later step is checked" + (" (this failure was on another rank)" if other else "")
        details: dict[str, Any] = {
            "part": self.part,
            "error": self.error,
            "where": self.where,
            "stops": stops,
            "guard_on": not core,
        }
        step = self.step if at_step is None else at_step
        if step != self.step:
            details["failed_at_step"] = self.step
        where = Where(global_step=step, epoch=epoch, batch_idx=batch_idx, rank=rank)
        return build_event(
            where, Found(("guard_error",), details=details), decided=Decided(core_action if core else "warned")
        )


class GuardParts:
    """Runs the optional parts, each switched off alone at its first error; notes a core failure.

    Args:
        mode: ``"continue"`` (an optional part's error turns that part off; a core error turns the
            guard off after dropping the step in hand) or ``"raise"`` (any internal error stops training
            with :class:`~lightning_nanguard.core.events.GuardInternalError`).
    """

    def __init__(self, mode: InternalErrorMode = "continue") -> None:
        self.mode: InternalErrorMode = mode
        self.step = 0  # the global step, kept current by the controller (for the events)
        self.off: dict[str, PartFailure] = {}
        self.unreported: list[PartFailure] = []  # failures whose event is not recorded yet (read on every step)
        self._when_off: dict[str, Callable[[], None]] = {}

    def on(self, part: str) -> bool:
        """Whether ``part`` still runs."""
        return part not in self.off

    def when_off(self, part: str, release: Callable[[], None]) -> None:
        """Call ``release`` (e.g. remove the part's hooks) when ``part`` is switched off."""
        self._when_off[part] = release

    def run(self, part: OptionalPart, function: Callable[..., _T], *args: Any, **kwargs: Any) -> _T | None:
        """``function(*args, **kwargs)`` unless ``part`` is off; ``None`` when it is off or fails now.

        A :class:`~lightning_nanguard.core.events.NonFiniteTrainingError` is the guard's decision and
        passes through.
        """
        if part in self.off:
            return None
        try:
            return function(*args, **kwargs)
        except (NonFiniteTrainingError, GuardInternalError):
            raise
        except Exception as error:
            self.failed(part, error)
            return None

    def failed(self, part: OptionalPart, error: BaseException) -> None:
        """Switch ``part`` off after ``error`` (once), log it, and keep the failure for its event."""
        if part in self.off:
            return
        failure = self._note(part, error)
        log.warning(
            "NanGuard: its %s part failed at step %d (%s); that part is off for the rest of the run (%s). "
            "NaN/Inf steps are still skipped. Please report this with the traceback.",
            part,
            failure.step,
            failure.error,
            OPTIONAL_PARTS.get(part, ""),
            exc_info=(type(error), error, error.__traceback__),
        )
        self._release(part)
        if self.mode == "raise":
            raise GuardInternalError(part, failure.error, failure.where) from error

    def off_elsewhere(self, part: OptionalPart) -> None:
        """Switch ``part`` off because it went off on another rank (a part that joins collectives)."""
        if part in self.off:
            return
        failure = PartFailure(part, "it went off on another rank", "another rank", self.step)
        self.off[part] = failure
        self.unreported.append(failure)
        log.warning("NanGuard: its %s part failed on another rank; off on every rank from step %d.", part, failure.step)
        self._release(part)

    def core_failed(self, error: BaseException) -> PartFailure | None:
        """Note an error of the core; ``None`` if one was noted already.

        Its event is not handed out by :meth:`take_unreported`: the controller records it when the
        guard stops (at the step every rank agrees on), with what was done to that step.
        """
        if CORE in self.off:
            return None
        failure = PartFailure(CORE, repr(error), _where(error), self.step)
        self.off[CORE] = failure
        return failure

    def _release(self, part: str) -> None:
        release = self._when_off.pop(part, None)
        if release is not None:
            try:
                release()
            except Exception as cleanup_error:  # releasing a broken part is best effort
                log.debug("NanGuard: releasing the %s part failed: %r", part, cleanup_error)

    def take_unreported(self) -> list[PartFailure]:
        """The failures whose ``guard_error`` event is not recorded yet (each is handed out once)."""
        taken, self.unreported = self.unreported, []
        return taken

    def _note(self, part: str, error: BaseException) -> PartFailure:
        failure = PartFailure(part, repr(error), _where(error), self.step)
        self.off[part] = failure
        self.unreported.append(failure)
        return failure

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_when_off"] = {}  # hooks of a live run are never pickled
        return state


def _where(error: BaseException) -> str:
    """The guard's innermost frame of ``error``'s traceback, and the innermost frame beyond it, if any."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if "lightning_nanguard" in f.filename.replace("\\", "/")]
    places = []
    if ours:
        frame = ours[-1]
        places.append(f"{_short(frame.filename)}:{frame.lineno} in {frame.name}")
    if frames and (not ours or frames[-1] is not ours[-1]):
        frame = frames[-1]
        places.append(f"{_short(frame.filename)}:{frame.lineno} in {frame.name}")
    return " -> ".join(places) or "unknown"


def _short(filename: str) -> str:
    """``lightning_nanguard/...`` or ``site-packages/...`` instead of the whole path."""
    path = filename.replace("\\", "/")
    for marker in ("lightning_nanguard/", "site-packages/"):
        if marker in path:
            return path[path.rindex(marker) :]
    return path
