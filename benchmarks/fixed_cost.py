"""The guard's fixed per-step host cost: microseconds inside NanGuard on a model whose check is free.

Run from the repository root::

    python -m benchmarks.fixed_cost            # 2,000 steps of a Linear(2, 1), 5 repetitions
    python -m benchmarks.fixed_cost --steps 500 --repeat 3
    python -m benchmarks.fixed_cost --logging  # also 4 logged values and 2 torchmetrics metrics a step
    python -m benchmarks.fixed_cost --optimization manual  # opt.step() in a manual training_step
    python -m benchmarks.fixed_cost --optimization lbfgs   # LBFGS (max_iter=4): the copy that undoes a bad step

A ``Linear(2, 1)`` trained on batches of 4 has three tiny tensors to check (two gradients and the
loss): what the guard spends per step there is its own Python and the handful of kernels it
launches whatever the model, the cost every step of every model pays before any per-tensor work.
Printed: ``guard.clock.total`` per step in microseconds (median over repetitions, min-max), per
hook, and the same guard's share of the step. With ``--logging`` the module logs four values
(mean, sum, max, min; ``on_epoch=True``) and updates two torchmetrics metrics every step: the rise of
``on_train_batch_start`` against a run without is what capturing them for a possible skip costs.
Compare two versions of the package side by side with ``--against <checkout>``: the repetitions
alternate between this checkout's package and that one's (each in a fresh process), and the ratio
of the medians is printed. ``--accelerator cuda`` measures on a GPU (the host time of the same hooks).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.models import benchmark_trainer
from lightning_nanguard import NanGuard

ROOT = Path(__file__).resolve().parent.parent


class _Tiny(LightningModule):
    def __init__(self, logging: bool = False, optimization: str = "automatic") -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.logging = logging
        self.optimization = optimization
        self.automatic_optimization = optimization != "manual"
        if logging:
            import torchmetrics

            self.mse, self.mae = torchmetrics.MeanSquaredError(), torchmetrics.MeanAbsoluteError()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        preds = self.layer(x).squeeze(1)
        loss = nn.functional.mse_loss(preds, y)
        if self.logging:
            for fx in ("mean", "sum", "max", "min"):
                self.log(f"loss_{fx}", loss, on_step=False, on_epoch=True, reduce_fx=fx)
            self.mse.update(preds.detach(), y)
            self.mae.update(preds.detach(), y)
        if not self.automatic_optimization:  # the manual loop of a user: zero, backward, step
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimization == "lbfgs":
            return torch.optim.LBFGS(self.parameters(), lr=1e-3, max_iter=4)
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def run(
    steps: int, logging: bool = False, accelerator: str = "cpu", optimization: str = "automatic"
) -> tuple[float, float, dict[str, float]]:
    """One fit of ``steps`` steps: guard microseconds per step, the guard's share of the step, per hook."""
    x = torch.randn(steps * 4, 2)
    loader = DataLoader(TensorDataset(x, x.sum(1)), batch_size=4)
    guard = NanGuard(verbose=False)
    guard.clock.enabled = True
    with tempfile.TemporaryDirectory() as root:
        trainer = benchmark_trainer(root, steps, [guard], accelerator=accelerator)
        begin = time.perf_counter()
        trainer.fit(_Tiny(logging, optimization), loader)
        wall = time.perf_counter() - begin
    per_hook = {name: seconds / steps * 1e6 for name, seconds in guard.clock.seconds.items()}
    return guard.clock.total / steps * 1e6, guard.clock.total / wall, per_hook


def _one_process(checkout: str, args: argparse.Namespace) -> float:
    """One repetition in a fresh process importing the package of ``checkout``: guard microseconds per step.

    The process runs this checkout's ``benchmarks`` (copied into its working directory, which ``python -m``
    puts first on the path) and imports ``lightning_nanguard`` from ``checkout`` (``PYTHONPATH``).
    """
    command = [sys.executable, "-m", "benchmarks.fixed_cost", "--steps", str(args.steps), "--repeat", "1", "--json"]
    command += ["--accelerator", args.accelerator, *(["--logging"] if args.logging else [])]
    command += ["--optimization", args.optimization] if args.optimization != "automatic" else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([checkout, os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as cwd:
        shutil.copytree(ROOT / "benchmarks", Path(cwd) / "benchmarks", ignore=shutil.ignore_patterns("__pycache__"))
        done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, check=True)
    return float(json.loads(done.stdout.strip().splitlines()[-1])["per_step_us"])


def paired_ratios(this: list[float], against: list[float]) -> tuple[float, float, float]:
    """The ratio of each repetition to its twin measured next to it: median, min, max.

    Two runs side by side share the machine's load of the moment, which moves single runs here by up
    to 2x: their ratio is steadier than the ratio of the two medians.

    Example:
        >>> paired_ratios([50.0, 100.0, 60.0], [100.0, 200.0, 100.0])
        (0.5, 0.5, 0.6)
    """
    ratios = [a / b for a, b in zip(this, against, strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def compare(args: argparse.Namespace) -> None:
    """Alternate this checkout and ``args.against``, one fresh process per repetition; print the ratios.

    Each pair runs back to back, in turns of order (this checkout first in even pairs, second in odd ones).
    """
    here = str(ROOT)
    times: dict[str, list[float]] = {"this checkout": [], "against": []}
    for repetition in range(args.repeat):
        order = [("this checkout", here), ("against", args.against)]
        for name, checkout in order if repetition % 2 == 0 else reversed(order):
            times[name].append(_one_process(checkout, args))
    for name, values in times.items():
        print(f"{name:14s} {statistics.median(values):7.1f} us per step (min {min(values):.1f}, max {max(values):.1f})")
    ratio = statistics.median(times["this checkout"]) / statistics.median(times["against"])
    print(f"ratio this/against: {ratio:.3f} ({args.repeat} alternating repetitions of {args.steps} steps)")
    middle, low, high = paired_ratios(times["this checkout"], times["against"])
    print(f"paired ratios (each repetition over its twin): median {middle:.3f} (min {low:.3f}, max {high:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--logging", action="store_true", help="4 logged values and 2 metrics every step")
    parser.add_argument("--accelerator", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--against", metavar="CHECKOUT", help="another checkout's root, measured side by side")
    parser.add_argument("--optimization", default="automatic", choices=("automatic", "manual", "lbfgs"))
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.against:
        compare(args)
        return
    results = [run(args.steps, args.logging, args.accelerator, args.optimization) for _ in range(args.repeat)]
    if args.json:
        print(json.dumps({"per_step_us": statistics.median(r[0] for r in results)}))
        return
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
