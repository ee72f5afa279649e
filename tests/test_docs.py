"""The documentation site builds in strict mode (mkdocs.yml): a warning, a broken link or anchor, a page
left out of the nav, or a docstring mkdocstrings cannot render fails the build, and so this test.

User-facing pages carry no machine-specific timings: those live on the pages that state the machine
(the performance page and the generated measurement pages).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_nanguard

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")
MISSING = [name for name in TOOLS if importlib.util.find_spec(name.split(".")[0]) is None]
# Pages that state the machine their numbers come from (the generated ones say how they were made).
MEASURED = {"guide/performance.md", "benchmarks.md", "spikes.md", "anomaly_mode_vs_nanguard.md"}
MACHINE_SPECIFIC = re.compile(r"\bthis (?:\d+-core )?(?:CPU|machine)\b|\bon this\b.*\bCPU\b|\bnot run here\b", re.I)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if MISSING:
        pytest.skip(f"the doc tools are not installed ({', '.join(MISSING)}): pip install -e '.[dev]'")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's notice about MkDocs 2.0
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return out


def test_the_site_builds_strictly(site: Path) -> None:
    assert (site / "index.html").is_file()
    assert (site / "guide" / "compatibility" / "index.html").is_file()


def test_the_api_page_is_generated_from_the_code(site: Path) -> None:
    page = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    for name in lightning_nanguard.__all__:
        assert f'id="lightning_nanguard.{name}"' in page, f"{name} is not on the API page"
    guard = page[page.index('id="lightning_nanguard.NanGuard"') : page.index('id="lightning_nanguard.NanEvent"')]
    rows = set(re.findall(r'<tr class="doc-section-item">\s*<td>\s*<code>(\w+)</code>', guard))
    for argument in inspect.signature(lightning_nanguard.NanGuard).parameters:
        assert argument in rows, f"NanGuard's argument {argument} has no row in its Parameters table"
    for field in lightning_nanguard.NanEvent.__dataclass_fields__:
        assert field in page, f"NanEvent.{field} is not on the API page"


def test_the_changelog_page_is_the_changelog(site: Path) -> None:
    page = (site / "changelog" / "index.html").read_text(encoding="utf-8")
    assert f"[{lightning_nanguard.__version__}]" in page
    assert f"## [{lightning_nanguard.__version__}]" in (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")


def test_user_facing_pages_carry_no_machine_specific_timings() -> None:
    pages = {p.relative_to(ROOT / "docs").as_posix(): p for p in (ROOT / "docs").rglob("*.md")}
    pages["../README.md"] = ROOT / "README.md"
    found = [
        f"{name}: {match.group(0)!r}"
        for name, path in sorted(pages.items())
        if name not in MEASURED
        for match in MACHINE_SPECIFIC.finditer(path.read_text(encoding="utf-8"))
    ]
    assert not found, f"machine-specific text outside the measured pages: {found}"
