"""The package's import rules hold, and a wrong arrow fails them: `lint-imports` on a copy with one planted."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
PACKAGES = ("lightning_nanguard", "lightning_nanguard_tensorboard")

pytestmark = pytest.mark.skipif(
    not LINT_IMPORTS.exists(), reason="import-linter is not installed (pip install -e .[dev])"
)


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """Run the project's contracts (its pyproject.toml) on the packages under ``root``."""
    env = {"PATH": str(LINT_IMPORTS.parent), "PYTHONPATH": str(root), "HOME": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """The packages and pyproject.toml, copied: a planted import changes nothing in the checkout."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def plant(root: Path, module: str, line: str) -> None:
    path = root / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text(encoding="utf-8") + f"\n{line}  # planted\n", encoding="utf-8")


def test_the_checkout_keeps_every_contract(copy: Path) -> None:
    result = lint_imports(copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 5 kept, 0 broken." in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        (  # a pure stage reaching up into the Trainer front-end
            "lightning_nanguard.detect.check",
            "from lightning_nanguard.trainer import callback",
            "The stages are layered",
        ),
        (  # the step engine reaching up into the Trainer front-end
            "lightning_nanguard.engine.controller",
            "import lightning_nanguard.trainer.frontend",
            "The stages are layered",
        ),
        (  # the step engine importing Lightning itself, even for a type
            "lightning_nanguard.engine.step.window",
            "import typing\nif typing.TYPE_CHECKING:\n    from lightning.pytorch import Trainer",
            "Only the Trainer front-end imports Lightning",
        ),
        (  # a type-only circle between the engine's sub-stages (the window reaching back to the controller)
            "lightning_nanguard.engine.step.window",
            "import typing\nif typing.TYPE_CHECKING:\n    import lightning_nanguard.engine.controller",
            "No import circle between the modules of a package",
        ),
        (  # core is the bottom layer
            "lightning_nanguard.core.events",
            "import lightning_nanguard.decide.policy",
            "The stages are layered",
        ),
        (  # independent siblings: recovery must not import reporting
            "lightning_nanguard.recover.recovery",
            "import lightning_nanguard.reporting.text",
            "The stages are layered",
        ),
        (  # the Fabric guard importing Lightning (Fabric calls its hooks by name: it needs no base class)
            "lightning_nanguard.fabric.guard",
            "import lightning.fabric",
            "Only the Trainer front-end imports Lightning",
        ),
        (  # a Trainer-free stage importing Lightning
            "lightning_nanguard.diagnose.runner",
            "import lightning.pytorch",
            "Only the Trainer front-end imports Lightning",
        ),
        (  # the dashboard's file layout is read by reporting only
            "lightning_nanguard.engine.step.window",
            "import lightning_nanguard_tensorboard.layout",
            "Only reporting reads the dashboard's file layout",
        ),
        (  # the TensorBoard plugin stays free of torch
            "lightning_nanguard_tensorboard.summary",
            "import torch",
            "The TensorBoard plugin imports neither",
        ),
        (  # an import circle made of a type-only import (the guard's state reaching back to the guard)
            "lightning_nanguard.engine.state",
            "import typing\nif typing.TYPE_CHECKING:\n    import lightning_nanguard.trainer.callback",
            "No import circle between the modules of a package",
        ),
        (  # a circle between two stage modules
            "lightning_nanguard.diagnose.batching",
            "import lightning_nanguard.diagnose.runner",
            "No import circle between the modules of a package",
        ),
    ],
)
def test_a_wrong_arrow_breaks_its_contract(copy: Path, module: str, line: str, contract: str) -> None:
    plant(copy, module, line)
    result = lint_imports(copy)
    assert result.returncode != 0
    broken = [row for row in result.stdout.splitlines() if row.endswith(" BROKEN")]
    assert any(row.startswith(contract) for row in broken), result.stdout


def test_importing_the_package_loads_nothing_beyond_its_dependencies() -> None:
    """``import lightning_nanguard`` adds no top-level module of its own beyond its declared dependencies'."""
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import torch, lightning.pytorch, pytorch_lightning, rich.console, tensorboard, lightning_utilities\n"
        "import typing_extensions\n"
        "dependencies = set(sys.modules)\n"
        "import lightning_nanguard\n"
        "lightning_nanguard.NanGuard  # imported on first use: the whole guard is loaded from here\n"
        "tops = lambda names: {name.split('.')[0] for name in names}\n"
        "print(sorted(tops(set(sys.modules) - dependencies) - tops(dependencies)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['lightning_nanguard', 'lightning_nanguard_tensorboard']"


# ------------------------------------------------------------------------------------ stage tests without a Trainer
# The tests of the Trainer-free stages drive no Lightning Trainer: not in the file, not through a helper it imports
# (tests/helpers/, conftest.py, followed from helper to helper); Trainer-driven tests live in tests/integration/.
# A stage test may use a helper's LightningModule as a plain module (the stages accept any module with a
# training_step), but imports no Lightning itself, unless it is listed below with the reason.

TESTS = ROOT / "tests"
TEST_HELPERS = TESTS / "helpers"
TRAINER_FREE_TESTS = ("core", "detect", "decide", "diagnose", "recover", "reporting", "engine")
TRAINER_NAMES = frozenset({"Trainer", "LightningCLI", "build_trainer", "make_trainer"})
LIGHTNING = ("lightning", "pytorch_lightning")
IMPORTS_LIGHTNING = {  # stage test -> why it imports Lightning itself
    "diagnose/test_frames.py": "tells Lightning's own files and LightningModule's class from the user's code",
    "engine/test_shard_layout.py": "reads the sharded layout off Lightning's strategy objects, as a front-end does",
}


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _imports(tree: ast.Module) -> list[tuple[str, int]]:
    """``(module, line)`` of every import, at any depth (``from x.y import z`` gives ``x.y``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.module, node.lineno))
    return found


def _trainer_names(tree: ast.Module) -> list[tuple[str, int]]:
    """Where a Trainer is named: a name, an attribute, an imported name or a parameter (a fixture)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.alias):
            name = node.name.rsplit(".", 1)[-1]
        elif isinstance(node, ast.arg):
            name = node.arg
        else:
            continue
        if name in TRAINER_NAMES:
            found.append((name, getattr(node, "lineno", 0)))
    return found


