"""The guard taking hold of a Fabric loop at ``fabric.setup`` (Fabric's ``on_after_setup`` hook).

Example:
    >>> import lightning as L, torch
    >>> from lightning_nanguard import NanGuard
    >>> fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[NanGuard(verbose=False)])
    >>> model, optimizer = fabric.setup(torch.nn.Linear(2, 1), torch.optim.SGD([torch.zeros(1)], lr=0.1))
    >>> type(fabric.strategy).__name__
    'NanGuardSingleDeviceStrategy'
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_nanguard.engine.moments import GuardEngine
from lightning_nanguard.engine.shard_layout import strategy_kind
from lightning_nanguard.fabric.fabric_class import early_loaders
from lightning_nanguard.fabric.frontend import FabricFrontEnd, LossFn
from lightning_nanguard.fabric.litgpt_loops import litgpt_loss_fn
from lightning_nanguard.fabric.quarantine import quarantine_in_fabric
from lightning_nanguard.fabric.steps import FabricSteps
from lightning_nanguard.fabric.strategy import hold_fabric_strategy
from lightning_nanguard.reporting.notice_texts import FABRIC_LOSS_FN

__all__ = ["take_hold_of_fabric"]


def take_hold_of_fabric(
    engine: GuardEngine,
    arguments: dict[str, Any],
    fabric: Any,
    module: nn.Module,
    loss_fn: LossFn | None,
) -> FabricSteps:
    """Configure the engine for this loop, attach it to the model, and hold the strategy; the loop's steps.

    Every rank calls it (``fabric.setup`` runs on every rank): the log directory is agreed here.
    Without a ``loss_fn``, a LitGPT model's recipe loss stands in (:mod:`.litgpt_loops`). Loaders set
    up before the model are watched from here on.
    """
    loss_fn = loss_fn or litgpt_loss_fn(getattr(module, "module", module))
    engine.configure(arguments, strategy_kind(fabric.strategy))
    front = FabricFrontEnd(fabric, module, loss_fn)
    engine.open_logs(front)
    engine.start(front, snapshot=False)  # the first snapshot once the optimizer is known (its first step)
    controller = engine.controller
    keep = loss_fn is not None and controller.diagnosis.diagnoses
    if loss_fn is None and controller.diagnosis.diagnoses:
        engine.recorder.notices.warn("fabric-loss-fn", FABRIC_LOSS_FN)
    steps = FabricSteps(engine, front, keep_batches=keep)
    hold_fabric_strategy(fabric.strategy, steps)
    for loader in early_loaders(fabric):
        controller.parts.run("remedies", quarantine_in_fabric, steps, loader)  # first: the batches noted are cut
        steps.watch_loader(loader)
    controller.attention.arm(front.global_step)  # the first step's forward comes next
    return steps
