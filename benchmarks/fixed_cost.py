"""The guard's fixed per-step host cost: microseconds inside NanGuard on a model whose check is free.

Run from the repository root::

    python benchmarks/fixed_cost.py            # 2,000 steps of a Linear(2, 1), 5 repetitions
    python benchmarks/fixed_cost.py --steps 500 --repeat 3

A ``Linear(2, 1)`` trained on batches of 4 has three tiny tensors to check (two gradients and the
loss): what the guard spends per step there is its own Python and the handful of kernels it
launches whatever the model, the cost every step of every model pays before any per-tensor work.
Printed: ``guard.clock.total`` per step in microseconds (median over repetitions, min-max), per
hook, and the same guard's share of the step. Compare two versions of the package by running this
file against each checkout in turn on a quiet machine (``PYTHONPATH=<checkout>``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import benchmark_trainer

from lightning_nanguard import NanGuard


class _Tiny(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.layer(x).squeeze(1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def run(steps: int) -> tuple[float, float, dict[str, float]]:
    """One fit of ``steps`` steps: guard microseconds per step, the guard's share of the step, per hook."""
    x = torch.randn(steps * 4, 2)
    loader = DataLoader(TensorDataset(x, x.sum(1)), batch_size=4)
    guard = NanGuard(verbose=False)
    guard.clock.enabled = True
    with tempfile.TemporaryDirectory() as root:
        trainer = benchmark_trainer(root, steps, [guard])
        begin = time.perf_counter()
        trainer.fit(_Tiny(), loader)
        wall = time.perf_counter() - begin
    per_hook = {name: seconds / steps * 1e6 for name, seconds in guard.clock.seconds.items()}
    return guard.clock.total / steps * 1e6, guard.clock.total / wall, per_hook


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = [run(args.steps) for _ in range(args.repeat)]
    totals = [r[0] for r in results]
    print(
        f"guard per step: {statistics.median(totals):.1f} us (min {min(totals):.1f}, max {max(totals):.1f}) "
        f"over {args.repeat} x {args.steps} steps; "
        f"{statistics.median(r[1] for r in results):.1%} of the fit's wall time"
    )
    hooks = sorted(results[0][2], key=lambda name: -statistics.median(r[2].get(name, 0.0) for r in results))
    for name in hooks:
        print(f"  {name:30s} {statistics.median(r[2].get(name, 0.0) for r in results):8.1f} us")


if __name__ == "__main__":
    main()
