#!/usr/bin/env bash
# Set up .venv (first run only) and run the whole test suite plus ruff, mypy and the import contracts.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
ensure_browser
echo "== ruff"; ruff check lightning_nanguard lightning_nanguard_tensorboard tests examples benchmarks studies
echo "== mypy"; mypy
echo "== import contracts"; lint-imports
echo "== pytest"; python -m pytest -n 2 --dist loadfile "$@"  # two workers, one file each at a time (module fixtures run once)
