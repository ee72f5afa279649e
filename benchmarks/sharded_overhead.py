"""Healthy-step cost of NanGuard under FSDP2 (``ModelParallelStrategy``) against DDP, same model, 2 CPU processes.

Run from the repository root::

    python -m benchmarks.sharded_overhead               # both strategies, prints a Markdown table
    python -m benchmarks.sharded_overhead --rounds 5    # more rounds (the median is reported)

Each strategy runs in its own pair of processes (gloo). In them, fits alternate between no guard
and ``NanGuard()`` (the order rotated per round), ``--steps`` steps each; the mean step time of the
steps after ``--warmup`` is taken per fit. Reported per strategy: the median over rounds of
(guarded / unguarded - 1), and the share of the guarded steps' wall time spent inside the guard
(``guard.clock``; under FSDP2 that includes the one all-reduce of the flags and the norm share).
The model is an MLP of ``--blocks`` ``Linear(--width, --width)`` blocks, each a ``fully_shard`` unit
under FSDP2. Run it on a quiet machine: other processes on the cores add noise to both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NanGuard

BATCH = 64


class MLP(pl.LightningModule):
    def __init__(self, width: int, blocks: int, sharded: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.sharded = sharded
        layers: list[nn.Module] = []
        for _ in range(blocks):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, 1)

    def configure_model(self) -> None:
        if not self.sharded:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.body:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.head, mesh=mesh)
        fully_shard(self.body, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.body(x)).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class StepTimer(pl.Callback):
    """Mean wall time of a training step (batch start to batch end) after ``warmup`` steps."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step > self.warmup:
            self.times.append(time.perf_counter() - self._start)


def _fit(strategy: str, guarded: bool, args: argparse.Namespace, root: str) -> dict[str, float]:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    timer = StepTimer(args.warmup)
    guard = NanGuard(verbose=False, save_repro=False)
    guard.clock.enabled = True
    callbacks: list[pl.Callback] = [timer, guard] if guarded else [timer]
    trainer = pl.Trainer(
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        if strategy == "fsdp2"
        else DDPStrategy(),
        accelerator="cpu",
        devices=2,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=root,
        callbacks=callbacks,
    )
    g = torch.Generator().manual_seed(0)
    n = BATCH * args.steps
    data = TensorDataset(torch.randn(n, args.width, generator=g), torch.randn(n, generator=g))
    trainer.fit(MLP(args.width, args.blocks, strategy == "fsdp2"), DataLoader(data, batch_size=BATCH))
    window = sum(timer.times)
    # the guard's clock over the whole fit, scaled to the timed window by the share of steps in it
    inside = guard.clock.total * len(timer.times) / max(1, args.steps) if guarded else 0.0
    return {"step_s": window / max(1, len(timer.times)), "inside_share": inside / window if window else 0.0}


def _worker(args: argparse.Namespace) -> None:
    """One strategy, in the two processes Lightning launches (rank 0 writes the result)."""
    results: dict[str, list[dict[str, float]]] = {"none": [], "guard": []}
    with tempfile.TemporaryDirectory() as root:
        for round_index in range(args.rounds):
            order = ["none", "guard"] if round_index % 2 == 0 else ["guard", "none"]
            for variant in order:
                results[variant].append(_fit(args.strategy, variant == "guard", args, root))
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps(results), encoding="utf-8")


def _summary(results: dict[str, list[dict[str, float]]]) -> dict[str, float]:
    ratios = [g["step_s"] / n["step_s"] - 1 for g, n in zip(results["guard"], results["none"], strict=True)]
    return {
        "step_ms": 1e3 * statistics.median(r["step_s"] for r in results["none"]),
        "overhead_pct": 100 * statistics.median(ratios),
        "inside_pct": 100 * statistics.median(r["inside_share"] for r in results["guard"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["ddp", "fsdp2"], default=None, help="(internal) one strategy")
    parser.add_argument("--out", default=None, help="(internal) where the worker writes its result")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.strategy is not None:
        _worker(args)
        return
    rows = []
    load_before = os.getloadavg()[0]
    for strategy in ("ddp", "fsdp2"):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            argv = [sys.executable, __file__, "--strategy", strategy, "--out", out]
            argv += ["--rounds", str(args.rounds), "--steps", str(args.steps), "--warmup", str(args.warmup)]
            argv += ["--width", str(args.width), "--blocks", str(args.blocks)]
            env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
            subprocess.run(argv, check=True, env=env, cwd=tmp)
            rows.append((strategy, _summary(json.loads(Path(out).read_text(encoding="utf-8")))))
    params = args.blocks * (args.width * args.width + args.width) + args.width + 1
    print(f"\nMLP {args.blocks} x Linear({args.width}), {params / 1e6:.1f}M parameters, batch {BATCH} per rank, ")
    print(f"2 CPU processes (gloo), {args.rounds} rounds; load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}\n")
    print("| strategy | step (no guard) | NanGuard() end to end | inside the guard |")
    print("|---|---|---|---|")
    for strategy, row in rows:
        print(
            f"| {strategy.upper()} | {row['step_ms']:.1f} ms | {row['overhead_pct']:+.1f}% | {row['inside_pct']:.1f}% |"
        )


if __name__ == "__main__":
    main()
