# Sourced by scripts/demo.sh and scripts/test.sh: create ./.venv and install the project into it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
STAMP=.venv/.nanguard-installed
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ requirements/dev-constraints.txt -nt "$STAMP" ] \
    || [ requirements/litgpt.txt -nt "$STAMP" ]; then
    # torch first, pinned, so no resolver ever reaches for a CUDA build.
    .venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check \
        -c requirements/dev-constraints.txt -e ".[dev]"
    # LitGPT for its recipe tests, without its pins (see requirements/litgpt.txt)
    .venv/bin/python -m pip install --quiet --disable-pip-version-check \
        -c requirements/dev-constraints.txt -r requirements/litgpt.txt
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "litgpt==0.5.13"
    touch "$STAMP"
fi
export PATH="$ROOT/.venv/bin:$PATH"

# The dashboard's browser tests drive Debian's chromium through chromedriver. Install them when
# missing and allowed to (CI=true, root, apt-get); elsewhere those tests skip and say why.
ensure_browser() {
    if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
        return 0
    fi
    if [ "${CI:-}" = "true" ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        echo "== installing chromium and chromium-driver (browser tests)"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null \
            || echo "== chromium could not be installed: the browser tests will be skipped"
    else
        echo "== no /usr/bin/chromium + /usr/bin/chromedriver: the browser tests will be skipped" \
            "(install: apt-get install -y chromium chromium-driver)"
    fi
}
