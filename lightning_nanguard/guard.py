"""``NanGuard``: the Lightning callback that wires detection, snapshots and reporting to hooks.

Example:
    >>> from lightning.pytorch import Trainer
    >>> trainer = Trainer(callbacks=[NanGuard()], logger=False, enable_checkpointing=False)
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from torch import Tensor

from lightning_nanguard._compat import CALLBACK_BASES, TENSORBOARD_LOGGER_TYPES
from lightning_nanguard.batching import slice_batch
from lightning_nanguard.detection import fused_health_check, negative_names, nonfinite_names
from lightning_nanguard.events import EventAction, EventKind, NanEvent, NonFiniteTrainingError
from lightning_nanguard.forensics import Diagnosis, diagnose, event_with_diagnosis
from lightning_nanguard.indices import RecordingBatchSampler, indices_from_batch, record_batch_indices
from lightning_nanguard.reporting import JsonlEventLog, TensorBoardReporter, TerminalReporter
from lightning_nanguard.reporting.jsonl import EVENTS_FILENAME
from lightning_nanguard.repro import prune_bundles, save_bundle
from lightning_nanguard.snapshot import BatchNormSnapshot, batchnorm_running_vars

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer
    from torch.optim import Optimizer

__all__ = ["Action", "NanGuard"]


def _localized(diagnosis: Diagnosis) -> bool:
    return diagnosis.localization is not None and diagnosis.localization.phase is not None


log = logging.getLogger("lightning_nanguard")

Action = Literal["skip", "raise", "warn"]
_ACTIONS: tuple[str, ...] = get_args(Action)
_ACTION_DONE: dict[str, EventAction] = {"skip": "skipped", "raise": "raised", "warn": "warned"}
_EVENTS_KEPT_IN_CHECKPOINT = 100


@dataclass
class _MicroBatch:
    """A (micro-)batch of the current optimizer step, kept until the step is checked."""

    batch: Any
    batch_idx: int
    dataset_indices: list[int] | None


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
        bisect: on a bad step, re-run ``training_step`` on sub-batches to find the offending samples.
        localize: on a bad step, name the module, autograd op and source line of the first NaN/Inf.
        max_bisect_passes: cap on the forward/backward passes one diagnosis may use.
        save_repro: save a repro bundle (``<log_dir>/nanguard/step-<N>/``) for each bad step.
        max_repro_bundles: keep at most this many bundles on disk (oldest deleted first).
        index_key: batch field (dict key, attribute or tuple position) holding dataset indices, used
            when the loader's sampler cannot be recorded (e.g. an ``IterableDataset``).
        batch_slicer: ``slicer(batch, positions) -> sub_batch`` for batches the built-in slicer cannot
            cut (a LightningModule method ``nanguard_slice_batch`` is used too when present).
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
        bisect: bool = True,
        localize: bool = True,
        max_bisect_passes: int = 64,
        save_repro: bool = True,
        max_repro_bundles: int = 5,
        index_key: str | int | None = None,
        batch_slicer: Callable[[Any, Sequence[int]], Any] | None = None,
        verbose: bool = True,
    ) -> None:
        _check_choice("action", action, _ACTIONS)
        _check_int("check_every_n_steps", check_every_n_steps, 1)
        _check_int("max_consecutive_bad_steps", max_consecutive_bad_steps, 1)
        _check_int("max_bisect_passes", max_bisect_passes, 1)
        _check_int("max_repro_bundles", max_repro_bundles, 0)
        if batch_slicer is not None and not callable(batch_slicer):
            raise ValueError(f"NanGuard: `batch_slicer` must be callable(batch, positions), got {batch_slicer!r}.")
        self.action: Action = action
        self.check_every_n_steps = check_every_n_steps
        self.max_consecutive_bad_steps = max_consecutive_bad_steps
        self.check_bn_stats = check_bn_stats
        self.bisect = bisect
        self.localize = localize
        self.max_bisect_passes = max_bisect_passes
        self.save_repro = save_repro
        self.max_repro_bundles = max_repro_bundles
        self.index_key = index_key
        self.batch_slicer = batch_slicer
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
        self._micro_batches: list[_MicroBatch] = []
        self._samplers: list[RecordingBatchSampler] = []
        self._window_open = False
        self._checking = False
        self._batch_idx = 0
        self._warned_manual = False
        self._warned_forensics = False
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

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Have every dataloader record its batches' dataset indices, before Lightning iterates it."""
        if stage != "fit" or not self.bisect or self.index_key is not None:
            return
        strategy = trainer.strategy
        if "process_dataloader" in vars(strategy):  # already wrapped (a second fit)
            return
        original = strategy.process_dataloader

        def process_dataloader(dataloader: Any) -> Any:
            dataloader = original(dataloader)
            record_batch_indices(dataloader)
            return dataloader

        strategy.process_dataloader = process_dataloader  # type: ignore[method-assign]

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Remove the dataloader wrapper installed in :meth:`setup`."""
        vars(trainer.strategy).pop("process_dataloader", None)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Pick the recording batch samplers of this epoch's training loaders."""
        self._samplers = []
        loader = trainer.train_dataloader
        if self.bisect and self.index_key is None:
            sampler = record_batch_indices(loader)
            if sampler is not None:
                self._samplers.append(sampler)

    # ------------------------------------------------------------------ per batch

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """Snapshot BatchNorm buffers before the first forward of an optimizer step."""
        self._batch_idx = batch_idx
        indices = self._dataset_indices(batch)
        if not self._window_open:  # the first micro-batch of an optimizer step
            self._window_open = True
            self._losses = []
            self._micro_batches = []
            self._checking = trainer.global_step % self.check_every_n_steps == 0
            if self._checking and self._bn is not None:
                self._bn.capture()
        if self._checking and (self.bisect or self.localize or self.save_repro):
            self._micro_batches.append(_MicroBatch(batch, batch_idx, indices))

    def _dataset_indices(self, batch: Any) -> list[int] | None:
        if self.index_key is not None:
            return indices_from_batch(batch, self.index_key)
        for sampler in self._samplers:
            if sampler.nanguard_fifo:
                return sampler.nanguard_fifo.popleft()
        return None

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
            self._micro_batches = []
            self._log_scalars(trainer, include_norm=True)
            return
        try:
            self._handle(trainer, pl_module, optimizer, event)
        finally:
            self._micro_batches = []

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
        bad_buffers += [
            n
            for n in negative_names((n, t) for n, t in float_buffers if n.endswith("running_var"))
            if n not in bad_buffers
        ]
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
        if pl_module.automatic_optimization:
            event = self._investigate(trainer, pl_module, event)

        if action in ("skip", "raise"):
            # Never let the bad values reach the weights or survive in the BatchNorm buffers.
            self._discard_step(optimizer)
        if action == "skip":
            self.skipped_total += 1
        self._record(trainer, pl_module, event)
        if action == "raise":
            history = self.events[-self.consecutive_bad_steps :]
            raise NonFiniteTrainingError(self._raise_message(event, escalate), history)

    # ------------------------------------------------------------------ forensics

    def _investigate(self, trainer: Trainer, pl_module: LightningModule, event: NanEvent) -> NanEvent:
        """Bisect, localise and save a bundle, from the BatchNorm state before the bad forward."""
        if not self._micro_batches or not (self.bisect or self.localize or self.save_repro):
            return event
        corrupted = [t.detach().clone() for _, t in self._bn.named_buffers] if self._bn is not None else []
        if self._bn is not None:
            self._bn.restore()  # diagnose (and save) the state the bad batch started from
        try:
            event = self._diagnose(trainer, pl_module, event)
        finally:
            if self.action == "warn" and event.action == "warned" and self._bn is not None:
                with torch.no_grad():  # action="warn" changes nothing: put the batch's statistics back
                    torch._foreach_copy_([t for _, t in self._bn.named_buffers], corrupted)
        return event

    def _diagnose(self, trainer: Trainer, pl_module: LightningModule, event: NanEvent) -> NanEvent:
        step_fn = self._step_fn(pl_module)
        slicer = self.batch_slicer or getattr(pl_module, "nanguard_slice_batch", None)
        diagnosis: Diagnosis | None = None
        chosen = self._micro_batches[-1]
        if self.bisect or self.localize:
            for micro in self._micro_batches:  # under accumulation: the first micro-batch that reproduces
                found = diagnose(
                    pl_module,
                    micro.batch,
                    step_fn=step_fn,
                    batch_idx=micro.batch_idx,
                    slicer=slicer,
                    context=trainer.precision_plugin.train_step_context,
                    bisect=self.bisect,
                    localize_origin=self.localize,
                    max_passes=self.max_bisect_passes,
                )
                if diagnosis is None or found.offending is not None or _localized(found):
                    diagnosis, chosen = found, micro
                if found.offending is not None or found.error:
                    break
        if diagnosis is not None:
            if diagnosis.error and not self._warned_forensics:
                self._warned_forensics = True
                log.warning(
                    "NanGuard: diagnosis failed (%s); bad steps are still detected and skipped.", diagnosis.error
                )
            event = event_with_diagnosis(event, diagnosis, dataset_indices=chosen.dataset_indices)
            event = event.replace(batch_idx=chosen.batch_idx)
        if self.save_repro and self.log_dir is not None:
            event = self._save_bundle(pl_module, event, chosen, slicer)
        return event

    def _step_fn(self, pl_module: LightningModule) -> Callable[[Any, int], Any]:
        compiler_ctx = getattr(pl_module, "_compiler_ctx", None)
        if compiler_ctx and compiler_ctx.get("original_training_step") is not None:
            original = compiler_ctx["original_training_step"]
            return lambda batch, batch_idx: original(batch, batch_idx)
        return pl_module.training_step

    def _save_bundle(
        self,
        pl_module: LightningModule,
        event: NanEvent,
        micro: _MicroBatch,
        slicer: Callable[[Any, Sequence[int]], Any] | None,
    ) -> NanEvent:
        directory = Path(self.log_dir or ".") / "nanguard"
        positions = list(event.offending_samples) if event.offending_samples is not None else None
        try:
            samples = micro.batch
            if positions is not None:
                samples = (slicer or slice_batch)(micro.batch, positions)
            indices = list(event.dataset_indices) if event.dataset_indices is not None else micro.dataset_indices
            if positions is None and micro.dataset_indices is None:
                indices = None
            path = save_bundle(directory, event, pl_module, samples, micro.batch_idx, positions, indices)
            prune_bundles(directory, self.max_repro_bundles)
        except Exception as error:  # never let the bundle kill training
            log.warning("NanGuard: could not save the repro bundle: %r", error)
            return event
        return event.replace(repro_path=str(path) if path.exists() else None)

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
