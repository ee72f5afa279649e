"""Runs that collapse by themselves: the warning comes at least 10 steps before the onset this test computes.

The tiny pre-LN GPT, task and learning-rate schedule of ``collapse_gpt.py`` (those of the evidence
for the defaults, ``python -m studies.attention_collapse``), trained by a real ``Trainer`` with
``NanGuard()`` defaults: at a peak learning rate of 0.15, ``blocks.1.attn``'s max logit runs away and
its attention turns one-hot (no NaN, no loss spike); at 0.01 it trains healthily. The test measures
every step's attention entropy itself (float64, from the layer's queries and keys) and takes as the
onset the first step after 15 where the collapsing layer's mean entropy is below 0.1 of its mean
over steps 5 to 15.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from collapse_gpt import RunConfig
from collapse_models import CollapsingGPT, collapse_batches, entropy_onset
from fitting import build_trainer

from lightning_nanguard import NanGuard

STEPS = 100  # the collapse at lr 0.15 begins around step 50; the schedule is the 300-step one


def _train(tmp_path: Path, attention: str, lr: float) -> tuple[NanGuard, CollapsingGPT]:
    config = RunConfig(attention=attention, qk_norm=False, lr=lr, seed=0)
    module, guard = CollapsingGPT(config), NanGuard(verbose=False)
    build_trainer("lightning", tmp_path, callbacks=[guard], max_steps=STEPS).fit(
        module, collapse_batches(config, STEPS)
    )
    return guard, module


@pytest.mark.parametrize("attention", ["manual", "sdpa"])
def test_a_collapsing_layer_is_named_at_least_10_steps_before_its_entropy_collapses(
    tmp_path: Path, attention: str
) -> None:
    guard, module = _train(tmp_path, attention, lr=0.15)
    onset = entropy_onset(module.entropy["model.blocks.1.attn"])
    assert onset is not None and max(module.max_logit["model.blocks.1.attn"]) > 200  # it did collapse
    warnings = [e for e in guard.events if e.kinds == ("precursor",)]
    assert warnings, f"no warning; onset at step {onset}"
    first = warnings[0]
    assert first.culprit_module == "model.blocks.1.attn"
    assert onset - first.global_step >= 10, (first.global_step, onset)
    assert all(e.kinds == ("precursor",) for e in guard.events)  # no NaN, no spike: nothing else to report
    assert guard.counters.skipped_total == 0


def test_a_healthy_run_at_a_low_learning_rate_gets_no_warning(tmp_path: Path) -> None:
    guard, module = _train(tmp_path, "sdpa", lr=0.01)
    assert guard.events == []
    assert max(module.max_logit["model.blocks.1.attn"]) < 80
