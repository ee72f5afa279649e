"""The ``NanGuard`` arguments: validated, then turned into the settings each part of the guard works with.

Validation: every rule names the argument, what is allowed and what was received, so a typo in a
LightningCLI YAML file or a script fails at construction with a message that says how to fix it.

Settings: :meth:`GuardSettings.from_arguments` is the one configuration path of every part of the
guard (the controller, the diagnosis, the after-step work, the spike detectors, the recovery). It
reads the guard's public attributes at ``setup``, so a change made after ``__init__`` (e.g.
``guard.action = "raise"``) takes effect at the next ``fit``.

Example:
    >>> validate_arguments({"action": "skip", "remedies": ["clip_grad"], "eps_factor": 10.0})
    >>> validate_arguments({"remedies": "clip_grad"})
    Traceback (most recent call last):
    ...
    ValueError: NanGuard: `remedies` must be a list of any of ['clip_grad', 'raise_eps', 'lr_backoff', \
'quarantine'], got 'clip_grad' (a single string: write ['clip_grad']).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, get_args

from lightning_nanguard.decide.policy import Policy, SpikeAction, StepAction
from lightning_nanguard.detect.precursors import PrecursorSettings
from lightning_nanguard.engine.after_step import ParamCheckSettings
from lightning_nanguard.engine.incident.step_diagnosis import DiagnosisSettings
from lightning_nanguard.engine.parts import InternalErrorMode
from lightning_nanguard.engine.rows.record_names import RecordSettings
from lightning_nanguard.engine.step.spikes import SpikeSettings
from lightning_nanguard.recover.recovery import RecoverySettings
from lightning_nanguard.recover.remedies import REMEDIES

__all__ = ["ACTIONS", "SPIKE_ACTIONS", "GuardSettings", "Rule", "validate_arguments"]

ACTIONS: tuple[str, ...] = get_args(StepAction)
INTERNAL_ERROR_MODES: tuple[str, ...] = get_args(InternalErrorMode)
SPIKE_ACTIONS: tuple[str, ...] = get_args(SpikeAction)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value  # not NaN


@dataclass(frozen=True)
class Rule:
    """What one argument accepts: a predicate and the words for it in the error message."""

    accepts: Callable[[Any], bool]
    allowed: str

    def check(self, name: str, value: object) -> None:
        """Raise ``ValueError`` naming ``name``, the allowed values and ``value`` when it is refused."""
        if not self.accepts(value):
            raise ValueError(f"NanGuard: `{name}` must be {self.allowed}, got {value!r}.")


def choice(options: Sequence[str]) -> Rule:
    """One of ``options`` (exact strings)."""
    return Rule(lambda v: isinstance(v, str) and v in options, f"one of {list(options)}")


def boolean() -> Rule:
    """``True`` or ``False`` (not a truthy string such as ``"false"``)."""
    return Rule(lambda v: isinstance(v, bool), "a bool (true or false)")


def integer(minimum: int, optional: bool = False) -> Rule:
    """An integer ``>= minimum`` (``None`` too when ``optional``)."""
    words = f"an integer >= {minimum}" + (" or None" if optional else "")
    return Rule(lambda v: (optional and v is None) or (_is_int(v) and v >= minimum), words)


def number(above: float, below: float | None = None) -> Rule:
    """A finite number in ``(above, below)`` (``below=None``: no upper bound)."""
    words = f"a number > {above:g}" + (f" and < {below:g}" if below is not None else "")
    return Rule(
        lambda v: _is_number(v) and above < float(v) < (below if below is not None else float("inf")),
        words,
    )


def _remedy_list(value: object) -> bool:
    if value is None:
        return True
    if isinstance(value, str) or not isinstance(value, list | tuple):
        return False
    return all(isinstance(item, str) and item in REMEDIES for item in value)


RULES: dict[str, Rule] = {
    "action": choice(ACTIONS),
    "check_every_n_steps": integer(1),
    "max_consecutive_bad_steps": integer(1),
    "max_events": integer(1, optional=True),
    "check_bn_stats": boolean(),
    "check_params_every_n_steps": integer(0),
    "bisect": boolean(),
    "localize": boolean(),
    "max_bisect_passes": integer(1),
    "save_repro": boolean(),
    "max_repro_bundles": integer(0),
    "index_key": Rule(lambda v: v is None or isinstance(v, str) or _is_int(v), "None, a str or an int"),
    "batch_slicer": Rule(lambda v: v is None or callable(v), "None or a callable(batch, positions)"),
    "row_records": Rule(
        lambda v: v is None or callable(v),
        "None or a callable(batch, indices) returning the dataset indices each row holds",
    ),
    "verify_indices": boolean(),
    "snapshot_every_n_steps": integer(1),
    "rollback_after_consecutive": integer(1),
    "remedies": Rule(_remedy_list, f"a list of any of {list(REMEDIES)}"),
    "max_remedy_applications": integer(0),
    "lr_backoff_factor": number(0.0, below=1.0),
    "eps_factor": number(1.0),
    "max_eps": number(0.0),
    "min_loss_scale": number(0.0),
    "max_consecutive_overflows": integer(1),
    "verbose": boolean(),
    "spike_action": choice(SPIKE_ACTIONS),
    "spike_sigmas": number(0.0),
    "spike_min_ratio": Rule(lambda v: _is_number(v) and 1.0 <= float(v) < float("inf"), "a number >= 1"),
    "spike_window": integer(3),
    "spike_warmup_steps": integer(2),
    "spike_rebaseline_after": integer(1),
    "sync_free": boolean(),
    "precursors": boolean(),
    "precursor_every_n_steps": integer(1),
    "precursor_min_logit": number(0.0),
    "precursor_growth": Rule(lambda v: _is_number(v) and 1.0 < float(v) < float("inf"), "a number > 1"),
    "precursor_window": integer(1),
    "precursor_max_cost": Rule(
        lambda v: v is None or (_is_number(v) and 0.0 < float(v) <= 1.0), "null or a number in (0, 1]"
    ),
    "qk_clip": Rule(lambda v: v is None or (_is_number(v) and 0.0 < float(v) < float("inf")), "null or a number > 0"),
    "loss_fn": Rule(lambda v: v is None or callable(v), "None or a callable(model, batch) returning the loss"),
    "on_internal_error": choice(INTERNAL_ERROR_MODES),
}


def validate_arguments(arguments: Mapping[str, Any]) -> None:
    """Check every argument in ``arguments`` against its rule; unknown names are not checked here.

    Raises:
        ValueError: the first refused argument, with its name, the allowed values and the value.

    Example:
        >>> validate_arguments({"bisect": "false"})
        Traceback (most recent call last):
        ...
        ValueError: NanGuard: `bisect` must be a bool (true or false), got 'false'.
    """
    window, warmup = arguments.get("spike_window"), arguments.get("spike_warmup_steps")
    for name, value in arguments.items():
        rule = RULES.get(name)
        if rule is None:
            continue
        if name == "remedies" and isinstance(value, str):
            raise ValueError(
                f"NanGuard: `remedies` must be {rule.allowed}, got {value!r} (a single string: write [{value!r}])."
            )
        rule.check(name, value)
    if arguments.get("qk_clip") is not None and arguments.get("precursors") is False:
        raise ValueError(
            "NanGuard: `qk_clip` needs `precursors=True` (it caps the max logits the precursor watch measures), "
            f"got qk_clip={arguments['qk_clip']!r} with precursors=False."
        )
    if _is_int(window) and _is_int(warmup) and warmup > window:  # type: ignore[operator]
        raise ValueError(f"NanGuard: `spike_warmup_steps` must be <= `spike_window` ({window}), got {warmup!r}.")


SHARDED_KINDS = ("fsdp", "model_parallel", "deepspeed")  # the precursor watch stays out of sharded forwards


@dataclass(frozen=True)
class GuardSettings:
    """Everything the parts of the guard need to know about the configuration.

    Attributes:
        policy: the decision rules (:mod:`~lightning_nanguard.decide.policy`).
        diagnosis: what to diagnose on a bad step.
        param_checks: when to check the weights and take snapshots.
        spikes: the spike detectors' parameters (``None``: ``spike_action="off"``).
        recovery: the remedies and their factors.
        track_batchnorm: check BatchNorm statistics.
        with_norm: compute the gradient norm every step (``clip_grad`` needs it).
        sync_free: skip on the device and read the flags one step later.
        precursors: the attention precursor watch's parameters (``None``: ``precursors=False``, or a
            sharded strategy: measuring inside FSDP's and ModelParallelStrategy's forwards is not
            proven safe yet).
        on_internal_error: what the guard's own errors do (:mod:`lightning_nanguard.engine.parts`).
    """

    policy: Policy
    diagnosis: DiagnosisSettings
    param_checks: ParamCheckSettings
    spikes: SpikeSettings | None
    recovery: RecoverySettings
    track_batchnorm: bool
    with_norm: bool
    sync_free: bool
    precursors: PrecursorSettings | None = None
    precursors_refused: str | None = None  # why an explicit ``qk_clip`` is off here (a sharded strategy)
    on_internal_error: InternalErrorMode = "continue"

    @classmethod
    def from_arguments(cls, a: Mapping[str, Any], strategy_kind: str = "single") -> GuardSettings:
        """From the ``NanGuard`` arguments (by name) and the kind of strategy (FSDP cannot diagnose on one rank).

        Example:
            >>> import inspect
            >>> from lightning_nanguard import NanGuard
            >>> guard = NanGuard(action="rollback", remedies=["clip_grad"], spike_action="off")
            >>> arguments = {n: getattr(guard, n) for n in inspect.signature(NanGuard).parameters}
            >>> settings = GuardSettings.from_arguments(arguments)
            >>> settings.policy.action, settings.with_norm, settings.spikes, settings.recovery.remedies
            ('rollback', True, None, ('clip_grad',))
        """
        return cls(
            policy=Policy(
                action=a["action"],
                max_consecutive_bad_steps=a["max_consecutive_bad_steps"],
                max_events=a["max_events"],
                rollback_after_consecutive=a["rollback_after_consecutive"],
                min_loss_scale=a["min_loss_scale"],
                max_consecutive_overflows=a["max_consecutive_overflows"],
                spike_action=a["spike_action"],
                spike_rebaseline_after=a["spike_rebaseline_after"],
            ),
            diagnosis=DiagnosisSettings(
                a["bisect"],
                a["localize"],
                a["max_bisect_passes"],
                a["save_repro"],
                a["max_repro_bundles"],
                a["batch_slicer"],
                diagnose_here=strategy_kind != "fsdp",
                source_root=os.getcwd(),  # source lines are shown relative to where `fit` started
                records=RecordSettings(a["index_key"], a["row_records"], a["verify_indices"]),  # warns once a fit
            ),
            param_checks=ParamCheckSettings(a["check_params_every_n_steps"], a["snapshot_every_n_steps"], a["action"]),
            spikes=None
            if a["spike_action"] == "off"
            else SpikeSettings(
                window=a["spike_window"],
                warmup=a["spike_warmup_steps"],
                sigmas=a["spike_sigmas"],
                min_ratio=a["spike_min_ratio"],
                rebaseline_after=a["spike_rebaseline_after"],
            ),
            recovery=RecoverySettings(
                tuple(a["remedies"] or ()),
                a["max_remedy_applications"],
                a["lr_backoff_factor"],
                a["eps_factor"],
                a["max_eps"],
            ),
            track_batchnorm=a["check_bn_stats"],
            with_norm="clip_grad" in (a["remedies"] or ()),
            sync_free=a["sync_free"],
            on_internal_error=a.get("on_internal_error", "continue"),
            precursors=PrecursorSettings(
                every_n_steps=a["precursor_every_n_steps"],
                min_logit=a["precursor_min_logit"],
                growth=a["precursor_growth"],
                window=a["precursor_window"],
                qk_clip=None if a.get("qk_clip") is None else float(a["qk_clip"]),
                max_cost=None if a.get("precursor_max_cost") is None else float(a["precursor_max_cost"]),
            )
            if a.get("precursors", False) and strategy_kind not in SHARDED_KINDS
            else None,
            precursors_refused=(
                f"NanGuard(qk_clip={a['qk_clip']!r}): off under this {strategy_kind!r} strategy, as is the attention "
                "precursor watch it needs: measuring inside sharded forwards (parameters gathered by hooks around "
                "each module) is not proven safe yet."
            )
            if a.get("qk_clip") is not None and a.get("precursors", False) and strategy_kind in SHARDED_KINDS
            else None,
        )
