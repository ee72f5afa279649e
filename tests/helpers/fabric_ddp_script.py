"""A Fabric loop on 2 CPU processes (gloo) under ``NanGuard``: run by ``fabric/test_ddp.py``.

Usage: ``launcher.launch("fabric_ddp_script.py", OUT_DIR, STRATEGY, nprocs=2, ...)``, ``STRATEGY``
``ddp`` or ``fsdp2`` (``ModelParallelStrategy``, every linear layer and the model
``fully_shard``ed). Each rank trains the normalising MLP of ``test_fabric.py`` on its half of 32
records (Fabric's ``DistributedSampler``, no shuffling: rank r gets records r, r + 2, ...); record
10 is all zeros, so rank 0's step 1 is NaN (its batch 1 holds records 8..14 of the even ones). Each
rank writes ``rank<N>.json``: its events, the steps whose update was dropped, whether its weights
are finite, and a hash of them.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

import lightning as L
import torch
from process_group import finish_script, leave_process_group_at_exit
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NanGuard

leave_process_group_at_exit()

BAD_RECORD = 10


class Normalised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x / x.norm(dim=-1, keepdim=True)  # FABRIC DDP ORIGIN
        return self.l2(torch.relu(self.l1(x))).squeeze(-1)


def _full(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a DTensor's shards gathered; every rank takes part)."""
    full = getattr(param, "full_tensor", None)
    return (full() if full is not None else param).detach()


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _fsdp2(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in (model.l1, model.l2):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _strategy(name: str) -> Any:
    if name == "fsdp2":
        from lightning.fabric.strategies import ModelParallelStrategy

        return ModelParallelStrategy(parallelize_fn=_fsdp2, data_parallel_size=2, tensor_parallel_size=1)
    return "ddp"


def main(out_dir: str, strategy: str) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, generator=g)
    x[BAD_RECORD] = 0.0
    guard = NanGuard(verbose=False, loss_fn=loss_fn)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=_strategy(strategy), callbacks=[guard])
    fabric.launch()
    module = Normalised()
    if strategy == "fsdp2":  # sharded first: the optimizer is built over the sharded parameters
        model = fabric.setup(module)
        optimizer = fabric.setup_optimizers(torch.optim.SGD(module.parameters(), lr=0.1))
    else:
        model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=4))
    dropped = []
    for step, batch in enumerate(loader):
        before = [_full(p).clone() for p in module.parameters()]
        fabric.backward(loss_fn(model, batch))
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        if all(torch.equal(a, _full(p)) for a, p in zip(before, module.parameters(), strict=True)):
            dropped.append(step)
    weights = torch.cat([_full(p).flatten() for p in module.parameters()])
    result = {
        "rank": fabric.global_rank,
        "events": [event.to_dict() for event in guard.events],
        "dropped": dropped,
        "finite": bool(torch.isfinite(weights).all()),
        "hash": hashlib.sha256(weights.numpy().tobytes()).hexdigest(),
        "strategy": type(fabric.strategy).__name__,
    }
    with open(os.path.join(out_dir, f"rank{fabric.global_rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(result, handle, default=str)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "ddp")
    finish_script()  # the result is written: no teardown of gloo's threads (DDP's reducer keeps them alive)
