"""A causal self-attention block for the attention-probe tests: a hand-written softmax, or SDPA.

Example:
    >>> block = CausalSelfAttention(sdpa=True, dim=8, heads=2)
    >>> block(torch.randn(2, 5, 8)).shape
    torch.Size([2, 5, 8])
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class CausalSelfAttention(nn.Module):
    """Causal self-attention over ``(batch, tokens, dim)``; ``residual`` adds its input to its output."""

    def __init__(self, sdpa: bool, dim: int = 8, heads: int = 2, residual: bool = False) -> None:
        super().__init__()
        self.sdpa, self.heads, self.residual = sdpa, heads, residual
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            logits = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            y = torch.softmax(logits.masked_fill(~causal, -math.inf), dim=-1) @ v
        out = y.transpose(1, 2).reshape(b, t, d)
        return x + out if self.residual else out
