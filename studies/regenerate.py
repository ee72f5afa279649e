"""Write every study's per-step traces again: the JSON files the repository no longer carries.

Run from the repository root::

    python -m studies.regenerate                 # every traces file, in studies/traces/ (~35 min on 2 cores)
    python -m studies.regenerate --quick         # the studies' smoke grids, in studies/traces/quick/ (~2 min)
    python -m studies.regenerate --only attention_collapse precursor_rows

In order (a later study reads the first one's traces): ``attention_collapse`` (88 runs, 2 workers,
~530 s on a shared 2-core machine), ``precursor_rows`` (44 runs, ~530 s on one worker, about half
with ``--workers 2``), ``other_precursors`` (44 runs, one process, ~500 s) and
``hf_attention_collapse`` (36 runs, one process, ~470-610 s; needs ``transformers``, skipped with a
note without it). Each prints its own tables as it goes (the numbers the docs cite); each file's
``meta`` records its command and wall time. ``precursor_rule.py``, ``qk_clip.py`` and the
``--replay`` options read these files; ``spike_margins.py`` writes ``docs/spikes.md`` instead and is
not run here.

``--quick`` runs each study's ``--quick`` grid (``precursor_rows`` then re-trains the quick collapse
runs): a smoke test of the whole chain, not the documented numbers, written to ``studies/traces/quick/``
so that it never replaces the full traces.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from studies import attention_collapse, hf_attention_collapse, other_precursors, precursor_rows
from studies.common import TRACES

STUDIES = ("attention_collapse", "precursor_rows", "other_precursors", "hf_attention_collapse")


def _plan(out: Path, quick: bool, workers: int) -> dict[str, tuple[Callable[[Sequence[str]], None], list[str]]]:
    """Each study's ``main`` and its arguments, writing into ``out``."""
    quick_flag = ["--quick"] if quick else []
    collapse = out / "attention_collapse_runs.json"
    return {
        "attention_collapse": (
            attention_collapse.main,
            [*quick_flag, "--workers", str(workers), "--out", str(collapse)],
        ),
        "precursor_rows": (
            precursor_rows.main,
            ["--workers", str(workers), "--traces", str(collapse), "--out", str(out / "precursor_rows_runs.json")],
        ),
        "other_precursors": (other_precursors.main, [*quick_flag, "--out", str(out / "other_precursors_runs.json")]),
        "hf_attention_collapse": (
            hf_attention_collapse.main,
            [*quick_flag, "--out", str(out / "hf_attention_collapse_runs.json")],
        ),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the smoke grids, into studies/traces/quick/")
    parser.add_argument("--only", nargs="+", choices=STUDIES, help="these studies only (in the order above)")
    parser.add_argument("--workers", type=int, default=2, help="processes for the studies that use several")
    args = parser.parse_args(argv)
    out = TRACES / "quick" if args.quick else TRACES
    out.mkdir(parents=True, exist_ok=True)
    chosen = [name for name in STUDIES if args.only is None or name in args.only]
    times: dict[str, float] = {}
    for name, (run, arguments) in _plan(out, args.quick, args.workers).items():
        if name not in chosen:
            continue
        if name == "hf_attention_collapse" and importlib.util.find_spec("transformers") is None:
            print(f"\n== {name}: skipped, transformers is not installed (pip install -e '.[dev]')", flush=True)
            continue
        print(f"\n== python -m studies.{name} {' '.join(arguments)}", flush=True)
        start = time.perf_counter()
        run(arguments)
        times[name] = time.perf_counter() - start
    print("\n" + "; ".join(f"{name} {seconds:.0f} s" for name, seconds in times.items()))
    print(f"total {sum(times.values()):.0f} s; traces in {out}")


if __name__ == "__main__":
    main()
