"""A real ``Trainer`` for the tests: quiet CPU defaults, one ``fit`` helper, a recorder of each step's state.

:func:`build_trainer` makes a ``Trainer`` of either namespace with the defaults every test shares
(CPU, one device, one epoch, no logger, bar, summary, checkpoints or sanity validation);
:func:`fit` trains a module with a guard first among the callbacks and returns the trainer and
the guard; :class:`StepRecorder` keeps the model and optimizer state around every training batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import torch
from models import NAMESPACES
from states import bitwise_equal, clone_state, states_equal

from lightning_nanguard import NanGuard
from lightning_nanguard.trainer._compat import CALLBACK_BASES

__all__ = ["Fitted", "StepRecord", "StepRecorder", "build_trainer", "fit"]


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


class Fitted(NamedTuple):
    """What :func:`fit` returns: the trainer after ``fit`` and the guard it ran with (``None`` without one)."""

    trainer: Any
    guard: NanGuard | None


def fit(
    module: Any,
    train: Any = None,
    val: Any = None,
    *,
    root: Path | str,
    guard: NanGuard | None,
    callbacks: Iterable[Any] = (),
    ns: ModuleType | str = "lightning",
    require_active: bool = False,
    **trainer_kwargs: Any,
) -> Fitted:
    """``trainer.fit(module, train, val)`` on :func:`build_trainer`'s Trainer, ``guard`` first among the callbacks.

    Args:
        module: the LightningModule.
        train: the training loader (or datamodule); ``None``: the module's own ``train_dataloader``.
        val: the validation loader, if any.
        root: the Trainer's ``default_root_dir``.
        guard: the ``NanGuard`` (``None``: a run without one, e.g. the reference of a comparison).
        callbacks: more callbacks, after the guard.
        ns: ``"lightning"``, ``"pytorch_lightning"`` or the namespace module.
        require_active: fail if the guard switched itself off (an internal error of the guard).
        trainer_kwargs: more ``Trainer`` arguments (``max_epochs``, ``max_steps``, ``logger``, ...);
            they override :func:`build_trainer`'s defaults.

    Returns:
        ``Fitted(trainer, guard)``, a named tuple.
    """
    every = [guard, *callbacks] if guard is not None else list(callbacks)
    trainer = build_trainer(ns, root, callbacks=every, **trainer_kwargs)
    trainer.fit(module, train, val)
    if require_active and guard is not None:
        assert guard.active, "NanGuard disabled itself after an internal error (see the log)"
    return Fitted(trainer, guard)


# ------------------------------------------------------------------------------------ state recorder


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
