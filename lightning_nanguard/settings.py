"""The ``NanGuard`` arguments turned into the settings each part of the guard works with.

Read at ``setup`` from the guard's public attributes, so a change made after ``__init__`` (e.g.
``guard.action = "raise"``) takes effect at the next ``fit``.

Example:
    >>> import inspect
    >>> from lightning_nanguard import NanGuard
    >>> guard = NanGuard(action="rollback", remedies=["clip_grad"], spike_action="off")
    >>> settings = GuardSettings.from_arguments({n: getattr(guard, n) for n in inspect.signature(NanGuard).parameters})
    >>> settings.policy.action, settings.with_norm, settings.spikes
    ('rollback', True, None)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_nanguard.after_step import ParamCheckSettings
from lightning_nanguard.decision import Policy
from lightning_nanguard.diagnosis import DiagnosisSettings
from lightning_nanguard.spike_watch import SpikeSettings

__all__ = ["GuardSettings"]


@dataclass(frozen=True)
class GuardSettings:
    """Everything the controller needs to know about the configuration.

    Attributes:
        policy: the decision rules (:mod:`~lightning_nanguard.decision`).
        diagnosis: what to diagnose on a bad step.
        param_checks: when to check the weights and take snapshots.
        spikes: the spike detectors' parameters (``None``: ``spike_action="off"``).
        track_batchnorm: check BatchNorm statistics.
        with_norm: compute the gradient norm every step (``clip_grad`` needs it).
        sync_free: skip on the device and read the verdict one step later.
    """

    policy: Policy
    diagnosis: DiagnosisSettings
    param_checks: ParamCheckSettings
    spikes: SpikeSettings | None
    track_batchnorm: bool
    with_norm: bool
    sync_free: bool

    @classmethod
    def from_arguments(cls, a: Mapping[str, Any], strategy_kind: str = "single") -> GuardSettings:
        """From the ``NanGuard`` arguments (by name) and the kind of strategy (FSDP cannot diagnose on one rank)."""
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
            track_batchnorm=a["check_bn_stats"],
            with_norm="clip_grad" in (a["remedies"] or ()),
            sync_free=a["sync_free"],
        )
