"""The cause a diagnosis concludes (``Diagnosis.cause`` / ``NanEvent.cause``) and the evidence behind it.

``"state"`` must never be given for a real data fault of one or a few samples, and must be
reached in at most 4 passes for a diverged model; ``"input"`` reads the samples off the batch
before any op; a reference sub-batch of a healthy step decides the state in 1 pass and corrects
what 3 probes alone cannot tell. The same through the guard on a real Trainer (its events,
remedies and bundles) is in ``tests/integration/test_cause.py``.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import forensics_models as fm
import pytest
import torch
import torch.nn.functional as F
from event_factory import make_event
from forensics_models import one_thread  # noqa: F401 (fixture)
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from lightning_nanguard.diagnose.batch_diagnosis import diagnose
from lightning_nanguard.diagnose.cause import MAX_STATE_PASSES, probe_positions
from lightning_nanguard.diagnose.event_fields import event_with_diagnosis

pytestmark = pytest.mark.usefixtures("one_thread")


class LogOfSum(nn.Module):
    """``log(w * sum(x))`` per sample: a sample is bad iff its row sums to 0 (exactly the rows chosen)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(1.0))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x = batch["x"] if isinstance(batch, dict) else batch
        return (self.w * x.sum(-1)).log().mean()


def rows(n: int, bad: tuple[int, ...] | list[int]) -> Tensor:
    x = torch.ones(n, 3)
    x[list(bad)] = 0.0
    return x


# ------------------------------------------------------------------------------------ data vs state


def test_one_or_two_bad_samples_are_never_the_state() -> None:
    """Every placement of 1 or 2 bad samples in a batch of 8, and of 3 except the 3 probed positions."""
    module = LogOfSum()
    probes = probe_positions(8)
    for k in (1, 2, 3):
        for bad in itertools.combinations(range(8), k):
            found = diagnose(module, rows(8, bad))
            if list(bad) == probes:  # the one placement 3 probes cannot tell from the state (see below)
                assert found.cause == "state"
                continue
            assert (found.cause, found.offending) == ("data", list(bad)), bad
            assert found.state_passes <= MAX_STATE_PASSES


def test_a_reference_sub_batch_tells_data_at_the_probed_positions_from_the_state() -> None:
    module = LogOfSum()
    bad = probe_positions(8)
    assert diagnose(module, rows(8, bad)).cause == "state"  # 3 probes, each bad alone
    found = diagnose(module, rows(8, bad), reference_batch=rows(2, ()))
    assert (found.cause, found.offending, found.state_passes) == ("data", bad, 1)


def test_every_sample_bad_is_data_with_a_healthy_reference() -> None:
    """A whole corrupt batch: without a reference it looks like the state; the reference says data."""
    module = LogOfSum()
    alone = diagnose(module, rows(8, range(8)))
    assert alone.cause == "state" and alone.offending is None and alone.passes == MAX_STATE_PASSES
    found = diagnose(module, rows(8, range(8)), reference_batch=rows(2, ()))
    assert (found.cause, found.offending) == ("data", list(range(8)))


def test_a_diverged_mlp_is_the_model_state_in_at_most_4_passes() -> None:
    """Issue 9, item 1: SGD lr=0.1 makes the weights huge but finite; every sample's loss is Inf."""
    module = fm.DivergingMLP()
    batch = fm.diverge(module, fm.diverging_data())
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())  # huge, not NaN
    before = {k: v.clone() for k, v in module.state_dict().items()}
    found = diagnose(module, batch)
    assert (found.cause, found.offending) == ("state", None)
    assert found.state_passes == found.passes == 4  # the batch, then 3 single samples
    assert "every sample tried is non-finite on its own" in found.reason and "not the data" in found.reason
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
    # the origin is localised on the full batch: where the divergence shows (the squared error overflows)
    assert found.localization is not None and found.localization.phase == "forward"
    assert found.localization.hint is not None and "the model state diverged" in found.localization.hint
    event = event_with_diagnosis(make_event(bare=True, global_step=7, batch_idx=7), found)
    assert event.cause == "state" and event.offending_samples is None and event.dataset_indices is None
    assert event.details["not_attributable"] == found.reason and event.details["state_passes"] == 4


def test_a_diverged_mlp_fails_its_reference_in_one_pass() -> None:
    module = fm.DivergingMLP()
    data = fm.diverging_data()
    batch = fm.diverge(module, data)
    reference = tuple(t[-2:] for t in data.tensors)  # two samples the run saw healthy (one epoch ago)
    found = diagnose(module, batch, reference_batch=reference)
    assert (found.cause, found.offending, found.state_passes, found.passes) == ("state", None, 1, 1)
    assert "known-good reference sub-batch (2 samples" in found.reason


def test_nonfinite_weights_are_the_state_without_a_pass() -> None:
    module = LogOfSum()
    with torch.no_grad():
        module.w.fill_(math.nan)
    found = diagnose(module, rows(8, ()))
    assert (found.cause, found.passes, found.state_passes) == ("state", 0, 0)
    assert "weights are already non-finite (w)" in found.reason


def test_an_interaction_and_a_batch_that_does_not_reproduce() -> None:
    values = torch.tensor(fm.interaction_values(8))
    found = diagnose(fm.InteractionModule(), (values,))
    assert (found.cause, found.offending) == ("interaction", None)
    assert found.state_passes == 2  # a single probe runs finite: not the model state

    class FirstCallOnly(nn.Module):
        calls = 0

        def training_step(self, x: Tensor, batch_idx: int) -> Tensor:
            type(self).calls += 1
            return x.sum() * (math.nan if type(self).calls == 1 else 1.0)

    FirstCallOnly.calls = 1  # the real step already ran
    found = diagnose(FirstCallOnly(), torch.ones(4))
    assert found.cause is None and found.passes == 1 and "gave finite values" in found.reason


