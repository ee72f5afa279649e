"""End-to-end step time under NanGuard on real shapes, for a GPU: the ratio to the same step without a guard.

Run from the repository root (on a machine with a CUDA device)::

    python -m benchmarks.gpu_steps --out gpu_steps.json            # 3 models x 4 variants, 5 rounds
    python -m benchmarks.gpu_steps --models GPT --rounds 3 --steps 30
    python -m benchmarks.gpu_steps --device cpu --quick --out /tmp/smoke.json   # tiny sizes, a smoke test

Models (``--quick``: the same layouts, tiny):

- ``GPT-2 small``: :class:`benchmarks.models.GPT2` at GPT-2 small's real sizes (12 layers, width 768,
  12 heads, vocabulary 50,257; 124M parameters in 148 tensors), 8 sequences of 1,024 tokens,
  next-token loss; its SDPA attention is what the precursor watch measures;
- ``ResNet-50``: torchvision's ResNet-50 layout written here in plain torch (bottleneck blocks
  3-4-6-3, 25.6M parameters in 161 tensors, 53 BatchNorm layers), 32 images of 224x224, 1,000 classes;
- ``1,500 small tensors``: the 750 residual ``Linear(8, 8)`` layers of ``benchmarks/models.py``
  (1,504 tensors), batch 32: launch-bound, the per-tensor worst case.

Variants, all with the same fused AdamW (``fused=True``, which ``sync_free=True`` needs to skip on
the device): ``no guard``; ``NanGuard()`` (the defaults: the precursor watch on); ``precursors off``
(``NanGuard(precursors=False)``); ``sync_free=True`` (``NanGuard(sync_free=True)``, no host read on a
healthy step).

Method: one Lightning ``Trainer`` fit per (model, variant, round), as the other benchmarks run it
(``benchmarks.models.benchmark_trainer``: a ``CSVLogger``, ``log_every_n_steps=50``); ``--warmup``
steps first, then a window of ``--steps`` steps timed with ``torch.cuda.synchronize()`` at its two
ends only (inside the window the host runs ahead as in training). Rounds are interleaved, the order
of the variants rotated each round, and every variant's ratio is taken against the ``no guard`` run
of its own round; the median over rounds is printed, with the host time spent inside the guard
(``guard.clock``) per step. Every fit starts from the same initial weights and data.
Printed: a table; written to ``--out``: every measurement as JSON, with the device's name.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from benchmarks.models import GPT2, GPT2Shape, _ManySmall, benchmark_trainer
from lightning_nanguard import NanGuard

# ---------------------------------------------------------------------------- ResNet-50 in plain torch


class _Bottleneck(nn.Module):
    """torchvision's ``Bottleneck``: 1x1, 3x3 (stride here), 1x1 convs with BatchNorm, expansion 4."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        return torch.relu(self.bn3(self.conv3(out)) + self.downsample(x))


class ResNet50(nn.Module):
    """ResNet-50 (torchvision layout: 7x7 stem, max-pool, bottleneck stages of ``blocks``, widths ``base`` x 1-8).

    The defaults are ResNet-50's: 25.6M parameters in 161 tensors for 1,000 classes.
    """

    def __init__(self, blocks: tuple[int, ...] = (3, 4, 6, 3), base: int = 64, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.BatchNorm2d(base), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        stages: list[nn.Module] = []
        cin = base
        for index, count in enumerate(blocks):
            width = base * 2**index
            for block in range(count):
                stages.append(_Bottleneck(cin, width, 2 if block == 0 and index > 0 else 1))
                cin = width * _Bottleneck.expansion
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.stages(self.stem(x)).mean(dim=(2, 3)))


# ---------------------------------------------------------------------------- models and data


class _Task(LightningModule):
    """A network, its loss (``"classify"`` or next-token ``"language"``) and a fused AdamW."""

    def __init__(self, net: nn.Module, task: str) -> None:
        super().__init__()
        self.net = net
        self.task = task

    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        if self.task == "language":
            tokens = batch[0]
            logits = self.net(tokens[:, :-1])
            return nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        x, y = batch
        return nn.functional.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)


class _Repeat(Dataset):
    """``length`` samples cycling over a few stored ones (no epoch ends inside a fit, little memory)."""

    def __init__(self, tensors: tuple[Tensor, ...], length: int) -> None:
        self.tensors = tensors
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[Tensor, ...]:
        row = index % self.tensors[0].shape[0]
        return tuple(t[row] for t in self.tensors)


