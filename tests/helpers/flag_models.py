"""A tiny BatchNorm regression with a NaN at known samples, and a hand-written skip, for the Trainer-flag tests.

``FlagModule`` (``Linear -> BatchNorm1d -> ReLU -> Linear``, Adam) trains on :func:`nan_data`: 64 samples of
4 features, ``x[i, 1] = NaN`` for each ``i`` in ``nan_at``. With batches of 8 and no shuffling, sample ``i``
is in batch ``i // 8`` at position ``i % 8``. The module records what the flags under test change:
validation, test and prediction calls (with the global step they ran at) and its validation losses.

``HandSkip`` is the reference for a skipped step: at the steps it is given it drops every gradient
(``p.grad = None``: the optimizer leaves the weights and its state alone) and puts the BatchNorm
buffers back as they were before the batch. A run with it and without a guard is "the run in
which that step's update never happened"; the guard's run must equal it bit for bit, which also
shows that the guard changed no healthy step.

Run as a script, it is the two-process ``sync_batchnorm=True`` run of ``test_trainer_flags.py``:
``python tests/helpers/flag_models.py syncbn OUTPUT_DIR`` (each rank writes ``rank<N>.json``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import lightning.pytorch as lightning_pytorch
import pytorch_lightning
import torch
from process_group import finish_script, leave_process_group_at_exit
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard.trainer._compat import CALLBACK_BASES

__all__ = [
    "BATCH_SIZE",
    "N_SAMPLES",
    "FlagModule",
    "HandSkip",
    "ValidationPoints",
    "cpu_sync_batchnorm",
    "flag_module",
    "model_state",
    "nan_data",
    "nan_loader",
]

NAMESPACES: dict[str, ModuleType] = {"lightning": lightning_pytorch, "pytorch_lightning": pytorch_lightning}
BATCH_SIZE = 8
N_SAMPLES = 64


def nan_data(nan_at: Iterable[int] = (), n: int = N_SAMPLES, seed: int = 0) -> TensorDataset:
    """``n`` regression samples (4 features); feature 1 of each sample in ``nan_at`` is NaN."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 4, generator=g), torch.randn(n, generator=g)
    for i in nan_at:
        x[i, 1] = math.nan
    return TensorDataset(x, y)


def nan_loader(nan_at: Iterable[int] = (), n: int = N_SAMPLES, seed: int = 0, **kwargs: Any) -> DataLoader:
    """A loader of :func:`nan_data` with batches of 8 (no shuffling unless ``kwargs`` say so)."""
    return DataLoader(nan_data(nan_at, n, seed), batch_size=BATCH_SIZE, **kwargs)


class _FlagModule:
    """The regression; ``log=False`` for ``barebones=True`` (where ``self.log`` raises)."""

    def __init__(
        self,
        log: bool = True,
        lr: float = 1e-2,
        train_loader: Callable[[int], DataLoader] | None = None,
        clip_without_grads: bool = True,
    ) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
        self.log_values = log
        self.lr = lr
        self.train_loader = train_loader
        self.clip_without_grads = clip_without_grads
        self.loaders_built: list[int] = []  # the epoch of each train_dataloader() call
        self.validated: list[tuple[bool, int]] = []  # (sanity checking, global step) at each validation batch 0
        self.val_losses: list[torch.Tensor] = []
        self.val_grad_modes: list[tuple[bool, bool]] = []  # (inference mode, grad enabled) in validation_step
        self.tested: list[int] = []  # global step at each test batch
        self.test_losses: list[torch.Tensor] = []

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        if self.log_values:
            self.log("train_loss", loss)  # type: ignore[attr-defined]
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        trainer = self.trainer  # type: ignore[attr-defined]
        if batch_idx == 0:
            self.validated.append((trainer.sanity_checking, trainer.global_step))
        self.val_grad_modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        loss = self._loss(batch)
        self.val_losses.append(loss.detach().clone())
        if self.log_values:
            self.log("val_loss", loss)  # type: ignore[attr-defined]

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.tested.append(self.trainer.global_step)  # type: ignore[attr-defined]
        self.test_losses.append(self._loss(batch).detach().clone())

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).squeeze(-1)

    def train_dataloader(self) -> DataLoader:
        if self.train_loader is None:
            raise RuntimeError("FlagModule: pass the training loader to fit or a train_loader factory")
        epoch = self.trainer.current_epoch  # type: ignore[attr-defined]
        self.loaders_built.append(epoch)
        return self.train_loader(epoch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)  # type: ignore[attr-defined]

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        """Lightning's default; ``clip_without_grads=False`` leaves a step without gradients alone.

        torch's ``clip_grad_value_`` raises on an empty list of gradients, so a hand-skipped step
        (every ``p.grad`` None) must not be clipped by value.
        """
        params = self.parameters()  # type: ignore[attr-defined]
        if self.clip_without_grads or any(p.grad is not None for p in params):
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)  # type: ignore[attr-defined]


