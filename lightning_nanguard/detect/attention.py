"""Attention logits measured on the side of a forward pass, per attention module, without changing it.

:class:`AttentionProbe` watches one forward pass (a sampled training step) and, for every attention
it sees, measures on a few batch rows and under ``no_grad``:

- ``max_logit``: the largest pre-softmax attention logit (masked positions left out);
- ``entropy``: the mean entropy of the attention rows, in nats;
- ``min_entropy``: the mean of ``logsumexp - max`` over rows, a lower bound of the entropy that
  reaches zero when one key takes all the attention.

What counts as attention:

- ``torch.nn.functional.scaled_dot_product_attention``, called from any module (the fused kernels
  never materialise the logits: the probe computes ``q @ k^T * scale`` for its few rows itself,
  honouring ``attn_mask``, ``is_causal``, ``scale`` and grouped-query heads);
- a softmax over the last dimension of a tensor of 3 or more dimensions (hand-written
  ``softmax(q @ k.T / sqrt(d))``, Hugging Face's eager attention);
- ``nn.MultiheadAttention`` (its functional form hides its inner calls): the logits from its
  projection weights and inputs, honouring ``attn_mask``, ``key_padding_mask`` and ``is_causal``.

Each is attributed to the innermost module of the watched model whose ``forward`` is running
(``blocks.1.attn``). The measurement costs one ``q @ k^T`` of ``rows`` batch rows per attention call
on the sampled step only; the values stay on the device until :meth:`AttentionProbe.take`.

Example:
    >>> import torch
    >>> from torch import nn
    >>> class Attention(nn.Module):
    ...     def forward(self, q):
    ...         return torch.softmax(q @ q.transpose(-2, -1), dim=-1)
    >>> model = nn.Sequential(Attention())
    >>> probe = AttentionProbe(model)
    >>> with probe.measuring():
    ...     _ = model(torch.tensor([[[10.0, 0.0], [0.0, 1.0]]]))
    >>> {name: float(stats.max_logit) for name, stats in probe.take().items()}
    {'0': 100.0}
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from time import perf_counter  # bound at import: a test that replaces time.perf_counter leaves the guard's own clock
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

__all__ = ["AttentionProbe", "AttentionStats", "attention_stats"]

log = logging.getLogger("lightning_nanguard")

_SDPA = (F.scaled_dot_product_attention,)
_SOFTMAX = (torch.softmax, F.softmax, Tensor.softmax)


@dataclass
class AttentionStats:
    """One attention module's measurements on one step (0-d tensors on the model's device).

    ``head_max`` is the max logit per head, ``(heads,)``, when the probe was asked for it and the
    logits had a head dimension (``(batch, heads, queries, keys)``); ``None`` otherwise.
    """

    max_logit: Tensor
    entropy: Tensor
    min_entropy: Tensor
    calls: int = 1
    head_max: Tensor | None = None

    def merge(self, other: AttentionStats) -> AttentionStats:
        """Both calls of one module in one step: the larger max, the mean entropies."""
        n = self.calls + other.calls
        head_max = None
        if self.head_max is not None and other.head_max is not None and self.head_max.shape == other.head_max.shape:
            head_max = torch.maximum(self.head_max, other.head_max)
        return AttentionStats(
            torch.maximum(self.max_logit, other.max_logit),
            (self.entropy * self.calls + other.entropy * other.calls) / n,
            (self.min_entropy * self.calls + other.min_entropy * other.calls) / n,
            n,
            head_max,
        )


def attention_stats(logits: Tensor, per_head: bool = False) -> AttentionStats:
    """The stats of attention logits ``(..., queries, keys)``; ``-inf`` marks masked keys.

    Rows with every key masked are left out of the means. A handful of kernels whatever the shape
    (the probe runs inside the user's forward: on a GPU each kernel launch is host time).

    Example:
        >>> s = attention_stats(torch.tensor([[0.0, 0.0], [50.0, float("-inf")]]))
        >>> float(s.max_logit), round(float(s.entropy), 3), round(float(s.min_entropy), 3)
        (50.0, 0.347, 0.347)
    """
    logits = logits.detach().float()
    log_p = torch.log_softmax(logits, dim=-1)  # NaN in rows with no key: left out of the means
    entropy = torch.special.entr(log_p.exp()).sum(dim=-1)
    means = torch.stack((entropy, log_p.amax(dim=-1))).flatten(1).nanmean(dim=1)  # max log p = -(lse - max)
    head_max = None
    if per_head and logits.ndim >= 4:  # (..., heads, queries, keys): the max per head
        head_max = logits.amax(dim=(-2, -1)).flatten(0, -2).amax(dim=0)
    return AttentionStats(logits.amax(), means[0], means[1].neg(), head_max=head_max)


class AttentionProbe:
    """Measure every attention of ``model`` during :meth:`measuring` (see module docs).

    Args:
        model: the model whose modules calls are attributed to.
        rows: how many batch rows (the first dimension) of each attention call are measured.
        rediscover_every: one pass in this many looks at every module again (attention modules
            added or replaced since).
        queries: at most this many query positions per call are measured, evenly strided (the
            probe's memory is ``rows x heads x queries x keys`` floats whatever the sequence length).
        per_head: also keep the max logit per head (``AttentionStats.head_max``; QK-clip needs it).
    """

    def __init__(
        self,
        model: nn.Module,
        rows: int = 2,
        rediscover_every: int = 20,
        queries: int = 64,
        per_head: bool = False,
    ) -> None:
        self.rows, self.queries, self.per_head = rows, queries, per_head
        self.names = {id(module): name for name, module in model.named_modules()}
        self.modules = dict(model.named_modules())
        self.multihead = [m for m in model.modules() if isinstance(m, nn.MultiheadAttention)]
        self.rediscover_every = rediscover_every
        self.attention: set[str] | None = None  # the modules found calling attention (None: not looked yet)
        self._passes = 0
        self._discovering = True
        self._stack: list[str] = []
        self._stats: dict[str, AttentionStats] = {}
        self._mode = _Intercept(self)
        self.broken = False  # a measurement raised: the probe stops (the user's forward never fails for it)
        self.host_seconds = 0.0  # host time spent measuring since the last ``measuring()`` began

    @contextmanager
    def measuring(self) -> Iterator[None]:
        """Within: attention calls under the watched modules are measured (only while autograd is on).

        Only module hooks are installed here: the function mode that sees the calls is entered when
        the outermost watched module's ``forward`` begins and left when it returns, so it nests
        inside whatever modes the loop itself uses (this context may span several hooks of a loop).
        """
        self._stack = []
        self.host_seconds = 0.0
        if self.broken:
            yield
            return
        self._discovering = self.attention is None or self._passes % self.rediscover_every == 0
        self._passes += 1
        handles = self._hooks() if self._discovering else self._attention_hooks()
        for module in self.multihead:
            handles.append(module.register_forward_pre_hook(self._multihead, with_kwargs=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            if self._stack:  # a forward that never returned (an error): leave its mode
                self._stack = []
                self._mode.__exit__(None, None, None)

    def take(self) -> dict[str, AttentionStats]:
        """The measurements since the last ``take``, per module name (device tensors).

        After a pass that looked at every module (the first, then one in ``rediscover_every``), the
        next passes watch only the modules found calling attention: the function mode is then
        active only inside them, and the other modules run without any hook.
        """
        stats, self._stats = self._stats, {}
        if self._discovering:
            self.attention = set(stats)
        return stats

    # ------------------------------------------------------------------ internals

    def _enter(self, name: str) -> None:
        """A watched module's forward begins: the outermost one enters the function mode."""
        if not self._stack:
            self._mode.__enter__()
        self._stack.append(name)

    def _leave(self) -> None:
        """A watched module's forward returned: the outermost one leaves the function mode."""
        if self._stack:
            self._stack.pop()
            if not self._stack:
                self._mode.__exit__(None, None, None)

    def _hooks(self) -> list[RemovableHandle]:
        """Global hooks: every module of the model is watched (the pass that finds the attention modules)."""
        names = self.names

        def enter(module: nn.Module, args: Any) -> None:
            name = names.get(id(module))
            if name is not None:
                self._enter(name)

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            if id(module) in names:
                self._leave()

        return [
            nn.modules.module.register_module_forward_pre_hook(enter),
            nn.modules.module.register_module_forward_hook(leave, always_call=True),
        ]

    def _attention_hooks(self) -> list[RemovableHandle]:
        """Hooks on the modules known to call attention only (see :meth:`take`)."""
        handles = []
        for name in sorted(self.attention or ()):
            module = self.modules.get(name)
            if module is None or isinstance(module, nn.MultiheadAttention):
                continue
            handles.append(module.register_forward_pre_hook(lambda m, a, name=name: self._enter(name)))
            handles.append(module.register_forward_hook(lambda m, a, o: self._leave(), always_call=True))
        return handles

    def _record(self, logits: Tensor, name: str | None = None) -> None:
        name = name or (self._stack[-1] if self._stack else None)
        if name is None:
            return  # outside the watched model
        with torch.no_grad():
            stats = attention_stats(logits, self.per_head)
        known = self._stats.get(name)
        self._stats[name] = stats if known is None else known.merge(stats)

    def _measuring(self) -> bool:
        return bool(self._stack) and torch.is_grad_enabled() and not self.broken  # not a no-grad pass (validation)

    def _fail(self, error: Exception) -> None:
        """A measurement raised (an attention call shaped as the probe never saw): stop measuring, say so once."""
        if not self.broken:
            log.warning(
                "NanGuard: the attention precursor watch stops: measuring an attention call raised %s: %s",
                type(error).__name__,
                error,
            )
        self.broken = True
        self._stats = {}

    def _softmax(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x = args[0] if args else kwargs.get("input")
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if not isinstance(x, Tensor) or not x.is_floating_point() or x.ndim < 3 or dim is None:
            return
        if dim % x.ndim != x.ndim - 1 or not self._measuring():
            return
        self._record(x[: self.rows][..., :: _stride(x.size(-2), self.queries), :])

    def _sdpa(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
        given = {**dict(zip(names, args, strict=False)), **kwargs}
        q, k = given["query"], given["key"]
        if not isinstance(q, Tensor) or q.ndim < 3 or not self._measuring():
            return
        with torch.no_grad():
            self._record(_sdpa_logits(q, k, given, self.rows, self.queries))

    def _multihead(self, module: nn.MultiheadAttention, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """``nn.MultiheadAttention``: its functional form hides the inner calls; its logits from its weights."""
        name = self.names.get(id(module))
        if name is None or not torch.is_grad_enabled() or self.broken:
            return
        start = perf_counter()
        try:
            with torch.no_grad():
                self._record(_multihead_logits(module, args, kwargs, self.rows, self.queries), name)
        except Exception as error:  # the module's own forward reports a bad call; the probe stays out of it
            self._fail(error)
        self.host_seconds += perf_counter() - start


def _stride(length: int, queries: int) -> int:
    """The step between the measured query positions: at most ``queries`` of ``length``."""
    return max(1, -(-length // max(1, queries)))


@functools.lru_cache(maxsize=32)
def _hidden(length: int, keys: int, stride: int, device: torch.device) -> Tensor:
    """Which keys the query positions ``0, stride, 2 * stride, ...`` of causal attention do not see (top-left).

    Cached: the same few shapes come back every sampled step (on a GPU each kernel is host time).
    """
    positions = torch.arange(0, length, stride, device=device)
    return torch.arange(keys, device=device) > positions.unsqueeze(-1)


def _strided_mask(mask: Tensor, stride: int) -> Tensor:
    """An attention mask's query dimension (``-2``) at the measured positions; a broadcast one as it is."""
    return mask[..., ::stride, :] if mask.ndim >= 2 and mask.size(-2) > 1 else mask


def _sdpa_logits(q: Tensor, k: Tensor, given: dict[str, Any], rows: int, queries: int) -> Tensor:
    """``q @ k^T * scale`` for the first ``rows`` batch rows, masked as ``scaled_dot_product_attention`` masks."""
    length = q.size(-2)
    stride = _stride(length, queries)
    q, k = q[:rows, ..., ::stride, :].float(), k[:rows].float()
    if given.get("enable_gqa") and q.ndim >= 3 and k.size(-3) != q.size(-3):
        k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
    scale = given.get("scale") or 1.0 / math.sqrt(q.size(-1))
    logits = (q @ k.transpose(-2, -1)) * scale
    mask = given.get("attn_mask")
    if isinstance(mask, Tensor):
        if mask.ndim == logits.ndim and mask.size(0) not in (1, logits.size(0)):
            mask = mask[:rows]
        elif mask.ndim == logits.ndim:
            mask = mask[: logits.size(0)]
        mask = _strided_mask(mask, stride)
        logits = logits.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else logits + mask.float()
    if given.get("is_causal"):
        logits = logits.masked_fill(_hidden(length, logits.size(-1), stride, logits.device), -math.inf)
    return logits


def _multihead_logits(
    module: nn.MultiheadAttention, args: tuple[Any, ...], kwargs: dict[str, Any], rows: int, queries: int
) -> Tensor:
    """The attention logits ``nn.MultiheadAttention`` computes, for ``rows`` batch rows: ``(rows, heads, L, S)``."""
    names = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights")
    given = {**dict(zip(names, args, strict=False)), **kwargs}
    query, key = given["query"], given["key"]
    if not module.batch_first and query.ndim == 3:
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    if query.ndim == 2:
        query, key = query.unsqueeze(0), key.unsqueeze(0)
    full_length = query.size(1)
    stride = _stride(full_length, queries)
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
        mask = _strided_mask(mask, stride)
        logits = logits.masked_fill(mask, -math.inf) if mask.dtype == torch.bool else logits + mask.float()
    padding = given.get("key_padding_mask")
    if isinstance(padding, Tensor):
        padding = padding[:n].view(n, 1, 1, source)
        logits = logits.masked_fill(padding, -math.inf) if padding.dtype == torch.bool else logits + padding.float()
    if given.get("is_causal") and mask is None:
        logits = logits.masked_fill(_hidden(full_length, source, stride, logits.device), -math.inf)
    return logits


class _Intercept(TorchFunctionMode):
    """Sees softmax and scaled-dot-product attention calls; hands their inputs to the probe after the call."""

    def __init__(self, probe: AttentionProbe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func not in _SDPA and func not in _SOFTMAX:
            return result
        start = perf_counter()
        try:
            if func in _SDPA:
                self.probe._sdpa(args, kwargs)
            else:
                self.probe._softmax(args, kwargs)
        except Exception as error:  # never the user's forward's failure
            self.probe._fail(error)
        self.probe.host_seconds += perf_counter() - start
        return result
