"""QK-clip across ranks: a rank that fails still joins the max-reduce, and then no rank rescales."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from states import clone_state, states_equal
from torch import Tensor, nn

import lightning_nanguard.engine.step.precursors as precursors_module
from lightning_nanguard.detect.precursors import PrecursorSettings
from lightning_nanguard.engine.step.precursors import PrecursorWatch

HEADS = 2


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, HEADS, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


def sampled_watch() -> tuple[nn.Module, PrecursorWatch]:
    """A watch whose step 0 was sampled (its values wait for the clip), on a model far above the cap."""
    torch.manual_seed(0)
    model = nn.Sequential(SelfAttention())
    watch = PrecursorWatch(PrecursorSettings(every_n_steps=1, qk_clip=1.0, max_cost=None))
    watch.attach(model)
    watch.arm(0)
    model(torch.randn(2, 5, 8) * 10)
    watch.finish(0)
    return model, watch


def other_rank(measured: float, failed: bool, sent: list[Tensor]) -> Callable[[Tensor], Tensor]:
    """A max-reduce with one other rank, which measured ``measured`` on every head and did or did not fail."""

    def reduce_max(values: Tensor) -> Tensor:
        sent.append(values.clone())
        theirs = torch.cat((torch.full((values.numel() - 1,), measured), torch.tensor([1.0 if failed else 0.0])))
        return torch.maximum(values, theirs)

    return reduce_max


def test_without_a_failure_every_rank_rescales_by_the_max() -> None:
    model, watch = sampled_watch()
    before, sent = clone_state(model.state_dict()), []
    watch.clip(other_rank(100.0, failed=False, sent=sent))
    assert len(sent) == 1 and sent[0].tolist()[-1] == 0.0 and sent[0].numel() == HEADS + 1
    assert not states_equal(before, model.state_dict())


def test_a_rank_that_cannot_make_its_values_joins_the_reduce_flags_it_and_raises_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, watch = sampled_watch()
    before, sent = clone_state(model.state_dict()), []

    def broken(*args: object) -> Tensor:
        raise RuntimeError("planted")

    monkeypatch.setattr(precursors_module, "_per_head", broken)
    with pytest.raises(RuntimeError, match="planted"):
        watch.clip(other_rank(100.0, failed=False, sent=sent))
    assert len(sent) == 1 and sent[0].tolist() == [float("-inf")] * HEADS + [1.0]  # joined, with the flag
    assert states_equal(before, model.state_dict())  # the other rank's values are above the cap: still no rescale


def test_a_failure_on_another_rank_stops_the_rescale_here_too() -> None:
    model, watch = sampled_watch()
    before, sent = clone_state(model.state_dict()), []
    watch.clip(other_rank(100.0, failed=True, sent=sent))
    assert len(sent) == 1 and states_equal(before, model.state_dict())