@dataclass(frozen=True)
class Shape:
    """One benchmark model: its network, a sample maker, batch size and task."""

    build: Callable[[], nn.Module]
    samples: Callable[[torch.Generator, int], tuple[Tensor, ...]]
    batch_size: int
    task: str


def _tokens(vocab: int, length: int) -> Callable[[torch.Generator, int], tuple[Tensor, ...]]:
    return lambda g, n: (torch.randint(0, vocab, (n, length + 1), generator=g),)


def _images(size: int, classes: int) -> Callable[[torch.Generator, int], tuple[Tensor, ...]]:
    return lambda g, n: (torch.randn(n, 3, size, size, generator=g), torch.randint(0, classes, (n,), generator=g))


def _vectors(g: torch.Generator, n: int) -> tuple[Tensor, ...]:
    return torch.randn(n, 16, generator=g), torch.randint(0, 10, (n,), generator=g)


GPT2_SMALL = GPT2Shape(layers=12, width=768, heads=12, vocab=50257, context=1024)
GPT2_TINY = GPT2Shape(layers=2, width=64, heads=2, vocab=256, context=32)

SHAPES: dict[str, Shape] = {
    "GPT-2 small": Shape(lambda: GPT2(GPT2_SMALL), _tokens(GPT2_SMALL.vocab, GPT2_SMALL.context), 8, "language"),
    "ResNet-50": Shape(ResNet50, _images(224, 1000), 32, "classify"),
    "1,500 small tensors": Shape(_ManySmall, _vectors, 32, "classify"),
}
QUICK_SHAPES: dict[str, Shape] = {
    "GPT-2 small": Shape(lambda: GPT2(GPT2_TINY), _tokens(GPT2_TINY.vocab, GPT2_TINY.context), 4, "language"),
    "ResNet-50": Shape(lambda: ResNet50((1, 1, 1, 1), base=8, classes=10), _images(32, 10), 4, "classify"),
    "1,500 small tensors": Shape(lambda: _ManySmall(depth=100), _vectors, 8, "classify"),  # 204 tensors
}

VARIANTS: dict[str, dict[str, Any] | None] = {
    "no guard": None,
    "NanGuard()": {},
    "precursors off": {"precursors": False},
    "sync_free=True": {"sync_free": True},
}


# ---------------------------------------------------------------------------- timing


class _Window(Callback):
    """Wall time of the steps from ``warmup`` to the end, with the device synchronised at both ends only."""

    def __init__(self, warmup: int, last: int, guard: NanGuard | None, cuda: bool) -> None:
        self.warmup, self.last, self.guard, self.cuda = warmup, last, guard, cuda
        self.start = self.seconds = 0.0
        self.steps = 0

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.warmup and not self.start:
            self._sync()
            if self.guard is not None:
                self.guard.clock.reset()
            self.start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.last and self.start and not self.seconds:
            self._sync()
            self.seconds = time.perf_counter() - self.start
            self.steps = self.last - self.warmup


@dataclass
class Fit:
    step_seconds: float
    guard_seconds: float  # host time inside the guard over the window


def fit_once(
    shape: Shape, net: nn.Module, data: tuple[Tensor, ...], variant: str, args: argparse.Namespace, root: str
) -> Fit:
    guard_kwargs = VARIANTS[variant]
    guard = NanGuard(verbose=False, **guard_kwargs) if guard_kwargs is not None else None
    if guard is not None:
        guard.clock.enabled = True
    steps = args.warmup + args.steps
    window = _Window(args.warmup, steps, guard, args.device == "cuda")
    callbacks: list[Callback] = [window, *([guard] if guard is not None else [])]
    trainer = benchmark_trainer(root, steps, callbacks, accelerator=args.device, precision=args.precision)
    loader = DataLoader(_Repeat(data, steps * shape.batch_size), batch_size=shape.batch_size, shuffle=False)
    trainer.fit(_Task(copy.deepcopy(net), shape.task), loader)
    if window.steps != args.steps:
        raise RuntimeError(f"{variant}: timed {window.steps} steps, expected {args.steps}")
    if guard is not None and guard.events:
        raise RuntimeError(f"{variant}: the guard reported {len(guard.events)} events on a healthy run")
    guard_seconds = guard.clock.total if guard is not None else 0.0
    del trainer
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return Fit(window.seconds / window.steps, guard_seconds / window.steps)


