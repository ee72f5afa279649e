"""Benchmark models, each with pinned shapes, batch size and input size.

- ``conv+BN``: three conv blocks with BatchNorm (0.4M parameters, 11 tensors) on 32x32 images,
  batch 32: few large tensors.
- ``ResNet-18``: torchvision's ResNet-18 layout rebuilt here (11.2M parameters, 62 tensors, 20
  BatchNorm layers) on 32x32 images, batch 16: the parameter-heavy, compute-light worst case.
- ``GPT-2-small-shaped``: a GPT-2 stack (pre-LayerNorm blocks, fused QKV projection, GELU MLP,
  learned positions, tied LM head) with GPT-2-small's depth and tensor layout (12 layers, 148
  tensors) at width 256 (10.6M parameters), 4 sequences of 64 tokens, next-token loss.
- ``transformer (2 layers)``: torch's ``TransformerEncoder``, 2 layers of width 128 (0.4M parameters,
  27 tensors), 16 sequences of 64 tokens.
- ``1,500 small tensors``: 750 residual ``Linear(8, 8)`` layers (1,504 tensors, 54k parameters),
  batch 32: per-tensor overhead dominates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset


class _Classifier(LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class _LanguageModel(_Classifier):
    """Next-token prediction: the batch is ``(tokens,)``; targets are the tokens shifted by one."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:  # type: ignore[override]
        tokens = batch[0]
        logits = self.net(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def conv_net() -> nn.Module:
    """Few large tensors: three conv blocks with BatchNorm (0.4M parameters, 11 tensors)."""

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2)]

    return nn.Sequential(*block(3, 64), *block(64, 128), *block(128, 256), nn.Flatten(), nn.Linear(256 * 16, 10))


class _BasicBlock(nn.Module):
    """torchvision's ``BasicBlock``: two 3x3 convs with BatchNorm and an identity (or 1x1) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.downsample(x))


class ResNet18(nn.Module):
    """ResNet-18 (torchvision layout: 7x7 stem, max-pool, 4 stages of 2 basic blocks) with 10 classes.

    11.18M parameters in 62 tensors, 60 BatchNorm buffers. On 32x32 inputs the stages run at
    8, 4, 2 and 1 pixels: few FLOPs per parameter, so per-step fixed costs weigh the most.
    """

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        stages: list[nn.Module] = []
        cin = 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            stages += [_BasicBlock(cin, cout, stride), _BasicBlock(cout, cout, 1)]
            cin = cout
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.stages(self.stem(x)).mean(dim=(2, 3)))


@dataclass(frozen=True)
class GPT2Shape:
    """Sizes of the GPT-2-style stack (GPT-2 small: 12 layers, width 768, 12 heads, vocab 50257)."""

    layers: int = 12
    width: int = 256
    heads: int = 4
    vocab: int = 4096
    context: int = 64


class _GPT2Block(nn.Module):
    """Pre-LayerNorm block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``, as in GPT-2."""

    def __init__(self, shape: GPT2Shape) -> None:
        super().__init__()
        self.heads = shape.heads
        self.ln_1 = nn.LayerNorm(shape.width)
        self.c_attn = nn.Linear(shape.width, 3 * shape.width)
        self.attn_proj = nn.Linear(shape.width, shape.width)
        self.ln_2 = nn.LayerNorm(shape.width)
        self.c_fc = nn.Linear(shape.width, 4 * shape.width)
        self.mlp_proj = nn.Linear(4 * shape.width, shape.width)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp_proj(nn.functional.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    """GPT-2 language model: token and position embeddings, blocks, final LayerNorm, tied LM head.

    With the default :class:`GPT2Shape`: 148 parameter tensors (12 per block + 4), 10.6M parameters.
    """

    def __init__(self, shape: GPT2Shape | None = None) -> None:
        super().__init__()
        shape = shape or GPT2Shape()
        self.wte = nn.Embedding(shape.vocab, shape.width)
        self.wpe = nn.Embedding(shape.context, shape.width)
        self.blocks = nn.ModuleList(_GPT2Block(shape) for _ in range(shape.layers))
        self.ln_f = nn.LayerNorm(shape.width)
        for name, param in self.named_parameters():  # GPT-2's initialisation
            if name.endswith("weight") and param.dim() == 2:
                std = 0.02 / math.sqrt(2 * shape.layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(param, std=std)
            elif name.endswith("bias") and "ln" not in name:
                nn.init.zeros_(param)

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()


class _Transformer(nn.Module):
    def __init__(self, vocab: int = 256, width: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, 10)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


class _ManySmall(nn.Module):
    """750 residual Linear(8, 8) layers: 1,500 small parameter tensors."""

    def __init__(self, depth: int = 750, width: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = h + 0.01 * torch.tanh(layer(h))
        return self.head(h)


def _images(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))


def _tokens(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, 256, (n, 64), generator=g), torch.randint(0, 10, (n,), generator=g))


def _text(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    shape = GPT2Shape()
    return TensorDataset(torch.randint(0, shape.vocab, (n, shape.context + 1), generator=g))


def _vectors(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 10, (n,), generator=g))


@dataclass(frozen=True)
class BenchModel:
    """One benchmark model: its network, data, batch size and training wrapper."""

    build_net: Callable[[], nn.Module]
    build_data: Callable[[int], TensorDataset]
    batch_size: int
    wrapper: type[_Classifier] = _Classifier


MODELS: dict[str, BenchModel] = {
    "conv+BN (few large tensors)": BenchModel(conv_net, _images, 32),
    "ResNet-18 (32x32, batch 16)": BenchModel(ResNet18, _images, 16),
    "GPT-2-small-shaped (12x256, 4x64 tokens)": BenchModel(GPT2, _text, 4, _LanguageModel),
    "transformer (2 layers)": BenchModel(_Transformer, _tokens, 16),
    "1,500 small tensors": BenchModel(_ManySmall, _vectors, 32),
}


def make(name: str, seed: int = 0, batches: int = 8) -> tuple[LightningModule, DataLoader]:
    """A fresh LightningModule (same initial weights for the same seed) and a loader of ``batches`` batches."""
    spec = MODELS[name]
    torch.manual_seed(seed)
    data = spec.build_data(spec.batch_size * batches)
    return spec.wrapper(spec.build_net()), DataLoader(data, batch_size=spec.batch_size, shuffle=False)


def benchmark_trainer(
    root: str, max_steps: int, callbacks: list[Callback], accelerator: str = "cpu", **kwargs: Any
) -> Trainer:
    """The Trainer every benchmark run uses: CPU (unless told), one device, a real ``CSVLogger`` (so
    NanGuard logs every ``log_every_n_steps``, Lightning's default 50), nothing else that costs time per step."""
    return Trainer(
        max_steps=max_steps,
        callbacks=callbacks,
        logger=CSVLogger(root),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        accelerator=accelerator,
        devices=1,
        **kwargs,
    )