def _helper_file(module: str, helper_dirs: tuple[Path, ...]) -> Path | None:
    """The test helper a top-level module name resolves to (as pytest's pythonpath finds it), if any."""
    if module == "conftest":
        return TESTS / "conftest.py"
    for folder in helper_dirs:
        for candidate in (folder / f"{module}.py", folder / module / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def _helper_trainer_use(path: Path, helper_dirs: tuple[Path, ...], seen: dict[Path, str | None]) -> str | None:
    """Why helper ``path`` drives a Trainer (it names one, or a helper it imports does), or ``None``."""
    if path in seen:
        return seen[path]
    seen[path] = None  # an import circle between helpers adds nothing
    tree = _tree(path)
    named = _trainer_names(tree)
    why = f"{path.name}:{named[0][1]} names {named[0][0]}" if named else None
    for module, _ in _imports(tree) if why is None else ():
        helper = _helper_file(module.split(".")[0], helper_dirs)
        inner = _helper_trainer_use(helper, helper_dirs, seen) if helper is not None else None
        if inner is not None:
            why = f"{path.name} imports {module}: {inner}"
            break
    seen[path] = why
    return why


def stage_test_findings(source: str, name: str, helper_dirs: tuple[Path, ...] = (TEST_HELPERS,)) -> list[str]:
    """What ties the stage test ``name`` (``diagnose/test_x.py``, its text ``source``) to Lightning's Trainer."""
    tree = ast.parse(source, filename=name)
    findings = [f"line {line}: names {what}" for what, line in _trainer_names(tree)]
    seen: dict[Path, str | None] = {}
    for module, line in _imports(tree):
        top = module.split(".")[0]
        if top in LIGHTNING and name not in IMPORTS_LIGHTNING:
            findings.append(f"line {line}: imports {module}")
        helper = _helper_file(top, helper_dirs)
        why = _helper_trainer_use(helper, helper_dirs, seen) if helper is not None else None
        if why is not None:
            findings.append(f"line {line}: imports {module}, which drives a Trainer ({why})")
    return findings


def stage_test_files() -> list[Path]:
    return sorted(path for stage in TRAINER_FREE_TESTS for path in (TESTS / stage).rglob("*.py"))


def test_the_stage_tests_drive_no_trainer() -> None:
    files = stage_test_files()
    assert len(files) > 40, [str(path) for path in files]  # the folders are where the check looks
    findings = {}
    for path in files:
        name = path.relative_to(TESTS).as_posix()
        found = stage_test_findings(path.read_text(encoding="utf-8"), name)
        if found:
            findings[name] = found
    assert findings == {}, "Trainer-driven tests belong in tests/integration/:\n" + "\n".join(
        f"{name}: {'; '.join(found)}" for name, found in findings.items()
    )


def test_every_listed_lightning_import_is_still_needed() -> None:
    for name in IMPORTS_LIGHTNING:
        imported = [module for module, _ in _imports(_tree(TESTS / name)) if module.split(".")[0] in LIGHTNING]
        assert imported, f"{name} imports no Lightning any more: take it off IMPORTS_LIGHTNING"


@pytest.mark.parametrize(
    ("source", "finding"),
    [
        ("import lightning.pytorch as pl\n", "imports lightning.pytorch"),
        ("from pytorch_lightning import Trainer\n", "names Trainer"),
        ("import lightning.pytorch as pl\n\ntrainer = pl.Trainer(max_epochs=1)\n", "names Trainer"),
        ("from fitting import fit\n", "imports fitting, which drives a Trainer (fitting.py:"),
        ("import conftest\n", "imports conftest, which drives a Trainer (conftest.py:"),
        ("def test_x(make_trainer):\n    make_trainer().fit(None)\n", "names make_trainer"),
        ("def test_x():\n    from dashboard_runs import run_nan\n", "imports dashboard_runs, which drives a Trainer"),
    ],
)
def test_a_stage_test_driving_a_trainer_is_flagged(source: str, finding: str) -> None:
    found = stage_test_findings(source, "detect/test_planted.py")
    assert any(finding in line for line in found), found


def test_a_trainer_behind_a_chain_of_helpers_is_flagged(tmp_path: Path) -> None:
    """A planted helper (in a temporary folder, not tests/helpers/) that imports one that builds a Trainer."""
    (tmp_path / "planted_runner.py").write_text("import fitting\n\n\ndef run(m):\n    return fitting.fit(m)\n")
    found = stage_test_findings("from planted_runner import run\n", "recover/test_planted.py", (tmp_path, TEST_HELPERS))
    assert found == [
        "line 1: imports planted_runner, which drives a Trainer (planted_runner.py imports fitting: "
        + _helper_trainer_use(TEST_HELPERS / "fitting.py", (TEST_HELPERS,), {})  # type: ignore[operator]
        + ")"
    ]


def test_lightning_is_imported_only_where_listed_and_trainer_free_helpers_pass() -> None:
    frames = (TESTS / "diagnose" / "test_frames.py").read_text(encoding="utf-8")
    assert stage_test_findings(frames, "diagnose/test_frames.py") == []
    assert stage_test_findings(frames, "diagnose/test_other.py") == ["line 10: imports lightning.pytorch"]
    clean = "import forensics_models\nfrom event_factory import make_event\nfrom states import states_equal\n"
    assert stage_test_findings(clean, "diagnose/test_planted.py") == []  # LightningModules, no Trainer