def test_bisection_off_is_not_investigated() -> None:
    found = diagnose(LogOfSum(), rows(8, (3,)), bisect=False)
    assert found.cause is None and found.offending is None and found.passes == 0
    assert found.localization is not None and found.localization.op == "LogBackward0"


# ------------------------------------------------------------------------------------ input


def test_nan_in_one_field_of_one_sample_is_the_input() -> None:
    pixels = torch.rand(8, 3, 4, 4)
    pixels[5, 1, 2, 2] = math.nan
    batch = {"pixel_values": pixels, "labels": torch.arange(8), "mask": torch.zeros(8, 4)}

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            return self.conv(batch["pixel_values"]).mean() + batch["mask"].sum()

    found = diagnose(Classifier(), batch)
    assert (found.cause, found.offending, found.input_fields) == ("input", [5], ("pixel_values",))
    assert found.passes == 1 and found.state_passes == 0  # the 7 others confirmed healthy at once
    loc = found.localization
    assert loc is not None and (loc.op, loc.module, loc.phase, loc.source_line) == ("<input>", None, "forward", None)
    event = event_with_diagnosis(make_event(bare=True, global_step=1, batch_idx=1), found)
    assert (event.cause, event.culprit_op, event.culprit_module) == ("input", "<input>", None)
    assert event.details["input_fields"] == ["pixel_values"]


def test_nan_in_a_tensor_shared_by_all_samples_blames_no_sample() -> None:
    batch = {"x": torch.ones(4, 3), "temperature": torch.tensor(math.inf)}

    class Tempered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            return (self.w * batch["x"] / batch["temperature"]).sum().log()

    found = diagnose(Tempered(), batch)
    assert (found.cause, found.offending, found.input_fields) == ("input", None, ("temperature",))
    assert "outside the sample dimension" in found.reason and found.passes == 0


def test_nan_input_next_to_another_fault_is_searched() -> None:
    """Sample 2 holds NaN, sample 6 divides by zero: the others are not healthy, so the search decides."""
    x = torch.ones(8, 3)
    x[2, 0] = math.nan
    x[6] = 0.0
    found = diagnose(LogOfSum(), x)
    assert (found.cause, found.offending) == ("data", [2, 6])
    assert found.input_fields == ("<batch>",) and "also holds NaN/Inf in <batch>" in found.reason
    assert found.localization is not None and found.localization.op == "LogBackward0"  # the other fault


def test_deliberate_infinities_in_the_batch_are_not_an_input_fault() -> None:
    """A {0, -inf} additive mask, and a field the healthy reference holds NaN/Inf in too."""
    n = 8
    mask = torch.zeros(n, 3)
    mask[:, 2] = -math.inf
    sentinel = torch.full((n,), math.inf)  # "no deadline" for every sample, healthy steps too
    x = torch.ones(n, 3)
    x[4] = 0.0
    batch = {"x": x, "mask": mask, "deadline": sentinel}
    reference = {"x": torch.ones(2, 3), "mask": mask[:2], "deadline": sentinel[:2]}
    assert diagnose(LogOfSum(), batch).cause == "input"  # without a reference the sentinel looks like data
    found = diagnose(LogOfSum(), batch, reference_batch=reference)
    assert (found.cause, found.offending, found.input_fields) == ("data", [4], ())


# ------------------------------------------------------------------------------------ loss spikes


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(x @ self.w, y)


def test_loss_spike_names_the_outlier_sample_without_localising() -> None:
    x, y = torch.ones(8, 3), torch.full((8,), 3.0)
    y[5] = 1e3  # a mislabelled target: finite, but its loss is ~1e6
    found = diagnose(Regression(), (x, y), loss_threshold=100.0)
    assert (found.cause, found.offending) == ("data", [5])
    assert found.localization is None  # nothing non-finite: no origin to name
    event = event_with_diagnosis(make_event(bare=True, global_step=1, batch_idx=1, kinds=("loss_spike",)), found)
    assert event.details["loss_threshold"] == 100.0 and event.cause == "data"


def test_loss_spike_of_every_sample_is_the_state() -> None:
    x, y = torch.ones(8, 3), torch.full((8,), 3.0)
    module = Regression()
    with torch.no_grad():
        module.w.fill_(100.0)  # a step too far: every prediction is 300
    found = diagnose(module, (x, y), loss_threshold=100.0)
    assert (found.cause, found.offending, found.state_passes) == ("state", None, 4)
    assert "above the loss threshold" in found.reason
    by_reference = diagnose(module, (x, y), loss_threshold=100.0, reference_batch=(x[:2], y[:2]))
    assert (by_reference.cause, by_reference.passes) == ("state", 1)


def test_a_non_finite_loss_threshold_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    found = diagnose(LogOfSum(), rows(8, (3,)), loss_threshold=math.nan)
    assert (found.cause, found.offending, found.loss_threshold) == ("data", [3], None)
    assert any("not a finite number" in r.message for r in caplog.records)


def test_every_sample_loader_helper() -> None:
    """The datasets above hold what the tests say they hold."""
    data = fm.diverging_data()
    assert isinstance(data, TensorDataset) and len(data) == 64
