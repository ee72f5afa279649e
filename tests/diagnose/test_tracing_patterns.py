"""The tracers on everyday patterns: masked softmax, infinities meeting, composites, custom Functions, checkpointing.

Ground truth comes from plain PyTorch on a fresh model (``pattern_models.bad_items``,
``first_module_birth``, ``first_backward_birth``) and from the ``# ORIGIN:`` markers, never from
the guard.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pattern_models as pm
import pytest
import thirdparty_ops
import torch
import torch.nn.functional as F
from forensics_models import one_thread  # noqa: F401 (fixture)
from models import origin_line
from torch import Tensor, nn

from lightning_nanguard.diagnose.batch_diagnosis import diagnose
from lightning_nanguard.diagnose.isolation import gradients
from lightning_nanguard.diagnose.localization import Localization, localize

pytestmark = pytest.mark.usefixtures("one_thread")

PM_FILE = pm.__file__


@pytest.fixture
def no_leftovers() -> Iterator[None]:
    """Nothing the instrumentation installs survives: modes, anomaly mode, the wrapped ``Function.apply``."""
    apply = torch.autograd.Function.__dict__["apply"]
    assert torch._C._len_torch_function_stack() == 0
    yield
    assert torch._C._len_torch_function_stack() == 0
    assert not torch.is_anomaly_enabled()
    assert torch.autograd.Function.__dict__["apply"] is apply


def localized(module: nn.Module, batch: Any, rows: list[int] | None = None) -> Localization:
    n = len(batch[0])
    return localize(module, lambda: module.training_step(batch, 0), batch=batch, rows=rows, batch_size=n)  # type: ignore[operator]


def line_of(name: str, path: str = PM_FILE) -> str:
    return f"{Path(path).name}:{origin_line(name, path)}"


# ------------------------------------------------------------------------------------ rows


# ------------------------------------------------------------------------------------ masked rows


@pytest.mark.usefixtures("no_leftovers")
@pytest.mark.parametrize("kind", pm.NAN_KINDS)
def test_softmax_of_a_fully_masked_row_is_the_origin(kind: str) -> None:
    """Sequence 3 is all padding: its softmax row is all -inf, NaN in the forward, not ``log(0)`` in the loss."""
    torch.manual_seed(0)
    data = pm.padded_tokens(8, empty=(3,))
    assert pm.bad_items(lambda: pm.AttentionClassifier(kind), data) == [3]
    module = pm.AttentionClassifier(kind)
    truth = pm.first_module_birth(module, lambda: module.training_step(data.tensors, 0))
    assert truth == ("attn" if kind == "mha" else None)  # None: the LightningModule's own code
    found = localized(module, data.tensors, rows=[3])
    assert (found.phase, found.op, found.module) == ("forward", "SoftmaxBackward0", truth or "")
    assert found.source_line is not None and found.source_line.endswith(line_of(kind))
    assert found.from_infinity and found.hint is not None and "masked entirely" in found.hint
    expected = "torch.nn.functional.multi_head_attention_forward" if kind == "mha" else "torch.softmax"
    assert found.function == expected


@pytest.mark.usefixtures("no_leftovers")
@pytest.mark.parametrize(
    ("make", "data", "bad", "origin", "op", "function"),
    [
        (pm.LogSumExpPool, pm.padded_tokens(8, empty=(5,)), 5, "inf_minus_inf", "SubBackward0", "torch.sub"),
        (pm.PaddedDistance, pm.padded_tokens(8, padded=(2,)), 2, "zero_times_inf", "MulBackward0", "torch.mul"),
        (pm.DistillModule, pm.distill_data(8, (6,)), 6, "kl_div", "DivBackward0", "torch.nn.functional.kl_div"),
    ],
    ids=["inf-inf", "0*inf", "kl_div"],
)
def test_nan_made_of_infinities_is_born_where_they_meet(
    make: Callable[[], nn.Module], data: Any, bad: int, origin: str, op: str, function: str
) -> None:
    torch.manual_seed(0)
    assert pm.bad_items(make, data) == [bad]
    found = diagnose(make(), data.tensors)
    loc = found.localization
    assert (found.cause, found.offending) == ("data", [bad])
    assert loc is not None and (loc.phase, loc.op, loc.function) == ("forward", op, function)
    assert loc.source_line is not None and loc.source_line.endswith(line_of(origin))
    assert loc.hint is not None and loc.hint.startswith("NaN made of infinities")


class CarriedMask(nn.Module):
    """An additive ``-inf`` mask carried through ``+`` and ``amax`` (no NaN), then a real ``log(0)``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x: Tensor, mask: Tensor, zero: Tensor) -> Tensor:
        scores = x * self.w + mask  # -inf carried on: not an origin
        top = scores.amax(-1)  # -inf for an all-masked row: carried on too
        return torch.where(torch.isfinite(top), top, 0).sum() + torch.log(zero * self.w.sum())


