"""One-line fixes for well-known origins of NaN/Inf (``lightning_nanguard.diagnose.hints``)."""

from __future__ import annotations

import pytest
from forensics_models import EXPECTED

from lightning_nanguard.diagnose.hints import hint_for


def test_hints_for_each_class() -> None:
    found = {}
    for kind, (_, op, phase) in EXPECTED.items():
        found[kind] = hint_for(op, phase)
    assert "add eps inside the root" in found["cosine_norm"]
    assert "add eps inside the root" in found["power_pool"]
    assert "check the input data" in found["bn_overflow"]
    assert "division by zero" in found["masked_div"]
    assert "clamp the argument to [-1+eps, 1-eps]" in found["acos"]
    assert "log(0)" in found["log_zero"]
    assert "the batch itself holds NaN/Inf" in found["input_data"]
    masked = hint_for("DivBackward0", "backward", masked_forward=True)
    assert masked is not None and "mask the denominator before dividing" in masked
    assert hint_for("LinalgVectorNormBackward0", "backward") == hint_for("SqrtBackward0", "backward")
    assert hint_for("expBackward", "forward") is not None and hint_for(None, None) is None


@pytest.mark.parametrize(
    ("op", "words"),
    [
        ("SqrtBackward0", "add eps inside the root"),
        ("RsqrtBackward0", "add eps inside the root"),
        ("PowBackward1", "add eps inside the root"),
        ("NormBackward1", "add eps inside the root"),
        ("CdistBackward0", "add eps inside the root"),
        ("DivBackward0", "division by zero"),
        ("ReciprocalBackward0", "division by zero"),
        ("AsinBackward0", "clamp the argument to [-1+eps, 1-eps]"),
        ("LogBackward0", "log(0)"),
        ("XlogyBackward0", "log(0)"),
        ("ExpBackward0", "exp overflow"),
        ("log", "log(0)"),  # a torch function name: the first letter is compared upper-case
        ("running_mean", "check the input data"),
        ("<parameters>", "roll back to a finite checkpoint"),
        ("<state>", 'remedies=["clip_grad", "lr_backoff"]'),
    ],
)
def test_hint_by_op(op: str, words: str) -> None:
    hint = hint_for(op, "backward")
    assert hint is not None and words in hint


@pytest.mark.parametrize("op", ["MmBackward0", "AddBackward0", "SoftmaxBackward0", ""])
def test_no_hint_for_other_ops(op: str) -> None:
    assert hint_for(op, "forward") is None


def test_a_masked_forward_changes_the_division_and_domain_hints() -> None:
    masked_sqrt = hint_for("SqrtBackward0", "backward", masked_forward=True)
    assert masked_sqrt is not None and "masked after the fact" in masked_sqrt  # torch.where(h > 0, h.sqrt(), 0)
    assert masked_sqrt != hint_for("SqrtBackward0", "backward")
    assert hint_for("ReciprocalBackward0", "backward", masked_forward=True) == hint_for(
        "DivBackward0", "backward", masked_forward=True
    )
    assert hint_for("DivBackward0", "backward", masked_forward=True) != hint_for("DivBackward0", "backward")
