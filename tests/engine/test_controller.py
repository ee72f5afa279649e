"""StepController: one configuration reaches every part; pickling drops the live Trainer pieces and keeps settings."""

from __future__ import annotations

import inspect
import pickle
from typing import Any

from lightning_nanguard import NanGuard
from lightning_nanguard.engine.settings import GuardSettings


def arguments(guard: NanGuard) -> dict[str, Any]:
    return {name: getattr(guard, name) for name in inspect.signature(NanGuard).parameters}


def test_configure_reaches_every_part() -> None:
    guard = NanGuard(verbose=False)
    guard.action, guard.max_bisect_passes, guard.check_params_every_n_steps = "rollback", 9, 7
    guard.remedies, guard.lr_backoff_factor, guard.spike_window = ["clip_grad", "lr_backoff"], 0.25, 40
    controller = guard.controller
    controller.configure(GuardSettings.from_arguments(arguments(guard)))
    assert controller.policy.action == "rollback"
    assert controller.diagnosis.max_bisect_passes == 9
    assert controller.after_step.settings is not None and controller.after_step.settings.check_params_every_n_steps == 7
    assert guard.recovery.book.enabled == ("clip_grad", "lr_backoff") and guard.recovery.lr_backoff_factor == 0.25
    assert controller.with_norm  # clip_grad needs the norm every step
    assert controller.spikes is not None and controller.spikes.settings.window == 40


def test_unchanged_spike_settings_keep_the_history() -> None:
    guard = NanGuard(verbose=False)
    controller = guard.controller
    watch = controller.spikes
    controller.configure(GuardSettings.from_arguments(arguments(guard)))
    assert controller.spikes is watch
    guard.spike_action = "off"
    controller.configure(GuardSettings.from_arguments(arguments(guard)))
    assert controller.spikes is None


def test_pickling_keeps_the_configuration_and_drops_the_run() -> None:
    guard = NanGuard(verbose=False, check_params_every_n_steps=7)
    guard.controller.step_params.named = [("w", object())]  # type: ignore[list-item]
    copy = pickle.loads(pickle.dumps(guard.controller))
    assert copy.named_params == [] and copy.params == []
    assert copy.after_step.settings == guard.controller.after_step.settings
    assert copy.policy == guard.controller.policy
