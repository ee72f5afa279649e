"""The guard's fixed per-step cost as counted by valgrind: instructions and cache misses inside its hooks.

Run from the repository root (needs ``valgrind`` and a C compiler with valgrind's headers)::

    python -m benchmarks.fixed_instructions                       # this checkout, 100 steps after 20
    python -m benchmarks.fixed_instructions --against /tmp/base   # side by side with another checkout
    python -m benchmarks.fixed_instructions --hook on_train_batch_start   # one hook's share
    python -m benchmarks.fixed_instructions --region lightning_nanguard.detect.spikes:SpikeDetector._refresh

The model is :mod:`benchmarks.fixed_cost`'s ``Linear(2, 1)``: what the guard executes per step there is
its own Python and the handful of kernels it launches whatever the model. Wall time on a shared
machine moves by a factor of two between runs of the same code; instruction counts do not (the runs
use one ``PYTHONHASHSEED``): callgrind counts only inside the guard's hooks (collection is switched on
and off where :class:`~lightning_nanguard.core.timing.GuardClock` times a hook) and simulates the
caches, which the rest of Lightning's step evicts between two hooks. Printed per step: instructions
(``Ir``), first-level instruction and data misses (``I1mr``, ``D1mr``, ``D1mw``), last-level misses,
and ``est. cycles``: ``Ir + 10 x (first-level misses) + 100 x (last-level misses)``, the usual rough
weighting, which tracked the wall-time ratios of :mod:`benchmarks.fixed_cost` within a few percent here.
``--region MODULE:QUALNAME`` counts inside one function or method of the package instead (its
outermost calls, whatever calls it, averaged over all steps): where a hook's instructions go. Each
call also counts the switch itself, about 2,400 instructions (a ``ctypes`` call): compare regions
with each other and with an empty one (``...step.window:StepWindow.close``).
Both checkouts run at once (one process each): two cores are enough.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EVENTS = ("Ir", "Dr", "Dw", "I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw")
_TOGGLE_SOURCE = """
#include <valgrind/callgrind.h>
void cg_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void cg_zero(void) { CALLGRIND_ZERO_STATS; }
void cg_start(void) { CALLGRIND_START_INSTRUMENTATION; }
"""


def _toggle_library(directory: Path) -> Path:
    """Compile the three callgrind client requests into a shared library (no-ops outside valgrind)."""
    source, library = directory / "cgtoggle.c", directory / "libcgtoggle.so"
    source.write_text(_TOGGLE_SOURCE)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library


def _fit_under_callgrind(
    library: str, steps: int, warmup: int, hook: str | None = None, region: str | None = None
) -> None:
    """The fit, inside valgrind: counting only inside the guard's timed hooks (or ``region``), zeroed after warm-up."""
    import tempfile as _tempfile
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from lightning.pytorch import Callback
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.fixed_cost import _Tiny
    from benchmarks.models import benchmark_trainer
    from lightning_nanguard import NanGuard
    from lightning_nanguard.core import timing

    torch.set_num_threads(1)
    requests = ctypes.CDLL(library)
    toggle = requests.cg_toggle
    enter, leave = timing._Measurement.__enter__, timing._Measurement.__exit__

    def measured_enter(self: timing._Measurement) -> None:
        enter(self)
        if hook is None or self._name == hook:
            toggle()

    def measured_exit(self: timing._Measurement, *exc: object) -> None:
        if hook is None or self._name == hook:
            toggle()
        leave(self, *exc)

    if region is not None:
        _count_inside(region, toggle)
    else:
        timing._Measurement.__enter__ = measured_enter  # type: ignore[method-assign]
        timing._Measurement.__exit__ = measured_exit  # type: ignore[method-assign]

    class _Counting(Callback):  # instrumented a few steps before counting: the simulated caches are warm
        def on_train_batch_start(self, trainer: object, pl_module: object, batch: object, batch_idx: int) -> None:
            if batch_idx == max(0, warmup - 5):
                requests.cg_start()
            if batch_idx == warmup:
                requests.cg_zero()

    x = torch.randn((steps + warmup) * 4, 2)
    loader = DataLoader(TensorDataset(x, x.sum(1)), batch_size=4)
    guard = NanGuard(verbose=False)
    guard.clock.enabled = True
    with _tempfile.TemporaryDirectory() as root:
        trainer = benchmark_trainer(root, steps + warmup, [_Counting(), guard])
        trainer.fit(_Tiny(), loader)


