"""QK-clip: the query and key projections are found and rescaled so the measured max logit becomes the cap, per head."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_nanguard.detect.attention import AttentionProbe
from lightning_nanguard.recover.qk_clip import find_qk_projections, qk_clip_

CAP = 5.0


def _head_max(model: nn.Module, x: Tensor, name: str) -> Tensor:
    """The max logit per head of ``name`` on ``x`` (every batch row and query), measured by the probe."""
    probe = AttentionProbe(model, rows=x.size(0), queries=x.size(1), per_head=True)
    with torch.enable_grad(), probe.measuring():
        model(x)
    head_max = probe.take()[name].head_max
    assert head_max is not None
    return head_max


class Projected(nn.Module):
    """Attention with separate ``q_proj``/``k_proj`` (Llama-style), grouped-query when ``kv_heads < heads``."""

    def __init__(self, dim: int = 8, heads: int = 4, kv_heads: int = 4) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, kv_heads * self.head_dim)
        self.v_proj = nn.Linear(dim, kv_heads * self.head_dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        gqa = self.num_heads != self.num_key_value_heads
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa).transpose(1, 2).flatten(2)


class Fused(nn.Module):
    """A fused ``qkv`` that declares its query and key rows."""

    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def nanguard_qk_projections(self) -> tuple[list[Tensor], list[Tensor]]:
        d = self.qkv.in_features
        return [self.qkv.weight[:d], self.qkv.bias[:d]], [self.qkv.weight[d : 2 * d], self.qkv.bias[d : 2 * d]]

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        logits = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        return (torch.softmax(logits, dim=-1) @ v).transpose(1, 2).flatten(2)


def _scaled(module: nn.Module, factor: float) -> nn.Module:
    """Blow the attention logits up (every weight of ``module`` times ``factor``)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(factor)
    return module


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


def test_multihead_attention_heads_above_the_cap_are_brought_to_it_and_the_others_left_bitwise() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(SelfAttention())
    x = torch.randn(3, 6, 8)
    mha = model[0].attn
    with torch.no_grad():
        mha.in_proj_weight[:4].mul_(8)  # head 0's queries: its logits far above the cap
    before = _head_max(model, x, "0.attn")
    assert before[0] > CAP > before[1]
    untouched = mha.in_proj_weight[[4, 5, 12, 13, 16]].clone()  # head 1's q and k rows, a v row
    factors = qk_clip_(find_qk_projections(model)["0.attn"], before, CAP)
    assert factors.tolist() == pytest.approx([CAP / float(before[0]), 1.0])
    after = _head_max(model, x, "0.attn")
    assert float(after[0]) == pytest.approx(CAP, rel=1e-5)
    assert torch.equal(after[1], before[1])
    assert torch.equal(mha.in_proj_weight[[4, 5, 12, 13, 16]], untouched)  # head 1's q and k rows, a v row


def test_separate_projections_and_grouped_query_heads() -> None:
    x = torch.randn(2, 5, 8)
    for kv_heads in (4, 2):
        model = _scaled(nn.Sequential(Projected(kv_heads=kv_heads)), 4.0)
        projection = find_qk_projections(model)["0"]
        assert (projection.heads, projection.kv_heads) == (4, kv_heads)
        keys_before = model[0].k_proj.weight.clone()
        before = _head_max(model, x, "0")
        assert bool((before > CAP).any())
        qk_clip_(projection, before, CAP)
        after = _head_max(model, x, "0")
        expected = torch.minimum(before, torch.tensor(CAP))
        assert torch.allclose(after, expected, rtol=1e-4), (kv_heads, before, after)
        if kv_heads == 2:  # a key head serves two query heads: only the queries were rescaled
            assert torch.equal(model[0].k_proj.weight, keys_before)


def test_a_declared_fused_projection_is_rescaled_in_place() -> None:
    model = _scaled(nn.Sequential(Fused()), 5.0)
    x = torch.randn(2, 5, 8)
    values = model[0].qkv.weight[16:].clone()
    before = _head_max(model, x, "0")
    qk_clip_(find_qk_projections(model)["0"], before, CAP)
    assert torch.allclose(_head_max(model, x, "0"), torch.minimum(before, torch.tensor(CAP)), rtol=1e-4)
    assert torch.equal(model[0].qkv.weight[16:], values)  # the value rows


def test_hugging_face_gpt2_attention_is_found_and_clipped() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_head=4, n_embd=16, vocab_size=32, n_positions=8)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.GPT2Model(config).eval()
    with torch.no_grad():
        model.h[0].attn.c_attn.weight.mul_(30)
    projection = find_qk_projections(model)["h.0.attn"]
    assert (projection.heads, projection.kv_heads) == (4, 4)
    ids = torch.randint(32, (2, 8))
    probe = AttentionProbe(model, rows=2, per_head=True)
    with probe.measuring():
        model(ids)
    before = probe.take()["h.0.attn"].head_max
    assert before is not None and bool((before > CAP).all())
    qk_clip_(projection, before, CAP)
    with probe.measuring():
        model(ids)
    after = probe.take()["h.0.attn"].head_max
    assert after is not None and torch.allclose(after, torch.full((4,), CAP), rtol=1e-4)


def test_values_below_the_cap_or_not_finite_leave_the_weights_bitwise_unchanged() -> None:
    model = nn.Sequential(Projected())
    weights = [p.clone() for p in model.parameters()]
    projection = find_qk_projections(model)["0"]
    for logits in ([1.0, 2.0, 3.0, CAP], [math.nan, math.inf, 1.0, 2.0]):
        factors = qk_clip_(projection, torch.tensor(logits), CAP)
        assert factors.tolist() == [1.0] * 4
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))


def test_unknown_heads_get_one_factor_from_the_module_max() -> None:
    class NoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.query, self.key = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)

    module = NoHeads()
    projection = find_qk_projections(module)[""]
    assert projection.heads is None
    q, k = module.query.weight.clone(), module.key.weight.clone()
    qk_clip_(projection, torch.tensor([20.0, 3.0]), CAP)  # per-head values, but the heads are unknown
    assert torch.allclose(module.query.weight, q * 0.5) and torch.allclose(module.key.weight, k * 0.5)


def test_modules_that_are_not_attention_and_fused_layouts_it_cannot_know_are_not_found() -> None:
    class NeoXStyle(nn.Module):  # a fused projection whose layout the guard cannot know from its name
        def __init__(self) -> None:
            super().__init__()
            self.query_key_value = nn.Linear(8, 24)

    model = nn.Sequential(nn.Linear(4, 4), NeoXStyle(), nn.TransformerEncoderLayer(8, 2, batch_first=True))
    assert sorted(find_qk_projections(model)) == ["2.self_attn"]
