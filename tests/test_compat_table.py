"""The compatibility table (docs/guide/compatibility.md) is exactly what the ``compat``-marked tests say.

The table is rendered by scripts/compat_table.py between its markers in that page.
"""

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


def test_the_docs_table_is_generated_from_the_tests() -> None:
    script = _script()
    assert script.PAGE == ROOT / "docs" / "guide" / "compatibility.md"  # type: ignore[attr-defined]
    text = script.PAGE.read_text(encoding="utf-8")  # type: ignore[attr-defined]
    assert text.count(script.START) == 1 and text.count(script.END) == 1  # type: ignore[attr-defined]
    assert script.main(["--check"]) == 0  # type: ignore[attr-defined]


def test_the_readme_holds_no_copy_of_the_table() -> None:
    script = _script()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert script.START not in readme and script.END not in readme  # type: ignore[attr-defined]
    assert "docs/guide/compatibility.md" in readme


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
