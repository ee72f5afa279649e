#!/usr/bin/env bash
# Set up .venv (first run only) and run the benchmarks; writes docs/benchmarks.md and docs/benchmarks.png.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
python benchmarks/overhead.py "$@"
python benchmarks/compare_anomaly_mode.py