@pytest.mark.usefixtures("no_leftovers")
def test_infinities_carried_on_or_written_on_purpose_are_not_origins() -> None:
    net = CarriedMask()
    mask = torch.zeros(2, 4)
    mask[1] = -math.inf
    healthy = localize(net, lambda: net(torch.ones(2, 4), mask, torch.tensor(1.0)))
    assert healthy == Localization(loss_finite=True, grads_finite=True)
    found = localize(net, lambda: net(torch.ones(2, 4), mask, torch.tensor(0.0)))
    assert (found.phase, found.op, found.from_infinity) == ("forward", "LogBackward0", False)


@pytest.mark.usefixtures("no_leftovers")
@pytest.mark.parametrize("kind", ["mha_no_weights", "sdpa", "encoder_layer"])
def test_attention_that_returns_zeros_for_masked_rows_is_never_blamed(kind: str) -> None:
    """Torch gives no NaN here: the empty sequence 3 is healthy; only sample 6's ``sqrt(0)`` is at fault."""
    torch.manual_seed(0)
    data = pm.padded_tokens(8, empty=(3,), poisoned=(6,))
    assert pm.bad_items(lambda: pm.AttentionClassifier(kind), data) == [6]
    found = diagnose(pm.AttentionClassifier(kind), data.tensors)
    loc = found.localization
    assert (found.cause, found.offending) == ("data", [6])
    assert loc is not None and (loc.phase, loc.op, loc.module) == ("backward", "SqrtBackward0", "")
    assert loc.source_line is not None and loc.source_line.endswith(line_of("scaled_root"))
    clean = pm.padded_tokens(8, empty=(3,))
    module = pm.AttentionClassifier(kind)
    assert localized(module, clean.tensors).phase is None  # nothing non-finite at all


@pytest.mark.usefixtures("no_leftovers")
def test_a_composite_is_named_by_its_inner_node() -> None:
    torch.manual_seed(0)
    data = pm.ctc_data(8, unalignable=(4,))
    found = diagnose(pm.CTCModule(), data.tensors)
    loc = found.localization
    assert (found.offending, loc.op if loc else None) == ([4], "CtcLossBackward0")  # not MeanBackward0
    assert loc is not None and loc.function == "torch.nn.functional.ctc_loss" and "zero_infinity=True" in str(loc.hint)


# ------------------------------------------------------------------------------------ custom Functions


@pytest.mark.usefixtures("no_leftovers")
@pytest.mark.parametrize(
    ("kind", "phase", "node", "function"),
    [
        ("backward", "backward", "SafeSqrtBackward", "pattern_models.SafeSqrt.apply"),
        ("forward", "forward", "ClippedLogBackward", "pattern_models.ClippedLog.apply"),
        ("thirdparty", "backward", "RootMeanSquareBackward", "thirdparty_ops.RootMeanSquare.apply"),
    ],
)
def test_custom_function_is_named_at_its_apply_line(kind: str, phase: str, node: str, function: str) -> None:
    torch.manual_seed(0)
    data = pm.blank_rows(8, blank=(2,))
    assert pm.bad_items(lambda: pm.CustomFunctionModule(kind), data) == [2]
    fresh = pm.CustomFunctionModule(kind)
    loss = fresh.training_step(data.tensors, 0)
    if phase == "backward":
        assert pm.first_backward_birth(loss) == node  # plain autograd hooks, no guard
    else:
        assert loss.grad_fn is not None and not math.isfinite(loss.item())
    found = localized(pm.CustomFunctionModule(kind), data.tensors, rows=[2])
    assert (found.phase, found.op, found.function, found.module) == (phase, node, function, "")
    marker = "thirdparty_function" if kind == "thirdparty" else f"custom_{kind}"
    assert found.source_line is not None and found.source_line.endswith(line_of(marker))
    assert found.hint is not None and "custom autograd Function" in found.hint
    assert "torch.cat" not in str(found.function)  # the op after the Function, blamed before


