"""``NanGuard``: the Lightning callback that wires detection, snapshots and reporting to hooks.

Example:
    >>> from lightning.pytorch import Trainer
    >>> trainer = Trainer(callbacks=[NanGuard()], logger=False, enable_checkpointing=False)
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from torch import Tensor

from lightning_nanguard._compat import CALLBACK_BASES, TENSORBOARD_LOGGER_TYPES
from lightning_nanguard.detection import fused_health_check, negative_names, nonfinite_names
from lightning_nanguard.events import EventAction, EventKind, NanEvent, NonFiniteTrainingError
from lightning_nanguard.reporting import JsonlEventLog, TensorBoardReporter, TerminalReporter
from lightning_nanguard.reporting.jsonl import EVENTS_FILENAME
from lightning_nanguard.snapshot import BatchNormSnapshot, batchnorm_running_vars

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer
    from torch.optim import Optimizer

__all__ = ["Action", "NanGuard"]

log = logging.getLogger("lightning_nanguard")

Action = Literal["skip", "raise", "warn"]
_ACTIONS: tuple[str, ...] = get_args(Action)
_ACTION_DONE: dict[str, EventAction] = {"skip": "skipped", "raise": "raised", "warn": "warned"}
_EVENTS_KEPT_IN_CHECKPOINT = 100


def _check_choice(name: str, value: object, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"NanGuard: `{name}` must be one of {list(allowed)}, got {value!r}.")


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"NanGuard: `{name}` must be an integer >= {minimum}, got {value!r}.")


class NanGuard(*CALLBACK_BASES):  # type: ignore[misc]
    """Stops NaN/Inf from reaching the weights and reports where it came from.

    After every backward pass (in ``on_before_optimizer_step``, where gradients are complete and
    unscaled) the loss, every gradient and every BatchNorm running statistic are checked in one
    fused pass on the device, with a single host read. On a bad step the optimizer update is made
    a true no-op, the BatchNorm buffers the bad forward touched are restored, and an event is
    recorded in ``guard.events``, ``<log_dir>/nanguard/events.jsonl``, TensorBoard (through the
    Trainer's own ``TensorBoardLogger``) and the terminal.

    Args:
        action: what to do on a bad step: ``"skip"`` the update (default), ``"raise"``
            :class:`~lightning_nanguard.NonFiniteTrainingError`, or ``"warn"`` (report only).
        check_every_n_steps: check one optimizer step in ``n`` (1 = every step).
        max_consecutive_bad_steps: raise, whatever ``action`` is, after this many bad steps in a row.
        check_bn_stats: include BatchNorm ``running_mean``/``running_var`` in the check.
        verbose: print a report of each event to the terminal.

    Example:
        >>> guard = NanGuard(action="skip", max_consecutive_bad_steps=5)
        >>> guard.events
        []
        >>> NanGuard(action="skp")
        Traceback (most recent call last):
        ...
        ValueError: NanGuard: `action` must be one of ['skip', 'raise', 'warn'], got 'skp'.
    """

    def __init__(
        self,
        action: Action = "skip",
        check_every_n_steps: int = 1,
        max_consecutive_bad_steps: int = 10,
        check_bn_stats: bool = True,
        verbose: bool = True,
    ) -> None:
        _check_choice("action", action, _ACTIONS)
        _check_int("check_every_n_steps", check_every_n_steps, 1)
        _check_int("max_consecutive_bad_steps", max_consecutive_bad_steps, 1)
        self.action: Action = action
        self.check_every_n_steps = check_every_n_steps
        self.max_consecutive_bad_steps = max_consecutive_bad_steps
        self.check_bn_stats = check_bn_stats
        self.verbose = verbose

        self.events: list[NanEvent] = []
        self.bad_steps_total = 0
        self.skipped_total = 0
        self.consecutive_bad_steps = 0
        self.last_grad_norm: float | None = None

        self.log_dir: str | None = None
        self._named_params: list[tuple[str, torch.nn.Parameter]] = []
        self._bn: BatchNormSnapshot | None = None
        self._losses: list[Tensor] = []
        self._window_open = False
        self._checking = False
        self._batch_idx = 0
        self._warned_manual = False
        self._jsonl: JsonlEventLog | None = None
        self._tensorboard: list[TensorBoardReporter] = []

    # ------------------------------------------------------------------ setup

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Resolve the log directory (a collective: every rank calls it) and the TensorBoard writers."""
        self.log_dir = trainer.log_dir or trainer.default_root_dir
        self._jsonl = JsonlEventLog(os.path.join(self.log_dir, "nanguard", EVENTS_FILENAME))
        self._tensorboard = []
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                if isinstance(logger, TENSORBOARD_LOGGER_TYPES):
                    reporter = TensorBoardReporter(logger.experiment)
                    reporter.register_layout()
                    self._tensorboard.append(reporter)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Cache parameter names and BatchNorm buffers once the model sits on its device."""
        self._named_params = list(pl_module.named_parameters())
        self._bn = BatchNormSnapshot(pl_module) if self.check_bn_stats else None

    # ------------------------------------------------------------------ per batch

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """Snapshot BatchNorm buffers before the first forward of an optimizer step."""
        self._batch_idx = batch_idx
        if self._window_open:  # a later micro-batch of gradient accumulation
            return
        self._window_open = True
        self._losses = []
        self._checking = trainer.global_step % self.check_every_n_steps == 0
        if self._checking and self._bn is not None:
            self._bn.capture()

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Tensor) -> None:
        """Keep the loss of each (micro-)batch for the check; no host read here."""
        if self._checking:
            self._losses.append(loss.detach())

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        """Check loss, gradients and BatchNorm statistics; act on a bad step."""
        self._window_open = False
        if not self._checking:
            return
        event = self._inspect(trainer, pl_module)
        if event is None:
            self.consecutive_bad_steps = 0
            self._log_scalars(trainer, include_norm=True)
            return
        self._handle(trainer, pl_module, optimizer, event)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Close the accumulation window when the loop stepped without calling the optimizer hook."""
        if not pl_module.automatic_optimization:
            self._window_open = False

    # ------------------------------------------------------------------ detection

    def _inspect(self, trainer: Trainer, pl_module: LightningModule) -> NanEvent | None:
        grads = [p.grad for _, p in self._named_params if p.grad is not None]
        bn_buffers = self._bn.named_buffers if self._bn is not None else []
        bn_floats = [t for _, t in bn_buffers if t.is_floating_point()]
        summary = fused_health_check(
            grads,
            others=[*self._losses, *bn_floats],
            nonnegative=batchnorm_running_vars(bn_buffers),
            device=pl_module.device,
        )
        flag, grad_norm = summary.tolist()  # the one host read of a healthy step
        self.last_grad_norm = grad_norm
        if not flag:
            return None
        # Bad path: confirm element-wise and name the tensors (a finite tensor may overflow its norm).
        bad_grads = nonfinite_names((n, p.grad) for n, p in self._named_params if p.grad is not None)
        float_buffers = [(n, t) for n, t in bn_buffers if t.is_floating_point()]
        bad_buffers = nonfinite_names(float_buffers)
        bad_buffers += [n for n in negative_names((n, t) for n, t in float_buffers if n.endswith("running_var"))
                        if n not in bad_buffers]
        losses = [float(loss.float().sum()) for loss in self._losses]
        bad_loss = any(not math.isfinite(v) for v in losses)
        kinds: list[EventKind] = []
        if bad_loss:
            kinds.append("loss")
        if bad_grads:
            kinds.append("grad")
        if bad_buffers:
            kinds.append("bn_stats")
        if not kinds:
            return None
        loss_value = next((v for v in losses if not math.isfinite(v)), losses[-1] if losses else None)
        return NanEvent(
            global_step=trainer.global_step,
            epoch=trainer.current_epoch,
            batch_idx=self._batch_idx,
            rank=trainer.global_rank,
            kinds=tuple(kinds),
            action=_ACTION_DONE[self.action],
            nonfinite_grads=tuple(bad_grads),
            nonfinite_buffers=tuple(bad_buffers),
            loss=loss_value,
            grad_norm=grad_norm,
            details={"grads_checked": len(grads), "buffers_checked": len(bn_buffers)},
        )

    # ------------------------------------------------------------------ action

    def _handle(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer, event: NanEvent) -> None:
        self.bad_steps_total += 1
        self.consecutive_bad_steps += 1
        escalate = self.consecutive_bad_steps >= self.max_consecutive_bad_steps
        action = "raise" if escalate else self.action
        if action == "skip" and not pl_module.automatic_optimization:
            self._warn_manual_once()
            action = "warn"
        event = event.replace(action=_ACTION_DONE[action])

        if action in ("skip", "raise"):
            # Never let the bad values reach the weights or survive in the BatchNorm buffers.
            self._discard_step(optimizer)
        if action == "skip":
            self.skipped_total += 1
        self._record(trainer, pl_module, event)
        if action == "raise":
            history = self.events[-self.consecutive_bad_steps :]
            raise NonFiniteTrainingError(self._raise_message(event, escalate), history)

    def _discard_step(self, optimizer: Optimizer) -> None:
        """Make the coming ``optimizer.step`` a no-op and undo this batch's BatchNorm updates."""
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = None  # optimizers skip parameters without grad: no state change at all
        if self._bn is not None:
            self._bn.restore()

    def _warn_manual_once(self) -> None:
        if not self._warned_manual:
            self._warned_manual = True
            log.warning(
                "NanGuard: manual optimisation detected; bad steps are detected and reported, "
                "but not skipped automatically. Check `guard.events` in your training_step."
            )

    def _raise_message(self, event: NanEvent, escalated: bool) -> str:
        where = f" Events are in {self._jsonl.path}." if self._jsonl is not None else ""
        if escalated:
            return (
                f"NanGuard: {self.consecutive_bad_steps} consecutive bad steps (max_consecutive_bad_steps="
                f"{self.max_consecutive_bad_steps}); last: {event.headline()}. Skipping no longer helps: the "
                "weights, the learning rate or the data pipeline is at fault, not single batches. Lower the "
                f"learning rate, enable gradient clipping, or inspect the events.{where}"
            )
        return (
            f"NanGuard: {event.headline()}. The optimizer step was not applied, so the weights are still finite. "
            "Inspect the event (error.event), then use action='skip' to train past bad batches or fix the "
            f"origin.{where}"
        )

    # ------------------------------------------------------------------ reporting

    def _record(self, trainer: Trainer, pl_module: LightningModule, event: NanEvent) -> None:
        self.events.append(event)
        if self._jsonl is not None:
            self._jsonl.append(event)
        if self.verbose:
            TerminalReporter(rank=trainer.global_rank).report(event)
        for reporter in self._tensorboard:
            reporter.report(event)
        self._log_scalars(trainer, include_norm=True, force=True)
        if self.skipped_total:
            pl_module.log("nan_skipped", float(self.skipped_total), prog_bar=True, logger=False, batch_size=1)

    def _log_scalars(self, trainer: Trainer, include_norm: bool, force: bool = False) -> None:
        connector = getattr(trainer, "_logger_connector", None)
        due = force or (connector.should_update_logs if connector is not None else True)
        if not due or not trainer.is_global_zero or not trainer.loggers:
            return
        metrics: dict[str, float] = {
            "nanguard/bad_steps_total": float(self.bad_steps_total),
            "nanguard/skipped_total": float(self.skipped_total),
        }
        if include_norm and self.last_grad_norm is not None:
            metrics["nanguard/grad_norm"] = self.last_grad_norm
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """Counters and the last 100 events as ``to_dict()`` primitives (``weights_only``-safe)."""
        summaries = [event.to_dict() for event in self.events[-_EVENTS_KEPT_IN_CHECKPOINT:]]
        return {
            "bad_steps_total": self.bad_steps_total,
            "skipped_total": self.skipped_total,
            "consecutive_bad_steps": self.consecutive_bad_steps,
            "events": summaries,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore counters and events; keys added in later versions default sensibly."""
        self.bad_steps_total = int(state_dict.get("bad_steps_total", 0))
        self.skipped_total = int(state_dict.get("skipped_total", 0))
        self.consecutive_bad_steps = int(state_dict.get("consecutive_bad_steps", 0))
        self.events = [NanEvent.from_dict(summary) for summary in state_dict.get("events", [])]
