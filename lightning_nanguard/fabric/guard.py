"""``FabricGuard``: the guard's arguments, state and Lightning Fabric hooks; the Trainer callback builds on it.

The shape of Lightning's own ``callbacks/spike.py``: the Fabric implementation is a plain class
(Fabric calls a callback's hooks by name, so it needs no Lightning base class and this module
imports no Lightning), and :class:`~lightning_nanguard.trainer.callback.NanGuard` is a short
subclass that adds the Trainer's hooks. Both hand every moment to the engine
(:class:`~lightning_nanguard.engine.moments.GuardEngine`); the Fabric moments are mapped in
:mod:`.steps`.

``Fabric`` itself is held (``setup_module``, loaders set up before the model: :mod:`.fabric_class`)
only once a Fabric loop is in use: when a ``Fabric`` is built after a guard (the entry point
Fabric calls in every ``Fabric()``), or at ``fabric.setup``.

Example:
    >>> import lightning as L, torch
    >>> guard = FabricGuard(verbose=False)
    >>> fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[guard])
    >>> model = fabric.setup(torch.nn.Linear(2, 1))
    >>> guard.holds_fabric(fabric), guard.active
    (True, True)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn

from lightning_nanguard.core.defaults import default_of
from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.decide.policy import Counters, Policy, SpikeAction, StepAction
from lightning_nanguard.detect.precursors import PrecursorSettings
from lightning_nanguard.detect.spikes import SpikeDetector
from lightning_nanguard.diagnose.batch_diagnosis import diagnose
from lightning_nanguard.engine.failure import failsafe
from lightning_nanguard.engine.moments import GuardEngine
from lightning_nanguard.engine.parts import InternalErrorMode
from lightning_nanguard.engine.settings import validate_arguments
from lightning_nanguard.engine.state import CounterView
from lightning_nanguard.fabric.fabric_class import hold_fabric_class, note_guard_made
from lightning_nanguard.fabric.setup import take_hold_of_fabric
from lightning_nanguard.fabric.steps import FabricSteps
from lightning_nanguard.recover.recovery import Recovery
from lightning_nanguard.recover.remedies import Remedy
from lightning_nanguard.reporting.notice_texts import ONE_FABRIC

__all__ = ["Action", "FabricGuard", "SpikeAction"]

Action = StepAction  # the `action` argument: what is done with a bad step


class FabricGuard:
    """Stops NaN/Inf from reaching the weights and reports where it came from.

    After every backward pass (in ``on_before_optimizer_step``, where gradients are complete and
    unscaled) the loss, every gradient and every BatchNorm running statistic are checked in one
    fused pass on the device, with a single host read. On a bad step the optimizer update is made
    a true no-op, the BatchNorm buffers the bad forward touched are restored, the offending
    samples, module, op and source line are found, and an event is recorded in ``guard.events``,
    ``<log_dir>/nanguard/events.jsonl``, TensorBoard (through the Trainer's own
    ``TensorBoardLogger``) and the terminal. Under DDP every decision is made once for all ranks.

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
            instead of the loader's recorded sampler (which an ``IterableDataset`` or ``batch_size=None``
            does not have): one index per row (repeated for several rows of one record, e.g.
            multi-crop), or a 2-D field of the records each row holds (packed sequences, mixup pairs;
            negative entries are padding). Indices read from the batch count as verified.
        batch_slicer: ``slicer(batch, positions) -> sub_batch`` for batches the built-in slicer cannot
            cut (a LightningModule method ``nanguard_slice_batch`` is used too when present).
        row_records: ``row_records(batch, indices) -> the dataset indices each row holds`` (one
            sequence per row; ``indices``: the batch's recorded indices, the sampler's or those of
            ``index_key``, ``None`` when unknown), for pipelines the guard cannot see into; called at
            incidents only, with each loader's part of the batch when there are several training
            loaders. A LightningModule method ``nanguard_row_records(batch, indices)`` is used when
            this is ``None``. Its answer counts as verified; a hook that raises or returns another
            row count leaves the indices unknown, with the reason.
        verify_indices: at an incident, check that each dataset index read off the batch sampler
            names the record really in its row: the record is read again (the loader's own
            ``dataset[i]`` and ``collate_fn``, then the same batch hooks, with every random number
            generator restored) and compared with the row. A collate that reorders rows is corrected,
            one that drops rows is matched by content; rows built from several records (packing,
            mixup), random reads (augmentation, masking) and failed reads name no index (unverified,
            with the reason); a dataset with ``nanguard_reread = False`` (reads with side effects)
            keeps the sampler's index, unverified (an ``IterableDataset`` or ``batch_size=None`` has
            none: name one with ``index_key``). Each broken assumption is warned about once per run,
            on every rank. ``False``: the sampler's indices are kept, marked unverified. Quarantine
            acts only on verified indices. Costs nothing on healthy steps.
        snapshot_every_n_steps: with ``action="rollback"``, refresh the last good snapshot every ``n`` steps.
        rollback_after_consecutive: with ``action="rollback"``, roll back after this many bad steps in a row.
        remedies: remedies to apply after incidents: ``"clip_grad"``, ``"raise_eps"``, ``"lr_backoff"``,
            ``"quarantine"`` (see the decision guide in docs/guide/recovery.md).
        max_remedy_applications: cap per remedy.
        lr_backoff_factor: learning-rate multiplier of one ``lr_backoff`` (between 0 and 1).
        eps_factor: multiplier of one ``raise_eps`` (above 1).
        max_eps: ``raise_eps`` never sets ``eps`` above this.
        min_loss_scale: with a GradScaler, a loss scale falling below this is an incident.
        max_consecutive_overflows: with a GradScaler, this many overflow skips in a row is an incident.
        verbose: print a report of each event to the terminal.
        spike_action: on a finite loss spike (the step loss far above its recent healthy values):
            ``"skip"`` the update (default), ``"warn"`` (report only) or ``"off"`` (no spike check).
            A spike never raises, is never rolled back and does not count toward escalation.
        spike_sigmas: a spike lies this many robust standard deviations of the step-to-step change
            of ``log(loss)`` above the median of the recent healthy losses...
        spike_min_ratio: ...and at least this many times that median.
        spike_window: healthy losses kept for the statistic.
        spike_warmup_steps: healthy steps before spikes are flagged (and again after a re-baseline).
        spike_rebaseline_after: after this many spikes in a row the statistic starts over (a level
            shift, e.g. a curriculum change, is not an endless skip), with a warning.
        sync_free: no host read on healthy steps: a bad step's update is skipped inside torch's fused
            Adam/AdamW/SGD/Adagrad (``found_inf``) and its BatchNorm statistics restored by a
            device-side select; the flags are read one step later, before the next forward, and
            the incident handled then. Other optimizers keep the one host read per step (one warning).
        precursors: warn of attention collapse before it happens (``kinds=("precursor",)``; the step
            is applied): every ``precursor_every_n_steps`` steps the max pre-softmax logit and the
            entropy of each attention module are measured on the side of the forward, and a module
            whose max logit is above ``precursor_min_logit`` and ``precursor_growth`` times what it
            was ``precursor_window`` steps before is named, at most once per 100 steps. ``False``:
            off (it is also off under FSDP and ``ModelParallelStrategy``). The evidence for the
            defaults: the user guide's precursor page.
        precursor_every_n_steps: how often the attention logits are sampled.
        precursor_min_logit: the level a module's max attention logit must exceed.
        precursor_growth: how many times its value ``precursor_window`` steps earlier it must be.
        precursor_window: how far back the growth is measured, in steps.
        precursor_max_cost: the most the watch may cost, as a share of the training time (``0.01``:
            1%): when measuring every ``precursor_every_n_steps`` steps costs more (measured on the host
            clock, no sync), the watch measures less often, with one notice. ``None``: no limit.
        qk_clip: opt-in remedy, a cap on the max attention logit (e.g. ``50.0``): after each sampled
            step's update, the query and key projections of every attention module measured above
            it are rescaled per head by ``sqrt(qk_clip / max_logit)`` each, where the guard knows
            them (``nn.MultiheadAttention``, ``q_proj``/``k_proj``-style ``Linear`` children, Hugging
            Face GPT-2, or a ``nanguard_qk_projections()`` method). Needs ``precursors=True``.
            ``None``: off.
        loss_fn: in a Lightning Fabric loop, ``loss_fn(model, batch) -> loss`` (a tensor, or a dict with
            ``"loss"``): the guard re-runs it on sub-batches of a bad step to name the offending samples
            (``model``: the module you gave ``fabric.setup``, run under Fabric's precision; ``batch``: as
            the training loader gave it, moved to the device). Without it a bad step is still skipped
            and reported. Ignored by the Trainer, which re-runs ``training_step``.
        on_internal_error: what an error of the guard itself does. ``"continue"`` (default): an error
            in an optional part (spike or precursor watch, QK-clip, diagnosis, bundles, remedies, events
            file, TensorBoard, terminal, scalars, progress bar, logged-value withdrawal, checkpoint check)
            switches off that part alone, with a ``guard_error`` event, and every bad step after it is
            still dropped; an error in the core (the check itself, the ranks' agreement, dropping a step)
            drops the step in hand and turns the guard off, on every rank at the same step, with a
            ``guard_error`` event. ``"raise"``: any internal error stops training with
            :class:`~lightning_nanguard.GuardInternalError` (for CI or a debugging session).

    The same object guards a Lightning ``Trainer`` (:class:`~lightning_nanguard.NanGuard`, this class
    with the Trainer's hooks) and a hand-written Fabric loop (``L.Fabric(callbacks=[guard])``, which
    calls :meth:`on_after_setup` and :meth:`on_after_optimizer_step` by name). Every argument is also
    a public attribute, which may be changed until the fit or the loop starts.

    Examples:
        >>> guard = FabricGuard(action="skip", max_consecutive_bad_steps=5)
        >>> guard.events
        []
        >>> FabricGuard(action="skp")
        Traceback (most recent call last):
        ...
        ValueError: NanGuard: `action` must be one of ['skip', 'raise', 'warn', 'rollback'], got 'skp'.
    """

    nanguard_takes_setup_module = True  # fabric.setup_module reaches on_after_setup too (fabric_class.py)

    # the arguments, as public attributes (see Args)
    action: Action
    check_every_n_steps: int
    max_consecutive_bad_steps: int
    max_events: int | None
    check_bn_stats: bool
    check_params_every_n_steps: int
    bisect: bool
    localize: bool
    max_bisect_passes: int
    save_repro: bool
    max_repro_bundles: int
    index_key: int | str | None
    batch_slicer: Callable[[Any, Sequence[int]], Any] | None
    row_records: Callable[[Any, list[int] | None], Sequence[Sequence[int]]] | None
    verify_indices: bool
    snapshot_every_n_steps: int
    rollback_after_consecutive: int
    remedies: list[Remedy]
    max_remedy_applications: int
    lr_backoff_factor: float
    eps_factor: float
    max_eps: float
    min_loss_scale: float
    max_consecutive_overflows: int
    verbose: bool
    spike_action: SpikeAction
    spike_sigmas: float
    spike_min_ratio: float
    spike_window: int
    spike_warmup_steps: int
    spike_rebaseline_after: int
    sync_free: bool
    precursors: bool
    precursor_every_n_steps: int
    precursor_min_logit: float
    precursor_growth: float
    precursor_window: int
    precursor_max_cost: float | None
    qk_clip: float | None
    loss_fn: Callable[[Any, Any], Any] | None
    on_internal_error: InternalErrorMode

    def __init__(
        self,
        action: Action = default_of(Policy, "action"),
        check_every_n_steps: int = 1,
        max_consecutive_bad_steps: int = default_of(Policy, "max_consecutive_bad_steps"),
        max_events: int | None = default_of(Policy, "max_events"),
        check_bn_stats: bool = True,
        check_params_every_n_steps: int = 50,
        bisect: bool = default_of(diagnose, "bisect"),
        localize: bool = default_of(diagnose, "localize_origin"),
        max_bisect_passes: int = default_of(diagnose, "max_passes"),
        save_repro: bool = True,
        max_repro_bundles: int = 5,
        index_key: int | str | None = None,
        batch_slicer: Callable[[Any, Sequence[int]], Any] | None = None,
        row_records: Callable[[Any, list[int] | None], Sequence[Sequence[int]]] | None = None,
        verify_indices: bool = True,
        snapshot_every_n_steps: int = 100,
        rollback_after_consecutive: int = default_of(Policy, "rollback_after_consecutive"),
        remedies: list[Remedy] | None = None,
        max_remedy_applications: int = default_of(Recovery, "max_remedy_applications"),
        lr_backoff_factor: float = default_of(Recovery, "lr_backoff_factor"),
        eps_factor: float = default_of(Recovery, "eps_factor"),
        max_eps: float = default_of(Recovery, "max_eps"),
        min_loss_scale: float = default_of(Policy, "min_loss_scale"),
        max_consecutive_overflows: int = default_of(Policy, "max_consecutive_overflows"),
        verbose: bool = True,
        spike_action: SpikeAction = default_of(Policy, "spike_action"),
        spike_sigmas: float = default_of(SpikeDetector, "sigmas"),
        spike_min_ratio: float = default_of(SpikeDetector, "min_ratio"),
        spike_window: int = default_of(SpikeDetector, "window"),
        spike_warmup_steps: int = default_of(SpikeDetector, "warmup"),
        spike_rebaseline_after: int = default_of(SpikeDetector, "rebaseline_after"),
        sync_free: bool = False,
        precursors: bool = True,
        precursor_every_n_steps: int = default_of(PrecursorSettings, "every_n_steps"),
        precursor_min_logit: float = default_of(PrecursorSettings, "min_logit"),
        precursor_growth: float = default_of(PrecursorSettings, "growth"),
        precursor_window: int = default_of(PrecursorSettings, "window"),
        precursor_max_cost: float | None = default_of(PrecursorSettings, "max_cost"),
        qk_clip: float | None = None,
        loss_fn: Callable[[Any, Any], Any] | None = None,
        on_internal_error: InternalErrorMode = "continue",
    ) -> None:
        arguments = dict(locals())
        arguments.pop("self")
        validate_arguments(arguments)
        for name, value in arguments.items():
            setattr(self, name, value)
        self.remedies = list(remedies or [])
        self.engine = GuardEngine(verbose)
        self.clock, self.recorder, self.recovery = self.engine.clock, self.engine.recorder, self.engine.recovery
        self.controller = self.engine.controller
        self.engine.configure(self._arguments())  # again at setup, once the strategy is known: the one path
        self._front: Any = None  # the engine's view of a Trainer fit in progress (the Trainer callback's)
        self._fabric_steps: FabricSteps | None = None  # a Fabric loop's steps (.steps)
        self.from_environment = False  # made by NANGUARD=1 (lightning_nanguard.entry_points): stands aside for yours
        note_guard_made()  # a Fabric built from now on is held (fabric_class.py)

    # ------------------------------------------------------------------ state, read-only

    @property
    def active(self) -> bool:
        """False once the guard disabled itself after an internal error (on every rank together).

        Setting it to False turns the guard off (every hook and the strategy wrapper pass through).
        """
        return not self.controller.state.disabled

    @active.setter
    def active(self, value: bool) -> None:
        self.controller.state.disabled = not value

    @property
    def events(self) -> list[NanEvent]:
        """This rank's events, oldest first."""
        return self.recorder.events

    @property
    def counters(self) -> Counters:
        """Counts over the run; identical on every rank (a bad step is a step bad on any rank)."""
        return self.controller.state.counters

    bad_steps_total = CounterView("bad_steps_total", "Steps with NaN/Inf on some rank, and non-finite weights found.")
    skipped_total = CounterView("skipped_total", "Updates dropped (NaN/Inf or loss spikes).")
    consecutive_bad_steps = CounterView("consecutive_bad_steps", "Bad steps in a row up to now.")
    amp_overflow_total = CounterView("amp_overflow_total", "Overflow steps a GradScaler skipped by itself.")

    @property
    def last_grad_norm(self) -> float | None:
        """The gradient norm of the last step where it was computed."""
        return self.controller.state.last_grad_norm

    @property
    def log_dir(self) -> str | None:
        """The run's log directory (the TensorBoardLogger's, else the first logger's, else ``default_root_dir``)."""
        return self.recorder.sinks.log_dir

    @property
    def remedy_book(self) -> Any:
        """Remedy counts and state (clip threshold, quarantined dataset indices)."""
        return self.recovery.book

    @property
    def records_indices(self) -> bool:
        """Whether training loaders should record dataset indices (and drop quarantined ones).

        With ``index_key`` too: the indices are read from the batch, but the quarantine drops records
        in the sampler (or cuts them out of a stream's batches, whose loader has no sampler).
        """
        return self.bisect or "quarantine" in self.remedies

    def _arguments(self) -> dict[str, Any]:
        """The current value of every ``__init__`` argument (public attributes: they may change after ``__init__``)."""
        return {
            name: getattr(self, name) for name in inspect.signature(FabricGuard.__init__).parameters if name != "self"
        }

    # ------------------------------------------------------------------ Lightning Fabric loops

    @failsafe
    def on_after_setup(self, fabric: Any, module: nn.Module) -> None:
        """Fabric's ``fabric.setup(model, ...)`` (or ``setup_module``): take hold of the loop's strategy (every rank).

        Each further model set up in the same loop is guarded with the first.
        """
        hold_fabric_class()  # in case no Fabric was built after this guard (the entry point not installed)
        guards = [cb for cb in getattr(fabric, "_callbacks", []) if isinstance(cb, FabricGuard)]
        if self.from_environment and any(not guard.from_environment for guard in guards):
            self.active = False  # the user's own NanGuard guards this loop: never two
            return
        if self._fabric_steps is not None:
            if self._fabric_steps.front.fabric is not fabric:
                self.recorder.notices.warn("fabric-fabrics", ONE_FABRIC)
                return
            self._fabric_steps.add_model(module)  # a second model in the same loop (e.g. a GAN's two)
            return
        self._fabric_steps = take_hold_of_fabric(self.engine, self._arguments(), fabric, module, self.loss_fn)

    def holds_fabric(self, fabric: Any) -> bool:
        """Whether this guard already holds ``fabric``'s loop."""
        return self._fabric_steps is not None and self._fabric_steps.front.fabric is fabric

    @failsafe
    def on_after_optimizer_step(self, strategy: Any, optimizer: Any) -> None:
        """Fabric, after ``optimizer.step()``: rollback, weight check, snapshot; the step count moves on."""
        if self._fabric_steps is not None:
            self._fabric_steps.after_update(optimizer)

    # ------------------------------------------------------------------ manual loops

    def check(self, module: nn.Module, loss: Tensor | None = None) -> NanEvent | None:
        """Check ``module``'s gradients, BatchNorm statistics and weights (and ``loss``) now.

        For manual optimisation and custom loops: call it after ``manual_backward`` and before
        ``optimizer.step()``; skip the step yourself when it returns an event.

        Examples:
            >>> import torch
            >>> net = nn.Linear(2, 1)
            >>> net(torch.tensor([[float("nan"), 1.0]])).sum().backward()
            >>> FabricGuard(verbose=False).check(net).nonfinite_grads
            ('weight',)
        """
        moment = getattr(self._front, "new_moment", None)  # a Trainer fit: called from training_step, not a hook
        if moment is not None:
            moment()
        return self.engine.check(self._front, module, loss)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_front"] = None  # never pickle the Trainer with the callback
        state["_fabric_steps"] = None  # nor a Fabric loop
        return state
