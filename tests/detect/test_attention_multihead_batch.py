"""``nn.MultiheadAttention`` calls measured together, like scaled-dot-product attention's.

Issue: the precursor probe's host cost per attention call. ``nn.MultiheadAttention`` used to have
its logits made when it was called, from its weights (two ``F.linear``, views, a matmul, masks: ~29
aten calls per call, a kernel launch each on a GPU). Now a call only keeps references (its inputs,
weights and masks) and the calls of one shape are projected and measured together when the forward
returns: a view or two per call, a fixed number of calls per forward. The values are those of the
per-call computation, kept here as the reference (:func:`_old_multihead_logits`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from op_budget import OpCounter, probe_ops_added
from torch import Tensor, nn

from lightning_nanguard.detect import attention
from lightning_nanguard.detect.attention import AttentionProbe, ProbeCalls, attention_stats

ROWS, QUERIES = 2, 16


def _old_multihead_logits(
    module: nn.MultiheadAttention, args: tuple[Any, ...], kwargs: dict[str, Any], rows: int, queries: int
) -> Tensor:
    """The per-call computation the probe made when the module was called (before batching), verbatim."""
    names = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights")
    given = {**dict(zip(names, args, strict=False)), **kwargs}
    query, key = given["query"], given["key"]
    if not module.batch_first and query.ndim == 3:
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    if query.ndim == 2:
        query, key = query.unsqueeze(0), key.unsqueeze(0)
    full_length = query.size(1)
    stride = attention._stride(full_length, queries)
    query, key = query[:rows, ::stride].float(), key[:rows].float()
    dim, heads = module.embed_dim, module.num_heads
    if module.in_proj_weight is not None:
        w_q, w_k = module.in_proj_weight[:dim].float(), module.in_proj_weight[dim : 2 * dim].float()
    else:
        w_q, w_k = module.q_proj_weight.float(), module.k_proj_weight.float()
    b_q = b_k = None
    if module.in_proj_bias is not None:
        b_q, b_k = module.in_proj_bias[:dim].float(), module.in_proj_bias[dim : 2 * dim].float()
    q, k = F.linear(query, w_q, b_q), F.linear(key, w_k, b_k)
    n, length, source = q.size(0), q.size(1), k.size(1)
    q = q.view(n, length, heads, dim // heads).transpose(1, 2)
    k = k.view(n, source, heads, dim // heads).transpose(1, 2)
    logits = (q @ k.transpose(-2, -1)) / math.sqrt(dim // heads)
    mask = given.get("attn_mask")
    if isinstance(mask, Tensor):
        mask = mask.view(-1, heads, full_length, source)[:n] if mask.ndim == 3 else mask
        mask = attention._strided_mask(mask, stride)
        logits = logits.masked_fill(mask, -math.inf) if mask.dtype == torch.bool else logits + mask.float()
    padding = given.get("key_padding_mask")
    if isinstance(padding, Tensor):
        padding = padding[:n].view(n, 1, 1, source)
        logits = logits.masked_fill(padding, -math.inf) if padding.dtype == torch.bool else logits + padding.float()
    if given.get("is_causal") and mask is None:
        logits = logits.masked_fill(attention._hidden(full_length, source, stride, logits.device), -math.inf)
    return logits


Call = tuple[str, nn.MultiheadAttention, tuple[Any, ...], dict[str, Any]]


def _reference(
    calls: list[Call], grouped: bool = True
) -> tuple[list[str], list[tuple[float, float, float]], list[Tensor]]:
    """Names, ``(max_logit, entropy, min_entropy)`` and max per head of each call, in the order the old probe gave.

    The old probe kept each call's logits and measured those of one shape together, in the order
    the shapes first came (``grouped``; else: in the calls' order).
    """
    groups: dict[Any, list[tuple[str, Tensor]]] = {}
    for i, (name, module, args, kwargs) in enumerate(calls):
        with torch.no_grad():
            logits = _old_multihead_logits(module, args, kwargs, ROWS, QUERIES)
        groups.setdefault((logits.shape, logits.dtype) if grouped else i, []).append((name, logits))
    names, values, head_max = [], [], []
    for group in groups.values():
        for name, logits in group:
            stats = attention_stats(logits, per_head=True)
            names.append(name)
            values.append((float(stats.max_logit), float(stats.entropy), float(stats.min_entropy)))
            assert stats.head_max is not None
            head_max.append(stats.head_max)
    return names, values, head_max


def _measured(parts: list[ProbeCalls]) -> tuple[list[str], list[tuple[float, float, float]], list[Tensor]]:
    """Each measured call's name, ``(max_logit, entropy, min_entropy)`` and max per head (see ``ProbeCalls``)."""
    assert len(parts) == 1
    (part,) = parts
    values = [(row[0], -row[1] / row[3], -row[2] / row[3]) for row in part.values.tolist()]
    assert all(h is not None for h in part.head_max)
    return part.names, values, [h for h in part.head_max if h is not None]


def _assert_same(
    got: tuple[list[str], list[tuple[float, float, float]], list[Tensor]],
    expected: tuple[list[str], list[tuple[float, float, float]], list[Tensor]],
) -> None:
    assert got[0] == expected[0]
    for mine, theirs in zip(got[1], expected[1], strict=True):
        assert torch.allclose(torch.tensor(mine), torch.tensor(theirs), rtol=1e-5, atol=1e-6), (mine, theirs)
    for mine_max, their_max in zip(got[2], expected[2], strict=True):
        assert torch.allclose(mine_max, their_max.to(mine_max.dtype), rtol=1e-5, atol=1e-6), (mine_max, their_max)


def _recording(model: nn.Module, calls: list[Call]) -> list[Any]:
    """Pre-hooks that note each ``nn.MultiheadAttention`` call of ``model`` (name, module, arguments)."""
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):

            def note(m: nn.Module, args: Any, kwargs: Any, name: str = name) -> None:
                assert isinstance(m, nn.MultiheadAttention)
                calls.append((name, m, args, dict(kwargs)))

            handles.append(module.register_forward_pre_hook(note, with_kwargs=True))
    return handles


