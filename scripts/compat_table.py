"""The docs' compatibility table (``docs/guide/compatibility.md``), generated from the tests proving each row.

Every test marked ``@pytest.mark.compat(feature=..., kind=..., status=..., note=...)`` is a row:
``kind`` is ``"callback"`` (a Lightning callback), ``"flag"`` (a Trainer flag or call), ``"strategy"`` or
``"optimization"`` (manual optimisation, several optimizers, closure optimizers);
``status`` is ``"works"`` (the guard works with it, bad steps included) or ``"refused"`` (refused at
setup with a message that says why and what to do); ``note`` says what the test shows. Several tests
of one feature make one row (their notes joined). A row exists only while its test exists, and CI runs
the test, so the table cannot claim what no passing test shows.

    python scripts/compat_table.py           # rewrite the table in docs/guide/compatibility.md between its markers
    python scripts/compat_table.py --check   # exit 1 when that table is not what the tests say

The rows are read by collecting the tests (``pytest --collect-only``): nothing runs here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "guide" / "compatibility.md"
START, END = "<!-- compat-table:start -->", "<!-- compat-table:end -->"
KINDS = {
    "callback": "Lightning callbacks",
    "flag": "Trainer flags and calls",
    "strategy": "Strategies",
    "optimization": "Optimisation loops",
}
STATUS = {"works": "works", "refused": "refused at setup"}


def collect_rows() -> list[dict[str, str]]:
    """The ``compat`` markers of the test suite, one dict per test (collected by pytest in a subprocess)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        env = {**os.environ, "NANGUARD_COMPAT_ROWS": str(out)}
        command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "compat", "tests/integration"]
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        if not out.exists():
            raise SystemExit(f"collecting the compat tests failed:\n{result.stdout}\n{result.stderr}")
        rows: list[dict[str, str]] = json.loads(out.read_text(encoding="utf-8"))
    return rows


def render(rows: Iterable[Mapping[str, str]]) -> str:
    """The markdown of the table: one section per kind, one row per feature (its tests' notes joined)."""
    merged: dict[tuple[str, str], dict[str, list[str]]] = {}
    for row in rows:
        entry = merged.setdefault((row["kind"], row["feature"]), {"status": [], "note": [], "tests": []})
        entry["status"].append(row["status"])
        if row["note"] and row["note"] not in entry["note"]:
            entry["note"].append(row["note"])
        entry["tests"].append(row["test"])
    lines = [START, ""]
    for kind, title in KINDS.items():
        features = sorted((f, e) for (k, f), e in merged.items() if k == kind)
        if not features:
            continue
        lines += [f"**{title}**", "", "| feature | with NanGuard | what the test shows |", "| --- | --- | --- |"]
        for feature, entry in features:
            status = "refused at setup" if "refused" in entry["status"] else "works"
            lines.append(f"| `{feature}` | {status} | {'; '.join(entry['note'])} |")
        lines.append("")
    lines.append(END)
    return "\n".join(lines)


def replace_table(text: str, table: str) -> str:
    """``text`` with the part between the markers replaced by ``table``."""
    if START not in text or END not in text:
        raise SystemExit(f"{PAGE.relative_to(ROOT)} has no {START} ... {END} markers")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return head + table + tail


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or with ``--check`` compare) the page's table; 0 on success."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when the page's table is out of date")
    args = parser.parse_args(argv)
    text = PAGE.read_text(encoding="utf-8")
    wanted = replace_table(text, render(collect_rows()))
    if args.check:
        if wanted != text:
            stale = (
                f"{PAGE.relative_to(ROOT)}: the compatibility table is out of date: run python scripts/compat_table.py"
            )
            print(stale, file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(wanted, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
