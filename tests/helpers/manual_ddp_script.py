"""The manual-optimisation loops of ``manual_loops.py`` on 2 CPU processes (gloo), a fault on rank 1 only.

Usage: ``launcher.launch("manual_ddp_script.py", LOOP, OUT_DIR, nprocs=2, ...)``, ``LOOP`` one of
``LOOPS`` (``dcgan``, ``wgan``, ``reinforce``); run by ``integration/test_manual_optimization_ddp.py``.

Each rank fits the loop twice in the same process group (``strategy="ddp_find_unused_parameters_true"``:
each backward reaches one network only; Lightning's own ``DistributedSampler``, shuffled with seed 0:
:func:`planted` picks the index that lands in a chosen batch of rank 1):

1. ``reference``: no guard, the bad step dropped by hand (``drop_by_hand=True``). DDP averages the
   gradients, so both ranks see the NaN/Inf and drop the same step;
2. ``guarded``: ``NanGuard`` with the loop's way of recomputing a loss (``loss_fn`` or the module's
   ``nanguard_loss``), every ``opt.step()`` called.

Each rank writes ``rank<N>.json``: per run, a SHA-256 of every parameter, buffer and optimizer-state
tensor (by name), whether the parameters are finite, the hand-dropped steps, and for the guarded run
its events, counters and the error it stopped with, if any.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from manual_loops import (
    BATCH,
    DCGAN,
    WGANGP,
    NamedReinforce,
    Reinforce,
    dcgan_data,
    dcgan_loss_fn,
    loader,
    reinforce_data,
    wgan_data,
    wgan_loss_fn,
)
from process_group import finish_script, leave_process_group_at_exit
from torch.utils.data import DistributedSampler, TensorDataset

from lightning_nanguard import NanGuard, NonFiniteTrainingError

leave_process_group_at_exit()


@dataclass(frozen=True)
class Loop:
    """A loop, its data with the planted record on rank 1, and how the guard recomputes its loss."""

    reference: Callable[[], pl.LightningModule]  # drops by hand
    guarded: Callable[[], pl.LightningModule]
    data: Callable[[], TensorDataset]
    loss_fn: Callable[..., torch.Tensor] | None


BAD_RANK = 1


def planted(n: int, batch: int, rank: int = BAD_RANK, position: int = 1) -> int:
    """The dataset index Lightning's training sampler puts at ``position`` of ``rank``'s batch ``batch``.

    Lightning injects ``DistributedSampler(dataset, shuffle=True, seed=0)`` for a training loader
    (epoch 0 here): the permutation is fixed, so the index is known before the run.
    """
    sampler: DistributedSampler[int] = DistributedSampler(range(n), num_replicas=2, rank=rank, shuffle=True, seed=0)  # type: ignore[arg-type]
    order = list(sampler)
    return order[BATCH * batch + position]


# The planted record sits in rank 1's batch 2 (DCGAN, REINFORCE) or 4 (WGAN-GP: a generator batch too).
PLANTED = {"dcgan": planted(48, 2), "wgan": planted(80, 4), "reinforce": planted(48, 2)}
LOOPS: dict[str, Loop] = {
    "dcgan": Loop(
        lambda: DCGAN(drop_by_hand=True), DCGAN, lambda: dcgan_data(n=48, bad=(PLANTED["dcgan"],)), dcgan_loss_fn
    ),
    "wgan": Loop(
        lambda: WGANGP(drop_by_hand=True), WGANGP, lambda: wgan_data(n=80, bad=(PLANTED["wgan"],)), wgan_loss_fn
    ),
    "reinforce": Loop(
        lambda: Reinforce(drop_by_hand=True),
        NamedReinforce,
        lambda: reinforce_data(n=48, bad=(PLANTED["reinforce"],)),
        None,
    ),
}


def _hashes(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, str]:
    """SHA-256 of every parameter, buffer and optimizer-state tensor, by name."""
    found = {}
    for kind, named in (("param", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, tensor in named:
            found[f"{kind}:{name}"] = _sha(tensor)
    for i, opt in enumerate(trainer.optimizers):
        for key, state in opt.state_dict()["state"].items():
            for field, value in state.items():
                found[f"optimizer{i}:{key}:{field}"] = _sha(torch.as_tensor(value))
    return found


def _sha(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().cpu().numpy().tobytes()).hexdigest()


def _trainer(guard: NanGuard | None, out_dir: str) -> pl.Trainer:
    return pl.Trainer(
        strategy="ddp_find_unused_parameters_true",
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=out_dir,
        callbacks=[guard] if guard is not None else [],
    )


def main(name: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # tiny models: intra-op threads only oversubscribe the 2 processes
    loop = LOOPS[name]
    result: dict[str, Any] = {"loop": name, "planted": PLANTED[name]}
    reference = loop.reference()
    trainer = _trainer(None, out_dir)
    trainer.fit(reference, loader(loop.data()))
    result["rank"] = trainer.global_rank
    result["reference"] = {
        "hashes": _hashes(trainer, reference),
        "dropped_by_hand": reference.dropped_by_hand,
        "finite": all(bool(torch.isfinite(p).all()) for p in reference.parameters()),
    }
    guard = NanGuard(verbose=False, save_repro=False, loss_fn=loop.loss_fn)
    guarded = loop.guarded()
    error = None
    trainer = _trainer(guard, out_dir)
    try:
        trainer.fit(guarded, loader(loop.data()))
    except NonFiniteTrainingError as caught:
        error = f"{type(caught).__name__}: {caught}"
    result["guarded"] = {
        "hashes": _hashes(trainer, guarded),
        "finite": all(bool(torch.isfinite(p).all()) for p in guarded.parameters()),
        "events": [event.to_dict() for event in guard.events],
        "event_optimizers": [getattr(event, "optimizer", "no `optimizer` field") for event in guard.events],
        "skipped_total": guard.skipped_total,
        "error": error,
    }
    with open(os.path.join(out_dir, f"rank{result['rank']}.json"), "w", encoding="utf-8") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    finish_script()
