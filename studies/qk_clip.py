"""Does NanGuard's opt-in QK-clip keep runs that collapse healthy? Measured on the collapse benchmark's runs.

Run from the repository root::

    python -m studies.qk_clip                      # tune on 5 runs, then the held-out runs (~15 min, 2 workers)
    python -m studies.qk_clip --stage tune          # the tuning grid only
    python -m studies.qk_clip --stage held-out --cap 50 --every 1

The runs, the model and the classification are ``studies/attention_collapse.py``'s (its traces
file, ``--traces``, default ``studies/traces/attention_collapse_runs.json``, not committed: ``python -m
studies.attention_collapse`` writes it, gives the unclipped runs and their healthy references). The
output of the run the docs cite is kept in ``studies/qk_clip_results.txt``. Each run here is the same training
(same seed, init and batches) with the guard's own QK-clip in the loop, as ``NanGuard`` runs it:
``PrecursorWatch(PrecursorSettings(every_n_steps=every, qk_clip=cap))`` arms before a sampled step's
forward, finishes after its backward, and clips after ``optimizer.step()`` (the benchmark's
``Attention`` declares its fused ``qkv`` rows through ``nanguard_qk_projections()``). The float64
side measurement of every step (max logit, entropy) is the benchmark's, so the classes are computed
exactly as there.

**Tuning set**: the collapsing runs of ``manual`` attention, 2 layers, seeds 0 and 1 (5 runs); caps
20, 50 and 100, every 1 and every 10 steps. **Held-out set**: every other collapsing run of the
benchmark: 2 layers, seeds 2 and 3, and 3 layers, seeds 0 and 1, both implementations (their
``sdpa`` twins of the tuning runs are left out: the same computation up to rounding), at the chosen
setting. **Healthy runs**: the benchmark's healthy runs at lr 0.03 and 0.05 (2 layers), to check that
the clip does not hurt a run that needed no help.

**Back-off** (``--stage backoff``): for comparison, no clip, but the learning rate multiplied by 0.5,
0.25 or 0.1 from the guard's first precursor warning on (its default rule, sampled every 10 steps),
on two of the tuning runs.

Reported per run: the class with and without the clip, the peak max logit, the lowest entropy as a
fraction of its steps 5-15 mean, the final loss against the healthy reference's, and how many
sampled steps clipped.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from lightning_nanguard.detect.precursors import PrecursorSettings
from lightning_nanguard.engine.step.precursors import PrecursorWatch
from studies.common import RunResult, classify, classify_all, final_loss, read_runs, reference_of, traces_file, train
from tests.helpers.collapse_gpt import RunConfig

TUNE_CAPS = (20.0, 50.0, 100.0)
TUNE_EVERY = (1, 10)


@dataclass(frozen=True)
class Job:
    config: RunConfig
    cap: float
    every: int


@dataclass
class Outcome:
    job: Job
    run: RunResult
    clipped_steps: int


def train_backed_off(config: RunConfig, factor: float) -> tuple[RunResult, int | None]:
    """No clip; the learning rate times ``factor`` from the guard's first precursor warning on."""
    watch = PrecursorWatch(PrecursorSettings(max_cost=None))
    warned: list[int] = []

    def after_update(step: int) -> float:
        if watch.judge(watch.ready()) and not warned:
            warned.append(step)
        return factor if warned else 1.0

    run = train(config, watch, after_update)
    return run, (warned[0] if warned else None)


def train_clipped(job: Job) -> Outcome:
    """The guard's QK-clip after each sampled step's update (the interval fixed: no cost limit)."""
    watch = PrecursorWatch(PrecursorSettings(every_n_steps=job.every, qk_clip=job.cap, max_cost=None))
    clipped = 0

    def after_update(step: int) -> float:
        nonlocal clipped
        watch.clip()
        clipped += any(s.max_logit > job.cap for s in watch.ready())
        return 1.0

    run = train(job.config, watch, after_update)
    assert sorted(watch.projections) == [f"blocks.{i}.attn" for i in range(job.config.n_layers)]
    return Outcome(job, run, clipped)


def reference_run(config: RunConfig, runs: dict[RunConfig, RunResult]) -> RunResult:
    return runs[reference_of(config)]


def run_jobs(jobs: list[Job], workers: int) -> list[Outcome]:
    if workers <= 1:
        return [train_clipped(job) for job in jobs]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(train_clipped, jobs))


