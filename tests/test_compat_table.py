"""The README's compatibility table is exactly what the ``compat``-marked tests say (scripts/compat_table.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script() -> object:
    spec = importlib.util.spec_from_file_location("compat_table", ROOT / "scripts" / "compat_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_table_is_generated_from_the_tests() -> None:
    assert _script().main(["--check"]) == 0  # type: ignore[attr-defined]


def test_one_row_per_feature_with_its_notes_and_refusals_winning() -> None:
    render = _script().render  # type: ignore[attr-defined]
    rows = [
        {"feature": "Timer", "kind": "callback", "status": "works", "note": "stops on time", "test": "a"},
        {"feature": "Timer", "kind": "callback", "status": "works", "note": "resumes", "test": "b"},
        {"feature": "X", "kind": "flag", "status": "refused", "note": "says why", "test": "c"},
    ]
    table = render(rows)
    assert "| `Timer` | works | stops on time; resumes |" in table
    assert "| `X` | refused at setup | says why |" in table
    assert table.index("Lightning callbacks") < table.index("Trainer flags")
