#!/usr/bin/env bash
# Benchmarks: writes docs/benchmarks.md, docs/benchmarks.png and docs/anomaly_mode_vs_nanguard.md.
#
#   bash scripts/bench.sh            # full run: about 12 minutes on a quiet 2-core machine
#   bash scripts/bench.sh --quick    # 2 rounds, no reference variants or diagnosis: about 4 minutes
#
# Other options go to python -m benchmarks.overhead (--rounds N, --steps N, --models WORD...; see its --help).
# Run it with nothing else busy: every number is a ratio of timings taken side by side, but other
# processes on the cores still add noise (docs/benchmarks.md records the load average).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
export OMP_NUM_THREADS=2 MKL_NUM_THREADS=2  # the benchmarks pin torch to 2 threads too
python -m benchmarks.overhead "$@"
if [ "$#" -eq 0 ]; then
    python -m benchmarks.compare_anomaly_mode
fi