def table(outcomes: list[Outcome], runs: dict[RunConfig, RunResult]) -> dict[str, int]:
    """Print one line per run; the count of classes with the clip."""
    print(
        f"{'run':28s} {'L':>1s} {'cap':>4s} {'every':>5s} {'unclipped':10s} {'clipped':10s} {'peak':>7s} "
        f"{'(was)':>7s} {'ent min':>7s} {'final':>5s} {'(was)':>5s} {'ref':>5s} {'clips':>5s}"
    )
    classes: dict[str, int] = {}
    for outcome in outcomes:
        cfg = outcome.job.config
        ref = reference_run(cfg, runs)
        before = classify(runs[cfg], ref, False)
        after = classify(outcome.run, ref, False)
        classes[after.cls] = classes.get(after.cls, 0) + 1
        print(
            f"{cfg.name:28s} {cfg.n_layers:1d} {outcome.job.cap:4g} {outcome.job.every:5d} {before.cls:10s} "
            f"{after.cls:10s} {max(max(t.max_logit) for t in outcome.run.layers.values()):7.1f} "
            f"{before.peak_logit:7.0f} {after.min_entropy_ratio:7.2f} {after.final_loss:5.2f} "
            f"{before.final_loss:5.2f} {final_loss(ref):5.2f} {outcome.clipped_steps:5d}"
        )
    return classes


def collapsing(runs: dict[RunConfig, RunResult]) -> list[RunConfig]:
    rows = classify_all(runs)
    return sorted((cfg for cfg, row in rows.items() if row.cls == "collapse"), key=lambda c: c.name)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--stage", choices=["tune", "held-out", "backoff", "all"], default="all")
    parser.add_argument("--cap", type=float, default=50.0, help="the held-out setting's cap")
    parser.add_argument("--every", type=int, default=10, help="the held-out setting's sampling")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the per-run results as JSON")
    parser.add_argument(
        "--traces", type=Path, default=traces_file("attention_collapse"), help="the collapse study's traces"
    )
    args = parser.parse_args(argv)
    runs, _ = read_runs(args.traces)
    collapses = collapsing(runs)
    tune = [c for c in collapses if c.attention == "manual" and c.n_layers == 2 and c.seed in (0, 1)]
    twins = {replace(c, attention="sdpa") for c in tune}
    held_out = [c for c in collapses if c not in tune and c not in twins]
    start = time.perf_counter()
    summary: dict[str, dict[str, int]] = {}
    if args.stage in ("tune", "all"):
        print(f"tuning on {len(tune)} collapsing runs")
        jobs = [Job(c, cap, every) for cap in TUNE_CAPS for every in TUNE_EVERY for c in tune]
        outcomes = run_jobs(jobs, args.workers)
        for cap in TUNE_CAPS:
            for every in TUNE_EVERY:
                chosen = [o for o in outcomes if o.job.cap == cap and o.job.every == every]
                summary[f"tune cap {cap:g} every {every}"] = table(chosen, runs)
    if args.stage in ("held-out", "all"):
        healthy = [
            c
            for c, run in runs.items()
            if c.n_layers == 2 and c.lr in (0.03, 0.05) and not c.qk_norm and c.attention == "manual"
        ]
        print(f"\nheld-out: {len(held_out)} collapsing runs, cap {args.cap:g}, every {args.every}")
        outcomes = run_jobs(
            [Job(c, args.cap, args.every) for c in held_out + sorted(healthy, key=lambda c: c.name)], args.workers
        )
        summary["held-out"] = table(outcomes[: len(held_out)], runs)
        print("\nhealthy runs with the clip on")
        summary["healthy"] = table(outcomes[len(held_out) :], runs)
        if args.out is not None:
            args.out.write_text(json.dumps({"summary": summary}, indent=1) + "\n")
    if args.stage in ("backoff", "all"):
        print("\nlearning rate backed off at the first warning (no clip)")
        for cfg in [c for c in tune if (c.lr, c.seed) in ((0.1, 0), (0.15, 1))]:
            ref = reference_run(cfg, runs)
            for factor in (0.5, 0.25, 0.1):
                run, warned = train_backed_off(cfg, factor)
                row = classify(run, ref, False)
                print(
                    f"{cfg.name:28s} x{factor:<4g} warned at {warned}: {row.cls}, peak {row.peak_logit:.0f}, "
                    f"final loss {row.final_loss:.2f} (reference {final_loss(ref):.2f})"
                )
    print(f"\nclasses with the clip: {json.dumps(summary)}")
    print(f"wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
