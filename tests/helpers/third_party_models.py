"""LightningModules around third-party models: Hugging Face ``transformers`` built from tiny configs.

Never ``from_pretrained`` (no download: ``HF_HUB_OFFLINE=1``). Every failing op written here
carries a trailing ``# ORIGIN: <name>`` comment (see ``models.origin_line``).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset
from transformers import (
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    ResNetConfig,
    ResNetForImageClassification,
    ViTConfig,
    ViTForImageClassification,
)

__all__ = [
    "BertClassifier",
    "DictDataset",
    "GPT2WithMaskedMean",
    "ImageClassifier",
    "documents",
    "tiny_resnet",
    "tiny_vit",
]

VOCAB = 64


class DictDataset(Dataset):
    """Items are dicts of the given tensors' rows (the default collate stacks them into a dict batch)."""

    def __init__(self, **tensors: Tensor) -> None:
        self.tensors = tensors
        self.size = len(next(iter(tensors.values())))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {name: t[index] for name, t in self.tensors.items()}


def documents(n: int, length: int, empty: tuple[int, ...] = (), seed: int = 0) -> DictDataset:
    """Token ids and an attention mask; documents at ``empty`` have no token at all (mask all 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, length), generator=g)
    lengths = torch.randint(2, length + 1, (n,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    mask[list(empty)] = 0
    return DictDataset(input_ids=ids, attention_mask=mask)


class GPT2WithMaskedMean(pl.LightningModule):
    """GPT-2's causal-LM loss plus a user's masked mean of the last hidden state over the attention mask.

    An empty document makes the masked mean 0/0 (the user's division): NaN in the real batch. A
    sub-batch of only empty documents also makes Hugging Face's LM loss NaN (the mean over zero
    tokens), which does not happen in the real batch (issue 9, item 2).
    """

    def __init__(self) -> None:
        super().__init__()
        config = GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0
        )
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        labels = ids.masked_fill(mask == 0, -100)
        out = self.model(input_ids=ids, attention_mask=mask, labels=labels, output_hidden_states=True)
        weights = mask.unsqueeze(-1).to(out.hidden_states[-1].dtype)
        pooled = (out.hidden_states[-1] * weights).sum(1) / weights.sum(1)  # ORIGIN: masked_mean
        return out.loss + 0.1 * pooled.pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class BertClassifier(nn.Module):
    """A tiny BERT with a classification head on the pooled output."""

    def __init__(self) -> None:
        super().__init__()
        config = BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
        )
        self.bert = BertModel(config)
        self.head = nn.Linear(32, 2)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        out = self.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return F.cross_entropy(self.head(out.pooler_output), batch["labels"])


def tiny_resnet() -> ResNetForImageClassification:
    """Hugging Face ResNet (conv + BatchNorm), two stages of 8 and 16 channels."""
    config = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    return ResNetForImageClassification(config)


def tiny_vit() -> ViTForImageClassification:
    """Hugging Face ViT on 16x16 images in 4x4 patches."""
    config = ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=3,
    )
    return ViTForImageClassification(config)


class ImageClassifier(pl.LightningModule):
    """A Hugging Face image classifier trained on ``{"pixel_values", "labels"}`` batches."""

    def __init__(self, kind: str = "resnet") -> None:
        super().__init__()
        self.model = tiny_resnet() if kind == "resnet" else tiny_vit()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        return self.model(pixel_values=batch["pixel_values"], labels=batch["labels"]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)
