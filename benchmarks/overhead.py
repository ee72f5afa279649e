"""Healthy-step cost of NanGuard on five model shapes, measured side by side in one process.

Run from the repository root (``bash scripts/bench.sh`` sets up the environment first)::

    python -m benchmarks.overhead            # full run (~12 min), writes docs/benchmarks.md and docs/benchmarks.png
    python -m benchmarks.overhead --quick    # 2 rounds, no reference variants (~4 min), same outputs
    python -m benchmarks.overhead --models ResNet --rounds 3   # a subset, for development

Run it on a quiet machine: every number is a ratio of two timings taken in the same run, but other
processes on the cores still add noise (the report records the load average before and after).
Threads are pinned to 2, shapes, batch and input sizes to ``benchmarks/models.py``.

What is measured:

1. **Time inside the guard** (the steady figure): every callable NanGuard installs runs under its
   ``guard.clock`` (:class:`lightning_nanguard.core.timing.GuardClock`): callback hooks, gradient
   hooks, the strategy's after-step work, the sampler wrapper. Its total over a window of
   ``--steps`` training steps, divided by the wall time of the same window. A ``CSVLogger`` is
   on and ``log_every_n_steps`` is Lightning's default (50), so the window holds one logging step
   (where the guard also computes the gradient norm): it is averaged in.
   Beside it, in a fit of its own, **the gradients fetched and read alone**: the time a callback
   spends where the guard checks (``on_before_optimizer_step``) taking ``p.grad`` of every parameter
   (the first access to a gradient made in backward creates its Python object) and summing each
   gradient of at least ``CPU_SUM_NUMEL`` (2^17) elements, one call each, over the same window. That
   is what no check of every gradient from Python can skip, in the cache state the check meets (the
   optimizer's last update and the backward evicted the gradients); smaller gradients cost a call
   more than their reading and are only fetched.
2. **End-to-end ratio**: mean step time of the window under ``NanGuard()`` over the same without
   a guard; one pair per round, rounds interleaved in rotated order, median over rounds.
   Reference variants (a hand-written per-parameter ``isfinite`` loop, ``detect_anomaly=True``)
   run in the first round only, 20 steps: their costs are far above the noise.
3. **The check against the memory floor**: on each model's real gradients, the check alone
   against one read of every gradient byte (``flat.sum()`` over one flat buffer of the same size).
   Every candidate, the floor included, is timed once right after a real backward (which evicts
   the caches), minimum over the runs. ``GradientCheck (hooks)`` sums large gradients in
   ``register_post_accumulate_grad_hook`` during backward: its cost is the time inside those hooks
   (sum over hooks of each hook's minimum over the runs), the autograd-to-Python dispatch of each
   hook (measured apart) and the work after backward. Synthetic gradient lists are timed after
   evicting the caches with a 64 MB read.
4. **Diagnosis**: the time of a bad step (bisection + localisation + bundle) against a healthy step.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor

from benchmarks.models import MODELS, benchmark_trainer, make
from lightning_nanguard import NanGuard
from lightning_nanguard.core.timing import GuardClock
from lightning_nanguard.detect.check import CPU_SUM_NUMEL, fused_health_check
from lightning_nanguard.detect.streaming import GradientCheck

DOCS = Path(__file__).resolve().parent.parent / "docs"
THREADS = 2
WARMUP = 5
TARGET = 0.02  # at most 2% of a step inside the guard


# ---------------------------------------------------------------------------- training runs


class StepWindow(Callback):
    """Wall time of the steps from ``warmup`` on (to the end of training); resets the guard's clock at its start."""

    def __init__(self, warmup: int, guard: NanGuard | GradientRead | None) -> None:
        self.warmup = warmup
        self.guard = guard
        self.start = 0.0
        self.first_step = 0
        self.seconds = 0.0
        self.steps = 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.warmup and not self.start:
            if self.guard is not None:
                self.guard.clock.reset()
            self.start = time.perf_counter()
            self.first_step = trainer.global_step

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.seconds = time.perf_counter() - self.start
        self.steps = trainer.global_step - self.first_step


class NaiveCheck(Callback):
    """What users write by hand: one ``isfinite(...).all()`` and one host read per gradient."""

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        for param in pl_module.parameters():
            if param.grad is not None and not torch.isfinite(param.grad).all():
                param.grad = None


