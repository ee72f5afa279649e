"""``AttentionProbe``: attention logits measured on the side, attributed to the module, the forward unchanged."""

from __future__ import annotations

import math

import pytest
import torch
from attention_blocks import CausalSelfAttention
from torch import Tensor, nn

from lightning_nanguard.detect import attention
from lightning_nanguard.detect.attention import AttentionProbe, attention_stats


class Net(nn.Module):
    def __init__(self, sdpa: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.ModuleDict({"attn": CausalSelfAttention(sdpa)}) for _ in range(2)])
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = x + block["attn"](x)
        return self.head(x)


def _reference(block: CausalSelfAttention, x: Tensor, rows: int) -> tuple[float, float]:
    """Max logit and mean entropy of ``block`` on ``x[:rows]``, computed directly."""
    b, t, d = x[:rows].shape
    q, k, _ = (z.view(b, t, 2, d // 2).transpose(1, 2) for z in block.qkv(x[:rows]).chunk(3, dim=-1))
    logits = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    logits = logits.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    p = torch.softmax(logits, dim=-1)
    entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean()
    return float(logits.amax()), float(entropy)


@pytest.mark.parametrize("sdpa", [False, True], ids=["manual", "sdpa"])
def test_each_attention_module_is_measured_by_name_and_matches_a_direct_computation(sdpa: bool) -> None:
    net = Net(sdpa)
    x = torch.randn(4, 5, 8) * 3
    probe = AttentionProbe(net, rows=2)
    with probe.measuring():
        net(x).sum().backward()
    stats = probe.take()
    assert sorted(stats) == ["blocks.0.attn", "blocks.1.attn"]
    with torch.no_grad():
        max_logit, entropy = _reference(net.blocks[0]["attn"], x, rows=2)
    assert float(stats["blocks.0.attn"].max_logit) == pytest.approx(max_logit, rel=1e-5)
    assert float(stats["blocks.0.attn"].entropy) == pytest.approx(entropy, rel=1e-4)
    assert 0 <= float(stats["blocks.0.attn"].min_entropy) <= float(stats["blocks.0.attn"].entropy) + 1e-6
    assert probe.take() == {}


@pytest.mark.parametrize("sdpa", [False, True], ids=["manual", "sdpa"])
def test_the_forward_and_backward_are_bitwise_unchanged(sdpa: bool) -> None:
    x = torch.randn(4, 5, 8)
    plain, probed = Net(sdpa), Net(sdpa)
    out = plain(x)
    out.sum().backward()
    probe = AttentionProbe(probed)
    with probe.measuring():
        out_probed = probed(x)
        out_probed.sum().backward()
    assert torch.equal(out, out_probed)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), probed.parameters(), strict=True))


def test_no_grad_passes_and_calls_outside_the_model_are_not_measured() -> None:
    net = Net(sdpa=False)
    probe = AttentionProbe(net)
    with probe.measuring():
        with torch.no_grad():
            net(torch.randn(2, 5, 8))  # a validation pass
        torch.softmax(torch.randn(2, 3, 4, requires_grad=True), dim=-1)  # not under a watched module
    assert probe.take() == {}


@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_is_measured_both_ways(need_weights: bool) -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"mha": nn.MultiheadAttention(8, 2, batch_first=True)})
    x = torch.randn(3, 6, 8)
    probe = AttentionProbe(model, rows=3)
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)  # True: masked
    with probe.measuring():
        model["mha"](x, x, x, need_weights=need_weights, attn_mask=causal)[0].sum().backward()
    (name, stats), *_ = probe.take().items()
    assert name == "mha"
    with torch.no_grad():  # the module's own per-head weights: the entropy they have
        _, weights = model["mha"](x, x, x, attn_mask=causal, average_attn_weights=False)
    entropy = -(weights * torch.log(weights.clamp_min(1e-30))).sum(-1).mean()
    assert float(stats.entropy) == pytest.approx(float(entropy), rel=1e-4)


