"""How many batch rows the precursor watch must measure: the rule on row 0, on 4 rows, on the whole batch.

Run from the repository root::

    python benchmarks/precursor_rows.py              # the 44 hand-written-attention runs of the grid (~8 min, 1 core)
    python benchmarks/precursor_rows.py --workers 2

``benchmarks/attention_collapse.py`` calibrated the guard's rule on the max logit of the **whole
batch** (32 rows); the guard measures the first ``rows`` rows of each attention call. This script
re-trains the grid's ``manual`` runs (their ``sdpa`` twins are the same computation) exactly as
that benchmark does, recording each layer's max logit over batch row 0, rows 0-3 and all 32 rows,
and replays the guard's ``LogitGrowthRule`` (defaults: above 80 and 2x within 20 steps, sampled
every 10 steps) on each view. The classes and onsets are the benchmark's (from its traces file).
Printed per view: collapsing runs warned >= 10 steps before the entropy onset (0.1x) and before the
loss stall, the module named, and warnings on healthy and reference runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention_collapse as bench

from lightning_nanguard.detect.precursors import LogitGrowthRule

VIEWS = {"row 0": 1, "rows 0-3": 4, "all 32 rows": 32}
OUT = Path(__file__).resolve().parent / "precursor_rows_runs.json"


def _train(config: bench.RunConfig) -> dict[str, dict[str, list[float]]]:
    """The run's per-step max logit of every layer, per view (same training as ``attention_collapse.train``)."""
    seen: list[tuple[Tensor, Tensor]] = []
    measure = bench.attention_signals

    def recording(q: Tensor, k: Tensor) -> tuple[float, float, float]:
        seen.append((q.detach(), k.detach()))
        return measure(q, k)

    bench.attention_signals = recording  # Attention.forward looks it up at call time
    try:
        views: dict[str, dict[str, list[float]]] = {view: {} for view in VIEWS}
        names = [f"blocks.{i}.attn" for i in range(config.n_layers)]
        original_train = bench.train

        def after_forward() -> None:
            for name, (q, k) in zip(names, seen, strict=True):
                length, dim = q.shape[-2], q.shape[-1]
                logits = (q.double() @ k.double().transpose(-2, -1)) / dim**0.5
                hidden = torch.ones(length, length, dtype=torch.bool).triu(1)
                logits = logits.masked_fill(hidden, float("-inf"))
                for view, rows in VIEWS.items():
                    views[view].setdefault(name, []).append(float(logits[:rows].amax()))
            seen.clear()

        class Hooked(bench.TinyGPT):
            def forward(self, idx: Tensor) -> Tensor:
                out = super().forward(idx)
                after_forward()
                return out

        bench.TinyGPT = Hooked  # type: ignore[misc]
        try:
            original_train(config)
        finally:
            bench.TinyGPT = Hooked.__mro__[1]  # type: ignore[misc]
        return views
    finally:
        bench.attention_signals = measure


def first_warning(layers: dict[str, list[float]], every: int = 10) -> tuple[int, str] | None:
    rule = LogitGrowthRule(80.0, 2.0, 20, cooldown=100)
    steps = len(next(iter(layers.values())))
    for step in range(0, steps, every):
        for name in sorted(layers):
            if rule.observe(name, step, layers[name][step]) is not None:
                return step, name
    return None


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--replay", action="store_true", help=f"score {OUT.name} without training")
    args = parser.parse_args(argv)
    data = json.loads(bench.DEFAULT_OUT.read_text())
    runs = [r for r in data["runs"] if r["config"]["attention"] == "manual"]
    configs = [bench.RunConfig(**r["config"]) for r in runs]
    start = time.perf_counter()
    if args.replay:
        traces = json.loads(OUT.read_text())
    else:
        if args.workers > 1:
            with ProcessPoolExecutor(args.workers) as pool:
                results = list(pool.map(_train, configs))
        else:
            results = [_train(c) for c in configs]
        traces = {r["name"] + f"/L{r['config']['n_layers']}": v for r, v in zip(runs, results, strict=True)}
        rounded = {
            k: {view: {n: [bench.sig4(x) for x in xs] for n, xs in layers.items()} for view, layers in v.items()}
            for k, v in traces.items()
        }
        OUT.write_text(json.dumps(rounded, separators=(",", ":")) + "\n")
    print(f"{len(runs)} runs, {time.perf_counter() - start:.0f} s")
    for view in VIEWS:
        in_time = before_stall = right = collapses = alarms = quiet = 0
        leads: list[int] = []
        for run in runs:
            row: dict[str, Any] = run["row"]
            warning = first_warning(traces[run["name"] + f"/L{run['config']['n_layers']}"][view])
            if row["cls"] == "collapse":
                collapses += 1
                if warning is not None:
                    lead = row["onset_strict"] - warning[0]
                    leads.append(lead)
                    in_time += lead >= 10
                    before_stall += row["stall"] - warning[0] >= 10
                    right += warning[1] == row["onset_layer"]
            elif row["cls"] in ("healthy", "reference"):
                quiet += 1
                alarms += warning is not None
        median = statistics.median(leads) if leads else float("nan")
        print(
            f"{view:12s} warned >= 10 steps before the 0.1x onset {in_time}/{collapses} (median lead {median:g}), "
            f"before the stall {before_stall}/{collapses}, right module {right}/{collapses}, "
            f"false alarms {alarms}/{quiet}"
        )


if __name__ == "__main__":
    main()
