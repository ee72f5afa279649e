"""A Lightning Fabric loop as the step engine's front-end: what the engine needs, read off ``Fabric``.

:class:`FabricFrontEnd` implements :class:`~lightning_nanguard.engine.frontend.FrontEnd` for a
hand-written Fabric loop. Fabric keeps no step counter, no epochs and no list of optimizers: the
front-end counts the optimizer steps it sees (``global_step``), and learns the optimizers as they
step. A step is re-run for a diagnosis only with the user's ``loss_fn(model, batch) -> loss``
(``NanGuard(loss_fn=...)``); without it the event says that naming samples needs it.

Where events go: ``$NANGUARD_DIR`` when set, else the first Fabric logger's ``log_dir``, else the
working directory (``./nanguard/events.jsonl``), rank zero's answer on every rank.

Example:
    >>> import lightning as L
    >>> from torch import nn
    >>> fabric = L.Fabric(accelerator="cpu", devices=1)
    >>> front = FabricFrontEnd(fabric, nn.Linear(2, 1))
    >>> front.global_step, front.world_size, front.grad_scaler is None
    (0, 1, True)
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_nanguard.engine.frontend import LossFn, call_loss_fn

if TYPE_CHECKING:
    from lightning_nanguard.diagnose.combined import CombinedLayout

__all__ = ["NANGUARD_DIR", "FabricFrontEnd", "LossFn"]

NANGUARD_DIR = "NANGUARD_DIR"  # environment variable: where events and bundles go
LOGGING_EVERY_N_STEPS = 50  # the nanguard/ scalars are written this often (and at every incident)


class FabricFrontEnd:
    """The engine's view of a Fabric loop (see module docs).

    Args:
        fabric: the ``Fabric`` object.
        module: the model as ``fabric.setup`` returned it (the one the loop calls).
        loss_fn: ``loss_fn(model, batch) -> loss``, to re-run a step on sub-batches (``None``: no re-runs).
    """

    def __init__(self, fabric: Any, module: nn.Module, loss_fn: LossFn | None = None) -> None:
        self.fabric = fabric
        self.models: list[nn.Module] = [_unwrapped(module)]  # the user's modules, behind Fabric's wrappers
        self.module: nn.Module = self.models[0]
        self.loss_fn = loss_fn
        self.optimizer_in_step: Any = None  # the optimizer whose step is being checked
        self.global_step = 0
        self.current_epoch = 0
        self.optimizers: list[Any] = []  # learned as they step (Fabric keeps no list)
        self.lr_schedulers: list[Any] = []
        self.progress_bar = None

    # ------------------------------------------------------------------ where the run is

    @property
    def global_rank(self) -> int:
        return int(self.fabric.global_rank)

    @property
    def world_size(self) -> int:
        return int(self.fabric.world_size)

    @property
    def is_global_zero(self) -> bool:
        return bool(self.fabric.is_global_zero)

    # ------------------------------------------------------------------ the model and its step

    @property
    def device(self) -> torch.device:
        return torch.device(self.fabric.device)

    @property
    def automatic_optimization(self) -> bool:
        return True  # the guard holds the strategy's optimizer step: it can drop the update

    @property
    def strategy(self) -> Any:
        return self.fabric.strategy

    @property
    def grad_scaler(self) -> Any:
        return getattr(getattr(self.fabric, "_precision", None), "scaler", None)

    def add_model(self, module: nn.Module) -> None:
        """Guard another model set up in the same loop: ``module`` becomes a container of all of them.

        Parameter names then start with the model's class name in snake case (``generator.fc.weight``);
        ``loss_fn`` receives the model whose parameters the optimizer being stepped updates.
        """
        model = _unwrapped(module)
        if any(known is model for known in self.models):
            return
        self.models.append(model)
        self.module = SetUpModels(self.models)

    def saw_optimizer(self, optimizer: Any) -> bool:
        """Note an optimizer the loop steps (the ones a rollback snapshots); ``True`` when it is new."""
        if any(known is optimizer for known in self.optimizers):
            return False
        self.optimizers.append(optimizer)
        return True

    # ------------------------------------------------------------------ re-running a step

    def step_fn(self) -> Callable[[Any, int], Any]:
        """``loss_fn(model, batch)`` or ``loss_fn(model, batch, optimizer)`` for the optimizer being stepped.

        ``model``: the model set up whose parameters that optimizer updates (the first one set up when
        none or unknown), as the user gave it to ``fabric.setup`` (sharded in place under FSDP2), run
        under the precision's autocast (``step_context``): Fabric's wrapper would insist on
        ``fabric.backward`` for the re-run's own backward. Batches are kept as the loader gave them.
        """
        loss_fn = self.loss_fn
        if loss_fn is None:
            raise RuntimeError("re-running a Fabric step needs NanGuard(loss_fn=...): loss_fn(model, batch) -> loss")
        optimizer, to_device = self.optimizer_in_step, self.fabric.to_device
        module = self.model_of(optimizer)
        return lambda batch, batch_idx: call_loss_fn(loss_fn, module, to_device(batch), optimizer)

    def model_of(self, optimizer: Any) -> nn.Module:
        """The model set up whose parameters ``optimizer`` updates (the first one set up otherwise)."""
        inner = getattr(optimizer, "optimizer", optimizer)
        stepped = {id(p) for group in getattr(inner, "param_groups", []) for p in group["params"]}
        return next((m for m in self.models if any(id(p) in stepped for p in m.parameters())), self.models[0])

    def cannot_rerun(self) -> str | None:
        if self.loss_fn is None:
            return "naming the offending samples needs NanGuard(loss_fn=...), with loss_fn(model, batch) -> loss"
        return None

    def step_context(self) -> AbstractContextManager[Any]:
        return self.fabric.autocast()  # what the Fabric module's forward applies in the loop

    def as_training_batch(
        self, record: Any, layout: CombinedLayout | None = None, part: int = 0, batch: Any = None
    ) -> Any:
        combined = record if layout is None else layout.with_parts(batch, {part: record})
        combined = self.fabric.to_device(combined)
        return combined if layout is None else layout.part(combined, part)

    # ------------------------------------------------------------------ around the step

    def keep_logged(self) -> str | None:
        return None  # a Fabric loop logs through its own calls: nothing accumulates to undo

    def drop_logged(self) -> None:
        pass

    def suspend_clipping(self) -> None:
        pass  # the loop calls fabric.clip_gradients itself; the guard's strategy skips it on a dropped step

    def resume_clipping(self) -> None:
        pass

    # ------------------------------------------------------------------ where to log

    def log_dir(self) -> str:
        """``$NANGUARD_DIR``, else the first logger's ``log_dir``, else ``.``; rank zero's, on every rank."""
        chosen = os.environ.get(NANGUARD_DIR)
        if not chosen:
            logger_dir = next((lg.log_dir for lg in self.loggers if getattr(lg, "log_dir", None)), None)
            chosen = str(logger_dir) if logger_dir is not None else os.getcwd()
        return str(self.fabric.broadcast(chosen)) if self.world_size > 1 else chosen

    @property
    def loggers(self) -> Sequence[Any]:
        return list(getattr(self.fabric, "loggers", []))

    def tensorboard_writers(self) -> Sequence[Any]:
        return [lg.experiment for lg in self.loggers if type(lg).__name__ == "TensorBoardLogger"]

    def logging_due(self) -> bool:
        return bool(self.loggers) and self.global_step % LOGGING_EVERY_N_STEPS == 0

    def show_in_progress_bar(self, key: str, value: int) -> None:
        pass  # a Fabric loop has no progress bar of Lightning's


class SetUpModels(nn.Module):
    """The models set up in one Fabric loop, as one module the engine checks (named by class, snake case).

    Example:
        >>> class Generator(nn.Linear): ...
        >>> [name for name, _ in SetUpModels([Generator(1, 1), nn.Linear(1, 1)]).named_children()]
        ['generator', 'linear']
    """

    def __init__(self, models: Sequence[nn.Module]) -> None:
        super().__init__()
        for model in models:
            base = _snake_case(type(model).__name__)
            name, n = base, 1
            while hasattr(self, name):
                name, n = f"{base}_{n}", n + 1
            self.add_module(name, model)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("SetUpModels only groups the models a Fabric loop set up; call the models themselves")


def _unwrapped(module: nn.Module) -> nn.Module:
    return getattr(module, "module", module)  # the user's module behind _FabricModule (uncompiled)


def _snake_case(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()