def run_model(name: str, shape: Shape, args: argparse.Namespace) -> dict[str, Any]:
    """All variants of one model, ``args.rounds`` interleaved rounds; ratios against each round's no-guard run."""
    torch.manual_seed(0)
    net = shape.build()
    data = shape.samples(torch.Generator().manual_seed(0), shape.batch_size * 4)
    result: dict[str, Any] = {
        "parameters": sum(p.numel() for p in net.parameters()),
        "tensors": sum(1 for _ in net.parameters()),
        "batch_size": shape.batch_size,
        "variants": {v: {"step_ms": [], "ratio": [], "guard_us_per_step": []} for v in VARIANTS},
    }
    names = list(VARIANTS)
    with tempfile.TemporaryDirectory() as root:
        for index in range(args.rounds):
            order = names[index % len(names) :] + names[: index % len(names)]
            fits = {variant: fit_once(shape, net, data, variant, args, root) for variant in order}
            base = fits["no guard"].step_seconds
            for variant, fit in fits.items():
                entry = result["variants"][variant]
                entry["step_ms"].append(fit.step_seconds * 1e3)
                entry["ratio"].append(fit.step_seconds / base)
                entry["guard_us_per_step"].append(fit.guard_seconds * 1e6)
            print(
                f"  {name} round {index + 1}/{args.rounds}: no guard {base * 1e3:.2f} ms; "
                + ", ".join(f"{v} {fits[v].step_seconds / base:.3f}x" for v in names[1:]),
                flush=True,
            )
    for entry in result["variants"].values():
        entry["median_step_ms"] = statistics.median(entry["step_ms"])
        entry["median_ratio"] = statistics.median(entry["ratio"])
        entry["median_guard_us_per_step"] = statistics.median(entry["guard_us_per_step"])
    return result


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads)"


def print_table(results: dict[str, dict[str, Any]]) -> None:
    names = list(VARIANTS)
    print("\n| model | tensors | no guard (ms/step) | " + " | ".join(names[1:]) + " |")
    print("|---|---|---|" + "---|" * (len(names) - 1))
    for model, result in results.items():
        variants = result["variants"]
        cells = [
            f"{variants[v]['median_ratio']:.3f}x ({variants[v]['median_guard_us_per_step']:.0f} us in the guard)"
            for v in names[1:]
        ]
        print(
            f"| {model} | {result['tensors']} | {variants['no guard']['median_step_ms']:.2f} | "
            + " | ".join(cells)
            + " |"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="*", default=None, help="words of the model names (default: all)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=50, help="timed steps per fit")
    parser.add_argument("--warmup", type=int, default=10, help="steps before the timed window")
    parser.add_argument(
        "--precision", default=None, help="Lightning precision (default: bf16-mixed on cuda, 32 on cpu)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 1 round, 2 timed steps: a smoke test")
    parser.add_argument("--out", default=None, help="write every measurement to this JSON file")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu --quick for a smoke test)")
    if args.precision is None:
        args.precision = "bf16-mixed" if args.device == "cuda" else "32-true"
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 2, 1
    if args.device == "cpu":
        torch.set_num_threads(1 if args.quick else 2)  # a smoke test on a shared machine: no oversubscription
    shapes = QUICK_SHAPES if args.quick else SHAPES
    chosen = [m for m in shapes if args.models is None or any(w.lower() in m.lower() for w in args.models)]
    if not chosen:
        parser.error(f"--models {args.models} matches none of {list(shapes)}")
    device = device_name(args.device)
    print(f"{device}; torch {torch.__version__}, Lightning {lightning.__version__}; precision {args.precision}")
    results = {}
    for model in chosen:
        results[model] = run_model(model, shapes[model], args)
    print_table(results)
    print(
        f"({args.rounds} interleaved rounds of {args.steps} timed steps after {args.warmup}; medians; ratio: step time "
        f"against the no-guard run of the same round; {device})"
    )
    if args.out:
        report = {
            "device": device,
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "precision": args.precision,
            "rounds": args.rounds,
            "steps": args.steps,
            "warmup": args.warmup,
            "quick": args.quick,
            "models": results,
        }
        Path(args.out).write_text(json.dumps(report, indent=2), encoding="utf-8")
        print(f"written: {args.out}")


if __name__ == "__main__":
    main()
