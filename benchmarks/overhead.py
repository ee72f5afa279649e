"""Healthy-step cost of NanGuard against every alternative, measured side by side in one process.

Run from the repository root (``bash scripts/bench.sh`` sets up the environment first)::

    python benchmarks/overhead.py            # full run, writes docs/benchmarks.md and docs/benchmarks.png
    python benchmarks/overhead.py --quick    # fewer repetitions

Everything is reported as ratios, never absolute times:

1. Training-step time of the same model and data with: no guard; ``NanGuard()`` defaults; a
   naive per-parameter ``torch.isfinite(p.grad).all()`` check; Lightning's ``detect_anomaly=True``.
   Variants are interleaved round by round so drift in machine load hits all of them alike; the
   median step time of each is divided by the no-guard median.
2. Kernel level: NanGuard's check against GradScaler's fused check
   (``_amp_foreach_non_finite_check_and_unscale_``) and against the floor (one reduction over a
   single flat buffer holding the same number of values), for synthetic gradient lists and the
   models' real gradients.
3. Diagnosis: time of a bad step (bisection + localisation + bundle) against a healthy step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import MODELS, make

from lightning_nanguard import NanGuard
from lightning_nanguard.detection import fused_health_check

DOCS = Path(__file__).resolve().parent.parent / "docs"


class StepTimer(Callback):
    """Wall time of each training batch, from ``on_train_batch_start`` to ``on_train_batch_end``."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx >= self.warmup:
            self.times.append(time.perf_counter() - self._start)


class NaiveCheck(Callback):
    """What users write by hand: one ``isfinite(...).all()`` and one host read per gradient."""

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        for param in pl_module.parameters():
            if param.grad is not None and not torch.isfinite(param.grad).all():
                param.grad = None


VARIANTS: dict[str, Callable[[], tuple[list[Callback], dict[str, Any]]]] = {
    "no guard": lambda: ([], {}),
    "NanGuard()": lambda: ([NanGuard(verbose=False)], {}),
    "naive isfinite loop": lambda: ([NaiveCheck()], {}),
    "detect_anomaly=True": lambda: ([], {"detect_anomaly": True}),
}


def fit_once(model_name: str, variant: str, steps: int, warmup: int, root: str) -> list[float]:
    module, loader = make(model_name)
    callbacks, trainer_kwargs = VARIANTS[variant]()
    timer = StepTimer(warmup)
    trainer = Trainer(
        max_steps=steps,
        callbacks=[timer, *callbacks],
        logger=CSVLogger(root),  # a real logger: NanGuard logs its norm every log_every_n_steps (50)
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
        **trainer_kwargs,
    )
    trainer.fit(module, loader)
    return timer.times


def step_overhead(rounds: int, steps: int, warmup: int) -> dict[str, dict[str, float]]:
    """Per model and variant: the median over rounds of (median step time / no-guard median step time).

    Each round runs every variant once, in a rotated order, and is compared with its own no-guard
    run, so slow drift of the machine's speed cancels out.
    """
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as root:
        for model_name in MODELS:
            ratios: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
            names = list(VARIANTS)
            for round_index in range(rounds):
                order = names[round_index % len(names) :] + names[: round_index % len(names)]  # rotate
                medians = {v: statistics.median(fit_once(model_name, v, steps, warmup, root)) for v in order}
                for variant, median in medians.items():
                    ratios[variant].append(median / medians["no guard"])
            results[model_name] = {v: statistics.median(r) for v, r in ratios.items()}
            print(f"{model_name}: " + ", ".join(f"{v} {r:.3f}x" for v, r in results[model_name].items()), flush=True)
    return results


def _median_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def model_gradients(model_name: str) -> list[Tensor]:
    module, loader = make(model_name)
    x, y = next(iter(loader))
    module.training_step((x, y), 0).backward()
    return [p.grad for p in module.parameters() if p.grad is not None]


