"""DDP on two CPU processes (gloo), a sorting collate, a silent record on each rank; run by ``test_data_pipelines.py``.

Usage: ``python tests/helpers/pipeline_ddp_script.py SCENARIO OUTPUT_DIR`` (``SCENARIOS``: ``report``, one
epoch; ``quarantine``, two epochs with ``remedies=["quarantine"]``). Each rank reads its own part of
64 utterances through a :class:`~pipeline_models.LoggedDistributedSampler` (shuffled, seed 7); the
collate sorts every batch by length. The silent records are chosen before training from the
samplers' first pass: on rank 0 the first record of its batch 1, on rank 1 the first record of its
batch 2, each one the sort moves down. Each rank writes ``rank<N>.json``: the silent records, its
sampler's passes, the records of every row it trained on, its events, the steps whose update it
skipped, a hash of its final weights, its quarantine and the warnings it raised.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import pipeline_models as pp  # beside this script: sys.path[0]
import torch
from process_group import finish_script, leave_process_group_at_exit
from torch.utils.data import DataLoader

from lightning_nanguard import NanGuard

leave_process_group_at_exit()  # every process of the run, ddp_spawn's workers too (they import this file)

N, BATCH, SEED, WORLD = 64, 8, 7, 2
GUILTY_BATCH = {0: 1, 1: 2}  # the batch of each rank's own silent record
SCENARIOS: dict[str, dict[str, Any]] = {
    "report": {"epochs": 1, "guard": {}},
    "quarantine": {"epochs": 2, "guard": {"remedies": ["quarantine"]}},
}


def first_pass(rank: int) -> list[int]:
    """Rank ``rank``'s indices in epoch 0, as its ``DistributedSampler`` will yield them."""
    return [
        int(i) for i in pp.LoggedDistributedSampler(range(N), num_replicas=WORLD, rank=rank, shuffle=True, seed=SEED)
    ]


def choose_guilty() -> dict[int, int]:
    """Per rank: the first record of batch ``GUILTY_BATCH[rank]`` that the sort moves to a later row."""
    healthy = pp.Utterances(N)
    guilty = {}
    for rank, b in GUILTY_BATCH.items():
        indices = first_pass(rank)[b * BATCH : (b + 1) * BATCH]
        rows = [int(u) - pp.UID_BASE for u in pp.sort_by_length([healthy[i] for i in indices])["uid"]]
        guilty[rank] = next(i for p, i in enumerate(indices) if rows.index(i) != p)
    return guilty


class Module(pp.UtteranceClassifier):
    def __init__(self, data: pp.Utterances) -> None:
        torch.manual_seed(0)  # identical initial weights on every rank
        super().__init__()
        self.data = data
        self.sampler: pp.LoggedDistributedSampler | None = None

    def train_dataloader(self) -> DataLoader:
        rank = self.trainer.global_rank
        self.sampler = pp.LoggedDistributedSampler(self.data, num_replicas=WORLD, rank=rank, shuffle=True, seed=SEED)
        return DataLoader(self.data, batch_size=BATCH, sampler=self.sampler, collate_fn=pp.sort_by_length)


class SkipLog(pl.Callback):
    """Global steps whose update left every parameter bitwise unchanged."""

    def __init__(self) -> None:
        self.skipped: list[int] = []
        self._before: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._before = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if all(torch.equal(a, p) for a, p in zip(self._before, pl_module.parameters(), strict=True)):
            self.skipped.append(trainer.global_step - 1)


def main(name: str, out_dir: str) -> None:
    scenario = SCENARIOS[name]
    guilty = choose_guilty()
    data = pp.Utterances(N, silent=tuple(guilty.values()))
    guard = NanGuard(verbose=False, save_repro=False, **scenario["guard"])
    seen, skips = pp.SeenRecords(), SkipLog()
    trainer = pl.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=WORLD,
        max_epochs=scenario["epochs"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # the module's own (logged) DistributedSampler
        num_sanity_val_steps=0,
        default_root_dir=out_dir,
        callbacks=[guard, seen, skips],
    )
    module = Module(data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    weights = b"".join(p.detach().cpu().numpy().tobytes() for p in module.parameters())
    result = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "guilty": {str(rank): index for rank, index in guilty.items()},
        "passes": module.sampler.passes if module.sampler is not None else [],
        "seen": [[s.epoch, s.batch_idx, s.global_step, [list(row) for row in s.rows]] for s in seen],
        "events": [event.to_dict() for event in guard.events],
        "skipped_steps": skips.skipped,
        "weights_sha256": hashlib.sha256(weights).hexdigest(),
        "finite": all(bool(torch.isfinite(p).all()) for p in module.parameters()),
        "active": guard.active,
        "quarantined": sorted(guard.remedy_book.quarantined),
        "warnings": [str(w.message) for w in caught],
    }
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    finish_script()
