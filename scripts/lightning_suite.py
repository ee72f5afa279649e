"""Lightning's own tests, run twice: without and with ``NanGuard()`` added to every ``Trainer``.

"Nothing changes for anyone who did not ask": a guard that is only present must not change what
Lightning's own test suite sees. This runs the chosen folders of Lightning's ``tests/tests_pytorch``
(from the Lightning repository, at the release under test) once as they are and once with the pytest
plugin ``scripts/lightning_nanguard_suite_plugin.py`` appending ``NanGuard()`` to every Trainer's
callbacks, then prints every test whose outcome differs, each with its known reason
(:data:`EXPECTED`, the table on the compatibility page) or ``UNEXPECTED``, the tests in which the
guard found bad steps or spikes, and those in which it switched a part of itself off or turned itself
off (with the traceback it logged).

    git clone --depth 1 --branch 2.6.5 https://github.com/Lightning-AI/pytorch-lightning /tmp/pl
    pip install -c requirements/dev-constraints.txt -r requirements/lightning-suite.txt
    python scripts/lightning_suite.py /tmp/pl/tests/tests_pytorch --out /tmp/lightning-suite
    python scripts/lightning_suite.py /tmp/pl/tests/tests_pytorch --compare
    python scripts/lightning_suite.py /tmp/pl/tests/tests_pytorch --folders loops --guard-args '{"precursors": false}'
    python scripts/lightning_suite.py /tmp/pl/tests/tests_pytorch --folders loops -- -k "test_fit"

The first runs both sides and compares them (results, logs and summary.txt in --out, by default
/tmp/lightning-suite); --compare compares the last runs again; --only runs one side; --guard-args
passes NanGuard arguments; what follows -- goes to pytest.

Exit status 0 when every difference is expected and the guard never turned itself off, 1 otherwise.
Lightning's own ``pyproject.toml`` (two levels above ``tests_pytorch``) supplies the pytest settings
its tests expect (strict markers, ``xfail_strict``, ``error::FutureWarning``). With pytest-xdist
installed the tests run in parallel (``--workers``); pytest-timeout, when installed, stops a hung test.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
FOLDERS = ("callbacks", "loops", "trainer/optimization", "trainer/logging_", "checkpointing")
RUNS = ("without", "with")
GUARD_OFF = ("disabled itself", "own check failed", "turns itself off")  # the guard's core failed: it is off
PART_OFF = ("part failed",)  # one optional part is off; bad steps are still skipped
ACTED = "NanGuard acted: "  # the plugin's note on a guard whose counters moved
FAILING = ("failed", "error")

REASONS = {
    "own scalars": "the guard logs its own scalars (nanguard/grad_norm, nanguard/bad_steps_total,"
    " nanguard/skipped_total, nanguard/spikes_total) through the Trainer's loggers every log_every_n_steps;"
    " the test asserts the exact list of log_metrics calls its mock logger received",
}
_THROUGHPUT = "tests_pytorch/callbacks/test_throughput_monitor.py::"
_LOGGING = "tests_pytorch/trainer/logging_/"
EXPECTED: dict[str, str] = {
    _THROUGHPUT + "test_throughput_monitor_fit": "own scalars",
    _THROUGHPUT + "test_throughput_monitor_fit_gradient_accumulation[1]": "own scalars",
    _THROUGHPUT + "test_throughput_monitor_fit_gradient_accumulation[3]": "own scalars",
    _THROUGHPUT + "test_throughput_monitor_fit_no_length_fn": "own scalars",
    _THROUGHPUT + "test_throughput_monitor_fit_with_validation": "own scalars",
    _THROUGHPUT + "test_throughput_monitor_variable_batch_size": "own scalars",
    _LOGGING + "test_eval_loop_logging.py::test_validation_step_log_with_tensorboard": "own scalars",
    _LOGGING + "test_train_loop_logging.py::test_log_metrics_epoch_step_values": "own scalars",
    _LOGGING + "test_train_loop_logging.py::test_log_on_train_start": "own scalars",
}
"""Known differences: node id (from ``tests_pytorch/`` on) -> why the guard changes its outcome (a key of REASONS).

Kept in step with the table "Lightning's own test suite" in ``docs/guide/compatibility.md``. The
throughput tests replace ``time.perf_counter`` process-wide; the guard binds its own clock at import,
so their fake timings reach only ``ThroughputMonitor``.
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tests", type=Path, help="Lightning's tests/tests_pytorch directory")
    parser.add_argument("--folders", nargs="+", default=list(FOLDERS), help="folders of tests_pytorch to run")
    parser.add_argument("--out", type=Path, default=Path("/tmp/lightning-suite"), help="results and logs go here")
    parser.add_argument("--only", choices=RUNS, help="run only this side (then compare with the other's last run)")
    parser.add_argument("--compare", action="store_true", help="run nothing: compare the last runs in --out")
    parser.add_argument("--workers", default="auto", help="pytest-xdist workers when it is installed (0: none)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per test, with pytest-timeout installed")
    parser.add_argument(
        "--guard-args", default="", help="NanGuard arguments as a JSON object, e.g. '{\"precursors\": false}'"
    )
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    return parser.parse_args(argv)


def versions() -> str:
    """The versions the runs used, for the summary."""
    names = ("lightning", "pytorch-lightning", "torch", "lightning-nanguard", "pytest")
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return f"Python {sys.version.split()[0]}; " + ", ".join(found)


