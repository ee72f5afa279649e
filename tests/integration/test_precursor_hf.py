"""A third-party model that collapses by itself: a tiny Hugging Face GPT-2, warned before its entropy collapses.

``transformers.GPT2LMHeadModel`` (2 layers, 4 heads of 16, random init, dropout off), trained by a
real ``Trainer`` with ``NanGuard()`` defaults on the task and 300-step schedule of ``collapse_gpt.py``
(``python -m studies.hf_attention_collapse`` is the evidence): at a peak learning rate of 0.05 (seed
0) ``transformer.h.1.attn``'s max logit grows past 100 by step 50 and to hundreds after, and its
attention entropy falls to a tenth of its early value around step 95 (``transformer.h.0`` turns
uniform); at 0.01 it trains healthily. Both of GPT-2's attention paths are covered: ``eager`` (a
softmax in ``eager_attention_forward``) and ``sdpa``. The test measures every step's attention
itself (float64, from the ``c_attn`` queries and keys, causal mask, GPT-2's ``1/sqrt(head_dim)``
scale) and takes as the onset the first step after 15 where a layer's mean entropy is below 0.1 of
its mean over steps 5 to 15, as ``test_precursor_runs.py`` does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.nn.functional as F
from collapse_gpt import RunConfig, SideMeasurement, gpt2
from collapse_models import ScheduledModule, collapse_batches
from fitting import build_trainer
from torch import Tensor

from lightning_nanguard import NanGuard

pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

STEPS = 120  # at lr 0.05 the 0.1x onset comes at step ~95; the schedule is the 300-step one
COLLAPSING = "model.transformer.h.1.attn"


class TinyGPT2(ScheduledModule):
    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        self.model = gpt2(config)  # seeded by config.seed
        self.side = SideMeasurement(self.model, prefix="model.")

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self.model(input_ids=x).logits.flatten(0, 1), y.flatten())
        for name, (max_logit, entropy, _, _) in self.side.last.items():
            self.record(name, max_logit, entropy)
        return loss


def _onset(entropy: dict[str, list[float]], fraction: float) -> tuple[int | None, str | None]:
    """First step > 15 where some layer's entropy < ``fraction`` x its mean over steps 5-15, and that layer."""
    thresholds = {name: fraction * sum(values[5:16]) / 11 for name, values in entropy.items()}
    for step in range(16, STEPS):
        for name, values in entropy.items():
            if values[step] < thresholds[name]:
                return step, name
    return None, None


def _train(tmp_path: Path, attention: str, lr: float) -> tuple[NanGuard, TinyGPT2]:
    config = RunConfig(attention=attention, qk_norm=False, lr=lr, seed=0)
    module, guard = TinyGPT2(config), NanGuard(verbose=False)
    build_trainer("lightning", tmp_path, callbacks=[guard], max_steps=STEPS).fit(
        module, collapse_batches(config, STEPS)
    )
    assert all(len(v) == STEPS for v in module.entropy.values())
    return guard, module


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_the_collapsing_gpt2_layer_is_named_at_least_10_steps_before_its_entropy_collapses(
    tmp_path: Path, attention: str
) -> None:
    guard, module = _train(tmp_path, attention, lr=0.05)
    onset, layer = _onset(module.entropy, 0.1)
    assert onset is not None and layer == COLLAPSING, (onset, layer)
    assert max(module.max_logit[COLLAPSING]) > 200  # it did collapse
    warnings = [e for e in guard.events if e.kinds == ("precursor",)]
    assert warnings, f"no warning; onset at step {onset}"
    first = warnings[0]
    assert first.culprit_module == COLLAPSING
    assert onset - first.global_step >= 10, (first.global_step, onset)
    onset_02, _ = _onset(module.entropy, 0.2)  # the study's main onset: here about 11 steps after the warning
    assert onset_02 is not None and first.global_step < onset_02, (first.global_step, onset_02)
    assert all(e.kinds == ("precursor",) for e in guard.events)  # no NaN, no spike: nothing else to report
    assert guard.counters.skipped_total == 0


def test_a_healthy_gpt2_at_a_low_learning_rate_gets_no_warning(tmp_path: Path) -> None:
    guard, module = _train(tmp_path, "sdpa", lr=0.01)
    assert guard.events == []
    assert max(max(values) for values in module.max_logit.values()) < 80
