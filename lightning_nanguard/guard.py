"""``NanGuard``: the Lightning callback that wires detection, forensics, recovery and reporting to hooks.

Example:
    >>> from lightning.pytorch import Trainer
    >>> trainer = Trainer(callbacks=[NanGuard()], logger=False, enable_checkpointing=False)
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar, get_args

import torch
from torch import Tensor, nn

from lightning_nanguard._compat import CALLBACK_BASES
from lightning_nanguard.detection import (
    all_finite,
    bad_batchnorm_names,
    fused_health_check,
    grouped_norms,
    nonfinite_names,
)
from lightning_nanguard.events import EventAction, EventKind, NanEvent, NonFiniteTrainingError
from lightning_nanguard.indices import RecordingBatchSampler, indices_from_batch, record_batch_indices
from lightning_nanguard.investigation import InvestigationSettings, MicroBatch, investigate
from lightning_nanguard.recovery import Recovery, apply_module_eps, grad_scaler
from lightning_nanguard.remedies import REMEDIES, Remedy, clip_gradients_
from lightning_nanguard.reporting import EventSinks
from lightning_nanguard.snapshot import BatchNormSnapshot, batchnorm_buffers, batchnorm_running_vars
from lightning_nanguard.strategy import apply_nanguard_strategy, remove_nanguard_strategy, strategy_kind
from lightning_nanguard.timing import GuardClock

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer
    from torch.optim import Optimizer

__all__ = ["Action", "NanGuard"]

log = logging.getLogger("lightning_nanguard")

Action = Literal["skip", "raise", "warn", "rollback"]
_ACTIONS: tuple[str, ...] = get_args(Action)
_DONE: dict[str, EventAction] = {"skip": "skipped", "raise": "raised", "warn": "warned", "rollback": "skipped"}
_EVENTS_KEPT_IN_CHECKPOINT = 100
_F = TypeVar("_F", bound=Callable[..., Any])


def _check_choice(name: str, value: object, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"NanGuard: `{name}` must be one of {list(allowed)}, got {value!r}.")


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"NanGuard: `{name}` must be an integer >= {minimum}, got {value!r}.")


def _check_positive(name: str, value: object, upper: float | None = None) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    if ok and upper is not None:
        ok = float(value) < upper  # type: ignore[arg-type]
    if not ok:
        bound = f" and < {upper}" if upper is not None else ""
        raise ValueError(f"NanGuard: `{name}` must be a number > 0{bound}, got {value!r}.")


def _any_inf(tensors: Sequence[Tensor]) -> bool:
    """Whether some element is +/-Inf (bad path only: one host read)."""
    flags = [torch.isinf(t).any() for t in tensors]
    return bool(torch.stack(flags).any()) if flags else False


def _failsafe(hook: _F) -> _F:
    """Run a hook so that the guard's own failure never kills training: warn once, disable the guard."""

    @functools.wraps(hook)
    def wrapper(self: NanGuard, *args: Any, **kwargs: Any) -> Any:
        if not self.active:
            return None
        try:
            with self.clock.measure(hook.__name__):
                return hook(self, *args, **kwargs)
        except NonFiniteTrainingError:
            raise
        except Exception as error:
            self.active = False
            log.warning(
                "NanGuard disabled itself after an internal error in %s: %r. Training continues unguarded; "
                "please report this with the traceback.",
                hook.__name__,
                error,
                exc_info=True,
            )
            return None

    return wrapper  # type: ignore[return-value]


