"""The module path of 0.2.0 its README documented (``lightning_nanguard._moved``) still imports and forwards.

Every old path imports with exactly one ``DeprecationWarning`` naming where it moved, pointed at the
importing line; every public name of the new modules resolves through the old path to the very same
object; and importing the package itself warns about nothing.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

import lightning_nanguard
from lightning_nanguard._moved import MOVED

HERE = str(Path(__file__).resolve())
PACKAGE_PARENT = str(Path(lightning_nanguard.__file__).resolve().parents[1])


def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def _target_param(old: str, target: str) -> object:
    missing = [t for t in MOVED[old] if not _exists(t)]  # dir() of the old path imports every target
    return pytest.param(
        old,
        target,
        id=f"{old.removeprefix('lightning_nanguard.')}->{target.removeprefix('lightning_nanguard.')}",
        marks=pytest.mark.xfail(
            bool(missing),
            strict=True,
            raises=ImportError,
            reason=f"source bug: _moved.MOVED forwards {old} to {', '.join(missing)}, which does not exist here",
        ),
    )


PAIRS = [_target_param(old, target) for old, targets in MOVED.items() for target in targets]


@pytest.fixture
def fresh_old_paths() -> Iterator[None]:
    """Old paths not imported yet (a second import of a module warns no more); put back as they were after."""
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if name in MOVED}
    parents = {}
    for name in MOVED:
        parent, _, child = name.rpartition(".")
        if parent in sys.modules and child in vars(sys.modules[parent]):
            parents[name] = vars(sys.modules[parent])[child]
    yield
    for name in MOVED:
        sys.modules.pop(name, None)
        parent, _, child = name.rpartition(".")
        if name in parents:
            setattr(sys.modules[parent], child, parents[name])
        elif parent in sys.modules and child in vars(sys.modules[parent]):
            delattr(sys.modules[parent], child)
    sys.modules.update(saved)


def _import_warning(old: str) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        importlib.import_module(old)
    return [w for w in caught if issubclass(w.category, DeprecationWarning)]


_IMPORT_LINE = _import_warning.__code__.co_firstlineno + 3


@pytest.mark.usefixtures("fresh_old_paths")
@pytest.mark.parametrize("old", sorted(MOVED), ids=lambda name: name.removeprefix("lightning_nanguard."))
def test_an_old_path_imports_with_one_deprecation_warning_naming_the_new_path(old: str) -> None:
    targets = MOVED[old]
    (warning,) = _import_warning(old)
    message = str(warning.message)
    assert message.startswith(f"`{old}` moved to `{targets[0]}`")
    assert all(f"`{target}`" in message for target in targets)
    assert "removed in lightning_nanguard 0.5" in message
    assert _import_warning(old) == []  # imported once: no second warning


@pytest.mark.usefixtures("fresh_old_paths")
def test_the_warning_points_at_the_importing_line() -> None:
    (warning,) = _import_warning("lightning_nanguard.spikes")
    assert (warning.filename, warning.lineno) == (HERE, _IMPORT_LINE)


@pytest.mark.usefixtures("fresh_old_paths")
@pytest.mark.parametrize(("old", "target"), PAIRS)
def test_every_public_name_resolves_through_the_old_path_to_the_same_object(old: str, target: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        moved = importlib.import_module(old)
    new = importlib.import_module(target)
    names = list(getattr(new, "__all__", ()))
    assert names, f"{target} has no __all__"
    for name in names:
        assert getattr(moved, name) is getattr(new, name), f"{old}.{name}"
    assert set(names) <= set(dir(moved))


@pytest.mark.usefixtures("fresh_old_paths")
def test_an_unknown_name_of_an_old_path_says_where_the_module_moved() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        moved = importlib.import_module("lightning_nanguard.spikes")
    with pytest.raises(AttributeError, match=r"moved to lightning_nanguard\.detect\.spikes\) has no attribute 'nope'"):
        moved.nope  # noqa: B018
    with pytest.raises(AttributeError):
        moved.__wrapped__  # noqa: B018  # dunder lookups are not forwarded


@pytest.mark.usefixtures("fresh_old_paths")
def test_from_import_of_an_old_path() -> None:
    with pytest.warns(DeprecationWarning, match=r"`lightning_nanguard\.spikes` moved to `lightning_nanguard\.detect"):
        from lightning_nanguard.spikes import SpikeDetector  # type: ignore[import-not-found]

    from lightning_nanguard.detect.spikes import SpikeDetector as new_detector

    assert SpikeDetector is new_detector


def test_paths_that_exist_are_not_taken_over() -> None:
    """Only the old paths are forwarded: a real module never goes through the finder."""
    assert all(not _exists_as_file(old) for old in MOVED)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        importlib.import_module("lightning_nanguard.reporting.jsonl")
        importlib.import_module("lightning_nanguard.engine.state")


def _exists_as_file(module: str) -> bool:
    relative = module.replace(".", os.sep)
    return any((Path(PACKAGE_PARENT) / f"{relative}{suffix}").exists() for suffix in (".py", os.sep + "__init__.py"))


def test_importing_the_package_warns_about_nothing_of_its_own() -> None:
    code = (
        "import json, warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import lightning_nanguard\n"
        "print(json.dumps([[w.category.__name__, str(w.message), w.filename] for w in caught]))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([PACKAGE_PARENT, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    caught = json.loads(result.stdout.strip().splitlines()[-1])
    package_dir = str(Path(lightning_nanguard.__file__).resolve().parent)
    ours = [
        w
        for w in caught
        if w[0] == "DeprecationWarning" and ("lightning_nanguard" in w[1] or w[2].startswith(package_dir))
    ]
    assert ours == []


def test_only_the_documented_path_is_forwarded_until_the_removal_version() -> None:
    """0.2.0's README documented ``lightning_nanguard.spikes`` only; other old paths are gone."""
    from lightning_nanguard._moved import REMOVED_IN

    assert set(MOVED) == {"lightning_nanguard.spikes"} and REMOVED_IN == "0.5"
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("lightning_nanguard.forensics")
