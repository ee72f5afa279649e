"""Shared fixtures: both Lightning namespaces, a quiet Trainer factory, a state recorder, TensorBoard reading.

The helpers behind them live in ``tests/helpers/`` (``fitting.py``, ``states.py``, ``tensorboard_runs.py``).
Every test also checks the ``details`` keys of the events it makes against ``DETAIL_KEYS`` (documented in
``docs/reference/events.md``): the event builder raises on one it lacks (``NANGUARD_STRICT_DETAIL_KEYS``,
inherited by the tests' worker processes), and every event recorded in the test's process is checked
after the test, whatever made it.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from detail_check import recorded_events, unregistered_keys, unregistered_message
from fitting import StepRecord, StepRecorder, build_trainer
from models import NAMESPACES
from states import bitwise_equal, clone_state, states_equal
from tensorboard_runs import CUSTOM_SCALARS_TAG, TensorBoardRun, read_tensorboard

from lightning_nanguard.core.detail_keys import STRICT_ENV

# Helpers that test files once imported from here; they live in tests/helpers/ (import them from there).
__all__ = [
    "CUSTOM_SCALARS_TAG",
    "StepRecord",
    "StepRecorder",
    "TensorBoardRun",
    "bitwise_equal",
    "build_trainer",
    "clone_state",
    "read_tensorboard",
    "states_equal",
]

NAMESPACE_IDS = tuple(NAMESPACES)  # ("lightning", "pytorch_lightning")

# Tiny models gain nothing from intra-op threads, and on a loaded 2-core machine oversubscribed
# threads made one tiny forward/backward ~60x slower. Results do not depend on the thread count.
torch.set_num_threads(1)

os.environ[STRICT_ENV] = "1"  # the event builder raises on an unregistered details key, in every process


@pytest.fixture(autouse=True)
def _seed() -> Iterator[None]:
    """Every test starts from the same global RNG state (torch, numpy, random)."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _details_keys_registered(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every event recorded during the test writes only ``details`` keys of ``DETAIL_KEYS`` (see module docs)."""
    with recorded_events(monkeypatch) as events:
        yield
    unregistered = unregistered_keys(events)
    assert not unregistered, unregistered_message(unregistered)


@pytest.fixture(params=NAMESPACE_IDS)
def ns_name(request: pytest.FixtureRequest) -> str:
    """``"lightning"`` or ``"pytorch_lightning"``."""
    return str(request.param)


@pytest.fixture
def ns(ns_name: str) -> ModuleType:
    """The Lightning namespace module: ``lightning.pytorch`` or ``pytorch_lightning``."""
    return NAMESPACES[ns_name]


@pytest.fixture
def make_trainer(ns: ModuleType, tmp_path: Path) -> Callable[..., Any]:
    """Factory: ``make_trainer(**overrides)`` -> Trainer of the test's namespace rooted at ``tmp_path``."""

    def factory(**kwargs: Any) -> Any:
        return build_trainer(ns, tmp_path, **kwargs)

    return factory


@pytest.fixture
def recorder() -> StepRecorder:
    return StepRecorder()


# ------------------------------------------------------------------------------------ TensorBoard


@pytest.fixture
def tb_reader() -> Callable[[str | Path], TensorBoardRun]:
    """``tb_reader(logdir)`` -> :class:`TensorBoardRun`."""
    return read_tensorboard


def pytest_collection_finish(session: pytest.Session) -> None:
    """With ``NANGUARD_COMPAT_ROWS`` set, write the ``compat`` markers of the collected tests.

    Read by ``scripts/compat_table.py``, which renders the compatibility table of docs/guide/compatibility.md.
    """
    import json
    import os

    out = os.environ.get("NANGUARD_COMPAT_ROWS")
    if not out:
        return
    rows = []
    for item in session.items:
        for mark in item.iter_markers("compat"):
            fields = {"feature": "", "kind": "", "status": "works", "note": "", **mark.kwargs}
            kinds = ("callback", "flag", "strategy", "optimization")
            if fields["kind"] not in kinds or fields["status"] not in ("works", "refused"):
                raise pytest.UsageError(f"{item.nodeid}: bad compat marker {mark.kwargs}")
            row = {key: str(fields[key]) for key in ("feature", "kind", "status", "note")}
            rows.append(row | {"test": item.nodeid})
    Path(out).write_text(json.dumps(rows), encoding="utf-8")
