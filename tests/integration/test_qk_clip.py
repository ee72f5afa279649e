"""``NanGuard(qk_clip=...)`` in real runs: after a sampled step's update the attention logits are capped, per head.

The optimizer steps with learning rate 0 where the test needs the clip to be the only change to the
weights: then the max logit of the sampled batch, measured again after the step, must be the cap
exactly for the heads that were above it and unchanged for the others. Under DDP (two gloo
processes) the ranks see different logits and must still rescale alike: the max over ranks.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from collapse_gpt import RunConfig
from collapse_models import CollapsingGPT, collapse_batches
from fitting import build_trainer
from launcher import HELPERS, launch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_nanguard import NanGuard
from lightning_nanguard.detect.attention import AttentionProbe
from lightning_nanguard.detect.precursors import PrecursorSettings

CAP = 4.0
ROWS = PrecursorSettings().rows  # the batch rows the guard measures per attention call


class Encoder(pl.LightningModule):
    """A ``TransformerEncoderLayer`` (``nn.MultiheadAttention``) whose head 0 starts with logits far above the cap."""

    def __init__(self, lr: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        with torch.no_grad():
            self.encoder.self_attn.in_proj_weight[:4].mul_(10)
        self.lr = lr
        self.batches = [torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(i)) * 2 for i in range(3)]

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self.encoder(batch).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _head_max(module: nn.Module, x: Tensor, rows: int) -> Tensor:
    probe = AttentionProbe(module, rows=rows, queries=x.size(1), per_head=True)
    with torch.enable_grad(), probe.measuring():
        module(x)
    values = probe.take()["self_attn"].head_max
    assert values is not None
    return values


def test_after_the_sampled_step_the_heads_above_the_cap_are_at_it_and_the_others_untouched(tmp_path: Path) -> None:
    module = Encoder()
    first = module.batches[0]
    before = _head_max(module.encoder, first, rows=ROWS)  # the rows the guard measures
    cap = 10.0  # head 0 far above it, head 1 below it
    assert before[0] > 4 * cap and before[1] < cap
    guard = NanGuard(verbose=False, qk_clip=cap, precursor_every_n_steps=10)
    build_trainer("lightning", tmp_path, callbacks=[guard], max_steps=1).fit(
        module, DataLoader(module.batches, batch_size=None)
    )
    after = _head_max(module.encoder, first, rows=ROWS)
    assert float(after[0]) == pytest.approx(cap, rel=1e-4)
    assert torch.equal(after[1], before[1])
    assert guard.events == []  # one sample, no growth yet: no warning, and nothing else went wrong


def test_steps_that_are_not_sampled_are_not_clipped(tmp_path: Path) -> None:
    module = Encoder()
    guard = NanGuard(verbose=False, qk_clip=CAP, precursor_every_n_steps=2)
    weights = module.encoder.self_attn.in_proj_weight.detach().clone()
    trainer = build_trainer("lightning", tmp_path, callbacks=[guard], max_steps=2)
    trainer.fit(module, DataLoader(module.batches[1:], batch_size=None))  # step 0 sampled (batch 1), step 1 not
    clipped_once = module.encoder.self_attn.in_proj_weight.detach()
    assert not torch.equal(clipped_once, weights)
    after = _head_max(module.encoder, module.batches[1], rows=ROWS)
    assert float(after[0]) == pytest.approx(CAP, rel=1e-4)  # the clip of step 0 only


def test_a_model_without_known_projections_is_told_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class Manual(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.mix = nn.Linear(4, 8)

        def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
            q, k = self.mix(batch).chunk(2, dim=-1)
            return torch.softmax(q @ k.transpose(-2, -1), dim=-1).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    caplog.set_level(logging.WARNING, logger="lightning_nanguard")
    batches = [torch.randn(2, 3, 4) for _ in range(3)]
    trained = {}
    for cap in (CAP, None):
        torch.manual_seed(0)
        trained[cap] = Manual()
        build_trainer("lightning", tmp_path, callbacks=[NanGuard(verbose=False, qk_clip=cap)]).fit(
            trained[cap], DataLoader(batches, batch_size=None)
        )
    told = [r.getMessage() for r in caplog.records if "qk_clip" in r.getMessage()]
    assert len(told) == 1 and "nanguard_qk_projections" in told[0] and "nothing will be rescaled" in told[0]
    assert torch.equal(trained[CAP].mix.weight, trained[None].mix.weight)  # nothing was rescaled indeed


def test_qk_clip_needs_the_precursor_watch() -> None:
    with pytest.raises(ValueError, match="`qk_clip` needs `precursors=True`"):
        NanGuard(qk_clip=CAP, precursors=False)
    with pytest.raises(ValueError, match="`qk_clip` must be null or a number > 0"):
        NanGuard(qk_clip=0)


def test_a_collapsing_run_keeps_its_max_logit_an_order_of_magnitude_lower(tmp_path: Path) -> None:
    config = RunConfig(attention="sdpa", qk_norm=False, lr=0.15, seed=0)
    steps = 100
    unclipped, clipped = CollapsingGPT(config), CollapsingGPT(config)  # the same seed, init and batches
    guard = NanGuard(verbose=False, qk_clip=20.0, precursor_every_n_steps=1, precursor_max_cost=None)
    for module, callbacks in ((unclipped, []), (clipped, [guard])):
        build_trainer("lightning", tmp_path, callbacks=callbacks, max_steps=steps).fit(
            module, collapse_batches(config, steps)
        )
    unclipped_peak = max(max(values) for values in unclipped.max_logit.values())
    peak = max(max(values) for values in clipped.max_logit.values())
    assert unclipped_peak > 1000  # it collapses without the clip
    assert peak < unclipped_peak / 10, (peak, unclipped_peak)
    assert all(torch.isfinite(p).all() for p in clipped.parameters())


@pytest.mark.slow
def test_under_ddp_every_rank_rescales_by_the_max_over_ranks(tmp_path: Path) -> None:
    run = launch(HELPERS / "qk_clip_ddp_script.py", str(tmp_path), nprocs=2, out_dir=tmp_path, timeout=180)
    ranks = run.results(ranks=(0, 1))
    assert ranks[0]["weights_sha256"] == ranks[1]["weights_sha256"]  # the ranks agree: the same weights
    assert ranks[0]["global_step"] == 4
    # each clip only lowers the weights (learning rate 0), so with the final weights the max over
    # every batch the clip saw is the cap, per head; rank 1's inputs are 4x larger, so its batches
    # set it, and rank 0's end far below it (rank 0 rescaled by rank 1's values)
    assert ranks[0]["head_max_rank1"] == pytest.approx([3.0, 3.0], rel=1e-4)
    assert max(ranks[0]["head_max_rank0"]) < 1.0


LONG_RUN = 12  # steps: enough for the precursor cost limit to act (it needs 3 measured and 3 timed steps)


@pytest.mark.slow
def test_under_ddp_a_run_long_enough_for_the_cost_limit_ends_with_the_ranks_in_step(tmp_path: Path) -> None:
    """Each rank times its own steps: were the cost limit to widen the sampling interval on each rank by its own
    timing, the ranks would sample (and join QK-clip's collective on) different steps, and the run would hang."""
    run = launch(HELPERS / "qk_clip_ddp_script.py", str(tmp_path), LONG_RUN, nprocs=2, out_dir=tmp_path, timeout=120)
    ranks = run.results(ranks=(0, 1))
    assert [ranks[r]["global_step"] for r in (0, 1)] == [LONG_RUN, LONG_RUN]
    assert ranks[0]["weights_sha256"] == ranks[1]["weights_sha256"]
    assert ranks[0]["cost_warnings"] == ranks[1]["cost_warnings"] == []  # the interval stays fixed (every step)
    # every step sampled and clipped by the max over ranks: with the final weights no batch of either rank is
    # above the cap (a step left unsampled would leave its batch above it), and the largest is at it
    cap = 3.0
    per_batch = ranks[0]["head_max_per_batch"]
    assert len(per_batch) == 2 * LONG_RUN
    assert max(max(heads) for heads in per_batch) == pytest.approx(cap, rel=1e-4)
    assert all(value <= cap * (1 + 1e-4) for heads in per_batch for value in heads), per_batch


@pytest.mark.slow
def test_under_ddp_qk_clip_failing_on_one_rank_goes_off_on_every_rank_in_step(tmp_path: Path) -> None:
    """Rank 1's precursor watch (and with it its QK-clip) fails at step 2: rank 0 must stop joining the clip's
    collective at that very step, or it waits there alone. The step's reduce tells it (``part_failed``)."""
    run = launch(
        HELPERS / "qk_clip_ddp_script.py", str(tmp_path), 6, "precursors", nprocs=2, out_dir=tmp_path, timeout=120
    )
    ranks = run.results(ranks=(0, 1))
    assert [ranks[r]["global_step"] for r in (0, 1)] == [6, 6]
    assert ranks[0]["weights_sha256"] == ranks[1]["weights_sha256"]  # clipped together, then not at all
    errors = {r: [(e["global_step"], e["details"]["part"]) for e in ranks[r]["events"]] for r in (0, 1)}
    assert errors == {0: [(2, "qk_clip")], 1: [(2, "precursors")]}
    assert ranks[0]["events"][0]["details"]["error"] == "it went off on another rank"
