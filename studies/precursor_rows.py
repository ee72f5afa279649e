"""How many batch rows the precursor watch must measure: the rule on row 0, on 4 rows, on the whole batch.

Run from the repository root::

    python -m studies.precursor_rows              # the 44 hand-written-attention runs of the grid (~8 min, 1 core)
    python -m studies.precursor_rows --workers 2
    python -m studies.precursor_rows --replay     # score studies/traces/precursor_rows_runs.json, no training

``studies/attention_collapse.py`` calibrated the guard's rule on the max logit of the **whole
batch** (32 rows); the guard measures the first ``rows`` rows of each attention call. This script
re-trains the grid's ``manual`` runs (their ``sdpa`` twins are the same computation) exactly as
that study does (``studies/common.py``'s ``fit``), recording each layer's max logit over batch row 0,
rows 0-3 and all 32 rows, and replays the guard's ``LogitGrowthRule`` (defaults: above 80 and 2x
within 20 steps, sampled every 10 steps) on each view. The runs, classes and onsets are those of
that study's traces (``--traces``, default ``studies/traces/attention_collapse_runs.json``: run
``python -m studies.attention_collapse`` first); the views go to ``--out`` (default
``studies/traces/precursor_rows_runs.json``; neither file is committed). Printed per view:
collapsing runs warned >= 10 steps before the entropy onset (0.1x) and before the loss stall, the
module named, and warnings on healthy and reference runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from studies.common import (
    attention_modules,
    dump_traces,
    fit,
    guard_warning,
    load_traces,
    sig4,
    tiny_gpt,
    traces_file,
)
from tests.helpers.collapse_gpt import RunConfig, causal_logits

VIEWS = {"row 0": 1, "rows 0-3": 4, "all 32 rows": 32}
OUT = traces_file("precursor_rows")


def _keep(store: dict[str, Tensor], key: str) -> Callable[[nn.Module, Any, Tensor], None]:
    """A forward hook that keeps the module's output (detached) in ``store[key]``."""

    def hook(module: nn.Module, args: Any, output: Tensor) -> None:
        store[key] = output.detach()

    return hook


def _train(config: RunConfig) -> dict[str, dict[str, list[float]]]:
    """The run's per-step max logit of every layer, per view (the training of ``common.train``)."""
    model = tiny_gpt(config)
    seen: dict[str, dict[str, Tensor]] = {}  # layer -> its last q and k (after the QK-norm, if any)
    for name, attn in attention_modules(model).items():
        seen[name] = {}
        attn.q_norm.register_forward_hook(_keep(seen[name], "q"))
        attn.k_norm.register_forward_hook(_keep(seen[name], "k"))
    views: dict[str, dict[str, list[float]]] = {view: {} for view in VIEWS}

    def record(step: int, loss: float) -> None:
        for name, qk in seen.items():
            logits = causal_logits(qk["q"], qk["k"])
            for view, rows in VIEWS.items():
                views[view].setdefault(name, []).append(float(logits[:rows].amax()))

    fit(config, model, record)
    return views


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--replay", action="store_true", help="score the views of --out without training")
    parser.add_argument(
        "--traces", type=Path, default=traces_file("attention_collapse"), help="the collapse study's traces"
    )
    parser.add_argument("--out", type=Path, default=OUT, help="the views' traces JSON")
    args = parser.parse_args(argv)
    data = load_traces(args.traces)
    runs = [r for r in data["runs"] if r["config"]["attention"] == "manual"]
    configs = [RunConfig(**r["config"]) for r in runs]
    start = time.perf_counter()
    if args.replay:
        traces = load_traces(args.out)
    else:
        if args.workers > 1:
            with ProcessPoolExecutor(args.workers) as pool:
                results = list(pool.map(_train, configs))
        else:
            results = [_train(c) for c in configs]
        traces = {r["name"] + f"/L{r['config']['n_layers']}": v for r, v in zip(runs, results, strict=True)}
        rounded = {
            k: {view: {n: [sig4(x) for x in xs] for n, xs in layers.items()} for view, layers in v.items()}
            for k, v in traces.items()
        }
        dump_traces(args.out, rounded)
    print(f"{len(runs)} runs, {time.perf_counter() - start:.0f} s")
    for view in VIEWS:
        in_time = before_stall = right = collapses = alarms = quiet = 0
        leads: list[int] = []
        for run in runs:
            row: dict[str, Any] = run["row"]
            warning = guard_warning(traces[run["name"] + f"/L{run['config']['n_layers']}"][view])
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
