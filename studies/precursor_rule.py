"""The attention precursor rule replayed on stored training traces: lead, right module, false alarms.

Run from the repository root::

    python -m studies.precursor_rule                       # the defaults and a few alternatives
    python -m studies.precursor_rule --min-logit 100 --growth 1.5 --every 5

Reads ``studies/traces/attention_collapse_runs.json`` (``--traces``; written by ``python -m
studies.attention_collapse``, not committed: per-step max attention logit of every layer of 88 tiny
GPT runs, with each run's class, entropy onset and loss-stall step) and feeds each run's values,
sampled every ``--every`` steps, through the guard's own
:class:`~lightning_nanguard.detect.precursors.LogitGrowthRule` (``studies/common.py``'s
``guard_warning``). Printed per rule: collapsing runs warned at least 10 steps before the entropy
onset (entropy below 0.1 of its start) and before the loss stall, the median leads, whether the
module named is the collapsing one, and warnings on healthy runs.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from studies.common import guard_warning, load_traces, traces_file

TRACES = traces_file("attention_collapse")
DEFAULT = (80.0, 2.0, 20, 10)
ALTERNATIVES = [(80.0, 2.0, 20, 5), (80.0, 2.0, 20, 1), (100.0, 1.0001, 20, 10), (50.0, 3.0, 20, 10)]


def first_warning(run: dict[str, Any], min_logit: float, growth: float, window: int, every: int) -> Any:
    """``(step, module)`` of the run's first warning, or ``None``."""
    max_logits = {name: layer["max_logit"] for name, layer in run["layers"].items()}
    return guard_warning(max_logits, every, (min_logit, growth, window, 100))


def score(runs: list[dict[str, Any]], min_logit: float, growth: float, window: int, every: int) -> str:
    onset_leads, stall_leads, right, alarms, healthy, collapses = [], [], 0, 0, 0, 0
    for run in runs:
        row = run["row"]
        first = first_warning(run, min_logit, growth, window, every)
        if row["cls"] in ("healthy", "reference"):
            healthy += 1
            alarms += first is not None
        elif row["cls"] == "collapse":
            collapses += 1
            if first is not None:
                onset_leads.append(row["onset_strict"] - first[0])
                stall_leads.append(row["stall"] - first[0])
                right += first[1] == row["layer"]

    def share(leads: list[int]) -> str:
        early = sum(lead >= 10 for lead in leads)
        median = statistics.median(leads) if leads else float("nan")
        return f"{early:2d}/{collapses} (median lead {median:g})"

    rule = f"> {min_logit:g} and >= {growth:g}x within {window} steps, every {every}"
    return (
        f"{rule:42s} before onset {share(onset_leads)}  before stall {share(stall_leads)}  "
        f"right module {right}/{collapses}  healthy warned {alarms}/{healthy}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-logit", type=float)
    parser.add_argument("--growth", type=float)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--table", action="store_true", help="one row per run: onset, stall, warning, lead")
    parser.add_argument("--traces", type=Path, default=TRACES, help="the collapse study's traces")
    args = parser.parse_args()
    runs = load_traces(args.traces)["runs"]
    if args.min_logit is not None or args.growth is not None:
        rules = [(args.min_logit or DEFAULT[0], args.growth or DEFAULT[1], args.window, args.every)]
    else:
        rules = [DEFAULT, *ALTERNATIVES]
    for rule in rules:
        print(score(runs, *rule))
    if args.table:
        print(f"\n{'run':38s} {'class':10s} {'onset':>5s} {'stall':>5s} {'warned':>6s} {'lead':>5s}  module")
        for run in sorted(runs, key=lambda r: (r["row"]["cls"], r["name"])):
            row, first = run["row"], first_warning(run, *rules[0])
            onset = row.get("onset_strict") if row["cls"] == "collapse" else None
            lead = onset - first[0] if first is not None and onset is not None else None
            name = f"{run['name']} ({run['config']['n_layers']} layers)"
            print(
                f"{name:38s} {row['cls']:10s} {onset if onset is not None else '-':>5} "
                f"{row.get('stall') if row.get('stall') is not None else '-':>5} "
                f"{first[0] if first else '-':>6} {lead if lead is not None else '-':>5}  {first[1] if first else ''}"
            )


if __name__ == "__main__":
    main()
