"""default_of: a default read off the signature that owns it; NanGuard's defaults are their owners'."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import pytest

from lightning_nanguard import NanGuard, SpikeDetector
from lightning_nanguard.core.defaults import default_of
from lightning_nanguard.decide.policy import Policy
from lightning_nanguard.diagnose.batch_diagnosis import diagnose
from lightning_nanguard.diagnose.bisection import find_offending
from lightning_nanguard.recover.recovery import Recovery
from lightning_nanguard.recover.remedies import RemedyBook


@dataclass
class Owner:
    size: int = 7


def test_reads_functions_classes_and_dataclasses() -> None:
    def function(a: int, b: float = 0.5) -> None: ...

    class Plain:
        def __init__(self, c: str = "x") -> None: ...

    assert (default_of(function, "b"), default_of(Plain, "c"), default_of(Owner, "size")) == (0.5, "x", 7)


@pytest.mark.parametrize("name", ["missing", "a"])
def test_a_parameter_without_a_default_is_an_error(name: str) -> None:
    def function(a: int) -> None: ...

    with pytest.raises(TypeError, match=f"no parameter '{name}' with a default"):
        default_of(function, name)


@pytest.mark.parametrize(
    ("argument", "owner", "name"),
    [
        ("action", Policy, "action"),
        ("max_consecutive_bad_steps", Policy, "max_consecutive_bad_steps"),
        ("max_events", Policy, "max_events"),
        ("rollback_after_consecutive", Policy, "rollback_after_consecutive"),
        ("min_loss_scale", Policy, "min_loss_scale"),
        ("max_consecutive_overflows", Policy, "max_consecutive_overflows"),
        ("spike_action", Policy, "spike_action"),
        ("bisect", diagnose, "bisect"),
        ("localize", diagnose, "localize_origin"),
        ("max_bisect_passes", diagnose, "max_passes"),
        ("max_remedy_applications", Recovery, "max_remedy_applications"),
        ("lr_backoff_factor", Recovery, "lr_backoff_factor"),
        ("eps_factor", Recovery, "eps_factor"),
        ("max_eps", Recovery, "max_eps"),
        ("spike_sigmas", SpikeDetector, "sigmas"),
        ("spike_min_ratio", SpikeDetector, "min_ratio"),
        ("spike_window", SpikeDetector, "window"),
        ("spike_warmup_steps", SpikeDetector, "warmup"),
        ("spike_rebaseline_after", SpikeDetector, "rebaseline_after"),
    ],
)
def test_nanguard_receives_each_default_from_its_owner(argument: str, owner: object, name: str) -> None:
    assert inspect.signature(NanGuard).parameters[argument].default == default_of(owner, name)  # type: ignore[arg-type]


def test_the_pass_budget_and_the_remedy_cap_agree_down_the_chain() -> None:
    assert default_of(find_offending, "max_passes") == default_of(diagnose, "max_passes") == 128
    assert default_of(Recovery, "max_remedy_applications") == default_of(RemedyBook, "max_applications")
    assert default_of(Policy, "spike_rebaseline_after") == default_of(SpikeDetector, "rebaseline_after")