def kernel_ratios(repeats: int) -> dict[str, dict[str, float]]:
    """NanGuard's check and GradScaler's check, each divided by the floor (one flat reduction)."""
    cases: dict[str, list[Tensor]] = {
        "160 tensors, 25M values": [torch.randn(156_250) for _ in range(160)],
        "2,000 tensors, 25M values": [torch.randn(12_500) for _ in range(2_000)],
        "20,000 tensors, 2M values": [torch.randn(100) for _ in range(20_000)],
    }
    for model_name in MODELS:
        cases[f"{model_name}: real grads"] = model_gradients(model_name)
    results: dict[str, dict[str, float]] = {}
    for name, grads in cases.items():
        flat = torch.cat([g.reshape(-1) for g in grads])
        found, one = torch.zeros(1), torch.ones(1)
        candidates: dict[str, Callable[[], Any]] = {
            "floor": lambda flat=flat: torch.linalg.vector_norm(flat).item(),
            "NanGuard check": lambda grads=grads: fused_health_check(grads, with_norm=False).tolist(),
            "NanGuard check + norm": lambda grads=grads: fused_health_check(grads).tolist(),
            "GradScaler check": lambda grads=grads, found=found, one=one: (
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one),
                found.item(),
            ),
        }
        timings: dict[str, list[float]] = {k: [] for k in candidates}
        for _ in range(5):  # interleave the candidates
            for key, fn in candidates.items():
                timings[key].append(_median_time(fn, max(1, repeats // 5)))
        floor = statistics.median(timings["floor"])
        results[name] = {k: statistics.median(v) / floor for k, v in timings.items() if k != "floor"}
        print(
            f"{name} ({len(grads)} tensors): " + ", ".join(f"{k} {r:.2f}x" for k, r in results[name].items()),
            flush=True,
        )
    return results


def diagnosis_cost() -> dict[str, float]:
    """Time of a bad step (with bisection/localisation/bundle) over a healthy step, batch of 32, one bad sample."""
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as root:
        for bisect in (False, True):
            module, loader = make("conv+BN (few large tensors)")
            dataset = loader.dataset
            images = dataset.tensors[0].clone()  # type: ignore[attr-defined]
            images[32 * 3 + 7] = float("nan")  # one bad sample in batch 3
            bad_loader = torch.utils.data.DataLoader(
                torch.utils.data.TensorDataset(images, dataset.tensors[1]),  # type: ignore[attr-defined]
                batch_size=32,
            )
            timer = StepTimer(warmup=0)
            guard = NanGuard(verbose=False, bisect=bisect, localize=bisect, save_repro=bisect)
            trainer = Trainer(
                max_steps=6,
                callbacks=[timer, guard],
                logger=CSVLogger(root),
                enable_progress_bar=False,
                enable_model_summary=False,
                enable_checkpointing=False,
                accelerator="cpu",
                devices=1,
            )
            trainer.fit(module, bad_loader)
            healthy = statistics.median(timer.times[1:3] + timer.times[4:])
            ratios["bad step, detect + skip only" if not bisect else "bad step, full diagnosis"] = (
                timer.times[3] / healthy
            )
            if bisect:
                ratios["bisection passes (n=32, k=1)"] = float(guard.events[0].details.get("bisect_passes", 0))
    print(", ".join(f"{k}: {v:.2f}" for k, v in ratios.items()), flush=True)
    return ratios


def write_report(
    step: dict[str, dict[str, float]], kernel: dict[str, dict[str, float]], diagnosis: dict[str, float]
) -> None:
    DOCS.mkdir(exist_ok=True)
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `python benchmarks/overhead.py` on {torch.get_num_threads()} CPU threads, "
        f"torch {torch.__version__}. All numbers are ratios measured side by side in one run.",
        "",
        "## Training-step time relative to no guard (median)",
        "",
    ]
    variants = list(next(iter(step.values())))
    lines += ["| model | " + " | ".join(variants) + " |", "|---|" + "---|" * len(variants)]
    lines += [f"| {m} | " + " | ".join(f"{r[v]:.3f}" for v in variants) + " |" for m, r in step.items()]
    lines += ["", "## Check kernels relative to the floor (one reduction over one flat buffer)", ""]
    kinds = list(next(iter(kernel.values())))
    lines += ["| gradients | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    lines += [f"| {c} | " + " | ".join(f"{r[k]:.2f}" for k in kinds) + " |" for c, r in kernel.items()]
    lines += ["", "## Diagnosis", "", "| | ratio to a healthy step |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in diagnosis.items()]
    (DOCS / "benchmarks.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        axes[0].bar([j + i * width for j in range(len(step))], [step[m][variant] for m in step], width, label=variant)
    axes[0].set_xticks([j + 0.4 - width / 2 for j in range(len(step))], list(step), fontsize=7)
    axes[0].set_ylabel("step time / no guard")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=7)
    width = 0.8 / len(kinds)
    for i, kind in enumerate(kinds):
        axes[1].bar([j + i * width for j in range(len(kernel))], [kernel[c][kind] for c in kernel], width, label=kind)
    axes[1].set_xticks([j + 0.4 - width / 2 for j in range(len(kernel))], list(kernel), fontsize=6, rotation=20)
    axes[1].set_ylabel("time / floor")
    axes[1].set_yscale("log")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(DOCS / "benchmarks.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and repetitions")
    args = parser.parse_args()
    rounds, steps, repeats = (2, 25, 10) if args.quick else (7, 40, 30)
    print("== kernel level", flush=True)
    kernel = kernel_ratios(repeats)
    print("== training step", flush=True)
    step = step_overhead(rounds, steps, warmup=5)
    print("== diagnosis", flush=True)
    diagnosis = diagnosis_cost()
    write_report(step, kernel, diagnosis)
    print(f"wrote {DOCS / 'benchmarks.md'} and {DOCS / 'benchmarks.png'}")


if __name__ == "__main__":
    main()
