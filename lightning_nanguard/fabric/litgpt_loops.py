"""LitGPT's training loops recognised: the loss a recipe computes, so the guard can re-run a step.

LitGPT's recipes build their own ``Fabric`` and loop; with ``NANGUARD=1`` the guard joins them
(:mod:`lightning_nanguard.entry_points`) without a ``loss_fn``. When the model set up is a LitGPT
``GPT`` (``litgpt.model.GPT`` or a subclass: LoRA, adapter), :func:`litgpt_loss_fn` stands in for it,
computing the loss the recipes compute from the two batch forms they use:

- fine-tuning (``litgpt/finetune/full.py``, ``lora.py``, ``adapter.py``, ``adapter_v2.py``): a dict
  with ``input_ids`` and ``labels``, loss ``chunked_cross_entropy(model(input_ids)[..., :-1, :],
  labels[..., 1:])``;
- pre-training (``litgpt/pretrain.py``): a tensor of token ids ``max_seq_length + 1`` wide, input
  ``batch[:, :L]``, targets ``batch[:, 1:L + 1]`` with ``L = model.max_seq_length``.

Tested with LitGPT 0.5.13. Any other batch raises a ``TypeError`` that names what was expected (the
event then says so); pass ``NanGuard(loss_fn=...)`` for a loop of your own.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_nanguard.fabric.frontend import LossFn

__all__ = ["is_litgpt_model", "litgpt_loss_fn"]


def is_litgpt_model(module: nn.Module) -> bool:
    """Whether ``module`` is a LitGPT ``GPT`` (only if LitGPT is imported: never imports it)."""
    litgpt_model = sys.modules.get("litgpt.model")
    gpt = getattr(litgpt_model, "GPT", None)
    return isinstance(gpt, type) and isinstance(module, gpt)


def litgpt_loss_fn(module: nn.Module) -> LossFn | None:
    """The recipes' loss as a ``loss_fn(model, batch)`` when ``module`` is a LitGPT ``GPT``, else ``None``."""
    if not is_litgpt_model(module):
        return None
    from litgpt.utils import chunked_cross_entropy

    def litgpt_loss(model: Any, batch: Any) -> torch.Tensor:
        if isinstance(batch, Mapping) and "input_ids" in batch and "labels" in batch:
            logits = model(batch["input_ids"])
            return chunked_cross_entropy(logits[..., :-1, :], batch["labels"][..., 1:])
        if isinstance(batch, torch.Tensor) and batch.ndim == 2 and not batch.is_floating_point():
            length = int(model.max_seq_length)
            inputs = batch[:, :length].contiguous().long()
            targets = batch[:, 1 : length + 1].contiguous().long()
            return chunked_cross_entropy(model(inputs), targets)
        raise TypeError(
            "NanGuard recognises LitGPT's fine-tuning batches (a dict with 'input_ids' and 'labels') and "
            f"pre-training batches (a 2-D tensor of token ids), not {type(batch).__name__}; "
            "pass NanGuard(loss_fn=...) for this loop"
        )

    return litgpt_loss
