"""A pytest plugin for ``scripts/lightning_suite.py``: Lightning's own tests, with ``NanGuard()`` in every Trainer.

Loaded with ``-p lightning_nanguard_suite_plugin`` (``scripts/`` on ``PYTHONPATH``). The environment says
what it does:

- ``NANGUARD_SUITE_GUARD=1``: import ``lightning_nanguard`` and wrap ``Trainer.__init__`` of every
  Lightning namespace in use (``lightning.pytorch``, and ``pytorch_lightning`` once something imports
  it) so that a ``NanGuard()`` is appended to its ``callbacks`` (its arguments from the JSON object
  ``NANGUARD_SUITE_ARGS``, none by default). Anything else: import nothing and change nothing (the
  run without the guard).
- ``NANGUARD_SUITE_RESULTS=path``: write ``{node id: {"outcome": ..., "guard": [...]}}`` there at the
  end, ``outcome`` one of passed, failed, error, skipped, xfailed, xpassed (setup and teardown
  errors count as error; a rerun test counts by its last run), ``guard`` the guard's own log
  records of WARNING and above during the test (with traceback), a line for a guard that turned
  itself off and one for a guard that found bad steps or loss spikes (its counters). Works under
  pytest-xdist too (the records travel in the reports).

Legacy-checkpoint tests whose checkpoints are not there are skipped in both runs.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import traceback
import weakref
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

GUARD = os.environ.get("NANGUARD_SUITE_GUARD", "") == "1"
ARGS: dict[str, Any] = json.loads(os.environ.get("NANGUARD_SUITE_ARGS", "") or "{}")  # NanGuard(**ARGS)
RESULTS = os.environ.get("NANGUARD_SUITE_RESULTS", "")
NAMESPACES = ("lightning.pytorch", "pytorch_lightning")
_KEY = "nanguard_suite"
_WRAPPED = "__nanguard_suite_wrapped__"

_guards: weakref.WeakSet[Any] = weakref.WeakSet()  # the guards made during the current test
_results: dict[str, dict[str, Any]] = {}


class _GuardRecords(logging.Handler):
    """Keeps the ``lightning_nanguard`` loggers' WARNING-and-above records of the current test."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = f"{record.levelname} {record.name}: {record.getMessage()}"
        if record.exc_info and record.exc_info[1] is not None:
            text += "\n" + "".join(traceback.format_exception(*record.exc_info))
        self.lines.append(text)


_records = _GuardRecords()


def _wrap_trainers() -> None:
    """Append a ``NanGuard()`` to the callbacks of every Trainer of the namespaces imported so far."""
    from lightning_nanguard import NanGuard

    for name in NAMESPACES:
        module = sys.modules.get(name)
        trainer = getattr(module, "Trainer", None)
        if trainer is None or getattr(trainer.__init__, _WRAPPED, False):
            continue
        original = trainer.__init__

        @functools.wraps(original)
        def __init__(self: Any, *args: Any, __original: Any = original, **kwargs: Any) -> None:
            callbacks = kwargs.get("callbacks")
            if callbacks is None:
                callbacks = []
            elif not isinstance(callbacks, (list, tuple)):
                callbacks = [callbacks]
            guard = NanGuard(**ARGS)
            _guards.add(guard)
            kwargs["callbacks"] = [*callbacks, guard]
            __original(self, *args, **kwargs)

        setattr(__init__, _WRAPPED, True)
        trainer.__init__ = __init__


def pytest_configure(config: pytest.Config) -> None:
    """With the guard: wrap the Trainers now; either way: listen to the guard's loggers."""
    if GUARD:
        import lightning.pytorch  # noqa: F401  (Lightning's conftest imports it first thing too)

        _wrap_trainers()
    logging.getLogger("lightning_nanguard").addHandler(_records)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the legacy-checkpoint tests of a Lightning version whose checkpoints are not there (both runs).

    Lightning's CI downloads them (``.actions/pull_legacy_checkpoints.sh``); ``local`` is made from the
    installed Lightning by ``tests/legacy/simple_classif_training.py local`` (then its ``.ckpt`` moved up
    into ``checkpoints/local/``, as ``tests/legacy/generate_checkpoints.sh`` does).
    """
    for item in items:
        path = Path(str(item.fspath))
        version = getattr(item, "callspec", None) and item.callspec.params.get("pl_version")
        if path.name != "test_legacy_checkpoints.py" or not version:
            continue
        folder = path.parents[2] / "legacy" / "checkpoints" / str(version)
        if not any(folder.glob("*.ckpt")):
            item.add_marker(pytest.mark.skip(reason=f"no legacy checkpoint in {folder} (not downloaded)"))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Start each test with no records and no guards (and wrap a namespace imported since)."""
    if GUARD:
        _wrap_trainers()  # a namespace imported since (pytorch_lightning, by a test module)
    _records.lines.clear()
    _guards.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    """Attach what the guard said during the test to its teardown report (it reaches an xdist controller)."""
    outcome = yield
    report = outcome.get_result()
    if call.when != "teardown":
        return
    lines = list(_records.lines)
    for guard in list(_guards):
        if not getattr(guard, "active", True):
            lines.append("NanGuard disabled itself (guard.active is False after the test)")
        counters = getattr(guard, "counters", None)
        acted = {name: getattr(counters, name, 0) for name in ("bad_steps_total", "skipped_total", "spikes_total")}
        if any(acted.values()):
            lines.append("NanGuard acted: " + ", ".join(f"{name} {value}" for name, value in acted.items()))
    report.user_properties.append((_KEY, lines))


def _outcome(report: pytest.TestReport) -> str:
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    if report.when == "call":
        return str(report.outcome)
    if report.failed:
        return "error"
    return str(report.outcome)  # setup "skipped" or "passed"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Fold the setup, call and teardown reports of a test into one outcome."""
    if report.outcome == "rerun":  # pytest-rerunfailures: the test runs again, its last run counts
        _results.pop(report.nodeid, None)
        return
    entry = _results.setdefault(report.nodeid, {"outcome": "passed", "guard": []})
    if report.when == "call" or (report.when == "setup" and not report.passed):
        entry["outcome"] = _outcome(report)
    elif report.when == "teardown" and report.failed:
        entry["outcome"] = "error"
    for key, value in report.user_properties:
        if key == _KEY:
            entry["guard"] = value


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Write the results (once, from the process that saw every report)."""
    if RESULTS and not hasattr(session.config, "workerinput"):  # the xdist controller or a plain run
        Path(RESULTS).write_text(json.dumps(_results, indent=1, sort_keys=True), encoding="utf-8")
