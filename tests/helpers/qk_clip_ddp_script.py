"""QK-clip under DDP on two CPU processes (gloo): both ranks rescale by the max over ranks, so the weights stay equal.

Each rank trains the same ``nn.MultiheadAttention`` model on its own data; rank 1's inputs are 4x
larger, so its attention logits are far larger than rank 0's. With ``NanGuard(qk_clip=CAP,
precursor_every_n_steps=1)`` and SGD at learning rate 0 (the update itself changes nothing) every
step's clip is the only change to the weights. Each rank writes ``rank<N>.json``: the hash of its
weights, the max logit per head over each rank's batches and of each batch, measured with the final
weights, and the guard's warnings about the precursor watch's cost (``precursor_max_cost`` keeps its
default: with enough steps the cost limit would widen the sampling interval, each rank by its own timing).

Usage: ``python qk_clip_ddp_script.py OUT_DIR [STEPS] [FAULT]`` under :func:`launcher.launch` (two ranks; 4
steps by default). ``FAULT=precursors``: rank 1's precursor watch fails at step 2 (its QK-clip goes with it, so
rank 0 must stop joining QK-clip's collective at that very step).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from fitting import build_trainer
from process_group import finish_script
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_nanguard import NanGuard
from lightning_nanguard.detect.attention import AttentionProbe
from lightning_nanguard.detect.precursors import PrecursorSettings

CAP = 3.0
STEPS = 4


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


def batches(rank: int, steps: int = STEPS) -> list[Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(2, 5, 8, generator=generator) * (4.0 if rank == 1 else 1.0) for _ in range(steps)]


class Attending(pl.LightningModule):
    def __init__(self, steps: int = STEPS) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(SelfAttention())
        self.steps = steps

    def train_dataloader(self) -> DataLoader:
        return DataLoader(batches(self.global_rank, self.steps), batch_size=None)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self.model(batch).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def head_max(model: nn.Module, x: Tensor) -> list[float]:
    probe = AttentionProbe(model, rows=PrecursorSettings().rows, queries=x.size(1), per_head=True)  # the guard's rows
    with torch.enable_grad(), probe.measuring():
        model(x)
    values = probe.take()["0.attn"].head_max
    assert values is not None
    return values.tolist()


class Warnings(logging.Handler):
    """The guard's warnings (the ``lightning_nanguard`` logger)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def break_rank_1_precursors_at_step_2() -> None:
    """Rank 1's precursor watch raises when step 2 begins (an optional part failing on one rank only)."""
    from lightning_nanguard.engine.step.precursors import PrecursorWatch

    original = PrecursorWatch.arm

    def arm(watch: PrecursorWatch, step: int) -> None:
        if torch.distributed.get_rank() == 1 and step == 2:
            raise RuntimeError("planted fault in rank 1's precursor watch")
        original(watch, step)

    PrecursorWatch.arm = arm  # type: ignore[method-assign]


def main(out_dir: str, steps: int = STEPS, fault: str | None = None) -> None:
    if fault == "precursors":
        break_rank_1_precursors_at_step_2()
    module = Attending(steps)
    guard = NanGuard(verbose=False, save_repro=False, qk_clip=CAP, precursor_every_n_steps=1)
    trainer = build_trainer(
        "lightning", out_dir, strategy="ddp", devices=2, use_distributed_sampler=False, callbacks=[guard]
    )
    warnings = Warnings()
    logging.getLogger("lightning_nanguard").addHandler(warnings)
    trainer.fit(module)
    weights = b"".join(p.detach().numpy().tobytes() for p in module.parameters())
    result = {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "weights_sha256": hashlib.sha256(weights).hexdigest(),
        "head_max_rank0": [max(h) for h in zip(*(head_max(module.model, x) for x in batches(0, steps)), strict=True)],
        "head_max_rank1": [max(h) for h in zip(*(head_max(module.model, x) for x in batches(1, steps)), strict=True)],
        "head_max_per_batch": [head_max(module.model, x) for rank in (0, 1) for x in batches(rank, steps)],
        "cost_warnings": [m for m in warnings.messages if "precursor_max_cost" in m],
        "events": [event.to_dict() for event in guard.events],
    }
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]), *sys.argv[3:4])
    finish_script()
