"""Every ``NanGuard`` argument refuses bad values with a message naming the argument, what is allowed, and the value.

Table-driven: each argument of ``NanGuard.__init__`` has a row of bad values and a row of good ones;
a test checks the table covers the whole signature, so a new argument cannot go unvalidated.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from lightning_nanguard import NanGuard
from lightning_nanguard.engine.settings import RULES

BAD: dict[str, list[Any]] = {
    "action": ["skp", "SKIP", None, 1],
    "check_every_n_steps": [0, -2, 1.5, True, "1"],
    "max_consecutive_bad_steps": [0, "3", 2.0, False],
    "max_events": [0, -1, 1.5, "2", True],
    "check_bn_stats": ["false", "true", 1, 0, None],
    "check_params_every_n_steps": [-1, 2.5, "50", True],
    "bisect": ["false", 0, 1, None],
    "localize": ["no", 0, None],
    "max_bisect_passes": [0, -3, 10.0, "64"],
    "save_repro": ["yes", 1, None],
    "max_repro_bundles": [-1, 1.0, "5"],
    "index_key": [1.5, ["idx"], ("idx",)],
    "batch_slicer": ["my_pkg.slice", 3],
    "row_records": ["my_pkg.rows", [[0]]],
    "verify_indices": ["false", 0, None],
    "snapshot_every_n_steps": [0, -1, 1.5],
    "rollback_after_consecutive": [0, 2.5, None],
    "remedies": ["clip_grad", ["clip"], ["clip_grad", "lr"], [1], "quarantine"],
    "max_remedy_applications": [-1, 1.5, None],
    "lr_backoff_factor": [0.0, 1.0, 1.5, -0.5, float("nan"), "0.5", True],
    "eps_factor": [0.5, 1.0, 0.0, -10.0, float("inf"), float("nan"), "10"],
    "max_eps": [0.0, -1e-3, float("inf"), "0.01"],
    "min_loss_scale": [0.0, -1.0, float("nan")],
    "max_consecutive_overflows": [0, 1.5, None],
    "verbose": ["false", 0, None],
    "spike_action": ["skp", "raise", "rollback", False, None],
    "spike_sigmas": [0, -1.0, float("inf"), "6"],
    "spike_min_ratio": [0.5, 0.0, float("nan"), float("inf")],
    "spike_window": [2, 0, 64.0, "128"],
    "spike_warmup_steps": [1, 0, 16.5],
    "spike_rebaseline_after": [0, 2.5, None],
    "sync_free": ["true", 1, None],
    "precursors": ["true", 1, None],
    "precursor_every_n_steps": [0, 2.5, None],
    "precursor_min_logit": [0.0, -1.0, float("nan"), "50"],
    "precursor_growth": [1.0, 0.5, float("inf"), "3"],
    "precursor_window": [0, 1.5, None],
    "qk_clip": [0, -1.0, "50", float("inf")],
    "precursor_max_cost": [0, 1.5, "0.01", float("nan")],
    "loss_fn": ["my_pkg.loss", 3],
    "on_internal_error": ["crash", "Continue", True, None],
}

GOOD: dict[str, list[Any]] = {
    "action": ["skip", "raise", "warn", "rollback"],
    "check_every_n_steps": [1, 1000],
    "max_consecutive_bad_steps": [1, 10],
    "max_events": [None, 1, 100],
    "check_bn_stats": [True, False],
    "check_params_every_n_steps": [0, 1, 50],
    "bisect": [True, False],
    "localize": [True, False],
    "max_bisect_passes": [1, 128],
    "save_repro": [True, False],
    "max_repro_bundles": [0, 5],
    "index_key": [None, "idx", 2],
    "batch_slicer": [None, lambda batch, positions: batch],
    "row_records": [None, lambda batch, indices: [[i] for i in indices or []]],
    "verify_indices": [True, False],
    "snapshot_every_n_steps": [1, 100],
    "rollback_after_consecutive": [1, 3],
    "remedies": [None, [], ["clip_grad"], ("quarantine", "raise_eps"), ["clip_grad", "raise_eps", "lr_backoff"]],
    "max_remedy_applications": [0, 3],
    "lr_backoff_factor": [0.5, 0.01, 0.99],
    "eps_factor": [1.5, 10.0, 100],
    "max_eps": [1e-8, 0.01, 1],
    "min_loss_scale": [1e-4, 1.0, 1],
    "max_consecutive_overflows": [1, 20],
    "verbose": [True, False],
    "spike_action": ["skip", "warn", "off"],
    "spike_sigmas": [0.5, 6.0, 10],
    "spike_min_ratio": [1, 1.5, 3.0],
    "spike_window": [16, 128, 1000],
    "spike_warmup_steps": [2, 16, 128],
    "spike_rebaseline_after": [1, 5],
    "sync_free": [True, False],
    "precursors": [True, False],
    "precursor_every_n_steps": [1, 10, 100],
    "precursor_min_logit": [0.5, 50.0, 100],
    "precursor_growth": [1.5, 3.0, 10],
    "precursor_window": [1, 20, 100],
    "qk_clip": [None, 20, 100.0],
    "precursor_max_cost": [None, 0.01, 1],
    "loss_fn": [None, lambda model, batch: model(batch).sum()],
    "on_internal_error": ["continue", "raise"],
}


def _arguments() -> list[str]:
    return [name for name in inspect.signature(NanGuard.__init__).parameters if name != "self"]


def test_the_tables_cover_every_argument() -> None:
    assert sorted(BAD) == sorted(GOOD) == sorted(_arguments())
    assert set(_arguments()) <= set(RULES)


def _stable_id(value: Any) -> str:
    """The same test id in every process (a function's repr holds its address: pytest-xdist needs one id)."""
    return f"<{value.__name__}>" if callable(value) else repr(value)


@pytest.mark.parametrize(("name", "value"), [(n, v) for n, values in BAD.items() for v in values], ids=_stable_id)
def test_a_bad_value_names_the_argument_the_allowed_values_and_the_value(name: str, value: Any) -> None:
    with pytest.raises(ValueError) as info:
        NanGuard(**{name: value})
    message = str(info.value)
    assert message.startswith(f"NanGuard: `{name}` must be {RULES[name].allowed}")
    assert repr(value) in message


@pytest.mark.parametrize(("name", "value"), [(n, v) for n, values in GOOD.items() for v in values], ids=_stable_id)
def test_good_values_are_accepted_and_kept(name: str, value: Any) -> None:
    guard = NanGuard(**{name: value})
    kept = getattr(guard, name)
    assert kept == (list(value or []) if name == "remedies" else value)


def test_a_single_remedy_string_says_how_to_write_the_list() -> None:
    with pytest.raises(ValueError, match=r"got 'clip_grad' \(a single string: write \['clip_grad'\]\)"):
        NanGuard(remedies="clip_grad")  # type: ignore[arg-type]


def test_spike_warmup_cannot_exceed_the_window() -> None:
    with pytest.raises(ValueError, match=r"`spike_warmup_steps` must be <= `spike_window` \(8\), got 16"):
        NanGuard(spike_window=8)
    NanGuard(spike_window=8, spike_warmup_steps=8)


def test_the_allowed_values_are_spelled_out() -> None:
    with pytest.raises(ValueError) as info:
        NanGuard(remedies=["clip"])  # type: ignore[list-item]
    assert "['clip_grad', 'raise_eps', 'lr_backoff', 'quarantine']" in str(info.value)
    with pytest.raises(ValueError, match=r"`eps_factor` must be a number > 1, got 0.5"):
        NanGuard(eps_factor=0.5)  # raise_eps would lower eps


@pytest.mark.parametrize("kind", ["fsdp", "model_parallel", "deepspeed"])
def test_the_precursor_watch_stays_out_of_sharded_forwards(kind: str) -> None:
    from lightning_nanguard.engine.settings import GuardSettings

    guard = NanGuard(verbose=False)
    arguments = {name: getattr(guard, name) for name in _arguments()}
    assert GuardSettings.from_arguments(arguments, strategy_kind="ddp").precursors is not None
    assert GuardSettings.from_arguments(arguments, strategy_kind=kind).precursors is None
    assert GuardSettings.from_arguments(arguments, strategy_kind=kind).precursors_refused is None  # defaults: quiet


@pytest.mark.parametrize("kind", ["fsdp", "model_parallel", "deepspeed"])
def test_an_explicit_qk_clip_under_a_sharded_strategy_is_refused_aloud(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    from lightning_nanguard.engine.controller import StepController
    from lightning_nanguard.engine.recording import IncidentRecorder
    from lightning_nanguard.engine.settings import GuardSettings
    from lightning_nanguard.recover.recovery import Recovery

    guard = NanGuard(verbose=False, qk_clip=50.0)
    arguments = {name: getattr(guard, name) for name in _arguments()}
    assert GuardSettings.from_arguments(arguments, strategy_kind="ddp").precursors_refused is None
    settings = GuardSettings.from_arguments(arguments, strategy_kind=kind)
    assert settings.precursors is None and settings.precursors_refused is not None
    with caplog.at_level("WARNING", logger="lightning_nanguard"):
        StepController(Recovery(), IncidentRecorder(verbose=False)).configure(settings)
    assert f"NanGuard(qk_clip=50.0): off under this {kind!r} strategy" in caplog.text
