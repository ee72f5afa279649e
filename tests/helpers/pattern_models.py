"""Everyday training patterns that go non-finite on known samples (issue 18), with their origins marked.

Every op where a NaN/Inf is born carries a trailing ``# ORIGIN: <name>`` comment (find its line
with ``models.origin_line(name, pattern_models.__file__)``). The data generators put the failure on
chosen dataset indices only; the tests compute the ground truth again with plain PyTorch
(:func:`bad_items`, :func:`first_module_birth`, :func:`first_backward_birth`), never with the guard.

- :class:`AttentionClassifier`: attention over padded token sequences, one sequence entirely
  padding. ``"mha"`` (``nn.MultiheadAttention``, default ``need_weights=True``) and
  ``"masked_softmax"`` (hand-written ``masked_fill(-inf).softmax``) give NaN for it in the forward;
  ``"mha_no_weights"``, ``"sdpa"`` (``F.scaled_dot_product_attention``) and ``"encoder_layer"``
  (``nn.TransformerEncoderLayer``) give zeros, no NaN. Every kind has a second, unrelated origin on
  ``scale == 0`` samples (``sqrt(0)`` in the backward), to check that nothing else is blamed.
- :class:`LogSumExpPool`: hand-written log-sum-exp over the valid tokens: ``-inf - (-inf)``.
- :class:`PaddedDistance`: padding distances set to ``+inf``, then averaged with a 0/1 mask: ``0 * inf``.
- :class:`CustomFunctionModule`: custom autograd Functions, defined here or in ``thirdparty_ops``.
- the sweep: :class:`CheckpointedBlocks` (activation checkpointing, reentrant or not),
  :class:`CTCModule` (a target that cannot be aligned), :class:`DistillModule` (KL divergence to a
  teacher with zero mass on masked classes), :class:`WhereSqrtModule` (``sqrt`` masked after the fact).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import thirdparty_ops
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import TensorDataset

__all__ = [
    "ATTENTION_KINDS",
    "AttentionClassifier",
    "CTCModule",
    "CheckpointedBlocks",
    "ClippedLog",
    "CustomFunctionModule",
    "DistillModule",
    "LogSumExpPool",
    "PaddedDistance",
    "SafeSqrt",
    "WhereSqrtModule",
    "bad_items",
    "blank_rows",
    "first_backward_birth",
    "first_module_birth",
    "padded_tokens",
]

VOCAB, LENGTH, WIDTH, CLASSES = 16, 6, 8, 3
ATTENTION_KINDS = ("mha", "masked_softmax", "mha_no_weights", "sdpa", "encoder_layer")
NAN_KINDS = ("mha", "masked_softmax")  # the kinds whose empty sequence is NaN in the forward


def padded_tokens(
    n: int, empty: Sequence[int] = (), padded: Sequence[int] | None = None, poisoned: Sequence[int] = (), seed: int = 0
) -> TensorDataset:
    """Token sequences ``(ids, pad, label, scale)``; ``pad`` is True on padding positions.

    Args:
        n: number of sequences.
        empty: sequences that are entirely padding.
        padded: when given, only these sequences have padding (the others are full length);
            otherwise every sequence has a random length of 2 to ``LENGTH`` tokens.
        poisoned: sequences with ``scale == 0`` (the second origin of :class:`AttentionClassifier`).
        seed: the generator's seed.
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
    if padded is None:
        lengths = torch.randint(2, LENGTH + 1, (n,), generator=g)
    else:
        lengths = torch.full((n,), LENGTH)
        lengths[list(padded)] = LENGTH - 2
    pad = torch.arange(LENGTH)[None, :] >= lengths[:, None]
    pad[list(empty)] = True
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    scale = torch.ones(n)
    scale[list(poisoned)] = 0.0
    return TensorDataset(ids, pad, labels, scale)