class GradientRead(Callback):
    """Every gradient fetched where the guard checks, and the largest read: ``p.grad`` of each parameter
    (the list kept from the first step, as the guard keeps it), then a ``sum`` of each gradient of at
    least :data:`~lightning_nanguard.detect.check.CPU_SUM_NUMEL` elements, one call each; timed by ``clock``.

    The floor of any check of every gradient from Python, in the loop's own cache state (see module docs).
    """

    def __init__(self) -> None:
        self.clock = GuardClock(enabled=True)
        self._params: list[Tensor] = []

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        with self.clock.measure("read"):
            if not self._params:
                self._params = list(pl_module.parameters())
            grads = [g for p in self._params if (g := p.grad) is not None]
            [g.sum() for g in grads if g.numel() >= CPU_SUM_NUMEL]


def _guard() -> NanGuard:
    guard = NanGuard(verbose=False)
    guard.clock.enabled = True
    return guard


VARIANTS: dict[str, Callable[[], tuple[list[Callback], dict[str, Any]]]] = {
    "no guard": lambda: ([], {}),
    "NanGuard()": lambda: ([_guard()], {}),
    "gradients read alone": lambda: ([GradientRead()], {}),
    "naive isfinite loop": lambda: ([NaiveCheck()], {}),
    "detect_anomaly=True": lambda: ([], {"detect_anomaly": True}),
}
MAIN_VARIANTS = ["no guard", "NanGuard()", "gradients read alone"]
REFERENCE_VARIANTS = ["naive isfinite loop", "detect_anomaly=True"]
REFERENCE_STEPS = 20  # anomaly mode runs up to 10x slower


def _steps_of(variant: str, steps: int) -> int:
    return min(steps, REFERENCE_STEPS) if variant in REFERENCE_VARIANTS else steps


@dataclass
class Run:
    step_seconds: float  # mean over the window
    guard_seconds: dict[str, float] = field(default_factory=dict)  # per guard callable, over the window
    window_seconds: float = 0.0


def fit_once(model_name: str, variant: str, steps: int, root: str) -> Run:
    module, loader = make(model_name, batches=WARMUP + steps)
    callbacks, trainer_kwargs = VARIANTS[variant]()
    guard = next((c for c in callbacks if isinstance(c, NanGuard | GradientRead)), None)
    window = StepWindow(WARMUP, guard)
    # the window first: its clock reset precedes the guard's hooks
    trainer = benchmark_trainer(root, WARMUP + steps, [window, *callbacks], **trainer_kwargs)
    trainer.fit(module, loader)
    if window.steps != steps:
        raise RuntimeError(f"{model_name} / {variant}: measured {window.steps} steps, expected {steps}")
    seconds = dict(guard.clock.seconds) if guard is not None else {}
    return Run(window.seconds / window.steps, seconds, window.seconds)


@dataclass
class ModelResult:
    no_guard_step: float = 0.0  # seconds, median over rounds
    guard_fraction: list[float] = field(default_factory=list)  # per round
    read_fraction: list[float] = field(default_factory=list)  # the gradients fetched and read alone, per round
    ratio: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # per variant, per round
    by_callable: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # seconds, all rounds
    window_total: float = 0.0  # seconds of NanGuard windows, all rounds
    max_load: float = 0.0  # the highest 1-minute load average seen after one of its runs