class NanGuard(*CALLBACK_BASES):  # type: ignore[misc]
    """Stops NaN/Inf from reaching the weights and reports where it came from.

    After every backward pass (in ``on_before_optimizer_step``, where gradients are complete and
    unscaled) the loss, every gradient and every BatchNorm running statistic are checked in one
    fused pass on the device, with a single host read. On a bad step the optimizer update is made
    a true no-op, the BatchNorm buffers the bad forward touched are restored, the offending
    samples, module, op and source line are found, and an event is recorded in ``guard.events``,
    ``<log_dir>/nanguard/events.jsonl``, TensorBoard (through the Trainer's own
    ``TensorBoardLogger``) and the terminal.

    Args:
        action: what to do on a bad step: ``"skip"`` the update (default), ``"raise"``
            :class:`~lightning_nanguard.NonFiniteTrainingError`, ``"warn"`` (report only) or
            ``"rollback"`` (skip, and restore the last good snapshot when NaN/Inf reached the
            weights or after ``rollback_after_consecutive`` bad steps).
        check_every_n_steps: check one optimizer step in ``n`` (1 = every step).
        max_consecutive_bad_steps: raise, whatever ``action`` is, after this many bad steps in a row.
        max_events: raise with the full history after this many incidents in total (``None``: never).
        check_bn_stats: include BatchNorm ``running_mean``/``running_var`` in the check.
        check_params_every_n_steps: check the weights after the update every ``n`` steps (0: never;
            also checked before every snapshot and checkpoint).
        bisect: on a bad step, re-run ``training_step`` on sub-batches to find the offending samples.
        localize: on a bad step, name the module, autograd op and source line of the first NaN/Inf.
        max_bisect_passes: cap on the forward/backward passes one diagnosis may use.
        save_repro: save a repro bundle (``<log_dir>/nanguard/step-<N>/``) for each bad step.
        max_repro_bundles: keep at most this many bundles on disk (oldest deleted first).
        index_key: batch field (dict key, attribute or tuple position) holding dataset indices, used
            when the loader's sampler cannot be recorded (e.g. an ``IterableDataset``).
        batch_slicer: ``slicer(batch, positions) -> sub_batch`` for batches the built-in slicer cannot
            cut (a LightningModule method ``nanguard_slice_batch`` is used too when present).
        snapshot_every_n_steps: with ``action="rollback"``, refresh the last good snapshot every ``n`` steps.
        rollback_after_consecutive: with ``action="rollback"``, roll back after this many bad steps in a row.
        remedies: remedies to apply after incidents: ``"clip_grad"``, ``"raise_eps"``, ``"lr_backoff"``,
            ``"quarantine"`` (see the README's decision guide).
        max_remedy_applications: cap per remedy.
        lr_backoff_factor: learning-rate multiplier of one ``lr_backoff``.
        eps_factor: multiplier of one ``raise_eps``.
        max_eps: ``raise_eps`` never sets ``eps`` above this.
        min_loss_scale: with a GradScaler, a loss scale falling below this is an incident.
        max_consecutive_overflows: with a GradScaler, this many overflow skips in a row is an incident.
        verbose: print a report of each event to the terminal.

    Example:
        >>> guard = NanGuard(action="skip", max_consecutive_bad_steps=5)
        >>> guard.events
        []
        >>> NanGuard(action="skp")
        Traceback (most recent call last):
        ...
        ValueError: NanGuard: `action` must be one of ['skip', 'raise', 'warn', 'rollback'], got 'skp'.
    """

    def __init__(
        self,
        action: Action = "skip",
        check_every_n_steps: int = 1,
        max_consecutive_bad_steps: int = 10,
        max_events: int | None = None,
        check_bn_stats: bool = True,
        check_params_every_n_steps: int = 50,
        bisect: bool = True,
        localize: bool = True,
        max_bisect_passes: int = 64,
        save_repro: bool = True,
        max_repro_bundles: int = 5,
        index_key: int | str | None = None,
        batch_slicer: Callable[[Any, Sequence[int]], Any] | None = None,
        snapshot_every_n_steps: int = 100,
        rollback_after_consecutive: int = 3,
        remedies: list[Remedy] | None = None,
        max_remedy_applications: int = 3,
        lr_backoff_factor: float = 0.5,
        eps_factor: float = 10.0,
        max_eps: float = 0.01,
        min_loss_scale: float = 1.0,
        max_consecutive_overflows: int = 20,
        verbose: bool = True,
    ) -> None:
        _check_choice("action", action, _ACTIONS)
        for name, value, minimum in (
            ("check_every_n_steps", check_every_n_steps, 1),
            ("max_consecutive_bad_steps", max_consecutive_bad_steps, 1),
            ("check_params_every_n_steps", check_params_every_n_steps, 0),
            ("max_bisect_passes", max_bisect_passes, 1),
            ("max_repro_bundles", max_repro_bundles, 0),
            ("snapshot_every_n_steps", snapshot_every_n_steps, 1),
            ("rollback_after_consecutive", rollback_after_consecutive, 1),
            ("max_remedy_applications", max_remedy_applications, 0),
            ("max_consecutive_overflows", max_consecutive_overflows, 1),
        ):
            _check_int(name, value, minimum)
        if max_events is not None:
            _check_int("max_events", max_events, 1)
        for remedy in remedies or []:
            _check_choice("remedies", remedy, REMEDIES)
        _check_positive("lr_backoff_factor", lr_backoff_factor, upper=1.0)
        _check_positive("eps_factor", eps_factor)
        _check_positive("max_eps", max_eps)
        _check_positive("min_loss_scale", min_loss_scale)
        if batch_slicer is not None and not callable(batch_slicer):
            raise ValueError(f"NanGuard: `batch_slicer` must be callable(batch, positions), got {batch_slicer!r}.")

        self.action: Action = action
        self.check_every_n_steps = check_every_n_steps
        self.max_consecutive_bad_steps = max_consecutive_bad_steps
        self.max_events = max_events
        self.check_bn_stats = check_bn_stats
        self.check_params_every_n_steps = check_params_every_n_steps
        self.bisect = bisect
        self.localize = localize
        self.max_bisect_passes = max_bisect_passes
        self.save_repro = save_repro
        self.max_repro_bundles = max_repro_bundles
        self.index_key = index_key
        self.batch_slicer = batch_slicer
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self.rollback_after_consecutive = rollback_after_consecutive
        self.remedies: list[Remedy] = list(remedies or [])
        self.max_remedy_applications = max_remedy_applications
        self.lr_backoff_factor = lr_backoff_factor
        self.eps_factor = eps_factor
        self.max_eps = max_eps
        self.min_loss_scale = min_loss_scale
        self.max_consecutive_overflows = max_consecutive_overflows
        self.verbose = verbose

        self.active = True
        self.events: list[NanEvent] = []
        self.bad_steps_total = 0
        self.skipped_total = 0
        self.consecutive_bad_steps = 0
        self.amp_overflow_total = 0
        self.consecutive_overflows = 0
        self.last_grad_norm: float | None = None
        self.recovery = Recovery(tuple(self.remedies), max_remedy_applications, lr_backoff_factor, eps_factor, max_eps)
        self.sinks = EventSinks(verbose)
        self.clock = GuardClock()  # `guard.clock.enabled = True` measures the time spent in the guard

        self._trainer: Trainer | None = None
        self._named_params: list[tuple[str, nn.Parameter]] = []
        self._params: list[nn.Parameter] = []
        self._bn: BatchNormSnapshot | None = None
        self._losses: list[Tensor] = []
        self._micro_batches: list[MicroBatch] = []
        self._samplers: list[RecordingBatchSampler] = []
        self._window_open = False
        self._checking = False
        self._step_was_bad = False
        self._pending_rollback = False
        self._diagnose_here = True
        self._batch_idx = 0
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ properties

    @property
    def log_dir(self) -> str | None:
        """The run's log directory (first logger's ``log_dir``, else ``default_root_dir``)."""
        return self.sinks.log_dir

    @property
    def remedy_book(self) -> Any:
        """Remedy counts and state (clip threshold, quarantined dataset indices)."""
        return self.recovery.book

    @property
    def records_indices(self) -> bool:
        """Whether training loaders should record dataset indices."""
        return self.index_key is None and (self.bisect or "quarantine" in self.remedies)

    # ------------------------------------------------------------------ setup

    @_failsafe
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Wrap the strategy (every process, before ``strategy.setup``) and refuse what cannot be guarded."""
        if stage != "fit":
            return
        kind = strategy_kind(trainer.strategy)
        if kind == "deepspeed":
            raise NonFiniteTrainingError(
                "NanGuard does not support DeepSpeed: its engine owns the optimizer step, so a bad step cannot be "
                "skipped from Lightning. Remove NanGuard, or use DDP/FSDP.",
                [],
            )
        self._diagnose_here = kind != "fsdp"
        if kind == "fsdp":
            self._warn_once(
                "fsdp",
                "NanGuard: under FSDP bad steps are detected and skipped on all ranks, but "
                "bisection and localisation are off (they would re-run sharded forwards on one rank).",
            )
        apply_nanguard_strategy(trainer.strategy, self)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Give the Trainer its own strategy class back."""
        remove_nanguard_strategy(trainer.strategy)

    @_failsafe
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Resolve the log directory (a collective: every rank calls it) and the writers."""
        self._trainer = trainer
        self.sinks.attach(trainer)
        if not pl_module.automatic_optimization and self.action in ("skip", "rollback"):
            self._warn_once(
                "manual",
                "NanGuard: manual optimisation; bad steps are detected and reported but not "
                "skipped, bisected or rolled back automatically. Call `guard.check(self)` in your "
                "training_step before `optimizer.step()` to act on them.",
            )
        if any(isinstance(opt, torch.optim.LBFGS) for opt in trainer.optimizers):
            self._warn_once(
                "lbfgs",
                "NanGuard: LBFGS evaluates its closure many times per step, so a step cannot "
                "be skipped halfway; bad steps are detected and reported only.",
            )

    @_failsafe
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Cache parameter names and BatchNorm buffers once the model sits on its device."""
        self._named_params = list(pl_module.named_parameters())
        self._params = [p for _, p in self._named_params]
        self._bn = BatchNormSnapshot(pl_module)  # restored on every discarded step, checked if check_bn_stats
        apply_module_eps(pl_module, self.recovery.book.module_eps)  # after a resume
        if self.action == "rollback" and self._params_finite(pl_module):
            self._capture(trainer, pl_module)

    @_failsafe
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Pick the recording batch samplers of this epoch's training loader."""
        self._samplers = []
        if self.records_indices:
            sampler = record_batch_indices(trainer.train_dataloader)
            if sampler is not None:
                sampler.nanguard_exclude = self.recovery.book.quarantined
                sampler.nanguard_clock = self.clock
                self._samplers.append(sampler)

    # ------------------------------------------------------------------ per batch

    @_failsafe
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """Snapshot BatchNorm buffers before the first forward of an optimizer step."""
        self._batch_idx = batch_idx
        indices = self._dataset_indices(batch)
        # the first micro-batch of an optimizer step; in manual optimisation every batch (a manual loop
        # may skip optimizer.step(), and then on_before_optimizer_step never closes the window)
        if not self._window_open or not pl_module.automatic_optimization:
            self._window_open = True
            self._losses = []
            self._micro_batches = []
            self._step_was_bad = False
            self._checking = trainer.global_step % self.check_every_n_steps == 0
            if self._checking and self._bn is not None:
                self._bn.capture()
        if self._checking and (self.bisect or self.localize or self.save_repro):
            self._micro_batches.append(MicroBatch(batch, batch_idx, indices))

    def _dataset_indices(self, batch: Any) -> list[int] | None:
        if self.index_key is not None:
            return indices_from_batch(batch, self.index_key)
        for sampler in self._samplers:
            if sampler.nanguard_fifo:
                return sampler.nanguard_fifo.popleft()
        return None

    @_failsafe
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Tensor) -> None:
        """Keep the loss of each (micro-)batch for the check; no host read here."""
        if self._checking:
            self._losses.append(loss.detach())

    @_failsafe
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        """Check loss, gradients and BatchNorm statistics; make the one skip decision of the step."""
        self._window_open = False
        if not self._checking:
            return
        grads = [g for p in self._params if (g := p.grad) is not None]
        bn_buffers = self._checked_bn_buffers()
        summary = fused_health_check(
            grads,
            others=[*self._losses, *(t for _, t in bn_buffers if t.is_floating_point())],
            nonnegative=batchnorm_running_vars(bn_buffers),
            device=pl_module.device,
            with_norm="clip_grad" in self.remedies or self.sinks.logging_due(trainer),
        )
        if trainer.world_size > 1:  # one reduce per step, every rank: [ranks bad, ranks whose loss/BN is bad]
            flags = torch.stack((summary[0], summary[2]))
            summary = torch.cat((summary, trainer.strategy.reduce(flags, reduce_op="sum")))
        values = summary.tolist()  # the one host read of a healthy step
        local_flag, grad_norm, others_flag = values[0], values[1], values[2]
        any_rank_bad = values[3] > 0 if len(values) > 3 else local_flag > 0
        if grad_norm < 0 and any_rank_bad:  # bad path: the norm tells NaN (nan) from overflow (inf)
            grad_norm = float(torch.linalg.vector_norm(grouped_norms(grads))) if grads else 0.0
        if grad_norm >= 0 or math.isnan(grad_norm):
            self.last_grad_norm = grad_norm

        if not any_rank_bad:
            self._healthy_step(trainer, grads, grad_norm)
            return
        if len(values) > 4 and values[4] > 0 and not others_flag:
            # DDP averages gradients: NaN/Inf born in another rank's loss or BatchNorm statistics reaches
            # this rank's gradients through the all-reduce. Skip with it; the event is that rank's.
            self._remote_bad_step(optimizer)
            return
        scaler = grad_scaler(trainer)
        # An fp16 overflow gives Inf (and, through Inf * 0 or Inf - Inf, NaN) gradients with a finite loss
        # and finite BatchNorm statistics: the GradScaler's to skip. NaN without any Inf is no overflow
        # (0/0 in a sqrt or a masked division): an incident.
        if scaler is not None and not others_flag and not math.isfinite(grad_norm) and _any_inf(grads):
            event = self._amp_overflow(trainer, scaler)
            if event is None:
                return  # the GradScaler skips this step by itself: not an incident
        else:
            event = self._inspect(trainer, grads, grad_norm) if local_flag else None
        if event is None:
            if trainer.world_size > 1:  # another rank is bad (or this one only overflowed a norm): all skip
                self._remote_bad_step(optimizer)
            else:  # a finite tensor whose norm overflowed: not a NaN/Inf step
                self._healthy_step(trainer, grads, grad_norm)
            return
        self._handle(trainer, pl_module, optimizer, event)

    def _healthy_step(self, trainer: Trainer, grads: list[Tensor], grad_norm: float) -> None:
        self.consecutive_bad_steps = 0
        self.consecutive_overflows = 0
        self._micro_batches = []
        if math.isfinite(grad_norm) and grad_norm >= 0:  # -1: not computed this step
            self.recovery.remember_healthy_norm(grad_norm)
            threshold = self.recovery.book.clip_threshold
            if threshold is not None:
                clip_gradients_(grads, grad_norm, threshold)
        self._log_scalars(trainer)

    def _remote_bad_step(self, optimizer: Optimizer) -> None:
        """Another rank saw NaN/Inf: skip here too so the weights stay identical on every rank."""
        self.consecutive_bad_steps += 1
        self._step_was_bad = True
        if self.action == "raise":  # every rank must stop, or the others hang in the next collective
            raise NonFiniteTrainingError("NanGuard: another rank saw NaN/Inf (action='raise'); see its event.", [])
        if self.action in ("skip", "rollback"):
            self._discard_step(optimizer)
            self.skipped_total += 1
        if self.consecutive_bad_steps >= self.rollback_after_consecutive and self.action == "rollback":
            self._pending_rollback = True
        if self.consecutive_bad_steps >= self.max_consecutive_bad_steps:
            raise NonFiniteTrainingError(
                f"NanGuard: {self.consecutive_bad_steps} consecutive bad steps on other ranks "
                "(max_consecutive_bad_steps); see their events.",
                self.events,
            )

    def _amp_overflow(self, trainer: Trainer, scaler: Any) -> NanEvent | None:
        """An Inf-only overflow the GradScaler handles; an incident only when the scale collapses."""
        self.amp_overflow_total += 1
        self.consecutive_overflows += 1
        scale = float(scaler.get_scale()) * scaler.get_backoff_factor()  # what update() will set
        self._log_scalars(trainer, force=True)
        if scale >= self.min_loss_scale and self.consecutive_overflows < self.max_consecutive_overflows:
            return None
        return NanEvent(
            global_step=trainer.global_step,
            epoch=trainer.current_epoch,
            batch_idx=self._batch_idx,
            rank=trainer.global_rank,
            kinds=("loss_scale",),
            action=_DONE[self.action],
            grad_norm=self.last_grad_norm,
            details={
                "loss_scale": scale,
                "consecutive_overflows": self.consecutive_overflows,
                "hint": "the loss scale collapsed: the model overflows fp16 even unscaled; use bf16-mixed, lower "
                "the learning rate, or find the op producing huge values",
            },
        )

    def _inspect(self, trainer: Trainer, grads: list[Tensor], grad_norm: float) -> NanEvent | None:
        """Bad path: confirm element-wise and name the tensors (a finite tensor may overflow its norm)."""
        bad_grads = nonfinite_names((n, p.grad) for n, p in self._named_params if p.grad is not None)
        bn_buffers = self._checked_bn_buffers()
        bad_buffers = bad_batchnorm_names(bn_buffers)
        losses = [float(loss.float().sum()) for loss in self._losses]
        kinds: list[EventKind] = []
        if any(not math.isfinite(v) for v in losses):
            kinds.append("loss")
        if bad_grads:
            kinds.append("grad")
        if bad_buffers:
            kinds.append("bn_stats")
        if not kinds:
            return None
        scale = self._loss_scale(trainer)
        loss = next((v for v in losses if not math.isfinite(v)), losses[-1] if losses else None)
        if loss is not None and scale is not None and math.isfinite(loss):
            loss /= scale  # on_before_backward saw the scaled loss
        return NanEvent(
            global_step=trainer.global_step,
            epoch=trainer.current_epoch,
            batch_idx=self._batch_idx,
            rank=trainer.global_rank,
            kinds=tuple(kinds),
            action=_DONE[self.action],
            nonfinite_grads=tuple(bad_grads),
            nonfinite_buffers=tuple(bad_buffers),
            loss=loss,
            grad_norm=grad_norm,
            details={
                "grads_checked": len(grads),
                "buffers_checked": sum(t.is_floating_point() for _, t in bn_buffers),
            },
        )

    def _checked_bn_buffers(self) -> list[tuple[str, Tensor]]:
        """The BatchNorm buffers the check covers (none with ``check_bn_stats=False``)."""
        return self._bn.named_buffers if self._bn is not None and self.check_bn_stats else []

    @staticmethod
    def _loss_scale(trainer: Trainer) -> float | None:
        scaler = grad_scaler(trainer)
        return float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else None

    # ------------------------------------------------------------------ action

    def _handle(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer, event: NanEvent) -> None:
        if self._step_was_bad and isinstance(getattr(optimizer, "_optimizer", optimizer), torch.optim.LBFGS):
            return  # LBFGS evaluates its closure (and this hook) many times per step: one event per step
        self.bad_steps_total += 1
        self.consecutive_bad_steps += 1
        self._step_was_bad = True
        escalate = self.consecutive_bad_steps >= self.max_consecutive_bad_steps or (
            self.max_events is not None and self.bad_steps_total >= self.max_events
        )
        action: str = "raise" if escalate else self.action
        if action in ("skip", "rollback") and not self._can_skip(pl_module, optimizer):
            action = "warn"
        event = event.replace(action=_DONE[action])

        if pl_module.automatic_optimization and self._diagnose_here and self._may_diagnose(trainer, pl_module):
            event = self._investigate(trainer, pl_module, event, restore_after=action == "warn")
        if action in ("skip", "raise", "rollback"):
            self._discard_step(optimizer)
        if action in ("skip", "rollback"):
            self.skipped_total += 1
            rollback_due = action == "rollback" and self.consecutive_bad_steps >= self.rollback_after_consecutive
            if rollback_due:
                self._pending_rollback = True  # done after the optimizer step, when the scaler has updated
            remedies = self.recovery.apply(trainer, pl_module, event, rolled_back=rollback_due)
            if remedies:
                event = event.replace(remedies=(*event.remedies, *remedies))
            if rollback_due and self.recovery.snapshot.available:
                event = event.replace(action="rolled_back")
        self._record(trainer, pl_module, event)
        if action == "raise":
            raise NonFiniteTrainingError(self._raise_message(event, escalate), self._history(escalate))

    def _can_skip(self, pl_module: LightningModule, optimizer: Optimizer) -> bool:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        return pl_module.automatic_optimization and not isinstance(optimizer, torch.optim.LBFGS)

    def _may_diagnose(self, trainer: Trainer, pl_module: LightningModule) -> bool:
        if trainer.world_size > 1 and any(isinstance(m, nn.SyncBatchNorm) for m in pl_module.modules()):
            self._warn_once(
                "syncbn",
                "NanGuard: SyncBatchNorm synchronises every forward across ranks, so the "
                "offending rank cannot re-run sub-batches alone; bisection and localisation are off.",
            )
            return False
        return self.bisect or self.localize or self.save_repro

    def _investigate(
        self, trainer: Trainer, pl_module: LightningModule, event: NanEvent, restore_after: bool
    ) -> NanEvent:
        """Bisect, localise and save a bundle, from the BatchNorm state before the bad forward."""
        corrupted = [t.detach().clone() for _, t in self._bn.named_buffers] if restore_after and self._bn else []
        if self._bn is not None:
            self._bn.restore()
        settings = InvestigationSettings(
            self.bisect,
            self.localize,
            self.max_bisect_passes,
            self.save_repro,
            self.max_repro_bundles,
            self.batch_slicer,
        )
        try:
            event, diagnosis = investigate(
                trainer, pl_module, event, self._micro_batches, settings, self.sinks.nanguard_dir
            )
        finally:
            if corrupted and self._bn is not None:  # action="warn" changes nothing: put the statistics back
                with torch.no_grad():
                    torch._foreach_copy_([t for _, t in self._bn.named_buffers], corrupted)
        if diagnosis is not None and diagnosis.error:
            self._warn_once(
                "diagnosis",
                f"NanGuard: diagnosis failed ({diagnosis.error}); bad steps are still detected and skipped.",
            )
        return event

    def _discard_step(self, optimizer: Optimizer) -> None:
        """Make the coming ``optimizer.step`` a no-op and undo this batch's BatchNorm updates."""
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = None  # optimizers skip parameters without grad: no state change at all
        if self._bn is not None:
            self._bn.restore()

    def _history(self, escalated: bool) -> list[NanEvent]:
        if not escalated:
            return self.events[-1:]
        return list(self.events) if self.max_events is not None else self.events[-self.consecutive_bad_steps :]

    def _raise_message(self, event: NanEvent, escalated: bool) -> str:
        where = f" Events are in {self.sinks.jsonl.path}." if self.sinks.jsonl is not None else ""
        if escalated:
            return (
                f"NanGuard: {self.consecutive_bad_steps} consecutive bad steps (max_consecutive_bad_steps="
                f"{self.max_consecutive_bad_steps}) or {self.bad_steps_total} in total (max_events={self.max_events});"
                f" last: {event.headline()}. Skipping no longer helps: the weights, the learning rate or the data "
                "pipeline is at fault, not single batches. Use action='rollback' with remedies=['clip_grad', "
                f"'lr_backoff'], lower the learning rate, or inspect the events.{where}"
            )
        return (
            f"NanGuard: {event.headline()}. The optimizer step was not applied, so the weights are still finite. "
            "Inspect the event (error.event), then use action='skip' to train past bad batches or fix the "
            f"origin.{where}"
        )

    # ------------------------------------------------------------------ after the optimizer step

    def _after_optimizer_step(self, optimizer: Optimizer) -> None:
        """Called by the strategy wrapper on every rank after the update: rollback, param check, snapshot."""
        trainer, pl_module = self._trainer, getattr(self._trainer, "lightning_module", None)
        if trainer is None or pl_module is None or not self.active:
            return
        try:
            with self.clock.measure("after_optimizer_step"):
                self._after_step(trainer, pl_module)
        except NonFiniteTrainingError:
            raise
        except Exception as error:  # same contract as the hooks
            self.active = False
            log.warning("NanGuard disabled itself after an internal error: %r", error, exc_info=True)

    def _after_step(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._pending_rollback:
            self._pending_rollback = False
            self._rollback(trainer, pl_module, reason="consecutive bad steps")
            return
        step = trainer.global_step + 1  # global_step increments after this call
        check_params = self.check_params_every_n_steps and step % self.check_params_every_n_steps == 0
        snapshot_due = self.action == "rollback" and not self._step_was_bad and step % self.snapshot_every_n_steps == 0
        if not (check_params or snapshot_due):
            return
        if self._params_finite(pl_module):
            if snapshot_due:
                self._capture(trainer, pl_module)
            return
        self._nonfinite_params(trainer, pl_module)

    def _nonfinite_params(self, trainer: Trainer, pl_module: LightningModule) -> None:
        names = tuple(nonfinite_names(self._named_params) + nonfinite_names(batchnorm_buffers(pl_module)))
        event = NanEvent(
            global_step=trainer.global_step,
            epoch=trainer.current_epoch,
            batch_idx=self._batch_idx,
            rank=trainer.global_rank,
            kinds=("param",),
            action="warned",
            nonfinite_params=names,
            details={"hint": "NaN/Inf reached the weights through an update with finite gradients (overflow)"},
        )
        self.bad_steps_total += 1
        if self.action == "rollback" and self.recovery.snapshot.available:
            description = self._rollback(trainer, pl_module, reason="non-finite weights", record=False)
            remedies = self.recovery.apply(trainer, pl_module, event, rolled_back=True)
            self._record(trainer, pl_module, event.replace(action="rolled_back", remedies=(description, *remedies)))
            return
        if self.action == "warn":
            self._record(trainer, pl_module, event)
            return
        event = event.replace(action="raised")
        self._record(trainer, pl_module, event)
        raise NonFiniteTrainingError(
            f"NanGuard: NaN/Inf reached the weights ({len(names)} tensors, e.g. {names[:3]}) at step "
            f"{trainer.global_step}; skipping steps cannot undo that. Use action='rollback' (keeps a last good "
            "snapshot) or restart from the last checkpoint with a lower learning rate.",
            [event],
        )

    def _rollback(self, trainer: Trainer, pl_module: LightningModule, reason: str, record: bool = True) -> str:
        description = self.recovery.rollback(trainer, pl_module)
        if description is None:
            raise NonFiniteTrainingError(
                f"NanGuard: a rollback is due ({reason}) but no last good snapshot exists yet.", self.events
            )
        self.consecutive_bad_steps = 0
        log.warning("[rank %d] NanGuard: %s (%s)", trainer.global_rank, description, reason)
        self._log_scalars(trainer, force=True)
        return description

    def _capture(self, trainer: Trainer, pl_module: LightningModule) -> None:
        first = not self.recovery.snapshot.available
        self.recovery.capture(trainer, pl_module, extra={})
        if first:
            snapshot = self.recovery.snapshot
            log.info(
                "NanGuard: rollback snapshot of %.1f MiB on the host, %.1f ms to take",
                snapshot.nbytes / 2**20,
                snapshot.seconds * 1e3,
            )

    def _params_finite(self, module: nn.Module) -> bool:
        return all_finite(list(module.state_dict().values()))

    # ------------------------------------------------------------------ manual loops

    def check(self, module: nn.Module, loss: Tensor | None = None) -> NanEvent | None:
        """Check ``module``'s gradients, BatchNorm statistics and weights (and ``loss``) now.

        For manual optimisation and custom loops: call it after ``manual_backward`` and before
        ``optimizer.step()``; skip the step yourself when it returns an event.

        Example:
            >>> net = nn.Linear(2, 1)
            >>> net(torch.tensor([[float("nan"), 1.0]])).sum().backward()
            >>> NanGuard(verbose=False).check(net).nonfinite_grads
            ('weight',)
        """
        named = list(module.named_parameters())
        grads = [(n, p.grad) for n, p in named if p.grad is not None]
        bad_grads = tuple(nonfinite_names(grads))
        bad_buffers = tuple(bad_batchnorm_names(batchnorm_buffers(module)))
        bad_params = tuple(nonfinite_names(named))
        loss_bad = loss is not None and not bool(torch.isfinite(loss.detach()).all())
        kinds = [
            k
            for k, bad in (("loss", loss_bad), ("grad", bad_grads), ("bn_stats", bad_buffers), ("param", bad_params))
            if bad
        ]
        if not kinds:
            return None
        trainer = self._trainer
        event = NanEvent(
            global_step=trainer.global_step if trainer else 0,
            epoch=trainer.current_epoch if trainer else 0,
            batch_idx=self._batch_idx,
            rank=trainer.global_rank if trainer else 0,
            kinds=tuple(kinds),  # type: ignore[arg-type]
            action="warned",
            nonfinite_grads=bad_grads,
            nonfinite_buffers=bad_buffers,
            nonfinite_params=bad_params,
            loss=float(loss.detach().float().sum()) if loss is not None else None,
        )
        self.bad_steps_total += 1
        self.events.append(event)
        if trainer is not None:
            self.sinks.event(event, trainer.global_rank, trainer)
        return event

    # ------------------------------------------------------------------ reporting

    def _record(self, trainer: Trainer, pl_module: LightningModule, event: NanEvent) -> None:
        self.events.append(event)
        self.sinks.event(event, trainer.global_rank, trainer)
        self._log_scalars(trainer, force=True)
        if self.skipped_total:
            pl_module.log("nan_skipped", float(self.skipped_total), prog_bar=True, logger=False, batch_size=1)

    def _log_scalars(self, trainer: Trainer, force: bool = False) -> None:
        metrics: dict[str, float] = {
            "nanguard/bad_steps_total": float(self.bad_steps_total),
            "nanguard/skipped_total": float(self.skipped_total),
        }
        if self.last_grad_norm is not None:
            metrics["nanguard/grad_norm"] = self.last_grad_norm
        if grad_scaler(trainer) is not None:
            metrics["nanguard/amp_overflow_total"] = float(self.amp_overflow_total)
        if self.action == "rollback":
            metrics["nanguard/rollbacks_total"] = float(self.recovery.rollbacks_total)
        if self.remedies:
            metrics["nanguard/remedies_total"] = float(self.recovery.book.total)
        self.sinks.scalars(trainer, metrics, force=force)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    # ------------------------------------------------------------------ checkpoint

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """Never save non-finite weights: save the last good snapshot instead, or refuse."""
        state = checkpoint.get("state_dict", {})
        if all_finite([t for t in state.values() if isinstance(t, Tensor)]):
            return
        snapshot = self.recovery.snapshot
        if snapshot.available:
            checkpoint["state_dict"] = {k: v.clone() for k, v in snapshot.module.value().items()}
            checkpoint["optimizer_states"] = [mirror.value() for mirror in snapshot.optimizers]
            checkpoint["nanguard_substituted_step"] = snapshot.global_step
            log.warning(
                "NanGuard: the weights hold NaN/Inf; the checkpoint holds the last good snapshot (step %s).",
                snapshot.global_step,
            )
            return
        bad = [
            k
            for k, v in state.items()
            if isinstance(v, Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all())
        ]
        raise NonFiniteTrainingError(
            f"NanGuard refuses to save a checkpoint with non-finite weights ({bad[:5]}). Use action='skip' or "
            "'rollback' so NaN/Inf never reaches the weights.",
            self.events[-1:],
        )

    def state_dict(self) -> dict[str, Any]:
        """Counters, remedy state and the last 100 events, as primitives (``weights_only``-safe)."""
        return {
            "bad_steps_total": self.bad_steps_total,
            "skipped_total": self.skipped_total,
            "consecutive_bad_steps": self.consecutive_bad_steps,
            "amp_overflow_total": self.amp_overflow_total,
            "events": [event.to_dict() for event in self.events[-_EVENTS_KEPT_IN_CHECKPOINT:]],
            "recovery": self.recovery.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore counters, remedies and events; keys added in later versions default sensibly."""
        self.bad_steps_total = int(state_dict.get("bad_steps_total", 0))
        self.skipped_total = int(state_dict.get("skipped_total", 0))
        self.consecutive_bad_steps = int(state_dict.get("consecutive_bad_steps", 0))
        self.amp_overflow_total = int(state_dict.get("amp_overflow_total", 0))
        self.events = [NanEvent.from_dict(summary) for summary in state_dict.get("events", [])]
        self.recovery.load_state_dict(state_dict.get("recovery", {}))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_trainer"] = None  # never pickle the Trainer with the callback
        state["_micro_batches"] = []
        state["_samplers"] = []
        return state
