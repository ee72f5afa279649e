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
(``blocks.1.attn``). An attention call is only kept (references to its ``query`` and ``key``, and
for ``nn.MultiheadAttention`` to its projection weights and masks, or a copy of the measured rows of
a softmax's input: at most 3 aten calls, views but one); when the forward that made the calls
returns, the calls of one shape are measured together (their ``q @ k^T`` of ``rows`` batch rows, one
``bmm`` for all, after one ``baddbmm`` for all the query and one for all the key projections of
``nn.MultiheadAttention`` calls, and 9 kernels of statistics), into one ``(calls, 4)`` tensor per
device (:class:`ProbeCalls`) that stays on the device until :meth:`AttentionProbe.take_calls` (the
host reads it once per step; :func:`summarise` makes it each module's values). The kept calls and a
batch's work are bounded in memory (64 MiB each: beyond, they are measured sooner, in several
batches). The weights a kept call refers to are read when its forward returns, before the optimizer
steps (:meth:`AttentionProbe.take_calls` measures the calls still kept, as a forward recomputed in
the backward pass leaves them).

The calls are seen by a function mode on the passes that look at every module (the first, then one
in ``rediscover_every``); on the others, a module whose attention calls all go through the public
functions is seen through wrappers of those four functions (:mod:`.attention_calls`), so its other
torch calls (projections, views) run without the mode's Python dispatch.

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from time import perf_counter  # bound at import: a test that replaces time.perf_counter leaves the guard's own clock
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from lightning_nanguard.detect import attention_calls
from lightning_nanguard.detect.attention_calls import SDPA, WATCHED

__all__ = ["AttentionProbe", "AttentionStats", "ProbeCalls", "attention_stats", "merged_stats", "summarise"]

log = logging.getLogger("lightning_nanguard")


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


class ProbeCalls:
    """One step's measured attention calls on one device: one row of :attr:`values` per call.

    ``values`` is ``(calls, 4)`` on the device: the max logit, the sum of ``p log p`` over the
    measured rows, the sum of ``max log p`` over them and how many rows were measured (rows with
    every key masked are not); :func:`summarise` turns the rows, read to the host, into each
    module's max logit, mean entropy and mean ``min_entropy``. ``head_max``: the max logit per head
    of each call (``None`` when not asked for or without a head dimension).
    """

    __slots__ = ("head_max", "names", "values")

    def __init__(self, names: list[str], values: Tensor, head_max: list[Tensor | None]) -> None:
        self.names, self.values, self.head_max = names, values, head_max

    def stats(self) -> dict[str, AttentionStats]:
        """Each module's :class:`AttentionStats` on the device (calls of one module merged)."""
        out: dict[str, AttentionStats] = {}
        for name, row, head_max in zip(self.names, self.values, self.head_max, strict=True):
            stats = AttentionStats(row[0], row[1].neg() / row[3], row[2].neg() / row[3], head_max=head_max)
            known = out.get(name)
            out[name] = stats if known is None else known.merge(stats)
        return out


def merged_stats(parts: list[ProbeCalls]) -> dict[str, AttentionStats]:
    """Each module's :class:`AttentionStats` on the device, over the calls of ``parts``."""
    stats: dict[str, AttentionStats] = {}
    for part in parts:
        for name, found in part.stats().items():
            known = stats.get(name)
            stats[name] = found if known is None else known.merge(found)
    return stats


def summarise(names: list[str], rows: list[list[float]]) -> dict[str, tuple[float, float, float]]:
    """Each module's ``(max_logit, entropy, min_entropy)`` from :attr:`ProbeCalls.values` read to the host.

    A module called several times in the step: the largest max logit (NaN if any is), the mean of
    its calls' entropies (as :meth:`AttentionStats.merge`).

    Example:
        >>> summarise(["a", "a"], [[3.0, -2.0, -1.0, 4.0], [5.0, -4.0, -4.0, 4.0]])
        {'a': (5.0, 0.75, 0.625)}
    """
    found: dict[str, list[float]] = {}
    for name, (max_logit, plogp, max_log_p, count) in zip(names, rows, strict=True):
        count = round(count)  # a sum of probabilities: the rows measured, to float rounding
        entropy = -plogp / count if count else math.nan
        min_entropy = -max_log_p / count if count else math.nan
        known = found.get(name)
        if known is None:
            found[name] = [max_logit, entropy, min_entropy, 1.0]
        else:
            known[0] = max_logit if math.isnan(max_logit) or max_logit > known[0] else known[0]
            known[1] += entropy
            known[2] += min_entropy
            known[3] += 1.0
    return {name: (v[0], v[1] / v[3], v[2] / v[3]) for name, v in found.items()}


class AttentionProbe:
    """Measure every attention of ``model`` during :meth:`measuring` (see module docs).

    Per attention call the probe only keeps what it needs (references to the call's ``query`` and
    ``key``, or a copy of the measured rows of a softmax's input); the logits and their statistics
    are computed for all the calls of one forward at once, when it returns, one batch of kernels per
    shape of call (a handful whatever the number of calls), into one ``(calls, 4)`` tensor.

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
        # torch.compile traces the wrappers into its graphs and then misses the calls: compiled models keep the mode
        self.compiled = any(_compiled(m) for m in model.modules())
        self.rediscover_every = rediscover_every
        self.attention: set[str] | None = None  # the modules found calling attention (None: not looked yet)
        self.roots: set[str] = set()  # the outermost modules whose forward holds attention calls
        self._found_roots: set[str] = set()
        self._passes = 0
        self._discovering = True
        self._stack: list[str] = []
        self._mode_depth = 0  # the depth of :attr:`_stack` at which the function mode was entered (0: not in it)
        self._wrapped = False  # this pass sees the attention functions through their wrappers (attention_calls)
        self._needs_mode: set[str] = set()  # modules with an attention call the wrappers do not see alone
        self._mode_saw = False  # the function mode measured the wrapped call in hand
        self._pending: list[tuple[Any, ...]] = []  # the calls kept, not measured yet
        self._held = 0  # bytes the kept calls hold
        self._results: list[tuple[list[str], Tensor, Tensor | None]] = []  # (names, values, head max) per batch
        self._mode = _Intercept(self)
        self.broken = False  # a measurement raised: the probe stops (the user's forward never fails for it)
        self.host_seconds = 0.0  # host time spent measuring since the last ``measuring()`` began

    @contextmanager
    def measuring(self) -> Iterator[None]:
        """Within: attention calls under the watched modules are measured (only while autograd is on).

        Only module hooks are installed here (this context may span several hooks of a loop). When
        the outermost watched module's ``forward`` begins, the attention functions' wrappers
        (:mod:`.attention_calls`) are installed, and removed when it returns (or raises): nothing
        global outlives a watched forward. On a pass that looks at every module, the function mode
        that sees every call is entered there too, so it nests inside whatever modes the loop itself
        uses; it also finds the modules whose attention calls the wrappers do not see alone (a
        function bound before they were installed, attention inside another torch function such as
        ``nn.MultiheadAttention``'s). On the other passes only those modules enter the mode; the
        others are seen through the wrappers, at no cost to their other torch calls.
        """
        self._stack, self._mode_depth = [], 0
        self.host_seconds = 0.0
        if self.broken:
            yield
            return
        self._discovering = self.attention is None or self._passes % self.rediscover_every == 0
        self._passes += 1
        if self._discovering:
            self._found_roots = set()
        handles = self._hooks() if self._discovering else self._attention_hooks()
        for module in self.multihead:
            handles.append(module.register_forward_pre_hook(self._multihead, with_kwargs=True))
        if not self._discovering:  # the calls are measured when the forward that holds them returns
            for name in sorted(self.roots):
                root = self.modules.get(name)
                if root is not None:
                    handles.append(root.register_forward_hook(self._flush_hook, always_call=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._stack = []
            if self._mode_depth:  # a forward that never returned (an error): leave its mode
                self._mode_depth = 0
                self._mode.__exit__(None, None, None)
            attention_calls.stop(self)

    def skip_idle_pass(self) -> bool:
        """Count the next pass as done without watching it when it would watch nothing.

        ``True`` (skipped) when the last look at every module found no attention, the model has no
        ``nn.MultiheadAttention`` and the next pass is not one that looks again: a model without
        attention costs one pass in ``rediscover_every`` instead of every sampled step.
        """
        if self.attention is None or self.attention or self.multihead or self._passes % self.rediscover_every == 0:
            return False
        self._passes += 1
        return True

    def take_calls(self) -> list[ProbeCalls]:
        """The calls measured since the last ``take``: one :class:`ProbeCalls` per device (usually one).

        After a pass that looked at every module (the first, then one in ``rediscover_every``), the
        next passes watch only the modules found calling attention: the function mode is then
        active only inside them, and the other modules run without any hook.
        """
        if self._pending:  # calls whose forward has not returned (recomputed under checkpointing)
            start = perf_counter()
            self._flush()
            self.host_seconds += perf_counter() - start
        results, self._results = self._results, []
        if self._discovering:
            self.attention = {name for names, _, _ in results for name in names}
            self.roots = self._found_roots
        by_device: dict[torch.device, list[tuple[list[str], Tensor, Tensor | None]]] = {}
        for result in results:
            by_device.setdefault(result[1].device, []).append(result)
        out = []
        for parts in by_device.values():
            names = [name for part_names, _, _ in parts for name in part_names]
            values = parts[0][1] if len(parts) == 1 else torch.cat([values for _, values, _ in parts])
            head_max: list[Tensor | None] = []
            for part_names, _, maxima in parts:
                head_max.extend(maxima.unbind(0) if maxima is not None else [None] * len(part_names))
            out.append(ProbeCalls(names, values, head_max))
        return out

    def take(self) -> dict[str, AttentionStats]:
        """The measurements since the last ``take``, per module name (device tensors; see :meth:`take_calls`)."""
        return merged_stats(self.take_calls())

    # ------------------------------------------------------------------ internals

    def _enter(self, name: str, everything: bool = True) -> None:
        """A watched module's forward begins: the outermost installs the wrappers; the mode where needed.

        ``everything``: a pass that looks at every module (the mode sees all of them).
        """
        if not self._stack:  # compiling, or another thread watching: this forward uses the function mode alone
            self._wrapped = not self.compiled and not torch.compiler.is_compiling() and attention_calls.start(self)
        self._stack.append(name)
        mode = everything or not self._wrapped or name in self._needs_mode
        if mode and not self._mode_depth:
            self._mode_depth = len(self._stack)
            self._mode.__enter__()

    def _leave(self) -> None:
        """A watched module's forward returned: the one that entered the function mode leaves it."""
        if self._stack:
            if self._mode_depth == len(self._stack):
                self._mode_depth = 0
                self._mode.__exit__(None, None, None)
            self._stack.pop()
            if not self._stack:  # the outermost returned
                attention_calls.stop(self)
                if self._discovering and self._pending:  # measure its calls
                    start = perf_counter()
                    self._flush()
                    self.host_seconds += perf_counter() - start

    def _flush_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        """A root's forward returned (see :attr:`roots`): measure the calls it made."""
        if self._pending:
            start = perf_counter()
            self._flush()
            self.host_seconds += perf_counter() - start

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
            handles.append(module.register_forward_pre_hook(lambda m, a, name=name: self._enter(name, False)))
            handles.append(module.register_forward_hook(lambda m, a, o: self._leave(), always_call=True))
        return handles

    def _keep(self, call: tuple[Any, ...], nbytes: int) -> None:
        """Keep one attention call until its forward returns (or the calls kept hold too much memory)."""
        self._pending.append(call)
        if self._discovering and self._stack:
            self._found_roots.add(self._stack[0])
        self._held += nbytes
        if self._held > _HELD_BYTES:
            self._flush()

    def _flush(self) -> None:
        """Measure the calls kept: one batch of kernels per shape of call (see :func:`_batch_logits`)."""
        pending, self._pending, self._held = self._pending, [], 0
        if self.broken:
            return
        try:
            with torch.no_grad():
                groups: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {}
                for call in pending:
                    key, item = _prepare(call, self.rows, self.queries)
                    groups.setdefault(key, []).append(item)
                for key, items in groups.items():
                    for batch in _batches(items):
                        values, head_max = _call_stats(_batch_logits(key, batch), self.per_head)
                        self._results.append(([item[0] for item in batch], values, head_max))
        except Exception as error:  # never the user's forward's failure
            self._fail(error)

    def attention_call(self, kind: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """An attention function's wrapper returned (:mod:`.attention_calls`): keep the call.

        Inside the function mode the mode keeps it instead; a wrapped call the mode did not see
        (made inside another torch function, which the mode sees whole) marks the modules around
        it as needing the mode, which sees what they do as it always did.
        """
        if not self._stack:
            return
        if self._mode_depth:
            if not self._mode_saw and self._discovering:
                self._needs_mode.update(self._stack)
            self._mode_saw = False
            return
        self._seen(kind, args, kwargs)

    def _seen(self, kind: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Keep an attention call (never the user's forward's failure)."""
        start = perf_counter()
        try:
            if kind == SDPA:
                self._sdpa(args, kwargs)
            else:
                self._softmax(args, kwargs)
        except Exception as error:
            self._fail(error)
        self.host_seconds += perf_counter() - start

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
        self._pending, self._results, self._held = [], [], 0

    def _softmax(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x = args[0] if args else kwargs.get("input")
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if not isinstance(x, Tensor) or not x.is_floating_point() or x.ndim < 3 or dim is None:
            return
        if dim % x.ndim != x.ndim - 1 or not self._measuring():
            return
        stride = _stride(x.size(-2), self.queries)
        if x.size(0) > self.rows or stride > 1:  # a copy of the measured rows: the input itself is freed
            with torch.no_grad():
                x = x[: self.rows] if x.size(0) > self.rows else x
                x = x[..., ::stride, :] if stride > 1 else x
                x = x.float() if x.dtype != torch.float32 else x.clone()
        self._keep(("l", self._stack[-1], x), x.nbytes)

    def _sdpa(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        n = len(args)
        q = args[0] if n else kwargs.get("query")
        if not isinstance(q, Tensor) or q.ndim < 3 or not self._measuring():
            return
        k = args[1] if n > 1 else kwargs["key"]
        mask = args[3] if n > 3 else kwargs.get("attn_mask")
        causal = args[5] if n > 5 else kwargs.get("is_causal", False)
        scale = args[6] if n > 6 else kwargs.get("scale")
        gqa = args[7] if n > 7 else kwargs.get("enable_gqa", False)
        self._keep(("s", self._stack[-1], q, k, mask, bool(causal), scale, bool(gqa)), q.nbytes + k.nbytes)

    def _multihead(self, module: nn.MultiheadAttention, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """``nn.MultiheadAttention`` (its functional form hides the inner calls): keep its inputs and weights.

        References only (no aten call): its logits are made from its projection weights with the
        other calls of their shape when the forward returns (:func:`_multihead_logits`).
        """
        name = self.names.get(id(module))
        if name is None or not torch.is_grad_enabled() or self.broken:
            return
        start = perf_counter()
        try:
            n = len(args)  # forward(query, key, value, key_padding_mask, need_weights, attn_mask, _, is_causal)
            query = args[0] if n else kwargs["query"]
            key = args[1] if n > 1 else kwargs["key"]
            padding = args[3] if n > 3 else kwargs.get("key_padding_mask")
            mask = args[5] if n > 5 else kwargs.get("attn_mask")
            mask = mask if isinstance(mask, Tensor) else None
            padding = padding if isinstance(padding, Tensor) else None
            causal = mask is None and bool(args[7] if n > 7 else kwargs.get("is_causal"))
            packed = module.in_proj_weight
            weights = (packed,) if packed is not None else (module.q_proj_weight, module.k_proj_weight)
            nbytes = query.nbytes + (0 if key is query else key.nbytes)
            nbytes += (0 if mask is None else mask.nbytes) + (0 if padding is None else padding.nbytes)
            call = ("m", name, query, key, weights, module.in_proj_bias, mask, padding, causal, module.num_heads)
            self._keep((*call, module.batch_first), nbytes)
        except Exception as error:  # the module's own forward reports a bad call; the probe stays out of it
            self._fail(error)
        self.host_seconds += perf_counter() - start


_HELD_BYTES = 64 << 20  # the calls kept may hold this much (more: measured at once, not when their forward returns)
_BATCH_BYTES = 64 << 20  # the most one batch of calls may take for its logits and their statistics


def _compiled(module: nn.Module) -> bool:
    """Whether ``module`` runs under ``torch.compile`` (a compiled wrapper, ``module.compile()``, Lightning's)."""
    return (
        type(module).__name__ == "OptimizedModule"
        or getattr(module, "_compiled_call_impl", None) is not None
        or bool(getattr(module, "_compiler_ctx", None))
    )


def _prepare(call: tuple[Any, ...], rows: int, queries: int) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """A kept call's batch key (calls of one key are measured together) and its item ``(name, ...)``.

    Scaled-dot-product attention: the first ``rows`` batch rows of ``query`` at the measured query
    positions and of ``key``, and its mask at those rows and positions. A logits tensor (a softmax's
    input, kept already cut to the measured rows): as it is. ``nn.MultiheadAttention``: see
    :func:`_prepare_multihead`.
    """
    if call[0] == "l":
        x = call[2]
        return ("l", x.shape, x.dtype, x.device), (call[1], x, None, x.numel())
    if call[0] == "m":
        return _prepare_multihead(call, rows, queries)
    _, name, q, k, mask, causal, scale, gqa = call
    length = q.size(-2)
    stride = _stride(length, queries)
    q = q[:rows] if q.size(0) > rows else q
    q = q[..., ::stride, :] if stride > 1 else q
    k = k[:rows] if k.size(0) > rows else k
    scale = scale or 1.0 / math.sqrt(q.size(-1))
    mask_key = None
    if isinstance(mask, Tensor):
        original = mask
        if mask.ndim == q.ndim and mask.size(0) > q.size(0):
            mask = mask[: q.size(0)]
        if stride > 1:
            mask = _strided_mask(mask, stride)
        mask_key = (mask.shape, mask.dtype)
        mask = (original, mask)
    key = ("s", q.shape, k.shape, q.dtype, k.dtype, q.device, scale, gqa, causal and (length, stride), mask_key)
    return key, (name, q, k, math.prod(q.shape[:-1]) * k.size(-2), mask)


def _batches(items: list[tuple[Any, ...]]) -> Iterator[list[tuple[Any, ...]]]:
    """``items`` in batches whose logits and statistics take at most ``_BATCH_BYTES`` (one call at least)."""
    batch: list[tuple[Any, ...]] = []
    size = 0
    for item in items:
        cost = 16 * item[3]  # the logits, their log-softmax and the probabilities, in float32, and slack (and
        # nn.MultiheadAttention's weights, inputs and projections: counted in item[3], see _prepare_multihead)
        if batch and size + cost > _BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += cost
    if batch:
        yield batch


def _stacked(tensors: list[Tensor]) -> Tensor:
    """``tensors`` stacked on a new first dimension, in float32 (one call: a view)."""
    stacked = torch.stack(tensors) if len(tensors) > 1 else tensors[0].unsqueeze(0)
    return stacked.float()


def _batch_logits(key: tuple[Any, ...], batch: list[tuple[Any, ...]]) -> Tensor:
    """The logits of a batch of calls of one key, stacked: ``(calls, *one call's logits)``."""
    if key[0] == "l":
        return _stacked([item[1] for item in batch])
    if key[0] == "m":
        return _multihead_logits(key, batch)
    return _sdpa_logits(key, batch)


def _sdpa_logits(key: tuple[Any, ...], batch: list[tuple[Any, ...]]) -> Tensor:
    """``q @ k^T * scale`` of a batch of calls, masked as ``scaled_dot_product_attention`` masks."""
    _, _, _, _, _, device, scale, gqa, causal, mask_key = key
    q, k = _stacked([item[1] for item in batch]), _stacked([item[2] for item in batch])
    if gqa and k.size(-3) != q.size(-3):
        k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
    logits = torch.matmul(q, k.transpose(-2, -1)).mul_(scale)
    if mask_key is not None:
        masks = [item[4] for item in batch]
        first = masks[0][0]
        if all(original is first for original, _ in masks):  # one mask for every call (as is usual): as it is
            mask = masks[0][1]
        else:
            mask = torch.stack([cut for _, cut in masks])
            mask = mask.view(len(masks), *([1] * (logits.ndim - mask.ndim)), *mask.shape[1:])
        if mask.dtype == torch.bool:
            logits.masked_fill_(~mask, -math.inf)
        else:
            logits.add_(mask)
    if causal:
        length, stride = causal
        logits.masked_fill_(_hidden(length, logits.size(-1), stride, device), -math.inf)
    return logits


def _call_stats(logits: Tensor, per_head: bool) -> tuple[Tensor, Tensor | None]:
    """Per call of ``logits`` ``(calls, ..., queries, keys)``: ``(calls, 4)`` values (see :class:`ProbeCalls`).

    Nine kernels whatever the number of calls. Rows with every key masked (``-inf``) have NaN
    log-probabilities: the ``nansum`` leave them out, and out of the row count (a sum of probabilities).
    """
    dims = tuple(range(1, logits.ndim))
    log_p = torch.log_softmax(logits, dim=-1)
    p = log_p.exp()
    count = p.nansum(dims)
    plogp = p.mul_(log_p).nansum(dims)  # 0 * -inf at masked keys: NaN, left out
    max_log_p = log_p.amax(dim=-1).nansum(dims[:-1])  # max log p = -(lse - max)
    values = torch.stack((logits.amax(dims), plogp, max_log_p, count), dim=1)
    head_max = None
    if per_head and logits.ndim >= 5:  # (calls, ..., heads, queries, keys): the max per head
        head_max = logits.amax(dim=(-2, -1)).flatten(1, -2).amax(dim=1)
    return values, head_max


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


def _prepare_multihead(call: tuple[Any, ...], rows: int, queries: int) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """A kept ``nn.MultiheadAttention`` call's batch key and item (see :func:`_prepare`): one view or two.

    The item is ``(name, query rows, key rows, cost, weights, in_proj_bias, attn_mask, key_padding_mask)``:
    the first ``rows`` batch rows of ``key`` and of ``query`` at the measured positions, batch first
    (``None`` for the query of self-attention, ``query is key``: taken from the key rows, for all
    the calls at once), the weights and masks as the module was called with. ``cost``: the elements
    of the call's logits, and half of those its weights, inputs and projections take (see :func:`_batches`).
    """
    _, name, query, key, weights, bias, mask, padding, causal, heads, batch_first = call
    if query.ndim == 3:
        batch_dim: int | None = 0 if batch_first else 1
        size, length = query.size(0 if batch_first else 1), query.size(1 if batch_first else 0)
    else:  # unbatched
        batch_dim, size, length = None, 1, query.size(0)
    stride = _stride(length, queries)
    n = size if size < rows else rows
    k = _rows(key, batch_dim, n, 1)
    q = None if key is query else _rows(query, batch_dim, n, stride)
    source, positions = k.size(1), -(-length // stride)
    w = weights[0]
    kinds: tuple[Any, ...]
    if len(weights) == 1:
        dim, kinds, elements = w.size(0) // 3, (w.shape, w.dtype), w.numel()
    else:
        w_k = weights[1]
        dim, kinds, elements = w.size(0), (w.shape, w.dtype, w_k.shape, w_k.dtype), w.numel() + w_k.numel()
    elements += n * (positions + source) * (dim + k.size(2))  # inputs and projections
    cost = n * heads * positions * source + elements // 2  # the logits; the rest in float32, and a copy: 8 bytes
    batch_key = (
        "m",
        None if q is None else (q.shape, q.dtype),
        k.shape,
        k.dtype,
        k.device,
        kinds,
        None if bias is None else (bias.shape, bias.dtype),
        heads,
        length,
        stride,
        causal,
        None if mask is None else (mask.shape, mask.dtype),
        None if padding is None else (padding.shape, padding.dtype),
    )
    return batch_key, (name, q, k, cost, weights, bias, mask, padding)


def _rows(x: Tensor, batch_dim: int | None, n: int, stride: int) -> Tensor:
    """``x``'s first ``n`` batch rows at every ``stride``-th position, batch first: ``(n, positions, features)``.

    ``batch_dim``: where ``x`` has its batch (``None``: unbatched, ``(positions, features)``). One
    view at most (``as_strided`` where slices would take two), none when ``x`` is already that;
    chained views for a tensor subclass.
    """
    if batch_dim == 0:
        cut = x.size(0) > n
        if stride == 1 or not cut:
            x = x[:n] if cut else x
            return x[:, ::stride] if stride > 1 else x
    if type(x) not in (Tensor, nn.Parameter) or x.layout != torch.strided:
        y = x.unsqueeze(0) if batch_dim is None else x.transpose(0, 1) if batch_dim == 1 else x
        y = y[:n] if y.size(0) > n else y
        return y[:, ::stride] if stride > 1 else y
    if batch_dim is None:
        length, size, strides = x.size(0), (1, x.size(1)), (0, x.stride(0), x.stride(1))
    else:
        seq = 1 - batch_dim
        length, size, strides = x.size(seq), (n, x.size(2)), (x.stride(batch_dim), x.stride(seq), x.stride(2))
    shape = (size[0], -(-length // stride), size[1])
    return x.as_strided(shape, (strides[0], strides[1] * stride, strides[2]), x.storage_offset())


def _multihead_logits(key: tuple[Any, ...], batch: list[tuple[Any, ...]]) -> Tensor:
    """The logits of a batch of ``nn.MultiheadAttention`` calls, masked as it masks: ``(calls, n, heads, L, S)``.

    One ``baddbmm`` projects the queries of every call, one the keys (stacked weights, in float32),
    one ``matmul`` makes the logits, then ``attn_mask``, ``key_padding_mask`` and ``is_causal``.
    """
    device, heads, length, stride, causal, mask_kind, padding_kind = key[4], *key[7:]
    calls = len(batch)
    k_in = _stacked([item[2] for item in batch])  # (calls, n, S, kdim)
    q_in = k_in if key[1] is None else _stacked([item[1] for item in batch])
    if key[1] is None and stride > 1:  # self-attention: the queries are the key rows at the measured positions
        q_in = k_in[:, :, ::stride]
    weights = [item[4] for item in batch]
    if len(weights[0]) == 1:  # in_proj_weight: the query, key and value projections packed
        w_q, w_k, _ = _stacked([w[0] for w in weights]).chunk(3, dim=1)
    else:
        w_q, w_k = _stacked([w[0] for w in weights]), _stacked([w[1] for w in weights])
    n, positions, source, dim = q_in.size(1), q_in.size(2), k_in.size(2), w_q.size(1)
    q_in, k_in = q_in.flatten(1, 2), k_in.flatten(1, 2)
    if key[6] is None:
        q, k = torch.bmm(q_in, w_q.transpose(1, 2)), torch.bmm(k_in, w_k.transpose(1, 2))
    else:
        b_q, b_k, _ = _stacked([item[5] for item in batch]).unsqueeze(1).chunk(3, dim=2)
        q, k = torch.baddbmm(b_q, q_in, w_q.transpose(1, 2)), torch.baddbmm(b_k, k_in, w_k.transpose(1, 2))
    q = q.view(calls, n, positions, heads, dim // heads).transpose(2, 3)
    k = k.view(calls, n, source, heads, dim // heads).transpose(2, 3)
    logits = torch.matmul(q, k.transpose(-2, -1)).div_(math.sqrt(dim // heads)).float()
    if mask_kind is not None:

        def cut(mask: Tensor) -> Tensor:  # (L, S) or (n * heads, L, S): (L', S) or (n, heads, L', S)
            mask = mask.view(-1, heads, length, source)[:n] if mask.ndim == 3 else mask
            return _strided_mask(mask, stride)

        mask = _per_call(logits, [item[6] for item in batch], cut)
        logits = logits.masked_fill_(mask, -math.inf) if mask.dtype == torch.bool else logits.add_(mask.float())
    if padding_kind is not None:

        def rows(padding: Tensor) -> Tensor:  # (batch, S) or (S,): (n, 1, 1, S)
            padding = padding[:n] if padding.ndim == 2 and padding.size(0) > n else padding
            return padding.view(n, 1, 1, source)

        padding = _per_call(logits, [item[7] for item in batch], rows)
        logits = (
            logits.masked_fill_(padding, -math.inf) if padding.dtype == torch.bool else logits.add_(padding.float())
        )
    if causal:
        logits.masked_fill_(_hidden(length, source, stride, device), -math.inf)
    return logits


def _per_call(logits: Tensor, masks: list[Tensor], cut: Callable[[Tensor], Tensor]) -> Tensor:
    """One mask per call of ``logits`` ``(calls, ...)``, cut to the measured rows: broadcast to ``logits``.

    One mask for every call (as is usual): cut once, broadcast over the calls; else each is cut and
    they are stacked.
    """
    first = masks[0]
    if all(mask is first for mask in masks):
        return cut(first)
    mask = torch.stack([cut(mask) for mask in masks])
    return mask.view(len(masks), *([1] * (logits.ndim - mask.ndim)), *mask.shape[1:])


class _Intercept(TorchFunctionMode):
    """Sees softmax and scaled-dot-product attention calls; hands their inputs to the probe after the call."""

    def __init__(self, probe: AttentionProbe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if kwargs is None:
            kwargs = {}
        result = func(*args, **kwargs)
        try:
            kind = WATCHED.get(func)
        except TypeError:  # an unhashable callable: not one of the watched functions
            return result
        if kind is None:
            return result
        probe = self.probe
        if probe._wrapped and probe._stack:
            if attention_calls.STATE.depth:  # through a wrapper: it hands the call over, to be skipped
                probe._mode_saw = True
            elif probe._discovering:  # a function bound before the wrappers: these modules keep the mode
                probe._needs_mode.update(probe._stack)
        probe._seen(kind, args, kwargs)
        return result