def step_overhead(models: list[str], rounds: int, steps: int, reference: bool) -> dict[str, ModelResult]:
    """Per model: guard fraction and end-to-end ratios, rounds interleaved in rotated order."""
    results: dict[str, ModelResult] = {}
    with tempfile.TemporaryDirectory() as root:
        for model_name in models:
            result = ModelResult()
            no_guard_steps: list[float] = []
            for index in range(rounds):
                names = MAIN_VARIANTS + (REFERENCE_VARIANTS if reference and index == 0 else [])
                order = names[index % len(names) :] + names[: index % len(names)]  # rotate
                runs = {}
                for variant in order:
                    runs[variant] = fit_once(model_name, variant, _steps_of(variant, steps), root)
                    result.max_load = max(result.max_load, os.getloadavg()[0])
                base = runs["no guard"].step_seconds
                no_guard_steps.append(base)
                for variant, run in runs.items():
                    if variant not in ("no guard", "gradients read alone"):
                        result.ratio[variant].append(run.step_seconds / base)
                guarded = runs["NanGuard()"]
                result.guard_fraction.append(sum(guarded.guard_seconds.values()) / guarded.window_seconds)
                read = runs["gradients read alone"]
                result.read_fraction.append(sum(read.guard_seconds.values()) / read.window_seconds)
                for name, seconds in guarded.guard_seconds.items():
                    result.by_callable[name] += seconds
                result.window_total += guarded.window_seconds
                print(
                    f"  {model_name} round {index + 1}/{rounds}: step {base * 1e3:.1f} ms, inside the guard "
                    f"{result.guard_fraction[-1]:.2%} (the gradients read alone {result.read_fraction[-1]:.2%}), "
                    + ", ".join(f"{v} {r[-1]:.3f}x" for v, r in result.ratio.items() if len(r) == index + 1),
                    flush=True,
                )
            result.no_guard_step = statistics.median(no_guard_steps)
            results[model_name] = result
            print(
                f"{model_name}: inside the guard {statistics.median(result.guard_fraction):.2%} of a step "
                f"(median of {rounds}; its gradients read alone "
                f"{statistics.median(result.read_fraction):.2%}), "
                f"end-to-end {statistics.median(result.ratio['NanGuard()']):.3f}x",
                flush=True,
            )
    return results


# ---------------------------------------------------------------------------- the check alone


def _min_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


class _HookTimes:
    """Clock stand-in for ``GradientCheck``: the duration of every hook call, in call order."""

    enabled = True

    def __init__(self) -> None:
        self.durations: list[float] = []

    @contextlib.contextmanager
    def measure(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.durations.append(time.perf_counter() - start)


def hook_dispatch_seconds(repeats: int) -> float:
    """Cost of autograd calling one Python post-accumulate-grad hook (backward with no-op hooks minus without)."""
    leaves = [torch.nn.Parameter(torch.ones(1)) for _ in range(256)]

    def backward() -> None:
        for leaf in leaves:
            leaf.grad = None
        torch.stack(leaves).sum().backward()

    plain = _min_time(backward, repeats)
    handles = [leaf.register_post_accumulate_grad_hook(lambda p: None) for leaf in leaves]
    hooked = _min_time(backward, repeats)
    for handle in handles:
        handle.remove()
    return max(0.0, (hooked - plain) / len(leaves))


CHECKS = ["GradientCheck (hooks)", "GradientCheck (after backward)", "fused_health_check", "GradScaler kernel (writes)"]


def _candidates(grads: list[Tensor], flat: Tensor, post: GradientCheck) -> dict[str, Callable[[], Any]]:
    found, one = torch.zeros(1), torch.ones(1)
    return {
        "floor": lambda: flat.sum().item(),
        "GradientCheck (after backward)": lambda: post.health_check(with_norm=False).tolist(),
        "fused_health_check": lambda: fused_health_check(grads, with_norm=False, layout=grads).tolist(),
        "GradScaler kernel (writes)": lambda: (
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one),
            found.item(),
        ),
        "with the global norm": lambda: fused_health_check(grads, with_norm=True, layout=grads).tolist(),
    }


def model_checks(model_name: str, runs: int, dispatch: float) -> tuple[dict[str, float], int, int]:
    """On a model's real gradients, right after a real backward each time: every check over the floor.

    Returns the ratios, the number of gradients and of hooked ones. The floor reads a flat buffer
    of the same size that backward has evicted from the caches, like the gradients the checks read.
    """
    module, loader = make(model_name, batches=1)
    batch = next(iter(loader))
    params = list(module.parameters())
    times = _HookTimes()
    hooked = GradientCheck(params, clock=times)  # type: ignore[arg-type]
    hooked.enabled = False
    post = GradientCheck(params, stream=False)
    flat = torch.zeros(sum(p.numel() for p in params))

    def backward() -> None:
        module.zero_grad(set_to_none=True)
        module.training_step(batch, 0).backward()

    backward()
    grads = [p.grad for p in params if p.grad is not None]
    best: dict[str, float] = defaultdict(lambda: float("inf"))
    per_hook: list[list[float]] = []
    for index in range(runs + 1):  # the first round warms up
        for key in _candidates(grads, flat, post):
            backward()
            grads[:] = [p.grad for p in params if p.grad is not None]
            fn = _candidates(grads, flat, post)[key]
            start = time.perf_counter()
            fn()
            if index:
                best[key] = min(best[key], time.perf_counter() - start)
        hooked.enabled = True
        times.durations = []
        backward()
        start = time.perf_counter()
        hooked.health_check(with_norm=False).tolist()
        if index:
            best["after the hooks"] = min(best["after the hooks"], time.perf_counter() - start)
            per_hook.append(times.durations)
        times.durations = []  # the disabled hooks of the other candidates' backward land here
        hooked.enabled = False
    hooked.remove()
    hooks = len(per_hook[0])
    inside = sum(min(run[i] for run in per_hook) for i in range(hooks))
    best["GradientCheck (hooks)"] = inside + hooks * dispatch + best.pop("after the hooks")
    floor = best.pop("floor")
    return {k: best[k] / floor for k in [*CHECKS, "with the global norm"]}, len(grads), hooks


