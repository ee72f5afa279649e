"""Blame when an op reshapes, permutes or re-views the batch dimension, with loader parts of unequal sizes.

The localisation follows the offending sample's rows by each loader part's size
(``Rows.per_size``): a tensor whose first dimension is a healthy part's size is skipped, one whose
first dimension is no part's size is tested whole. An op that changes the first dimension was
judged by rows on one side and whole (or by another part's rows) on the other, so it could be named
the origin of a NaN/Inf it only carried on:

- a healthy loader's padded token scores, ``-inf`` on purpose, flattened (``(8, T) -> (8 * T,)``);
- a sequence-first transpose mapping loader ``b``'s ``(4, 8)`` scores onto loader ``a``'s size 8;
- a parameter gathered into a fresh buffer before each forward, as FSDP2 unshards one: the buffer
  (8 values, a's part size) is viewed ``(world, -1)`` before the collective writes it, and what the
  allocator left there (a freed NaN tensor) shows in the view. This is how
  ``tests/integration/test_sharded_loaders.py`` once named ``view`` instead of ``div``: it depended
  on what memory FSDP2's all-gather output happened to reuse.

Each model really computes ``0 / 0`` for an all-zero record (``Encoder``'s ``div``): that is the origin.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_nanguard.diagnose.batch_diagnosis import diagnose
from lightning_nanguard.diagnose.combined import CombinedLayout
from lightning_nanguard.diagnose.finiteness import WHOLE, Rows
from lightning_nanguard.diagnose.tracing import ForwardTracer

AB = CombinedLayout.from_paths([("a",), ("b",)])
FEATURES = 4
HERE = Path(__file__).resolve()


def origin_line() -> int:
    lines = HERE.read_text(encoding="utf-8").splitlines()
    return next(i for i, line in enumerate(lines, start=1) if line.rstrip().endswith("# ORIGIN"))


class Encoder(nn.Module):
    """A projection, cosine-normalised: an all-zero record gives ``0 / 0``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(FEATURES, FEATURES, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        h = self.proj(x)
        return h / h.norm(dim=-1, keepdim=True)  # ORIGIN


class Tagger(nn.Module):
    """Token scores of each loader's padded sequences; padded tokens score ``-inf`` on purpose.

    ``flat``: the scores of a part are flattened over its tokens, ``(N, T) -> (N * T,)``.
    ``time_major``: they are transposed sequence-first, ``(N, T) -> (T, N)``.
    ``order``: the loaders' parts in the order ``training_step`` runs them.
    """

    def __init__(self, layout: str, order: tuple[str, ...] = ("a", "b")) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layout = layout
        self.order = order
        self.encoder = Encoder()
        self.score = nn.Linear(FEATURES, 1)

    def part_loss(self, x: Tensor, lengths: Tensor) -> Tensor:
        pad = torch.arange(x.shape[1]) >= lengths[:, None]  # (N, T)
        scores = self.score(self.encoder(x)).squeeze(-1).masked_fill(pad, -math.inf)
        if self.layout == "flat":
            logp = scores.flatten().log_softmax(0)  # over every token of the part
            return -logp[~pad.flatten()].mean()
        scores, pad = scores.t(), pad.t()  # (T, N): sequence-first
        logp = scores.log_softmax(0)  # over each sequence's tokens
        return -torch.where(pad, torch.zeros_like(logp), logp).sum() / (~pad).sum()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return torch.stack([self.part_loss(*batch[key]) for key in self.order]).sum()


def padded_parts(steps: dict[str, int], bad: tuple[str, int], sizes: dict[str, int] | None = None) -> dict[str, Any]:
    """Loader ``a`` (8 sequences) and ``b`` (4), ``steps[key]`` tokens each; every other sequence padded.

    Padded tokens hold random values (only the scores are masked); the record ``bad`` is all zeros.
    """
    sizes = sizes or {"a": 8, "b": 4}
    g = torch.Generator().manual_seed(1)
    parts = {}
    for key, size in sizes.items():
        x = torch.randn(size, steps[key], FEATURES, generator=g) + 2
        lengths = torch.tensor([steps[key] if i % 2 == 0 else steps[key] // 2 for i in range(size)])
        parts[key] = (x, lengths)
    key, position = bad
    parts[key][0][position] = 0.0
    return parts


def assert_blames_the_encoder_div(found: Any, bad: tuple[str, int]) -> None:
    assert found.cause == "data" and found.loaders is not None
    assert [found.loaders.locate(p) for p in found.offending or ()] == [bad]
    loc = found.localization
    assert loc is not None
    assert (loc.phase, loc.op, loc.module, loc.module_type, loc.function) == (
        "forward",
        "DivBackward0",
        "encoder",
        "Encoder",
        "torch.div",
    )
    assert loc.source_line is not None and loc.source_line.endswith(f"{HERE.name}:{origin_line()}")


@pytest.mark.parametrize("bad", [("b", 2), ("a", 5)])
def test_a_healthy_loaders_masked_scores_flattened_before_the_bad_record_take_no_blame(bad: tuple[str, int]) -> None:
    """Loader a's ``(8, 3)`` scores, ``-inf`` at its padding, flattened to ``(24,)``: tested whole, a's rows skipped.

    With the record in b (a runs first), ``flatten`` was named (``ViewBackward0``, the root module).
    """
    found = diagnose(Tagger("flat"), padded_parts({"a": 3, "b": 3}, bad), layout=AB)
    assert_blames_the_encoder_div(found, bad)


@pytest.mark.parametrize("bad", [("a", 5), ("b", 2)])
def test_a_transpose_that_maps_one_loaders_rows_onto_the_others_size_takes_no_blame(bad: tuple[str, int]) -> None:
    """Loader b's ``(4, 8)`` scores, transposed ``(8, 4)``: a's size, read at a's followed row 5 (b's token 5).

    b's short sequences are padded at token 5 (``-inf``): with the record in a (b runs first), ``t``
    was named (``TBackward0``).
    """
    found = diagnose(Tagger("time_major", order=("b", "a")), padded_parts({"a": 3, "b": 8}, bad), layout=AB)
    assert_blames_the_encoder_div(found, bad)


class GatheredHead(nn.Module):
    """A head whose weight is gathered into a fresh buffer before each forward, as FSDP2 unshards a parameter.

    The buffer (``world * shard`` = 8 values) is viewed ``(world, -1)`` before it is written, as
    ``foreach_all_gather_copy_out`` does; it holds what the allocator left there: NaN, as a freed NaN
    tensor (a previous pass's gradients) would.
    """

    WORLD = 2

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(self.WORLD, FEATURES) / FEATURES)
        self.register_forward_pre_hook(self._gather)

    def _gather(self, module: nn.Module, args: Any) -> None:
        with torch.no_grad():
            buffer = torch.full((self.weight.numel(),), math.nan)  # stale memory, not yet written
            rows = buffer.view(self.WORLD, -1)  # as FSDP2 views its all-gather output
            rows.copy_(self.weight)  # the collective writes it

    def forward(self, h: Tensor) -> Tensor:
        return h @ self.weight.t()


class GatheredTasks(nn.Module):
    """One loss per loader (a runs first): ``Encoder`` then the gathered head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = Encoder()
        self.head = GatheredHead()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        losses = [(self.head(self.encoder(batch[key])) ** 2).mean() for key in ("a", "b")]
        return torch.stack(losses).sum()


@pytest.mark.parametrize("bad", [("b", 2), ("a", 5)])
def test_an_unwritten_buffer_of_a_healthy_parts_size_viewed_before_it_is_filled_takes_no_blame(
    bad: tuple[str, int],
) -> None:
    """The mechanism of the sharded-loaders event that named ``view``: the buffer's 8 values were read by a's
    (empty) rows and judged finite, its ``(2, 4)`` view whole and judged non-finite."""
    g = torch.Generator().manual_seed(2)
    batch = {"a": torch.randn(8, FEATURES, generator=g) + 2, "b": torch.randn(4, FEATURES, generator=g) + 2}
    batch[bad[0]][bad[1]] = 0.0
    assert_blames_the_encoder_div(diagnose(GatheredTasks(), batch, layout=AB), bad)


def test_rows_showing_judges_the_inputs_by_the_test_that_saw_the_outputs() -> None:
    follow = Rows.per_size({8: [], 4: [2]})
    healthy = torch.zeros(8)
    healthy[0] = math.inf  # a healthy part's row: skipped when read by rows
    assert follow.finite([healthy]) and not follow.finite([healthy.view(2, 4)])
    assert follow.showing([healthy.view(2, 4)]) is WHOLE and not WHOLE.finite([healthy])
    bad = torch.zeros(4, 3)
    bad[2, 0] = math.nan
    assert follow.showing([bad, healthy.view(2, 4)]) is follow  # the followed rows show it: judged by rows
    assert follow.showing([bad], nan_only=True) is follow and follow.showing([healthy], nan_only=True) is None
    assert Rows(None, None).showing([healthy]) is WHOLE  # nothing followed: all whole, as before


def test_the_forward_tracer_never_names_an_op_that_only_moves_values() -> None:
    """Read by rows ``[5]`` of size 8, b's ``(4, 8)`` tensor is skipped and its transpose's row 5 is not: a
    moved ``-inf`` looks born. No move makes a NaN/Inf; the next op that does is the origin."""
    net = nn.Linear(8, 8)
    scores = torch.zeros(4, 8).masked_fill(torch.arange(8) >= 5, -math.inf)  # b's padding: -inf on purpose
    tracer = ForwardTracer(net, Rows.per_size({8: [5], 4: []}))
    try:
        with tracer:
            moved = scores.t().reshape(8, 4).flip(0).roll(1, 0)
            torch.cat([moved, moved]).view(16, 4)
            assert tracer.origin is None
            (torch.zeros(8, 4) / 0).sum()
    finally:
        tracer.remove()
    assert tracer.origin is not None and tracer.origin[0] == "div"