class FlagModule(_FlagModule, lightning_pytorch.LightningModule):
    """The regression as a ``lightning.pytorch.LightningModule``."""


class PLFlagModule(_FlagModule, pytorch_lightning.LightningModule):
    """The regression as a ``pytorch_lightning.LightningModule``."""


def flag_module(ns_name: str = "lightning", **kwargs: Any) -> Any:
    """A :class:`FlagModule` of namespace ``ns_name`` (``"lightning"`` or ``"pytorch_lightning"``)."""
    return (FlagModule if ns_name == "lightning" else PLFlagModule)(**kwargs)


class HandSkip(*CALLBACK_BASES):  # type: ignore[misc]
    """Makes the update of each global step in ``steps`` a true no-op, by hand (the reference for a skip).

    In ``on_before_optimizer_step`` (gradients complete and unscaled) every ``p.grad`` becomes ``None``,
    so the optimizer moves no weight and keeps its state; the BatchNorm buffers are put back as they
    were at ``on_train_batch_start``.
    """

    def __init__(self, steps: Iterable[int]) -> None:
        self.steps = set(steps)
        self.skipped: list[int] = []
        self._buffers: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._buffers = [b.detach().clone() for b in pl_module.buffers()]

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step not in self.steps:
            return
        self.skipped.append(trainer.global_step)
        for p in pl_module.parameters():
            p.grad = None
        with torch.no_grad():
            for buffer, saved in zip(pl_module.buffers(), self._buffers, strict=True):
                buffer.copy_(saved)


class ValidationPoints(*CALLBACK_BASES):  # type: ignore[misc]
    """``(global_step, batch_idx, epoch)`` of each validation run's start during ``fit`` (sanity check excluded)."""

    def __init__(self) -> None:
        self.points: list[tuple[int, int]] = []
        self.train_batches: list[tuple[int, int]] = []  # (epoch, batch_idx) of every training batch

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.train_batches.append((trainer.current_epoch, batch_idx))

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self.points.append((trainer.current_epoch, trainer.global_step))