class Calls(nn.Module):
    """Calls its attention modules as ``plan`` says: ``(module name, (query, key, value), keyword arguments)``."""

    def __init__(self, modules: dict[str, nn.MultiheadAttention], plan: list[tuple[str, tuple[Tensor, ...], dict]]):
        super().__init__()
        self.attn = nn.ModuleDict(modules)
        self.plan = plan

    def forward(self) -> Tensor:
        total = torch.zeros(())
        for name, inputs, kwargs in self.plan:
            total = total + self.attn[name](*inputs, **kwargs)[0].sum()
        return total


def _mha(dim: int = 8, heads: int = 2, seed: int = 0, **kwargs: Any) -> nn.MultiheadAttention:
    torch.manual_seed(seed)
    module = nn.MultiheadAttention(dim, heads, **kwargs)
    with torch.no_grad():  # logits large enough to tell the heads and the masks apart
        for param in module.parameters():
            param.mul_(3.0).add_(0.1)
    return module


def _x(*shape: int, seed: int = 1, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _causal(length: int, source: int | None = None) -> Tensor:
    return torch.ones(length, source or length, dtype=torch.bool).triu(1)  # True: masked


def _padding(batch: int, source: int) -> Tensor:
    padding = torch.zeros(batch, source, dtype=torch.bool)
    padding[0, -2:] = True
    padding[-1, -1] = True
    return padding


def _float(mask: Tensor) -> Tensor:
    return torch.zeros(mask.shape).masked_fill(mask, -math.inf) + _x(*mask.shape, seed=5)


def _case_batch_first() -> Calls:
    x = _x(3, 6, 8)  # 3 rows, 2 measured
    return Calls({"a": _mha(batch_first=True)}, [("a", (x, x, x), {})])


def _case_seq_first() -> Calls:
    x = _x(6, 3, 8)
    return Calls({"a": _mha()}, [("a", (x, x, x), {"need_weights": False})])


def _case_unbatched() -> Calls:
    x = _x(6, 8)
    return Calls({"a": _mha(batch_first=True)}, [("a", (x, x, x), {"attn_mask": _causal(6)})])


def _case_kdim_vdim(batch_first: bool) -> Calls:
    q, kv = _x(3, 5, 8, seed=2), _x(3, 7, 4, seed=3)  # another key length and width
    if not batch_first:
        q, kv = q.transpose(0, 1), kv.transpose(0, 1)
    module = _mha(kdim=4, vdim=4, batch_first=batch_first)
    return Calls({"a": module}, [("a", (q, kv, kv), {"key_padding_mask": _padding(3, 7)})])


def _case_no_bias() -> Calls:
    x = _x(3, 6, 8)
    return Calls({"a": _mha(bias=False, batch_first=True)}, [("a", (x, x, x), {"attn_mask": _causal(6)})])


def _case_mask(kind: str) -> Calls:
    x = _x(3, 6, 8)
    mask = _causal(6)
    if kind.startswith("3-D"):  # (batch * heads, L, S): every row and head its own
        mask = torch.stack([_causal(6).roll(i, dims=1) for i in range(3 * 2)])
        mask[..., 0] = False  # no row without keys
    if kind.endswith("float"):
        mask = _float(mask)
    return Calls({"a": _mha(batch_first=True)}, [("a", (x, x, x), {"attn_mask": mask})])


def _case_padding(kind: str) -> Calls:
    x = _x(3, 6, 8)
    padding = _padding(3, 6)
    mask = _causal(6)
    padding, mask = (_float(padding), _float(mask)) if kind == "float" else (padding, mask)
    return Calls({"a": _mha(batch_first=True)}, [("a", (x, x, x), {"key_padding_mask": padding, "attn_mask": mask})])


def _case_long(batch_first: bool) -> Calls:
    """100 tokens, 16 measured: every 7th query position, with every kind of mask."""
    x, kv = _x(3, 100, 8), _x(3, 100, 8, seed=4)
    mask3 = torch.stack([_causal(100).roll(i, dims=1) for i in range(6)])
    mask3[..., 0] = False
    if not batch_first:
        x, kv = x.transpose(0, 1).contiguous(), kv.transpose(0, 1)  # a non-contiguous key
    plan = [
        ("a", (x, x, x), {"attn_mask": _causal(100)}),
        ("a", (x, kv, kv), {"attn_mask": _float(mask3), "key_padding_mask": _float(_padding(3, 100))}),
        ("a", (x, x, x), {"key_padding_mask": _float(_padding(3, 100))}),
    ]
    return Calls({"a": _mha(batch_first=batch_first)}, plan)


def _case_bfloat16() -> Calls:
    x = _x(3, 6, 8, dtype=torch.bfloat16)
    module = _mha(batch_first=True).to(torch.bfloat16)
    return Calls({"a": module}, [("a", (x, x, x), {"attn_mask": _causal(6)})])


def _case_several_calls() -> Calls:
    """Modules called several times, with a shared mask and masks of their own (stacked), and two shapes."""
    x, y, z = _x(3, 6, 8), _x(3, 6, 8, seed=2), _x(3, 4, 8, seed=3)
    causal, other = _causal(6), _causal(6).roll(1, dims=1)
    padding = _padding(3, 6)
    plan = [
        ("a", (x, x, x), {"attn_mask": causal, "key_padding_mask": padding}),
        ("b", (y, y, y), {"attn_mask": causal, "key_padding_mask": padding}),
        ("c", (z, z, z), {}),  # another shape: a batch of its own
        ("a", (y, y, y), {"attn_mask": other, "key_padding_mask": _padding(3, 6).roll(1, dims=1)}),
        ("b", (x, x, x), {"attn_mask": causal, "key_padding_mask": padding}),
    ]
    modules = {"a": _mha(batch_first=True), "b": _mha(batch_first=True, seed=1), "c": _mha(batch_first=True, seed=2)}
    return Calls(modules, plan)


CASES: dict[str, Callable[[], Calls]] = {
    "batch first, rows < batch": _case_batch_first,
    "sequence first": _case_seq_first,
    "unbatched": _case_unbatched,
    "kdim, vdim: q_proj_weight, k_proj_weight": lambda: _case_kdim_vdim(True),
    "kdim, vdim, sequence first": lambda: _case_kdim_vdim(False),
    "bias=False": _case_no_bias,
    "bool attn_mask": lambda: _case_mask("2-D bool"),
    "float attn_mask": lambda: _case_mask("2-D float"),
    "3-D bool attn_mask": lambda: _case_mask("3-D bool"),
    "3-D float attn_mask": lambda: _case_mask("3-D float"),
    "bool key_padding_mask": lambda: _case_padding("bool"),
    "float key_padding_mask": lambda: _case_padding("float"),
    "100 tokens, strided, batch first": lambda: _case_long(True),
    "100 tokens, strided, sequence first": lambda: _case_long(False),
    "bfloat16": _case_bfloat16,
    "several calls": _case_several_calls,
}


@pytest.mark.parametrize("discovering", [True, False], ids=["discovery pass", "watched pass"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_batched_logits_are_the_per_call_ones(case: str, discovering: bool) -> None:
    model = CASES[case]()
    probe = AttentionProbe(model, rows=ROWS, queries=QUERIES, per_head=True)
    if not discovering:  # a first pass finds the attention modules; the next ones flush at the root's return
        with probe.measuring():
            model()
        probe.take_calls()
    calls: list[Call] = []
    handles = _recording(model, calls)
    flushed = []
    try:
        with probe.measuring():
            model()
            flushed.append(not probe._pending)  # measured when the forward returned
        parts = probe.take_calls()
    finally:
        for handle in handles:
            handle.remove()
    assert not probe.broken
    assert flushed == [True]
    _assert_same(_measured(parts), _reference(calls))


def test_is_causal_without_a_mask_hides_the_later_keys() -> None:
    """``is_causal=True`` alone (the module itself asks for a mask; the probe honours the hint as before)."""
    module = _mha(batch_first=True)
    model = nn.ModuleDict({"a": module})
    probe = AttentionProbe(model, rows=ROWS, queries=QUERIES, per_head=True)
    calls: list[Call] = []
    with probe.measuring():
        for length in (6, 100):  # 100: strided
            x = _x(3, length, 8)
            args, kwargs = (x, x, x), {"is_causal": True, "need_weights": False}
            probe._multihead(module, args, kwargs)
            calls.append(("a", module, args, kwargs))
        parts = probe.take_calls()
    assert not probe.broken
    _assert_same(_measured(parts), _reference(calls))


def test_an_unbatched_key_padding_mask_is_measured() -> None:
    """Unbatched input with a ``(S,)`` padding mask (the per-call code cut it as a batch and raised)."""
    torch.manual_seed(0)
    module = _mha(batch_first=True)
    model = nn.ModuleDict({"a": module})
    x = _x(6, 8)
    padding = torch.tensor([False, False, False, False, True, True])
    probe = AttentionProbe(model, rows=ROWS, queries=QUERIES)
    with probe.measuring():
        module(x, x, x, key_padding_mask=padding)
    stats = probe.take()["a"]
    with torch.no_grad():
        expected = _old_multihead_logits(module, (x.unsqueeze(0), x.unsqueeze(0)), {}, ROWS, QUERIES)
        expected = attention_stats(expected.masked_fill(padding, -math.inf))
    assert float(stats.max_logit) == pytest.approx(float(expected.max_logit), rel=1e-5)
    assert float(stats.entropy) == pytest.approx(float(expected.entropy), rel=1e-5)


def test_a_transformer_encoder_with_masks_measures_the_per_call_values() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, nhead=4, dim_feedforward=32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
    x = _x(4, 40, 16) * 4
    mask, padding = nn.Transformer.generate_square_subsequent_mask(40), _float(_padding(4, 40))
    probe = AttentionProbe(model, rows=ROWS, queries=QUERIES, per_head=True)
    for _ in range(2):  # the discovery pass, then a watched one
        calls: list[Call] = []
        handles = _recording(model, calls)
        try:
            with probe.measuring():
                model(x, mask=mask, src_key_padding_mask=padding).sum().backward()
            parts = probe.take_calls()
        finally:
            for handle in handles:
                handle.remove()
        assert [name for name, *_ in calls] == ["layers.0.self_attn", "layers.1.self_attn", "layers.2.self_attn"]
        _assert_same(_measured(parts), _reference(calls))


@pytest.mark.parametrize("limit", ["held", "batch"])
def test_calls_measured_in_several_batches_give_the_values_of_one(limit: str) -> None:
    """The memory bounds split the calls (or measure them early): the values are the same."""
    model = _case_several_calls()
    calls: list[Call] = []
    handles = _recording(model, calls)
    probe = AttentionProbe(model, rows=ROWS, queries=QUERIES, per_head=True)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(attention, "_HELD_BYTES" if limit == "held" else "_BATCH_BYTES", 1)
            with probe.measuring():
                model()
            parts = probe.take_calls()
    finally:
        for handle in handles:
            handle.remove()
    assert not probe.broken
    # held: each call measured as it comes, alone (the calls' order); batch: kept, then one batch per call
    _assert_same(_measured(parts), _reference(calls, grouped=limit == "batch"))


def test_the_weights_are_read_before_the_optimizer_steps() -> None:
    """The kept calls refer to the weights: measured at the forward's return, before any update."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x = _x(4, 8, 16)
    probe = AttentionProbe(model, rows=ROWS, queries=QUERIES, per_head=True)
    for _ in range(3):
        calls: list[Call] = []
        handles = _recording(model, calls)
        try:
            with probe.measuring():
                model(x).square().sum().backward()
            expected = _reference(calls)  # the weights of the forward, before the step
            optimizer.step()  # the guard takes the calls before the step; here after it: measured already
            optimizer.zero_grad()
            parts = probe.take_calls()
        finally:
            for handle in handles:
                handle.remove()
        _assert_same(_measured(parts), expected)


@pytest.mark.parametrize("discovering", [True, False], ids=["discovery pass", "watched pass"])
def test_a_failure_stops_the_probe_and_never_the_forward(
    discovering: bool, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _case_several_calls()
    probe = AttentionProbe(model, rows=ROWS, queries=QUERIES)
    if not discovering:
        with probe.measuring():
            model()
        probe.take_calls()

    def broken(key: Any, batch: Any) -> Tensor:
        raise RuntimeError("a shape the probe never saw")

    monkeypatch.setattr(attention, "_multihead_logits", broken)
    expected = model()
    with probe.measuring():
        out = model()  # measured (and failed) when the forward returned
        assert probe.broken
    assert torch.equal(out, expected)
    assert probe.take() == {}
    assert "attention precursor watch stops" in caplog.text and "a shape the probe never saw" in caplog.text


# ---------------------------------------------------------------- counted cost (aten calls, not time)

# at most, per nn.MultiheadAttention call: the row slice of its input (one view)
PER_CALL = 3
# at most, per forward and shape of call: stacks of inputs, weights and biases, 2 baddbmm, the head views,
# q @ k^T (a bmm and its views), the scale, and the 9 kernels of the statistics
PER_BATCH = 45


def _encoder(layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True) for _ in range(layers))
    )


@pytest.mark.parametrize("length", [8, 200], ids=["8 tokens", "200 tokens"])
def test_the_calls_added_per_multihead_call_are_a_few_views(length: int) -> None:
    x = torch.randn(8, length, 16)  # 8 batch rows, 4 measured; 200 tokens: every 4th query
    few, many = probe_ops_added(_encoder(2), x), probe_ops_added(_encoder(10), x)
    per_call = (many - few) / 8
    assert per_call <= PER_CALL, (few, many)  # it was ~29 per call
    assert few - 2 * per_call <= PER_BATCH, (few, many)


class Marked(Tensor):
    """A tensor subclass: its rows are cut by slices, not ``as_strided``."""


@pytest.mark.parametrize("subclass", [False, True], ids=["tensor", "subclass"])
@pytest.mark.parametrize("layout", ["batch first", "sequence first", "unbatched", "transposed storage"])
@pytest.mark.parametrize(("rows", "stride"), [(2, 1), (2, 3), (8, 3), (8, 1)])
def test_the_measured_rows_are_one_view_of_the_input(layout: str, rows: int, stride: int, subclass: bool) -> None:
    base = _x(4, 10, 6)  # (batch, positions, features)
    if layout == "batch first":
        x, batch_dim = base, 0
    elif layout == "sequence first":
        x, batch_dim = base.transpose(0, 1).contiguous(), 1
    elif layout == "unbatched":
        x, batch_dim, base = base[1], None, base[1:2]
    else:  # sequence first, a transposed view of a batch-first tensor
        x, batch_dim = base.transpose(0, 1), 1
    x = x.as_subclass(Marked) if subclass else x
    n = min(rows, base.size(0))
    counter = OpCounter()
    with counter.modes():
        got = attention._rows(x, batch_dim, n, stride)
    assert torch.equal(got.as_subclass(Tensor), base[:n, ::stride])
    if not subclass:
        assert counter.all_ops <= 1 and got.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
