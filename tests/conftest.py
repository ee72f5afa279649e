"""Shared fixtures: both Lightning namespaces, a quiet Trainer factory, a state recorder, TensorBoard reading."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from models import NAMESPACES
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from lightning_nanguard.trainer._compat import CALLBACK_BASES

NAMESPACE_IDS = tuple(NAMESPACES)  # ("lightning", "pytorch_lightning")

# Tiny models gain nothing from intra-op threads, and on a loaded 2-core machine oversubscribed
# threads made one tiny forward/backward ~60x slower. Results do not depend on the thread count.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> Iterator[None]:
    """Every test starts from the same global RNG state (torch, numpy, random)."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(params=NAMESPACE_IDS)
def ns_name(request: pytest.FixtureRequest) -> str:
    """``"lightning"`` or ``"pytorch_lightning"``."""
    return str(request.param)


@pytest.fixture
def ns(ns_name: str) -> ModuleType:
    """The Lightning namespace module: ``lightning.pytorch`` or ``pytorch_lightning``."""
    return NAMESPACES[ns_name]


def build_trainer(ns: ModuleType | str, root: Path | str, **kwargs: Any) -> Any:
    """A CPU Trainer of namespace ``ns`` with quiet defaults; ``kwargs`` override them."""
    module = NAMESPACES[ns] if isinstance(ns, str) else ns
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 1,
        "logger": False,
        "log_every_n_steps": 1,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "default_root_dir": str(root),
    }
    defaults.update(kwargs)
    return module.Trainer(**defaults)


@pytest.fixture
def make_trainer(ns: ModuleType, tmp_path: Path) -> Callable[..., Any]:
    """Factory: ``make_trainer(**overrides)`` -> Trainer of the test's namespace rooted at ``tmp_path``."""

    def factory(**kwargs: Any) -> Any:
        return build_trainer(ns, tmp_path, **kwargs)

    return factory


# ------------------------------------------------------------------------------------ state recorder


def clone_state(value: Any) -> Any:
    """Deep copy with every tensor detached and cloned (optimizer state, buffers, parameters)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: clone_state(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(clone_state(item) for item in value)
    return copy.deepcopy(value)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (``torch.equal`` on the raw bits: NaN equals the same NaN, -0.0 != 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(_bytes(a), _bytes(b))


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(-1).view(torch.uint8)


def states_equal(a: Any, b: Any) -> bool:
    """Bitwise equality of nested states (dicts, lists, tensors, numbers)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and bitwise_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(states_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(states_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@dataclass
class StepRecord:
    """Model and optimizer state around one training batch."""

    global_step: int
    batch_idx: int
    params_before: dict[str, torch.Tensor]
    buffers_before: dict[str, torch.Tensor]
    optimizer_before: dict[str, Any]
    params_after: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers_after: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer_after: dict[str, Any] = field(default_factory=dict)

    def changed_params(self) -> list[str]:
        after = self.params_after
        return [name for name, before in self.params_before.items() if not bitwise_equal(before, after[name])]

    def unchanged(self) -> bool:
        """Parameters, buffers and optimizer state are bitwise identical before and after the batch."""
        return (
            states_equal(self.params_before, self.params_after)
            and states_equal(self.buffers_before, self.buffers_after)
            and states_equal(self.optimizer_before, self.optimizer_after)
        )

    def adam_steps(self, when: str = "before") -> list[float]:
        """``state["step"]`` of every Adam parameter state (empty before the first step)."""
        opt = self.optimizer_before if when == "before" else self.optimizer_after
        return [float(s["step"]) for s in opt["state"].values() if "step" in s]


class StepRecorder(*CALLBACK_BASES):  # type: ignore[misc]
    """Records parameters, buffers and optimizer state at ``on_train_batch_start`` and after the step.

    Derives from the ``Callback`` of both namespaces (like ``NanGuard``), so one class serves
    either ``Trainer``.
    """

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.progress_bar: list[dict[str, Any]] = []

    @staticmethod
    def _state(trainer: Any, pl_module: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        buffers = {n: b.detach().clone() for n, b in pl_module.named_buffers()}
        optimizer = clone_state(trainer.optimizers[0].state_dict()) if trainer.optimizers else {}
        return params, buffers, optimizer

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        params, buffers, optimizer = self._state(trainer, pl_module)
        self.records.append(StepRecord(trainer.global_step, batch_idx, params, buffers, optimizer))
        self.progress_bar.append(dict(trainer.progress_bar_metrics))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        record = self.records[-1]
        record.params_after, record.buffers_after, record.optimizer_after = self._state(trainer, pl_module)

    def by_step(self, global_step: int) -> StepRecord:
        matches = [r for r in self.records if r.global_step == global_step]
        assert len(matches) == 1, f"no single record for step {global_step}: {[r.global_step for r in self.records]}"
        return matches[0]


@pytest.fixture
def recorder() -> StepRecorder:
    return StepRecorder()


# ------------------------------------------------------------------------------------ TensorBoard


class TensorBoardRun:
    """The event files of one TensorBoard run, read back with ``EventAccumulator`` (nothing sampled away)."""

    def __init__(self, logdir: str | Path) -> None:
        self.accumulator = EventAccumulator(
            str(logdir),
            size_guidance={"scalars": 0, "tensors": 0, "histograms": 0, "images": 0, "audio": 0},
        )
        self.accumulator.Reload()

    @property
    def tags(self) -> dict[str, Any]:
        return self.accumulator.Tags()

    def scalars(self, tag: str) -> list[tuple[int, float]]:
        """``(step, value)`` pairs of a scalar tag."""
        return [(event.step, event.value) for event in self.accumulator.Scalars(tag)]

    def texts(self, tag: str) -> list[tuple[int, str]]:
        """``(step, text)`` pairs of a text summary (``add_text`` stores it under ``<tag>/text_summary``)."""
        return [
            (event.step, b"".join(event.tensor_proto.string_val).decode("utf-8"))
            for event in self.accumulator.Tensors(tag)
        ]

    def layouts(self) -> list[layout_pb2.Layout]:
        """Every custom-scalars layout written to the run (``add_custom_scalars``)."""
        if CUSTOM_SCALARS_TAG not in self.tags["tensors"]:
            return []
        out = []
        for event in self.accumulator.Tensors(CUSTOM_SCALARS_TAG):
            layout = layout_pb2.Layout()
            layout.ParseFromString(event.tensor_proto.string_val[0])
            out.append(layout)
        return out


CUSTOM_SCALARS_TAG = "custom_scalars__config__"


def read_tensorboard(logdir: str | Path) -> TensorBoardRun:
    return TensorBoardRun(logdir)


@pytest.fixture
def tb_reader() -> Callable[[str | Path], TensorBoardRun]:
    """``tb_reader(logdir)`` -> :class:`TensorBoardRun`."""
    return read_tensorboard


def pytest_collection_finish(session: pytest.Session) -> None:
    """With ``NANGUARD_COMPAT_ROWS`` set, write the ``compat`` markers of the collected tests.

    Read by ``scripts/compat_table.py``, which renders the README's compatibility table.
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
            if fields["kind"] not in ("callback", "flag", "strategy") or fields["status"] not in ("works", "refused"):
                raise pytest.UsageError(f"{item.nodeid}: bad compat marker {mark.kwargs}")
            row = {key: str(fields[key]) for key in ("feature", "kind", "status", "note")}
            rows.append(row | {"test": item.nodeid})
    Path(out).write_text(json.dumps(rows), encoding="utf-8")