def model_state(module: Any, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """A clone of the module's parameters and buffers and the optimizer's state (compare with ``states_equal``)."""
    state: dict[str, Any] = {name: t.detach().clone() for name, t in module.state_dict().items()}
    if optimizer is not None:
        optim = optimizer.state_dict()
        state["optimizer"] = {
            key: {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in value.items()}
            for key, value in optim["state"].items()
        }
    return state


# ------------------------------------------------------------------------------------ two-process sync_batchnorm


def cpu_sync_batchnorm() -> None:
    """Let ``nn.SyncBatchNorm`` train on CPU processes (gloo): torch runs it on GPUs only.

    DDP refuses a CPU module holding one ("SyncBatchNorm layers only work with GPU modules") and its
    statistics kernel (``torch.batch_norm_stats``) has no CPU implementation. The stand-in forward does
    what SyncBatchNorm does, with autograd-aware ``all_reduce`` (``torch.distributed.nn``): the batch
    statistics are those of every rank's batch together, every forward is a collective, the gradient flows
    through the shared statistics, and the running statistics move identically on every rank.
    Lightning's ``sync_batchnorm=True`` conversion and every class check stay real.
    """
    from torch.distributed.nn.functional import all_reduce
    from torch.nn.parallel import DistributedDataParallel

    def forward(self: nn.SyncBatchNorm, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
            return nn.modules.batchnorm._BatchNorm.forward(self, x)
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        count = all_reduce(torch.tensor(float(x.numel() // x.shape[1]), dtype=x.dtype))
        mean = all_reduce(x.sum(dims)) / count
        var = all_reduce((x * x).sum(dims)) / count - mean * mean  # biased, as batch_norm_gather_stats
        with torch.no_grad():
            assert self.running_mean is not None and self.running_var is not None
            assert self.num_batches_tracked is not None
            self.num_batches_tracked.add_(1)
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * count / (count - 1), self.momentum)
        out = (x - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        return out * self.weight.view(shape) + self.bias.view(shape)

    nn.SyncBatchNorm.forward = forward  # type: ignore[method-assign]
    DistributedDataParallel._passing_sync_batchnorm_handle = lambda self, module: None  # type: ignore[method-assign]


def _syncbn_main(out_dir: str) -> None:
    """``sync_batchnorm=True`` on two gloo processes; rank 1's sample 11 (batch 1) is NaN; guard or hand skip.

    Two fits in one launch: with ``NanGuard`` and, as the reference, with :class:`HandSkip` at step 1.
    Each rank writes per-step weight hashes, its BatchNorm class, the steps its weights did not move,
    its events and counters.
    """
    import logging

    from lightning_nanguard import NanGuard

    cpu_sync_batchnorm()

    class Steps(lightning_pytorch.Callback):
        def __init__(self) -> None:
            self.hashes: list[str] = []
            self.unchanged: list[int] = []
            self.batchnorm = ""
            self._before: list[torch.Tensor] = []

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.batchnorm = type(pl_module.net[1]).__name__  # Lightning reverts the conversion after fit

        def on_train_batch_start(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            self._before = [t.detach().clone() for t in pl_module.state_dict().values()]

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            after = list(pl_module.state_dict().values())
            if all(torch.equal(a, b) for a, b in zip(self._before, after, strict=True)):
                self.unchanged.append(trainer.global_step - 1)
            self.hashes.append(_sha(pl_module))

    class Messages(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    results: dict[str, Any] = {}
    for name in ("guard", "reference"):
        guard = NanGuard(verbose=False, save_repro=False) if name == "guard" else None
        steps = Steps()
        callbacks = [guard or HandSkip([1]), steps]
        trainer = lightning_pytorch.Trainer(
            strategy="ddp",
            accelerator="cpu",
            devices=2,
            max_epochs=1,
            sync_batchnorm=True,
            use_distributed_sampler=False,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=os.path.join(out_dir, name),
            callbacks=callbacks,
        )
        rank = trainer.global_rank
        module = FlagModule(log=False)
        loader = nan_loader(nan_at=(11,) if rank == 1 else (), n=32, seed=100 + rank)
        messages = Messages()
        logging.getLogger("lightning_nanguard").addHandler(messages)
        try:
            trainer.fit(module, loader)
        finally:
            logging.getLogger("lightning_nanguard").removeHandler(messages)
        results[name] = {
            "batchnorm": steps.batchnorm,
            "global_step": trainer.global_step,
            "hashes": steps.hashes,
            "unchanged": steps.unchanged,
            "finite": all(bool(torch.isfinite(t).all()) for t in module.state_dict().values() if t.is_floating_point()),
            "events": [event.to_dict() for event in guard.events] if guard else [],
            "counters": [guard.bad_steps_total, guard.skipped_total] if guard else [],
            "active": guard.active if guard else None,
            "warnings": messages.messages,
        }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump({"rank": rank, **results}, handle)


def _sha(module: Any) -> str:
    return hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in module.state_dict().values())).hexdigest()


if __name__ == "__main__":
    if sys.argv[1] != "syncbn":
        raise SystemExit(f"unknown scenario {sys.argv[1]!r}")
    leave_process_group_at_exit()
    _syncbn_main(sys.argv[2])
    finish_script()