def test_hugging_face_gpt2_attention_is_named_for_eager_and_sdpa() -> None:
    transformers = pytest.importorskip("transformers")
    maxima = {}
    for implementation in ("eager", "sdpa"):
        config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=16)
        config._attn_implementation = implementation
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)
        probe = AttentionProbe(model)
        ids = torch.randint(50, (2, 8), generator=torch.Generator().manual_seed(0))
        with probe.measuring():
            model(ids, labels=ids).loss.backward()
        stats = probe.take()
        assert sorted(stats) == ["transformer.h.0.attn", "transformer.h.1.attn"], implementation
        maxima[implementation] = float(stats["transformer.h.0.attn"].max_logit)
    assert maxima["eager"] == pytest.approx(maxima["sdpa"], rel=1e-4)  # the same logits, measured both ways


def test_one_hot_attention_has_zero_entropy_and_masked_rows_are_left_out() -> None:
    logits = torch.tensor([[[1000.0, 0.0], [float("-inf"), float("-inf")]]])
    stats = attention_stats(logits)
    assert float(stats.max_logit) == 1000.0
    assert float(stats.entropy) == pytest.approx(0.0, abs=1e-6)
    assert float(stats.min_entropy) == pytest.approx(0.0, abs=1e-6)


def test_after_the_first_pass_only_the_modules_found_calling_attention_are_watched() -> None:
    net = Net(sdpa=True)
    x = torch.randn(4, 5, 8)
    probe = AttentionProbe(net, rediscover_every=3)
    firsts = []
    for _ in range(4):
        with probe.measuring():
            net(x).sum().backward()
        firsts.append({name: float(s.max_logit) for name, s in probe.take().items()})
    assert probe.attention == {"blocks.0.attn", "blocks.1.attn"}
    assert firsts[0] == firsts[1] == firsts[2] == firsts[3]  # the watched-only passes measure the same
    calls: list[str] = []
    hook = nn.modules.module.register_module_forward_pre_hook(lambda m, a: calls.append(type(m).__name__))
    try:
        with probe.measuring():  # pass 5: watched-only (pass 4 was the rediscovery)
            net.head(torch.randn(1, 8))
    finally:
        hook.remove()
    assert probe.take() == {} and calls == ["Linear"]  # nothing of the guard's ran around the head


@pytest.mark.parametrize("sdpa", [False, True], ids=["manual", "sdpa"])
def test_long_sequences_are_measured_on_evenly_strided_queries_only(sdpa: bool) -> None:
    net = Net(sdpa)
    x = torch.randn(2, 40, 8) * 3
    probe = AttentionProbe(net, rows=1, queries=8, per_head=True)  # 40 queries: every 5th is measured
    with probe.measuring():
        net(x)
    stats = probe.take()["blocks.0.attn"]
    block = net.blocks[0]["attn"]
    with torch.no_grad():
        q, k, _ = (z.view(1, 40, 2, 4).transpose(1, 2) for z in block.qkv(x[:1]).chunk(3, dim=-1))
        logits = (q @ k.transpose(-2, -1) / 2.0)[..., ::5, :]
        causal = torch.arange(40) <= torch.arange(0, 40, 5).unsqueeze(-1)
        logits = logits.masked_fill(~causal, float("-inf"))
        p = torch.softmax(logits, dim=-1)
        entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean()
    assert float(stats.max_logit) == pytest.approx(float(logits.amax()), rel=1e-5)
    assert float(stats.entropy) == pytest.approx(float(entropy), rel=1e-4)
    assert stats.head_max is not None
    assert torch.allclose(stats.head_max, logits.amax(dim=(0, 2, 3)), rtol=1e-5)


def test_a_call_the_probe_cannot_measure_stops_the_probe_not_the_forward(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unforeseen(*args: object) -> Tensor:  # an attention call shaped as the probe never saw
        raise IndexError("unforeseen mask layout")

    monkeypatch.setattr(attention, "_sdpa_logits", unforeseen)
    x = torch.randn(2, 5, 8)
    plain, probed = Net(sdpa=True), Net(sdpa=True)
    probe = AttentionProbe(probed)
    with probe.measuring():
        out = probed(x)
    assert torch.equal(out, plain(x))  # the forward went on, unchanged
    assert probe.broken and "precursor watch stops" in caplog.text and "unforeseen mask layout" in caplog.text
    assert probe.take() == {}
    with probe.measuring():  # from now on: no hooks, nothing measured
        probed(x)
    assert probe.take() == {}
