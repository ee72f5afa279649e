"""Where the guard's per-step time goes: cProfile of NanGuard's own code on one benchmark model.

Run from the repository root::

    python -m benchmarks.profile_guard                      # the 1,500-small-tensor model, 60 steps
    python -m benchmarks.profile_guard --model ResNet --steps 100

Prints ``guard.clock`` per callable (milliseconds per step, wall time without the profiler) and
the functions of ``lightning_nanguard`` with the most cumulative time under cProfile (which adds
its own overhead to every Python call: compare functions with each other, not with the clock).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile

import torch

from benchmarks.models import MODELS, benchmark_trainer, make
from lightning_nanguard import NanGuard


def run(model_name: str, steps: int, profile: bool) -> tuple[NanGuard, cProfile.Profile | None]:
    module, loader = make(model_name, batches=steps)
    guard = NanGuard(verbose=False)
    guard.clock.enabled = True
    with tempfile.TemporaryDirectory() as root:
        trainer = benchmark_trainer(root, steps, [guard])  # as benchmarks/overhead.py runs it
        profiler = cProfile.Profile() if profile else None
        if profiler is not None:
            profiler.enable()
        trainer.fit(module, loader)
        if profiler is not None:
            profiler.disable()
    return guard, profiler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="1,500", help="a word of the benchmark model's name")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--top", type=int, default=25, help="functions to list")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model_name = next((m for m in MODELS if args.model.lower() in m.lower()), None)
    if model_name is None:
        parser.error(f"--model {args.model!r} matches none of {list(MODELS)}")
    guard, _ = run(model_name, args.steps, profile=False)
    print(f"{model_name}, {args.steps} steps: guard.clock, ms per step (no profiler)")
    for name, seconds in sorted(guard.clock.seconds.items(), key=lambda kv: -kv[1]):
        print(f"  {name:28s} {seconds * 1e3 / args.steps:8.3f}   ({guard.clock.calls[name]} calls)")
    _, profiler = run(model_name, args.steps, profile=True)
    assert profiler is not None
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out).sort_stats("cumulative")
    stats.print_stats("lightning_nanguard", args.top)
    print(out.getvalue())


if __name__ == "__main__":
    main()
