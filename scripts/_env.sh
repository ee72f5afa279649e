# Sourced by scripts/demo.sh and scripts/test.sh: create ./.venv and install the project into it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
STAMP=.venv/.nanguard-installed
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ requirements/dev-constraints.txt -nt "$STAMP" ]; then
    # torch first, pinned, so no resolver ever reaches for a CUDA build.
    .venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check \
        -c requirements/dev-constraints.txt -e ".[dev]"
    touch "$STAMP"
fi
export PATH="$ROOT/.venv/bin:$PATH"
