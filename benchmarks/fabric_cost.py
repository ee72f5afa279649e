"""The guard's per-step cost in a Lightning Fabric loop, beside the same step in the Trainer.

Run from the repository root::

    python -m benchmarks.fabric_cost               # 1,000 steps of a Linear(2, 1), 5 alternating repetitions
    python -m benchmarks.fabric_cost --steps 500 --repeat 3
    python -m benchmarks.fabric_cost --accelerator cuda   # on a GPU

The loop is Fabric's plain one (``fabric.backward``, ``fabric.clip_gradients``, ``optimizer.step()``)
on batches of 4, where a step costs little besides Python: what the guard adds there is its own
host time per step. Each repetition runs the loop without a guard, with ``NanGuard()`` and with
``NanGuard(sync_free=True)`` (fused SGD: no host read on a healthy step), in turn, so drift in the
machine's speed hits all three alike; printed: median microseconds per step of each and the
guard's added microseconds per step (with minus without). The Trainer's figure for the same model is
``benchmarks/fixed_cost.py``'s (time inside the guard's hooks).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NanGuard


def _loop(steps: int, make_guard: Callable[[], NanGuard] | None, fused: bool, accelerator: str = "cpu") -> float:
    """Seconds per step of one Fabric loop of ``steps`` steps (after 20 warm-up steps)."""
    torch.manual_seed(0)
    x = torch.randn((steps + 20) * 4, 2)
    callbacks = [make_guard()] if make_guard is not None else []
    fabric = L.Fabric(accelerator=accelerator, devices=1, callbacks=callbacks)
    module = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3, fused=fused or None)
    model, optimizer = fabric.setup(module, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(x, x.sum(1)), batch_size=4))
    begin = 0.0
    for i, (xb, yb) in enumerate(loader):
        if i == 20:
            begin = time.perf_counter()
        loss = nn.functional.mse_loss(model(xb).squeeze(1), yb)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
    if accelerator == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - begin) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--accelerator", default="cpu", help="cpu (default) or cuda")
    args = parser.parse_args()
    torch.set_num_threads(1)
    variants: dict[str, tuple[Callable[[], NanGuard] | None, bool]] = {
        "no guard": (None, False),
        "NanGuard()": (lambda: NanGuard(verbose=False), False),
        "NanGuard(sync_free=True)": (lambda: NanGuard(verbose=False, sync_free=True), True),
        "no guard, fused SGD": (None, True),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeat):
        for name, (make_guard, fused) in variants.items():
            times[name].append(_loop(args.steps, make_guard, fused, args.accelerator) * 1e6)
    median = {name: statistics.median(values) for name, values in times.items()}
    for name, value in median.items():
        print(f"{name:26s} {value:8.1f} us per step (min {min(times[name]):.1f}, max {max(times[name]):.1f})")
    print(f"added by NanGuard():               {median['NanGuard()'] - median['no guard']:7.1f} us per step")
    added = median["NanGuard(sync_free=True)"] - median["no guard, fused SGD"]
    print(f"added by NanGuard(sync_free=True): {added:7.1f} us per step")
    device = torch.cuda.get_device_name() if args.accelerator == "cuda" else "CPU"
    print(f"({args.repeat} alternating repetitions of {args.steps} steps, one CPU thread, {device})")


if __name__ == "__main__":
    main()
