"""The package's import rules hold, and a wrong arrow fails them: `lint-imports` on a copy with one planted."""

from __future__ import annotations

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
            "The Trainer-free stages import no Lightning",
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
        (  # a Trainer-free stage importing Lightning
            "lightning_nanguard.diagnose.runner",
            "import lightning.pytorch",
            "The Trainer-free stages import no Lightning",
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
        "tops = lambda names: {name.split('.')[0] for name in names}\n"
        "print(sorted(tops(set(sys.modules) - dependencies) - tops(dependencies)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['lightning_nanguard', 'lightning_nanguard_tensorboard']"