def run_side(side: str, args: argparse.Namespace) -> float:
    """Run the folders once (``side`` "with" adds the guard); results to ``<out>/<side>.json``. Returns seconds."""
    tests = args.tests.resolve()
    results, log = args.out / f"{side}.json", args.out / f"{side}.log"
    results.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("NANGUARD", "NANGUARD_ARGS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SCRIPTS), env.get("PYTHONPATH", "")]))
    env["NANGUARD_SUITE_GUARD"] = "1" if side == "with" else "0"
    env["NANGUARD_SUITE_RESULTS"] = str(results)
    env["NANGUARD_SUITE_ARGS"] = args.guard_args
    command = [sys.executable, "-m", "pytest", *(f"{tests.name}/{folder}" for folder in args.folders)]
    command += ["-p", "lightning_nanguard_suite_plugin", "-p", "no:cacheprovider", "-q", "-rN", "--color=no"]
    if importlib.util.find_spec("xdist") is not None and args.workers not in ("0", ""):
        command += ["-n", args.workers]
    if importlib.util.find_spec("pytest_timeout") is not None:
        command += [f"--timeout={args.timeout}"]
    command += args.pytest_args
    print(f"== {side} the guard: {' '.join(command)}  (cwd {tests.parent}, log {log})", flush=True)
    start = time.monotonic()
    with log.open("w", encoding="utf-8") as out:
        subprocess.run(command, cwd=tests.parent, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    seconds = time.monotonic() - start
    if not results.is_file():
        sys.exit(f"pytest wrote no results ({side} the guard); see {log}:\n{log.read_text(encoding='utf-8')[-3000:]}")
    print(f"   {seconds / 60:.1f} min", flush=True)
    return seconds


def reason(nodeid: str) -> str | None:
    """Why the guard changes this test's outcome, if that is known (:data:`EXPECTED`)."""
    at = nodeid.find("tests_pytorch/")
    return EXPECTED.get(nodeid[at:] if at >= 0 else nodeid)


def _with_note(results: dict[str, dict[str, object]], marks: tuple[str, ...]) -> dict[str, list[str]]:
    """The tests in which one of the guard's notes contains one of ``marks``, with those notes."""
    found: dict[str, list[str]] = {}
    for nodeid, entry in sorted(results.items()):
        notes = [note for note in entry.get("guard", []) if any(mark in note for mark in marks)]  # type: ignore[union-attr]
        if notes:
            found[nodeid] = notes
    return found


def compare(out: Path) -> int:
    """Print the counts and every difference; 0 when all differences are expected and the guard never turned off."""
    without, with_ = (json.loads((out / f"{side}.json").read_text(encoding="utf-8")) for side in RUNS)
    lines = [versions()]
    for side, results in zip(RUNS, (without, with_), strict=True):
        counts = Counter(entry["outcome"] for entry in results.values())
        failing = sum(counts[o] for o in FAILING)
        shown = ", ".join(f"{counts[o]} {o}" for o in sorted(counts))
        lines.append(f"{side:>7} the guard: {len(results)} tests, {failing} failing ({shown})")
    differ = sorted(
        nodeid
        for nodeid in without.keys() | with_.keys()
        if without.get(nodeid, {}).get("outcome") != with_.get(nodeid, {}).get("outcome")
    )
    unexpected = [nodeid for nodeid in differ if reason(nodeid) is None]
    lines.append(f"{len(differ)} tests differ, {len(unexpected)} of them unexpected:")
    for nodeid in differ:
        before = without.get(nodeid, {}).get("outcome", "absent")
        after = with_.get(nodeid, {}).get("outcome", "absent")
        lines.append(f"  {nodeid}: {before} -> {after}  [{reason(nodeid) or 'UNEXPECTED'}]")
    for label in sorted({reason(nodeid) for nodeid in differ} - {None}):
        lines.append(f"  [{label}]: {REASONS[label]}")  # type: ignore[index]
    acted = _with_note(with_, (ACTED,))
    lines.append(f"The guard found bad steps or loss spikes in {len(acted)} tests:")
    lines.extend(f"  {nodeid}: {notes[0].removeprefix(ACTED)}" for nodeid, notes in acted.items())
    warnings = Counter(
        note.splitlines()[0] for entry in with_.values() for note in entry.get("guard", []) if ACTED not in note
    )
    lines.append(f"The guard's own warnings, by message ({sum(warnings.values())} in all):")
    lines.extend(f"  {count:5d} x {message}" for message, count in warnings.most_common())
    turned_off = _with_note(with_, GUARD_OFF)
    parts_off = _with_note(with_, PART_OFF)
    for title, tests in (("turned itself off", turned_off), ("switched one of its parts off", parts_off)):
        lines.append(f"The guard {title} in {len(tests)} tests:")
        for nodeid, notes in tests.items():
            lines.append(f"  {nodeid}")
            lines.extend("      " + line for note in notes for line in note.splitlines()[:60])
    text = "\n".join(lines)
    print(text)
    (out / "summary.txt").write_text(text + "\n", encoding="utf-8")
    return 1 if unexpected or turned_off else 0


def main(argv: list[str] | None = None) -> int:
    """Run both sides (or one, or none) and compare."""
    args = parse_args(argv)
    if not (args.tests / "conftest.py").is_file():
        sys.exit(f"{args.tests} is not Lightning's tests/tests_pytorch (no conftest.py there)")
    if not (args.tests.resolve().parents[1] / "pyproject.toml").is_file():
        print("warning: no pyproject.toml two levels above the tests: Lightning's pytest settings are missing")
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.compare:
        for side in (args.only,) if args.only else RUNS:
            run_side(side, args)
    return compare(args.out)


if __name__ == "__main__":
    sys.exit(main())
