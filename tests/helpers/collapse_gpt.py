"""The attention-collapse task and its tiny GPTs, in plain torch: the one copy the tests and the studies share.

The precursor rule's defaults were calibrated on these runs (``python -m studies.attention_collapse``);
the tests train the same runs through a real ``Trainer`` (``collapse_models.py``). The tests import
this module by name (``tests/helpers`` is on pytest's path), the studies as
``tests.helpers.collapse_gpt``: it imports no other helper, so both work.

- The task: vocabulary 64, sequences of 32 tokens whose first 16 follow a fixed random bigram chain
  and whose last 16 repeat them (:func:`transition_matrix`, :func:`make_batch`); a seed fixes the batches.
- :class:`RunConfig`, one run, and :func:`lr_at`, its warm-up/cosine schedule.
- :class:`TinyGPT`, a pre-LN GPT whose :class:`Attention` (hand-written or SDPA, QK-norm optional)
  measures on the side, every forward, the max logit, mean entropy and min-entropy bound of its
  causal attention (:func:`attention_signals`, float64, detached).
- :func:`gpt2`, a tiny Hugging Face ``GPT2LMHeadModel`` for the same task, and :class:`SideMeasurement`,
  the same signals read from its ``c_attn`` outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "TASK_SEED",
    "VOCAB",
    "Attention",
    "Block",
    "RunConfig",
    "SideMeasurement",
    "TinyGPT",
    "attention_signals",
    "causal_logits",
    "gpt2",
    "gpt2_signals",
    "lr_at",
    "make_batch",
    "transition_matrix",
]

VOCAB = 64
TASK_SEED = 0


@dataclass(frozen=True)
class RunConfig:
    """One training run: attention implementation, QK-norm, peak learning rate, seed, sizes and schedule."""

    attention: str
    qk_norm: bool
    lr: float
    seed: int
    steps: int = 300
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 32
    batch_size: int = 32
    warmup: int = 30
    final_lr_ratio: float = 0.1
    weight_decay: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.attention}/qk{'on' if self.qk_norm else 'off'}/lr{self.lr:g}/s{self.seed}"


# --------------------------------------------------------------------------------------------------
# Task and schedule
# --------------------------------------------------------------------------------------------------


def transition_matrix() -> Tensor:
    """The fixed bigram chain of the task (the same for every run)."""
    gen = torch.Generator().manual_seed(TASK_SEED)
    return torch.softmax(3.0 * torch.randn(VOCAB, VOCAB, generator=gen), dim=-1)


def make_batch(chain: Tensor, gen: torch.Generator, batch_size: int, seq_len: int) -> tuple[Tensor, Tensor]:
    """Inputs and next-token targets: a Markov first half, then a copy of it (period ``seq_len // 2``)."""
    half = seq_len // 2
    tokens = torch.empty(batch_size, half, dtype=torch.long)
    tokens[:, 0] = torch.randint(VOCAB, (batch_size,), generator=gen)
    for t in range(1, half):
        tokens[:, t] = torch.multinomial(chain[tokens[:, t - 1]], 1, generator=gen).squeeze(1)
    reps = (seq_len + 1 + half - 1) // half
    seq = tokens.repeat(1, reps)[:, : seq_len + 1]
    return seq[:, :-1], seq[:, 1:]


def lr_at(config: RunConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to ``final_lr_ratio`` of the peak."""
    warm = min(1.0, (step + 1) / config.warmup) if config.warmup else 1.0
    progress = max(0, step - config.warmup) / max(1, config.steps - 1 - config.warmup)
    decay = config.final_lr_ratio + (1 - config.final_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return config.lr * warm * decay


# --------------------------------------------------------------------------------------------------
# The side measurement of attention
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def causal_logits(q: Tensor, k: Tensor, scale: float | None = None) -> Tensor:
    """Float64 pre-softmax logits ``q.k * scale`` (default ``1/sqrt(head_dim)``) of (B, H, T, D) q and k, masked.

    The positions a query may not attend to (later keys) are ``-inf``.
    """
    length, dim = q.shape[-2], q.shape[-1]
    logits = q.detach().double() @ k.detach().double().transpose(-2, -1)
    logits = logits / math.sqrt(dim) if scale is None else logits * scale
    allowed = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    return logits.masked_fill(~allowed, float("-inf"))


@torch.no_grad()
def _signals(logits: Tensor) -> tuple[Tensor, float, float, float]:
    """Row maxima, and the max logit, mean entropy and mean min-entropy bound of masked causal ``logits``."""
    length = logits.shape[-1]
    allowed = torch.ones(length, length, dtype=torch.bool, device=logits.device).tril()
    row_max = logits.amax(dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - lse.unsqueeze(-1))
    entropy = lse - (probs * logits.masked_fill(~allowed, 0.0)).sum(dim=-1)
    return row_max, float(row_max.max()), float(entropy.mean()), float((lse - row_max).mean())


@torch.no_grad()
def attention_signals(q: Tensor, k: Tensor) -> tuple[float, float, float]:
    """Max logit, mean entropy, mean min-entropy bound of causal attention, from q and k (B, H, T, D).

    The max is over batch, heads and unmasked positions; the entropy (nats) per query row, averaged
    over batch, heads and rows (row 0 has one key, entropy 0); the min-entropy bound is
    ``logsumexp - max`` per row (``-log`` of the largest attention weight), averaged the same way.
    """
    _, max_logit, entropy, min_entropy = _signals(causal_logits(q, k))
    return max_logit, entropy, min_entropy


# --------------------------------------------------------------------------------------------------
# The tiny pre-LN GPT
# --------------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Causal multi-head self-attention, hand-written or through SDPA, optionally with QK-LayerNorm.

    Every forward (while ``measure``) keeps :func:`attention_signals` of its q and k in ``last``.
    """

    def __init__(self, d_model: int, n_heads: int, qk_norm: bool, implementation: str) -> None:
        super().__init__()
        if implementation not in ("manual", "sdpa"):
            raise ValueError(implementation)
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.q_norm: nn.Module = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm: nn.Module = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.implementation = implementation
        self.measure = True
        self.last: tuple[float, float, float] | None = None

    def nanguard_qk_projections(self) -> tuple[list[Tensor], list[Tensor]]:
        """The query and key rows of the fused ``qkv`` projection (NanGuard's QK-clip rescales them)."""
        width = self.n_heads * self.head_dim
        weight, bias = self.qkv.weight, self.qkv.bias
        return [weight[:width], bias[:width]], [weight[width : 2 * width], bias[width : 2 * width]]

    def forward(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.measure:
            self.last = attention_signals(q, k)
        if self.implementation == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            mask = torch.full((length, length), float("-inf"), device=x.device).triu(1)
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim) + mask
            y = torch.softmax(scores, dim=-1) @ v
        return self.out(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    """Pre-LN transformer block."""

    def __init__(self, d_model: int, n_heads: int, qk_norm: bool, implementation: str) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_heads, qk_norm, implementation)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token + position embeddings, pre-LN blocks (attention modules ``blocks.{i}.attn``), final LN, linear head."""

    def __init__(self, config: RunConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, config.d_model)
        self.pos = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(
            Block(config.d_model, config.n_heads, config.qk_norm, config.attention) for _ in range(config.n_layers)
        )
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, VOCAB, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        h = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


# --------------------------------------------------------------------------------------------------
# A tiny Hugging Face GPT-2 on the same task
# --------------------------------------------------------------------------------------------------


def gpt2(config: RunConfig) -> nn.Module:
    """A tiny ``GPT2LMHeadModel`` (random init from ``config.seed``; dropout off, no cache).

    ``config.attention`` is its ``attn_implementation``: ``eager`` or ``sdpa``; its attention modules are
    ``transformer.h.{i}.attn``. Needs ``transformers`` (imported here, not at the module's import).
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=config.seq_len,
        n_embd=config.d_model,
        n_layer=config.n_layers,
        n_head=config.n_heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=None,
        eos_token_id=None,
    )
    hf_config._attn_implementation = config.attention  # "eager" or "sdpa"
    torch.manual_seed(config.seed)
    return GPT2LMHeadModel(hf_config)


@torch.no_grad()
def gpt2_signals(qkv: Tensor, split: int, head_dim: int, scaling: float) -> tuple[float, float, float, float]:
    """Max logit, mean entropy, mean min-entropy bound and batch row 0's max logit of GPT-2's causal attention.

    ``qkv`` is the output of its ``c_attn`` (queries, keys and values side by side, ``split`` wide each).
    """
    q, k, _ = qkv.detach().double().split(split, dim=2)
    batch, length, _ = q.shape
    q = q.view(batch, length, -1, head_dim).transpose(1, 2)
    k = k.view(batch, length, -1, head_dim).transpose(1, 2)
    row_max, max_logit, entropy, min_entropy = _signals(causal_logits(q, k, scaling))
    return max_logit, entropy, min_entropy, float(row_max[0].max())


class SideMeasurement:
    """Per step and per ``transformer.h.{i}.attn``: the attention signals from its ``c_attn`` output (q, k).

    Float64 under ``no_grad``, causal mask, scale ``attn.scaling`` (``1/sqrt(head_dim)`` for GPT-2):
    :func:`gpt2_signals` of the last forward with gradients, in ``last[prefix + name]``.
    """

    def __init__(self, model: nn.Module, prefix: str = "") -> None:
        self.last: dict[str, tuple[float, float, float, float]] = {}
        self.handles = []
        for name, module in model.named_modules():
            if type(module).__name__ == "GPT2Attention":
                hook = self._hook(prefix + name, module)
                self.handles.append(module.c_attn.register_forward_hook(hook))

    def _hook(self, name: str, attn: Any) -> Any:  # attn: a GPT2Attention
        def hook(module: nn.Module, args: Any, output: Tensor) -> None:
            if not torch.is_grad_enabled():
                return
            self.last[name] = gpt2_signals(output, int(attn.split_size), int(attn.head_dim), float(attn.scaling))

        return hook