def synthetic_checks(grads: list[Tensor], repeats: int) -> dict[str, float]:
    """Synthetic gradient lists: every check over the floor, each timed after evicting the caches."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    post = GradientCheck([torch.nn.Parameter(torch.empty_like(g)) for g in grads], stream=False)
    for param, grad in zip(post.params, grads, strict=True):
        param.grad = grad
    evict = torch.zeros(16_000_000)  # 64 MB, twice the last-level cache
    best: dict[str, float] = defaultdict(lambda: float("inf"))
    candidates = _candidates(grads, flat, post)
    for index in range(repeats + 1):
        for key, fn in candidates.items():
            evict.sum()
            start = time.perf_counter()
            fn()
            if index:
                best[key] = min(best[key], time.perf_counter() - start)
    floor = best.pop("floor")
    return {k: v / floor for k, v in best.items()}


def kernel_ratios(models: list[str], repeats: int) -> dict[str, dict[str, float]]:
    """Each check's time over the floor (one read of every gradient byte), same gradients, side by side."""
    dispatch = hook_dispatch_seconds(repeats)
    print(f"  autograd -> Python hook dispatch: {dispatch * 1e6:.2f} us per hook", flush=True)
    results: dict[str, dict[str, float]] = {}
    for model_name in models:
        ratios, tensors, hooks = model_checks(model_name, max(5, repeats // 3), dispatch)
        results[f"{model_name} ({tensors} tensors, {hooks} hooked)"] = ratios
    synthetic = {
        "2,000 tensors, 25M values": [torch.randn(12_500) for _ in range(2_000)],
        "20,000 tensors, 2M values": [torch.randn(100) for _ in range(20_000)],
    }
    for name, grads in synthetic.items():
        results[name] = synthetic_checks(grads, max(5, repeats // 3))
    for name, ratios in results.items():
        print(f"  {name}: " + ", ".join(f"{k} {r:.2f}x" for k, r in ratios.items()), flush=True)
    return results


# ---------------------------------------------------------------------------- diagnosis


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
            times = _BatchTimes()
            guard = NanGuard(verbose=False, bisect=bisect, localize=bisect, save_repro=bisect)
            trainer = benchmark_trainer(root, 6, [times, guard])
            trainer.fit(module, bad_loader)
            healthy = statistics.median(times.seconds[1:3] + times.seconds[4:])
            key = "bad step, full diagnosis" if bisect else "bad step, detect + skip only"
            ratios[key] = times.seconds[3] / healthy
            if bisect and guard.events:
                ratios["bisection passes (n=32, k=1)"] = float(guard.events[0].details.get("bisect_passes", 0))
    print("  " + ", ".join(f"{k}: {v:.2f}" for k, v in ratios.items()), flush=True)
    return ratios


class _BatchTimes(Callback):
    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.seconds.append(time.perf_counter() - self._start)


# ---------------------------------------------------------------------------- report


def _shapes(step: dict[str, ModelResult]) -> list[str]:
    lines = [
        "| model | parameters | tensors | batch | step time, no guard | load average during its runs (max) |",
        "|---|---|---|---|---|---|",
    ]
    for name, spec in MODELS.items():
        module, _ = make(name, batches=1)
        params = list(module.parameters())
        measured = f"{step[name].no_guard_step * 1e3:.1f} ms | {step[name].max_load:.2f}" if name in step else "- | -"
        size = f"{sum(p.numel() for p in params) / 1e6:.2f}M"
        lines.append(f"| {name} | {size} | {len(params)} | {spec.batch_size} | {measured} |")
    return lines


def write_report(
    step: dict[str, ModelResult],
    kernel: dict[str, dict[str, float]],
    diagnosis: dict[str, float],
    settings: dict[str, Any],
) -> None:
    DOCS.mkdir(exist_ok=True)
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `bash scripts/bench.sh` (`python -m benchmarks.overhead{settings['flags']}`) on "
        f"{THREADS} CPU threads, torch {torch.__version__}; {settings['rounds']} interleaved rounds of "
        f"{settings['steps']} measured steps per variant (after {WARMUP} warm-up steps), a `CSVLogger`, "
        f"Lightning's default `log_every_n_steps=50`. Load average {settings['load_before']:.2f} before, "
        f"{settings['load_after']:.2f} after, per model below (anything well above 0 means other processes "
        "shared the 2 cores: the times inside the guard then drift too, usually up for small models). "
        "Shapes, batch and input sizes are pinned in `benchmarks/models.py`.",
        "",
        "## Models",
        "",
    ]
    lines += _shapes(step)
    variants = ["NanGuard()", *(v for v in REFERENCE_VARIANTS if any(r.ratio.get(v) for r in step.values()))]
    lines += [
        "",
        f"## Time inside the guard (target: at most {TARGET:.0%} of a step) and end-to-end step time",
        "",
        "Inside the guard: `guard.clock.total` (every hook, gradient hook, after-step work and sampler wrapper "
        "NanGuard installs) over the wall time of the same steps, median over rounds (min-max in brackets). "
        "End-to-end: mean step time relative to the same model without a guard, median over rounds "
        f"(reference variants: first round only, {REFERENCE_STEPS} steps). Gradients read alone: in a fit of its "
        "own, a callback where the guard checks takes `p.grad` of every parameter and sums each gradient of at "
        f"least {CPU_SUM_NUMEL:,} elements, one call each, over the wall time of the same steps: the floor of any "
        "check of every gradient from Python, in the loop's cache state.",
        "",
        "| model | inside the guard | within target | gradients read alone | " + " | ".join(variants) + " |",
        "|---|---|---|---|" + "---|" * len(variants),
    ]
    for name, result in step.items():
        fraction = statistics.median(result.guard_fraction)
        spread = f"({min(result.guard_fraction):.2%}-{max(result.guard_fraction):.2%})"
        read = f"{statistics.median(result.read_fraction):.2%}" if result.read_fraction else "-"
        ratios = " | ".join(_median_or_dash(result.ratio.get(v)) for v in variants)
        within = "yes" if fraction <= TARGET else "NO"
        lines.append(f"| {name} | {fraction:.2%} {spread} | {within} | {read} | {ratios} |")
    lines += [
        "",
        "### Where the guard's time goes (share of a step, all rounds)",
        "",
        "| model | " + " | ".join(f"`{c}`" for c in _callables(step)) + " |",
        "|---|" + "---|" * len(_callables(step)),
    ]
    for name, result in step.items():
        window = result.window_total or float("inf")
        shares = [result.by_callable.get(c, 0.0) / window for c in _callables(step)]
        lines.append(f"| {name} | " + " | ".join(f"{share:.2%}" for share in shares) + " |")
    lines += [
        "",
        "## The check alone against the memory floor",
        "",
        "Time of each check on the same gradients over one read of every gradient byte (`flat.sum()` over one "
        "flat buffer of the same size), each timed right after a real backward (caches evicted), minimum over "
        "interleaved runs. `GradientCheck (hooks)` sums large gradients during backward (the sum over hooks of "
        "their time, their dispatch, and the work after backward; see `benchmarks/overhead.py`); "
        "`GradientCheck (after backward)` is the same object without hooks; `fused_health_check` the function "
        "the guard calls, planned for the gradients' layout as in a run; `GradScaler kernel (writes)` the check "
        "used before, which writes every gradient.",
        "",
    ]
    kinds = [k for k in [*CHECKS, "with the global norm"] if any(k in r for r in kernel.values())]
    lines += ["| gradients | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    for case, found in kernel.items():
        lines.append(f"| {case} | " + " | ".join(f"{found[k]:.2f}" if k in found else "-" for k in kinds) + " |")
    if diagnosis:
        lines += ["", "## Diagnosis", "", "| | ratio to a healthy step |", "|---|---|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in diagnosis.items()]
    (DOCS / "benchmarks.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    _plot(step, kernel, kinds)


def _median_or_dash(values: list[float] | None) -> str:
    return f"{statistics.median(values):.3f}" if values else "-"


def _callables(step: dict[str, ModelResult]) -> list[str]:
    totals: dict[str, float] = defaultdict(float)
    for result in step.values():
        for name, seconds in result.by_callable.items():
            totals[name] += seconds / result.window_total if result.window_total else 0.0
    return sorted(totals, key=totals.__getitem__, reverse=True)


def _plot(step: dict[str, ModelResult], kernel: dict[str, dict[str, float]], kinds: list[str]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    names = list(step)
    positions = range(len(names))
    fractions = [100 * statistics.median(step[n].guard_fraction) for n in names]
    low = [f - 100 * min(step[n].guard_fraction) for f, n in zip(fractions, names, strict=True)]
    high = [100 * max(step[n].guard_fraction) - f for f, n in zip(fractions, names, strict=True)]
    axes[0].bar(positions, fractions, yerr=[low, high], color="tab:blue", capsize=3)
    reads = [100 * statistics.median(step[n].read_fraction) if step[n].read_fraction else math.nan for n in names]
    axes[0].scatter(positions, reads, marker="_", s=500, color="black", label="the gradients read alone")
    axes[0].axhline(100 * TARGET, color="tab:red", linestyle="--", label=f"target {TARGET:.0%}")
    axes[0].set_xticks(list(positions), [n.split(" (")[0] for n in names], fontsize=8, rotation=15)
    axes[0].set_ylabel("time inside the guard, % of a step")
    axes[0].set_title("NanGuard() per healthy step (median, min-max over rounds)", fontsize=9)
    axes[0].legend(fontsize=8)
    width = 0.8 / max(1, len(kinds))
    cases = list(kernel)
    for i, kind in enumerate(kinds):
        values = [kernel[c].get(kind, float("nan")) for c in cases]
        axes[1].bar([j + i * width for j in range(len(cases))], values, width, label=kind)
    axes[1].axhline(1.2, color="tab:red", linestyle="--", label="1.2x the floor")
    axes[1].set_xticks(
        [j + 0.4 - width / 2 for j in range(len(cases))], [c.split(" (")[0] for c in cases], fontsize=7, rotation=15
    )
    axes[1].set_ylabel("time / one read of every gradient byte")
    axes[1].set_yscale("log")
    axes[1].set_title("the check alone against the memory floor", fontsize=9)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(DOCS / "benchmarks.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds, no reference variants, no diagnosis")
    parser.add_argument("--rounds", type=int, help="interleaved rounds per model (default 5, --quick 2)")
    parser.add_argument("--steps", type=int, default=50, help="measured steps per run (default 50: one logging step)")
    parser.add_argument("--models", nargs="*", help="only models whose name contains one of these words")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    rounds = args.rounds or (2 if args.quick else 5)
    models = [m for m in MODELS if not args.models or any(word.lower() in m.lower() for word in args.models)]
    if not models:
        parser.error(f"--models {args.models} matches none of {list(MODELS)}")
    load_before = os.getloadavg()[0]
    if load_before > 0.5:
        print(f"note: load average {load_before:.2f}: other processes share the cores, expect noise", flush=True)
    started = time.perf_counter()
    print("== the check alone against the memory floor", flush=True)
    kernel = kernel_ratios(models, repeats=10 if args.quick else 30)
    print(f"== training steps ({rounds} rounds of {args.steps} steps per variant)", flush=True)
    step = step_overhead(models, rounds, args.steps, reference=not args.quick)
    diagnosis: dict[str, float] = {}
    if not args.quick:
        print("== diagnosis", flush=True)
        diagnosis = diagnosis_cost()
    flags = "".join(f" {a}" for a in sys.argv[1:])
    settings = {
        "flags": flags,
        "rounds": rounds,
        "steps": args.steps,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }
    write_report(step, kernel, diagnosis, settings)
    print(f"wrote {DOCS / 'benchmarks.md'} and {DOCS / 'benchmarks.png'} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