@pytest.mark.usefixtures("no_leftovers")
def test_a_function_called_inside_its_package_is_named_there_with_the_users_line_on_the_stack() -> None:
    torch.manual_seed(0)
    found = localized(pm.CustomFunctionModule("thirdparty_wrapper"), pm.blank_rows(8, blank=(2,)).tensors, rows=[2])
    assert (found.phase, found.op) == ("backward", "RootMeanSquareBackward")
    lines = Path(thirdparty_ops.__file__).read_text(encoding="utf-8").splitlines()
    apply_line = lines.index("    return RootMeanSquare.apply(x)") + 1
    assert found.source_line is not None and found.source_line.endswith(f"thirdparty_ops/__init__.py:{apply_line}")
    assert [f[1:] for f in found.stack][-2:] == [
        (origin_line("thirdparty_wrapper", PM_FILE), "training_step"),
        (apply_line, "rms"),
    ]


@pytest.mark.usefixtures("no_leftovers")
def test_function_apply_is_restored_when_the_step_raises() -> None:
    class Broken(nn.Module):
        def forward(self) -> Tensor:
            raise ValueError("user error")

    net = Broken()
    with pytest.raises(ValueError, match="user error"):
        localize(net, lambda: net())


# ------------------------------------------------------------------------------------ activation checkpointing


@pytest.mark.usefixtures("no_leftovers")
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_activation_checkpointing(reentrant: bool) -> None:
    """Non-reentrant: the op inside the block. Reentrant (refuses ``autograd.grad``): the checkpoint call."""
    torch.manual_seed(0)
    data = pm.blank_rows(8, blank=(5,))
    assert pm.bad_items(lambda: pm.CheckpointedBlocks(reentrant), data) == [5]
    found = diagnose(pm.CheckpointedBlocks(reentrant), data.tensors)
    loc = found.localization
    assert (found.cause, found.offending, found.error) == ("data", [5], None)
    assert loc is not None and loc.phase == "backward"
    if reentrant:
        assert (loc.op, loc.module) == ("CheckpointFunctionBackward", "")
        assert loc.source_line is not None and loc.source_line.endswith(line_of("checkpoint_call"))
        assert loc.hint is not None and "use_reentrant=False" in loc.hint
    else:
        assert (loc.op, loc.module) == ("SqrtBackward0", "block")
        assert loc.source_line is not None and loc.source_line.endswith(line_of("checkpointed_sqrt"))


def test_gradients_leave_grad_untouched_under_reentrant_checkpointing() -> None:
    torch.manual_seed(0)
    module = pm.CheckpointedBlocks(reentrant=True)
    for p in module.parameters():
        p.grad = torch.full_like(p, 7.0)
    loss = module.training_step(pm.blank_rows(4, blank=()).tensors, 0)
    grads = gradients(loss, list(module.parameters()))
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in module.parameters())  # type: ignore[arg-type]


@pytest.mark.usefixtures("no_leftovers")
def test_where_masked_sqrt_gets_the_masked_domain_hint() -> None:
    torch.manual_seed(0)
    x, y = pm.blank_rows(8, blank=()).tensors
    x = x.abs()
    x[6] = -x[6]  # negative: sqrt is NaN in the branch torch.where drops
    assert pm.bad_items(pm.WhereSqrtModule, torch.utils.data.TensorDataset(x, y)) == [6]
    loc = diagnose(pm.WhereSqrtModule(), (x, y)).localization
    assert loc is not None and (loc.phase, loc.op) == ("backward", "SqrtBackward0")
    assert loc.source_line is not None and loc.source_line.endswith(line_of("where_sqrt"))
    assert loc.hint is not None and loc.hint.startswith("op applied outside its domain")


def test_functional_sdpa_check_is_plain_torch() -> None:
    """The premise of the no-NaN checks: torch 2.13 returns zeros, not NaN, for an all-masked row here."""
    q = torch.randn(2, 4, 8)
    keep = torch.ones(2, 1, 4, dtype=torch.bool)
    keep[1] = False
    assert torch.isfinite(F.scaled_dot_product_attention(q, q, q, attn_mask=keep)).all()