def _count_inside(region: str, toggle: Callable[[], object]) -> None:
    """Switch collection on and off around the outermost calls of ``region`` (``module:Qual.name``)."""
    module_name, _, qualified = region.partition(":")
    owner: Any = importlib.import_module(module_name)
    *path, name = qualified.split(".")
    for attribute in path:
        owner = getattr(owner, attribute)
    function = getattr(owner, name)
    depth = 0

    @functools.wraps(function)
    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal depth
        depth += 1
        if depth == 1:
            toggle()
        try:
            return function(*args, **kwargs)
        finally:
            if depth == 1:
                toggle()
            depth -= 1

    setattr(owner, name, counted)


def _start(checkout: str, library: Path, out: Path, args: argparse.Namespace, cwd: Path) -> subprocess.Popen[bytes]:
    """valgrind on a fresh process importing the package of ``checkout`` (this checkout's benchmarks)."""
    command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no", "--cache-sim=yes"]
    command += [f"--callgrind-out-file={out}", sys.executable, "-m", "benchmarks.fixed_instructions", "--inside"]
    command += [str(library), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    command += ["--hook", args.hook] if args.hook else []
    command += ["--region", args.region] if args.region else []
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    env["PYTHONPATH"] = os.pathsep.join([checkout, os.environ.get("PYTHONPATH", "")])
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _per_step(out: Path, steps: int) -> dict[str, float]:
    """The ``summary:`` line of a callgrind output, per step."""
    line = next(line for line in out.read_text().splitlines() if line.startswith("summary:"))
    counts = [int(value) for value in line.split()[1:]]
    per = dict.fromkeys(EVENTS, 0.0)  # callgrind leaves trailing zero counts out of the line
    per |= {name: count / steps for name, count in zip(EVENTS, counts, strict=False)}
    first, last = per["I1mr"] + per["D1mr"] + per["D1mw"], per["ILmr"] + per["DLmr"] + per["DLmw"]
    per["est. cycles"] = per["Ir"] + 10 * first + 100 * last
    return per


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="steps counted (default 100)")
    parser.add_argument("--warmup", type=int, default=20, help="steps before counting (default 20)")
    parser.add_argument("--against", metavar="CHECKOUT", help="another checkout's root, counted side by side")
    parser.add_argument("--hook", help="count inside this hook only (e.g. on_before_optimizer_step)")
    parser.add_argument("--region", metavar="MODULE:QUALNAME", help="count inside this function of the package only")
    parser.add_argument("--inside", metavar="LIBRARY", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        _fit_under_callgrind(args.inside, args.steps, args.warmup, args.hook, args.region)
        return
    if shutil.which("valgrind") is None or shutil.which("cc") is None:
        sys.exit("fixed_instructions: needs valgrind and a C compiler (apt install valgrind gcc).")
    checkouts = {"this checkout": str(ROOT)} | ({"against": args.against} if args.against else {})
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        library = _toggle_library(directory)
        shutil.copytree(ROOT / "benchmarks", directory / "benchmarks", ignore=shutil.ignore_patterns("__pycache__"))
        runs = {
            name: _start(path, library, directory / f"out.{i}", args, directory)
            for i, (name, path) in enumerate(checkouts.items())
        }
        results = {}
        for i, (name, process) in enumerate(runs.items()):
            _, errors = process.communicate()
            if process.returncode != 0:
                sys.exit(f"fixed_instructions: the run of {name} failed:\n{errors.decode()[-3000:]}")
            results[name] = _per_step(directory / f"out.{i}", args.steps)
    shown = ("Ir", "I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "est. cycles")
    print(f"per guarded step, {args.steps} steps after {args.warmup}:  " + "  ".join(f"{n:>11s}" for n in shown))
    for name, per in results.items():
        print(f"  {name:14s}" + " " * 22 + "  ".join(f"{per[n]:11,.0f}" for n in shown))
    if args.against:
        here, there = results["this checkout"], results["against"]
        cycles = here["est. cycles"] / there["est. cycles"]
        print(f"ratio this/against: Ir {here['Ir'] / there['Ir']:.3f}, est. cycles {cycles:.3f}")


if __name__ == "__main__":
    main()