def blank_rows(n: int, blank: Sequence[int], features: int = 4, seed: int = 0) -> TensorDataset:
    """``(x, y)`` with ``x`` all zeros for the ``blank`` items."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    x[list(blank)] = 0.0
    return TensorDataset(x, torch.randn(n, generator=g))


class _Adam(pl.LightningModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


# ---------------------------------------------------------------------------- softmax over masked rows


class AttentionClassifier(_Adam):
    """Token embeddings, one attention layer over a key-padding mask, mean pooling, a classifier head."""

    def __init__(self, kind: str = "mha") -> None:
        super().__init__()
        if kind not in ATTENTION_KINDS:
            raise ValueError(f"kind must be one of {ATTENTION_KINDS}, got {kind!r}")
        self.kind = kind
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.attn: nn.Module
        if kind in ("mha", "mha_no_weights"):
            self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        elif kind == "encoder_layer":
            self.attn = nn.TransformerEncoderLayer(WIDTH, 2, 16, dropout=0.0, batch_first=True)
        else:
            self.attn = nn.Linear(WIDTH, WIDTH)  # the query projection
        self.head = nn.Linear(WIDTH, CLASSES)

    def attend(self, h: Tensor, pad: Tensor) -> Tensor:
        if self.kind == "mha":
            out, _ = self.attn(h, h, h, key_padding_mask=pad)  # ORIGIN: mha
        elif self.kind == "mha_no_weights":
            out, _ = self.attn(h, h, h, key_padding_mask=pad, need_weights=False)
        elif self.kind == "masked_softmax":
            scores = self.attn(h) @ h.transpose(1, 2) / math.sqrt(WIDTH)
            weights = scores.masked_fill(pad[:, None, :], -math.inf).softmax(-1)  # ORIGIN: masked_softmax
            out = weights @ h
        elif self.kind == "sdpa":
            out = F.scaled_dot_product_attention(self.attn(h), h, h, attn_mask=~pad[:, None, :])
        else:
            out = self.attn(h, src_key_padding_mask=pad)
        return out

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        ids, pad, labels, scale = batch
        pooled = self.attend(self.embed(ids), pad).mean(1)
        loss = F.cross_entropy(self.head(pooled), labels)
        spread = (scale * (1 + pooled.pow(2).sum(-1))).sqrt()  # ORIGIN: scaled_root
        return loss + 1e-3 * spread.mean()


# ---------------------------------------------------------------------------- NaN made of infinities


class LogSumExpPool(_Adam):
    """Log-sum-exp of per-token scores over the valid tokens, written by hand (max subtracted first)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.score = nn.Linear(WIDTH, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        ids, pad, labels, _ = batch
        scores = self.score(self.embed(ids)).squeeze(-1).masked_fill(pad, -math.inf)
        top = scores.amax(-1, keepdim=True)
        pooled = top.squeeze(-1) + (scores - top).exp().sum(-1).log()  # ORIGIN: inf_minus_inf
        return F.mse_loss(pooled, labels.float())


class PaddedDistance(_Adam):
    """Squared distances of tokens to a learned centre; padding set to ``+inf`` (never the nearest)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.centre = nn.Parameter(torch.zeros(WIDTH))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        ids, pad, _, _ = batch
        dist = (self.embed(ids) - self.centre).pow(2).sum(-1).masked_fill(pad, math.inf)
        nearest = dist.amin(-1)
        kept = (~pad).float()
        mean = (kept * dist).sum(-1) / kept.sum(-1)  # ORIGIN: zero_times_inf
        return (mean - nearest).mean()


# ---------------------------------------------------------------------------- custom autograd Functions


class SafeSqrt(torch.autograd.Function):
    """``sqrt`` with a hand-written backward ``1 / (2 sqrt(x))``: infinite at 0."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        root = x.sqrt()
        ctx.save_for_backward(root)
        return root

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (root,) = ctx.saved_tensors
        return grad / (2 * root)


class ClippedLog(torch.autograd.Function):
    """``log`` as a custom Function: ``-inf`` at 0 in its forward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x.log()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return grad / x


FUNCTION_KINDS = ("backward", "forward", "thirdparty", "thirdparty_wrapper")


class CustomFunctionModule(_Adam):
    """A bias-free projection, a custom Function on it, then ``torch.cat`` (the op blamed before issue 18).

    A blank input makes the projection exactly zero, where the Function fails: ``"backward"``
    (:class:`SafeSqrt`, infinite derivative), ``"forward"`` (:class:`ClippedLog`, ``-inf``),
    ``"thirdparty"`` (``thirdparty_ops.RootMeanSquare.apply`` called here) or
    ``"thirdparty_wrapper"`` (through the package's own wrapper ``thirdparty_ops.rms``).
    """

    def __init__(self, kind: str = "backward") -> None:
        super().__init__()
        if kind not in FUNCTION_KINDS:
            raise ValueError(f"kind must be one of {FUNCTION_KINDS}, got {kind!r}")
        self.kind = kind
        self.proj = nn.Linear(4, 4, bias=False)
        self.head = nn.Linear(5, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        h = self.proj(x)
        energy = h.pow(2).sum(-1)
        if self.kind == "backward":
            feature = SafeSqrt.apply(energy)  # ORIGIN: custom_backward
        elif self.kind == "forward":
            feature = ClippedLog.apply(energy)  # ORIGIN: custom_forward
        elif self.kind == "thirdparty":
            feature = thirdparty_ops.RootMeanSquare.apply(h)  # ORIGIN: thirdparty_function
        else:
            feature = thirdparty_ops.rms(h)  # ORIGIN: thirdparty_wrapper
        features = torch.cat([feature[:, None], h], -1)
        return F.mse_loss(self.head(features).squeeze(-1), y)


# ---------------------------------------------------------------------------- the sweep


class Block(nn.Module):
    """``h + |h|`` with ``|h| = sqrt(sum h**2)``: infinite derivative for an all-zero row."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x)
        return h + (h * h).sum(-1, keepdim=True).sqrt()  # ORIGIN: checkpointed_sqrt


class CheckpointedBlocks(_Adam):
    """A projection, a :class:`Block` under activation checkpointing, a head."""

    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.pre = nn.Linear(4, 4, bias=False)
        self.block = Block()
        self.head = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        h = checkpoint(self.block, self.pre(x), use_reentrant=self.reentrant)  # ORIGIN: checkpoint_call
        return F.mse_loss(self.head(h).squeeze(-1), y)


def ctc_data(n: int, unalignable: Sequence[int], seed: int = 0) -> TensorDataset:
    """``(features, targets, target_lengths)``: 6 frames per input, targets of 3 labels (10 when unalignable)."""
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(n, 6, 4, generator=g)
    targets = torch.randint(1, 5, (n, 10), generator=g)
    lengths = torch.full((n,), 3)
    lengths[list(unalignable)] = 10
    return TensorDataset(features, targets, lengths)


class CTCModule(_Adam):
    """Frame classifier trained with CTC; a target longer than its input has no alignment: infinite loss."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 5)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        features, targets, target_lengths = batch
        log_probs = self.lin(features).log_softmax(-1).transpose(0, 1)
        input_lengths = torch.full((features.shape[0],), features.shape[1], dtype=torch.long)
        return F.ctc_loss(log_probs, targets, input_lengths, target_lengths)  # ORIGIN: ctc


def distill_data(n: int, constrained: Sequence[int], seed: int = 0) -> TensorDataset:
    """``(x, allowed, teacher)``: the ``constrained`` items forbid class 5, and their teacher gives it no mass."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    allowed = torch.ones(n, 6, dtype=torch.bool)
    allowed[list(constrained), 5] = False
    teacher = torch.rand(n, 6, generator=g) + 0.1
    teacher[list(constrained), 5] = 0.0
    return TensorDataset(x, allowed, teacher / teacher.sum(-1, keepdim=True))


class DistillModule(_Adam):
    """Distillation with constrained classes: the student's forbidden logits are ``-inf`` before ``log_softmax``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, allowed, teacher = batch
        log_q = self.lin(x).masked_fill(~allowed, -math.inf).log_softmax(-1)
        return F.kl_div(log_q, teacher, reduction="batchmean")  # ORIGIN: kl_div


class WhereSqrtModule(_Adam):
    """``sqrt`` of a learned value, selected with ``torch.where`` only where it is positive."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        h = (x * self.w).sum(-1)
        root = torch.where(h > 0, h.sqrt(), torch.zeros_like(h))  # ORIGIN: where_sqrt
        return F.mse_loss(root, y)


# ---------------------------------------------------------------------------- ground truth, without the guard


def _finite(tensors: Sequence[Any]) -> bool:
    """Whether every floating-point tensor among ``tensors`` is finite (``None`` entries are skipped)."""
    return all(bool(torch.isfinite(t).all()) for t in tensors if isinstance(t, Tensor) and t.is_floating_point())


def bad_items(make: Callable[[], nn.Module], dataset: TensorDataset) -> list[int]:
    """Dataset items whose loss or gradients are non-finite on their own, on a fresh model (plain PyTorch)."""
    bad = []
    for index in range(len(dataset)):
        module = make()
        sample = [t[index : index + 1] for t in dataset.tensors]
        loss = module.training_step(sample, 0)  # type: ignore[operator]
        loss.backward()  # a fresh model: .grad is its own (and reentrant checkpointing refuses autograd.grad)
        if not _finite([loss, *(p.grad for p in module.parameters() if p.grad is not None)]):
            bad.append(index)
    return bad


def first_module_birth(module: nn.Module, run: Callable[[], Any]) -> str | None:
    """The first submodule (in the order they finish) whose output is non-finite while its inputs hold no NaN."""
    found: list[str] = []

    def hook(name: str) -> Callable[..., None]:
        def record(_: nn.Module, args: Any, output: Any) -> None:
            outputs = output if isinstance(output, tuple) else (output,)
            inputs = [a for a in args if isinstance(a, Tensor) and a.is_floating_point()]
            if not _finite(list(outputs)) and all(not bool(torch.isnan(a).any()) for a in inputs):
                found.append(name)

        return record

    handles = [child.register_forward_hook(hook(name)) for name, child in module.named_modules() if name]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return found[0] if found else None


def first_backward_birth(loss: Tensor) -> str | None:
    """The first autograd node, in the engine's order, turning finite incoming gradients into NaN/Inf."""
    order: list[tuple[str, bool, bool]] = []
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        node.register_hook(
            lambda grad_in, grad_out, node=node: order.append((node.name(), _finite(grad_out), _finite(grad_in)))
        )
        stack.extend(fn for fn, _ in node.next_functions)
    loss.backward()
    return next((name for name, ok_out, ok_in in order if ok_out and not ok_in), None)
