"""QK-clip: cap an attention module's max logit by rescaling its query and key projections.

After the optimizer step of a sampled step, an attention module whose measured max pre-softmax
logit ``S`` is above the cap ``tau`` has its query and key projections multiplied by
``sqrt(tau / S)`` each, so the same input would give a max logit of ``tau`` (Kimi K2's MuonClip
step, applied per head where the heads are known: a head below the cap is left alone). The query
and key of a head enter its logits as a product, so the rescaling is exact for linear projections
with their biases, and for rotary embeddings (a rotation per head). It does nothing useful behind a
QK-norm, which undoes a scale (and such models do not need it).

Where the projections are found (:func:`find_qk_projections`):

- ``nn.MultiheadAttention``: the first two thirds of ``in_proj_weight``/``in_proj_bias``, or
  ``q_proj_weight``/``k_proj_weight``;
- a module that declares them: a method ``nanguard_qk_projections()`` returning
  ``(query_tensors, key_tensors)``, each tensor's first dimension the projection's output features,
  head after head (views of a fused ``qkv`` weight are fine: they are scaled in place);
- a module with two ``nn.Linear`` children named as the common implementations name them
  (``q_proj``/``k_proj``, ``query``/``key``, ``q``/``k``, ``wq``/``wk``, ``q_lin``/``k_lin``,
  ``to_q``/``to_k``);
- Hugging Face GPT-2's fused ``c_attn`` (``Conv1D``: query, key and value side by side in its columns).

A fused projection is never guessed from its name alone: layouts differ (GPT-NeoX interleaves the
heads). The heads come from the module (``num_heads``, ``n_head``, ``num_attention_heads``, ... or
its ``config``); where they are unknown, or the measured logits have no head dimension, one factor
from the module's max scales all its heads.

Example:
    >>> attn = nn.MultiheadAttention(4, 2, batch_first=True)
    >>> projection = find_qk_projections(nn.Sequential(attn))["0"]
    >>> projection.heads, projection.kv_heads
    (2, 2)
    >>> before = attn.in_proj_weight[:4].clone()
    >>> factors = qk_clip_(projection, torch.tensor([400.0, 50.0]), cap=100.0)
    >>> factors.tolist()  # head 0 was at 4x the cap; head 1 is below it
    [0.25, 1.0]
    >>> torch.allclose(attn.in_proj_weight[:2], before[:2] * 0.5), torch.equal(attn.in_proj_weight[2:4], before[2:4])
    (True, True)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["QKProjection", "find_qk_projections", "qk_clip_"]

NAMED_PAIRS = (("q_proj", "k_proj"), ("query", "key"), ("q", "k"), ("wq", "wk"), ("q_lin", "k_lin"), ("to_q", "to_k"))
HEAD_ATTRIBUTES = ("num_heads", "n_heads", "n_head", "num_attention_heads", "heads", "n_heads_q")
KV_HEAD_ATTRIBUTES = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "n_kv_head", "n_query_groups")


@dataclass(frozen=True)
class QKProjection:
    """The query and key tensors of one attention module, each with the axis of its output features.

    Attributes:
        queries: ``(tensor, axis)`` pairs; ``axis`` holds the heads one after the other.
        keys: the same for the keys.
        heads: query heads, ``None`` when unknown.
        kv_heads: key heads (fewer than ``heads`` under grouped-query attention), ``None`` when unknown.
    """

    queries: tuple[tuple[Tensor, int], ...]
    keys: tuple[tuple[Tensor, int], ...]
    heads: int | None
    kv_heads: int | None


def find_qk_projections(model: nn.Module) -> dict[str, QKProjection]:
    """The attention modules of ``model`` whose query and key projections are known, by name (see module docs)."""
    found = {}
    for name, module in model.named_modules():
        projection = _projection(module)
        if projection is not None:
            found[name] = projection
    return found


def qk_clip_(projection: QKProjection, max_logit: Tensor, cap: float) -> Tensor:
    """Rescale ``projection`` in place so that ``max_logit`` would be at most ``cap``; the factors on the logits.

    ``max_logit`` is the module's measured max, 0-d, or one per head (``(heads,)``). A
    value that is not finite (the guard's other checks deal with NaN) or not above ``cap`` leaves
    its head unchanged. Runs on the device with no host read. Under grouped-query attention, where
    a key head serves several query heads, the whole factor goes to the query heads.
    """
    logit = max_logit.detach().float()
    per_head = logit.ndim == 1 and projection.heads is not None and logit.numel() == projection.heads
    if not per_head:
        logit = logit.amax()
    factor = torch.where(torch.isfinite(logit) & (logit > cap), cap / logit, torch.ones_like(logit))
    with torch.no_grad():
        if per_head and projection.kv_heads not in (None, projection.heads):
            _scale_(projection.queries, factor)  # grouped-query attention: the query heads take all of it
        else:
            root = factor.sqrt()
            _scale_(projection.queries, root)
            _scale_(projection.keys, root)
    return factor


def _scale_(tensors: Sequence[tuple[Tensor, int]], factor: Tensor) -> None:
    """Multiply each tensor by ``factor``: one value, or one per head along its output axis."""
    for tensor, axis in tensors:
        if factor.ndim == 0:
            tensor.mul_(factor.to(tensor.dtype))
            continue
        per_row = factor.to(tensor.dtype).repeat_interleave(tensor.size(axis) // factor.numel())
        shape = [1] * tensor.ndim
        shape[axis] = -1
        tensor.mul_(per_row.view(shape))


def _projection(module: nn.Module) -> QKProjection | None:
    """The query and key projections of ``module``, if it is an attention module whose projections are known."""
    if isinstance(module, nn.MultiheadAttention):
        return _multihead(module)
    declared = getattr(module, "nanguard_qk_projections", None)
    if callable(declared):
        queries, keys = declared()
        return _checked(module, [(t, 0) for t in queries], [(t, 0) for t in keys])
    children = dict(module.named_children())
    for q_name, k_name in NAMED_PAIRS:
        q, k = children.get(q_name), children.get(k_name)
        if isinstance(q, nn.Linear) and isinstance(k, nn.Linear):
            return _checked(module, _linear(q), _linear(k))
    c_attn = children.get("c_attn")
    if type(c_attn).__name__ == "Conv1D" and not getattr(module, "is_cross_attention", False):
        return _gpt2(module, c_attn)
    return None


def _linear(layer: nn.Linear) -> list[tuple[Tensor, int]]:
    tensors = [(layer.weight, 0)]
    return [*tensors, (layer.bias, 0)] if layer.bias is not None else tensors


def _multihead(module: nn.MultiheadAttention) -> QKProjection:
    dim, heads = module.embed_dim, module.num_heads
    if module.in_proj_weight is not None:
        queries, keys = [(module.in_proj_weight[:dim], 0)], [(module.in_proj_weight[dim : 2 * dim], 0)]
    else:
        queries, keys = [(module.q_proj_weight, 0)], [(module.k_proj_weight, 0)]
    if module.in_proj_bias is not None:
        queries.append((module.in_proj_bias[:dim], 0))
        keys.append((module.in_proj_bias[dim : 2 * dim], 0))
    return QKProjection(tuple(queries), tuple(keys), heads, heads)


def _gpt2(module: nn.Module, c_attn: Any) -> QKProjection | None:
    """Hugging Face GPT-2's ``c_attn``: weight ``(in, 3 * width)``, query then key then value columns."""
    width = c_attn.weight.size(1) // 3
    queries = [(c_attn.weight[:, :width], 1), (c_attn.bias[:width], 0)]
    keys = [(c_attn.weight[:, width : 2 * width], 1), (c_attn.bias[width : 2 * width], 0)]
    return _checked(module, queries, keys)


def _heads(module: nn.Module, names: Sequence[str]) -> int | None:
    config = getattr(module, "config", None)
    for owner in (module, config):
        for attribute in names:
            value = getattr(owner, attribute, None) if owner is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _checked(
    module: nn.Module, queries: list[tuple[Tensor, int]], keys: list[tuple[Tensor, int]]
) -> QKProjection | None:
    """A projection whose heads divide its output features; heads forgotten when they do not."""
    if not queries or not keys:
        return None
    heads, kv_heads = _heads(module, HEAD_ATTRIBUTES), _heads(module, KV_HEAD_ATTRIBUTES)
    width = queries[0][0].size(queries[0][1])
    key_width = keys[0][0].size(keys[0][1])
    if heads is None or any(t.size(axis) % heads for t, axis in queries) or width % heads:
        heads = kv_heads = None
    elif kv_heads is None:
        kv_heads = heads if key_width == width else None
    if heads is not None and kv_heads is not None and key_width % kv_heads:
        kv_heads = None
    if heads is not None and kv_heads is None and key_width != width:
        heads = None  # the key heads cannot be told apart: one factor for the module
    return QKProjection(tuple(queries), tuple(keys), heads, kv_heads)
