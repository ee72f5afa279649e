"""The attention probe's cost per attention call, counted (aten operator calls), never timed.

On a GPU the probe's cost is host time: about one kernel launch per aten call that is not a view.
An attention call only keeps references (or a copy of its measured rows); the logits and their
statistics are computed once per forward for all the calls of one shape. So the calls the probe adds
per attention call are a few views, whatever the number of heads, the sequence length or the
number of layers, and a forward's batch costs a fixed number of calls (issue 35, item 4: it was 29
per call, 31 with the two row slices).
"""

from __future__ import annotations

import pytest
import torch
from attention_blocks import CausalSelfAttention
from op_budget import OpCounter, probe_ops_added
from torch import Tensor, nn

from lightning_nanguard.detect import attention
from lightning_nanguard.detect.attention import AttentionProbe
from lightning_nanguard.detect.precursors import PrecursorSettings
from lightning_nanguard.engine.step.precursors import PrecursorWatch

# at most, per attention call: the row slices of query and key and the strided query positions (views,
# no kernel); for a softmax's input, the row and query slices and their copy (one kernel)
PER_CALL = 3
# at most, per forward and shape of call: 2 stacks, q @ k^T (a bmm and 5 views), the scale, the causal mask,
# 9 kernels for the statistics (log_softmax, exp, 3 nansum, mul_, 2 amax, stack)
PER_BATCH = 20


def _block(sdpa: bool, heads: int) -> CausalSelfAttention:
    return CausalSelfAttention(sdpa, dim=16, heads=heads, residual=True)


def _net(layers: int, sdpa: bool, heads: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(_block(sdpa, heads) for _ in range(layers)))


@pytest.mark.parametrize("sdpa", [True, False], ids=["sdpa", "softmax"])
@pytest.mark.parametrize(("heads", "length"), [(2, 8), (8, 8), (2, 200)], ids=["2 heads", "8 heads", "200 tokens"])
def test_the_calls_added_per_attention_call_are_a_few_views_whatever_the_shape(
    sdpa: bool, heads: int, length: int
) -> None:
    x = torch.randn(8, length, 16)  # 8 batch rows, 4 measured; 200 tokens: every 4th query
    few, many = probe_ops_added(_net(2, sdpa, heads), x), probe_ops_added(_net(10, sdpa, heads), x)
    per_call = (many - few) / 8
    assert per_call <= PER_CALL, (few, many)
    assert few - 2 * per_call <= PER_BATCH, (few, many)


def test_a_sampled_step_of_the_watch_adds_a_fixed_number_of_calls_and_no_host_read() -> None:
    """``PrecursorWatch`` on CPU: its copy is the values themselves; the read is ``ready``'s ``tolist``."""
    x = torch.randn(4, 8, 16)
    counts = []
    for layers in (2, 12):
        net = _net(layers, sdpa=True, heads=2)
        watch = PrecursorWatch(PrecursorSettings(every_n_steps=1, max_cost=None))
        watch.attach(net)
        for step in range(3):
            watch.arm(step)
            net(x)
            watch.finish(step)
            watch.ready()
        count = OpCounter()
        with count.modes():
            watch.arm(3)
            net(x)
            watch.finish(3)
        plain = OpCounter()
        with plain.modes():
            net(x)
        counts.append(count.all_ops - plain.all_ops)
        assert [s.module for s in watch.ready()] == sorted(str(i) for i in range(layers))
    assert counts[0] == counts[1] <= PER_BATCH, counts  # 4 rows of 8 tokens: nothing to slice, no call per layer


def test_calls_measured_in_several_batches_give_the_values_of_one() -> None:
    """A memory limit splits the calls of a forward into batches (and measures kept calls early): same values."""
    net = _net(4, sdpa=True, heads=2)
    x = torch.randn(8, 100, 16) * 3
    values = []
    for limit in (64 << 20, 1):
        probe = AttentionProbe(net, rows=4, queries=16, per_head=True)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(attention, "_HELD_BYTES", limit)
            patch.setattr(attention, "_BATCH_BYTES", limit)
            with probe.measuring():
                net(x)
        values.append({name: (float(s.max_logit), float(s.entropy), s.head_max) for name, s in probe.take().items()})
    assert values[0].keys() == values[1].keys() == {"0", "1", "2", "3"}
    for name, (max_logit, entropy, head_max) in values[0].items():
        assert values[1][name][:2] == pytest.approx((max_logit, entropy), rel=1e-6)
        other = values[1][name][2]
        assert head_max is not None and other is not None and torch.allclose(other, head_max)


def test_calls_of_different_shapes_in_one_forward_are_each_measured() -> None:
    """Two shapes of call (4 and 2 heads) and a softmax: one batch each, every module named once."""
    torch.manual_seed(0)
    net = nn.Sequential(_block(True, 4), _block(True, 2), _block(False, 2), _block(True, 4))
    x = torch.randn(4, 6, 16)
    probe = AttentionProbe(net, rows=4)
    with probe.measuring():
        net(x)
    stats = probe.take()
    assert sorted(stats) == ["0", "1", "2", "3"]
    direct = AttentionProbe(nn.Sequential(net[3]), rows=4)  # the last block alone, on its own input
    with torch.no_grad():
        inner = net[2](net[1](net[0](x)))
    with direct.measuring():
        nn.Sequential(net[3])(inner)
    alone = direct.take()["0"]
    assert float(stats["3"].max_logit) == pytest.approx(float(alone.max_logit), rel=1e-6)
    assert float(stats["3"].entropy) == pytest.approx(float(alone.entropy), rel=1e-6)


def test_a_model_without_attention_is_looked_at_once_in_rediscover_every_sampled_steps() -> None:
    """Nothing found to watch: the other sampled steps install nothing (no hooks, no wrappers), as unsampled ones."""
    from lightning_nanguard.detect import attention_calls

    watched: list[int] = []

    class Spy(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            if attention_calls.STATE.sinks:  # the wrappers are in while a pass is watched
                watched.append(step)
            return x * 2

    net = nn.Sequential(nn.Linear(4, 4), Spy())
    watch = PrecursorWatch(PrecursorSettings(every_n_steps=2, max_cost=None))
    watch.attach(net)
    assert watch.probe is not None
    every = watch.probe.rediscover_every
    for step in range(4 * every + 1):
        watch.arm(step)
        net(torch.randn(2, 4))
        watch.finish(step)
        assert watch.ready() == []
    # sampled steps are the even ones; the probe looks again on one sampled pass in ``every``
    assert watched == [0, 2 * every, 4 * every]
    assert watch.probe.attention == set()
