#!/usr/bin/env bash
# Run the same tests N times in a row and tell how many runs were green: a flaky test shows up here.
#
#   bash scripts/flake_check.sh [N] <pytest node ids, files or options...>
#   bash scripts/flake_check.sh 20 tests/tensorboard/test_dashboard_browser.py
#   bash scripts/flake_check.sh tests/tensorboard/test_dashboard_browser.py::test_run_selector   # N = 20
#
# Each run is `.venv/bin/python -m pytest -q -p no:cacheprovider -ra <args>` from the repository root;
# a failed run does not stop the next one. Prints one row per run (green or not, pytest's exit status,
# wall time, pytest's summary line), the number of green runs and, for each run that failed, the ids
# of the tests that failed or errored. Exits 1 when any run was not green (exit status other than 0),
# 2 on a usage error. Each run's full output is kept in FLAKE_LOG_DIR (default: a new temporary folder).
# FLAKE_TIMEOUT=<seconds> stops a run that takes longer (counted as failed, exit status 124).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

RUNS=20
if [ $# -gt 0 ] && [[ "$1" =~ ^[0-9]+$ ]]; then
    RUNS="$1"
    shift
fi
if [ $# -eq 0 ] || [ "$RUNS" -lt 1 ]; then
    echo "usage: bash scripts/flake_check.sh [N (default 20)] <pytest node ids or files...>" >&2
    exit 2
fi
PYTHON=.venv/bin/python
if [ ! -x "$PYTHON" ]; then
    echo "no $ROOT/$PYTHON: create the virtual environment first (bash scripts/test.sh does)" >&2
    exit 2
fi
LOG_DIR="${FLAKE_LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/flake_check.XXXXXX")}"
mkdir -p "$LOG_DIR"
LIMIT=()
if [ -n "${FLAKE_TIMEOUT:-}" ]; then
    LIMIT=(timeout --kill-after=30 "$FLAKE_TIMEOUT")
fi

echo "== $RUNS runs of: pytest -q -p no:cacheprovider -ra $*"
echo "== logs: $LOG_DIR/run-<n>.log"
printf '%-5s %-6s %-4s %9s  %s\n' run result rc seconds "pytest summary"

green=0
failed_runs=()
total_start=$(date +%s.%N)
for ((run = 1; run <= RUNS; run++)); do
    log="$LOG_DIR/run-$run.log"
    start=$(date +%s.%N)
    "${LIMIT[@]}" "$PYTHON" -m pytest -q -p no:cacheprovider -ra "$@" >"$log" 2>&1
    rc=$?
    seconds=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    # pytest's last line: "11 passed, 2 warnings in 45.37s" (or "1 failed, 10 passed ...")
    summary=$(grep -E '^=*[ ]*[0-9]+ (passed|failed|error|errors|skipped|deselected|xfailed|xpassed)|no tests ran' "$log" \
        | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
    if [ "$rc" -eq 0 ]; then
        result=pass
        green=$((green + 1))
    else
        result=FAIL
        failed_runs+=("$run")
    fi
    printf '%-5s %-6s %-4s %9s  %s\n' "$run" "$result" "$rc" "$seconds" "${summary:-(no summary: see the log)}"
done
total=$(awk -v a="$total_start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.0f", b - a }')

echo
echo "== green runs: $green of $RUNS (${total}s in all)"
if [ ${#failed_runs[@]} -eq 0 ]; then
    exit 0
fi
echo "== failing tests, by run:"
for run in "${failed_runs[@]}"; do
    log="$LOG_DIR/run-$run.log"
    # the short summary (-ra): "FAILED tests/x.py::test_y - AssertionError: ..." / "ERROR tests/x.py::test_z - ..."
    ids=$(grep -E '^(FAILED|ERROR) ' "$log" | sed -E 's/^(FAILED|ERROR) ([^ ]+).*/\1 \2/' | sort -u)
    if [ -z "$ids" ]; then
        ids="(no failing test id in the output, e.g. a collection error or a timeout: see $log)"
    fi
    while IFS= read -r line; do
        printf '  run %-4s %s\n' "$run" "$line"
    done <<<"$ids"
done
echo "== failures by test:"
for run in "${failed_runs[@]}"; do
    grep -E '^(FAILED|ERROR) ' "$LOG_DIR/run-$run.log" | sed -E 's/^(FAILED|ERROR) ([^ ]+).*/\2/' | sort -u
done | sort | uniq -c | sort -rn | sed 's/^/  /'
exit 1
