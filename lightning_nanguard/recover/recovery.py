"""Recovery after incidents: last-good snapshots, rollback and remedies, for one training run.

:class:`Recovery` combines :mod:`~lightning_nanguard.recover.snapshot` and
:mod:`~lightning_nanguard.recover.remedies`: it acts on the :class:`TrainingParts` it is handed
(the module, optimizers, LR schedulers and GradScaler; the engine reads them off its front-end,
:func:`lightning_nanguard.engine.frontend.training_parts`), decides which remedies fit an
incident, and keeps the counts that go into checkpoints and TensorBoard. It never sees a Trainer.

Which remedy for which incident, decided by the incident's ``cause`` at the first incident:

- ``"data"`` or ``"input"`` (samples named, dataset indices known) -> ``quarantine`` them (the
  engine passes only records whose index and blame are verified);
- ``"batch"`` (the batch as a whole is degenerate) -> nothing but the skip (and ``raise_eps`` below);
- origin localised in a layer with ``eps`` (norm layers) -> ``raise_eps`` (also Adam's ``eps``);
- ``"state"`` (the weights or the learning rate are the problem), ``"interaction"`` or not
  attributable to samples, or a rollback -> ``clip_grad`` and ``lr_backoff``.

Remedies and rollbacks compose: the learning rate and optimizer ``eps`` live in the optimizer and
scheduler state a rollback restores, so ``lr_backoff`` and ``raise_eps`` applied after the last
snapshot are applied again right after each rollback (a remedy decided on the bad step that
triggers the rollback stays in force).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_nanguard.core.defaults import default_of
from lightning_nanguard.core.events import NonFiniteTrainingError
from lightning_nanguard.decide.messages import checkpoint_refusal
from lightning_nanguard.detect.confirm import all_finite, nonfinite_names
from lightning_nanguard.recover.remedies import RemedyBook, clip_threshold, lr_backoff_, raise_eps_
from lightning_nanguard.recover.snapshot import TrainingSnapshot

__all__ = ["Recovery", "RecoverySettings", "TrainingParts", "apply_module_eps"]


@dataclass(frozen=True)
class TrainingParts:
    """What a recovery acts on: the module and the state that trains it.

    Attributes:
        module: the model (its ``state_dict`` is snapshotted; ``raise_eps`` looks up modules in it).
        optimizers: the optimizers (their state is snapshotted; ``lr_backoff``/``raise_eps`` change them).
        schedulers: the LR schedulers (snapshotted; ``lr_backoff`` scales their base rates too).
        scaler: the GradScaler, or ``None``.
        global_step: the step a snapshot taken now belongs to.

    Example:
        >>> import torch
        >>> net = nn.Linear(2, 1)
        >>> parts = TrainingParts(net, [torch.optim.SGD(net.parameters(), lr=0.1)])
        >>> Recovery(("lr_backoff",)).apply(parts, cause="state")
        ['lr_backoff: learning rate x0.5 (group 0: 0.1 -> 0.05)']
    """

    module: nn.Module
    optimizers: Sequence[Optimizer]
    schedulers: Sequence[Any] = ()
    scaler: Any = None
    global_step: int = 0


@dataclass(frozen=True)
class RecoverySettings:
    """The remedy configuration (mirrors the ``NanGuard`` arguments of the same names; no defaults here)."""

    remedies: tuple[str, ...]
    max_remedy_applications: int
    lr_backoff_factor: float
    eps_factor: float
    max_eps: float


class Recovery:
    """Snapshots, rollback and remedies (see module docs).

    Args:
        remedies: enabled remedies, any of ``"clip_grad"``, ``"raise_eps"``, ``"lr_backoff"``, ``"quarantine"``.
        max_remedy_applications: cap per remedy.
        lr_backoff_factor: learning-rate multiplier of one ``lr_backoff``.
        eps_factor: ``eps`` multiplier of one ``raise_eps``.
        max_eps: ``raise_eps`` never goes above this.
    """

    def __init__(
        self,
        remedies: tuple[str, ...] = (),
        max_remedy_applications: int = default_of(RemedyBook, "max_applications"),
        lr_backoff_factor: float = 0.5,
        eps_factor: float = 10.0,
        max_eps: float = 1e-2,
    ) -> None:
        self.book = RemedyBook()
        self.snapshot = TrainingSnapshot()
        self.rollbacks_total = 0
        self._since_snapshot: list[str] = []  # optimizer-state remedies the snapshot predates
        self.configure(RecoverySettings(remedies, max_remedy_applications, lr_backoff_factor, eps_factor, max_eps))

    def configure(self, settings: RecoverySettings) -> None:
        """Take a (new) configuration; remedy counts, the clip threshold and quarantined indices are kept."""
        self.book.enabled = tuple(settings.remedies)
        self.book.max_applications = settings.max_remedy_applications
        self.lr_backoff_factor = settings.lr_backoff_factor
        self.eps_factor = settings.eps_factor
        self.max_eps = settings.max_eps

    # ------------------------------------------------------------------ snapshots

    def capture(self, parts: TrainingParts, extra: dict[str, Any] | None = None) -> None:
        """Take a last-good snapshot (the caller checked that the weights are finite)."""
        self.snapshot.capture(parts.module, parts.optimizers, parts.scaler, parts.schedulers, parts.global_step, extra)
        self._since_snapshot = []

    def rollback(self, parts: TrainingParts) -> str | None:
        """Restore the last good snapshot; return a description, ``None`` without a snapshot.

        ``lr_backoff`` and ``raise_eps`` applied since the snapshot are applied again to the
        restored optimizer and scheduler state, so a rollback never undoes a remedy.
        """
        if not self.snapshot.available:
            return None
        self.snapshot.restore(parts.module, parts.optimizers, parts.scaler, parts.schedulers)
        self.rollbacks_total += 1
        for remedy in self._since_snapshot:
            self._reapply(parts, remedy)
        megabytes = self.snapshot.nbytes / 2**20
        kept = f", kept {', '.join(self._since_snapshot)}" if self._since_snapshot else ""
        return f"rollback: restored the state of step {self.snapshot.global_step} ({megabytes:.1f} MiB snapshot{kept})"

    def _reapply(self, parts: TrainingParts, remedy: str) -> None:
        """Apply an optimizer-state remedy again (module ``eps`` is not in the snapshot: it stays)."""
        if remedy == "lr_backoff":
            for optimizer in parts.optimizers:
                lr_backoff_(optimizer, parts.schedulers, self.lr_backoff_factor)
        elif remedy == "raise_eps":
            raise_eps_(None, parts.optimizers, self.eps_factor, self.max_eps)

    # ------------------------------------------------------------------ remedies

    def remember_healthy_norm(self, grad_norm: float) -> None:
        """Feed the clipping threshold with the norm of a healthy step."""
        self.book.healthy_norms.append(grad_norm)

    def apply(
        self,
        parts: TrainingParts,
        cause: str | None,
        quarantine: Sequence[int] = (),
        culprit_module: str | None = None,
        rolled_back: bool = False,
        quarantine_items: Sequence[tuple[str | int, int]] = (),
    ) -> list[str]:
        """Apply the remedies that fit the shared cause of an incident; return their descriptions.

        The same call runs on every rank with the same arguments, so every rank changes the same things.

        Args:
            parts: the model (for ``raise_eps`` on ``culprit_module``), optimizers and LR schedulers.
            cause: the incident's cause: ``"data"``/``"input"`` quarantine samples; ``"state"``, ``"interaction"``
                or ``None`` (not attributable to samples) clip gradients and back off the learning rate;
                ``"batch"`` (a degenerate batch) neither: skipping it was the remedy.
            quarantine: dataset indices of the offending samples (all ranks').
            culprit_module: where the first NaN/Inf was produced (its ``eps`` is raised).
            rolled_back: a rollback happens at this step (clip and back off whatever the cause).
            quarantine_items: with several training loaders, ``(loader key, dataset index)`` of the
                offending samples: each index is quarantined in its own loader only.
        """
        done: list[str] = []
        if cause in ("data", "input") and (quarantine or quarantine_items) and self.book.can_apply("quarantine"):
            change = self.book.quarantine(quarantine, quarantine_items)  # shared with the recording batch samplers
            if change:
                self.book.record("quarantine")
                done.append(change)
        if culprit_module is not None and self.book.can_apply("raise_eps"):
            culprit = _submodule(parts.module, culprit_module)
            change = raise_eps_(culprit, parts.optimizers, self.eps_factor, self.max_eps)
            if change:
                if culprit is not None and _is_float(getattr(culprit, "eps", None)):
                    self.book.module_eps[culprit_module] = float(culprit.eps)  # type: ignore[arg-type]
                self.book.record("raise_eps")
                self._since_snapshot.append("raise_eps")
                done.append(change)
        if rolled_back or cause not in ("data", "input", "batch"):  # a degenerate batch is not the weights' fault
            if self.book.can_apply("clip_grad"):
                threshold = clip_threshold(self.book.healthy_norms, self.book.clip_threshold)
                if threshold is not None:
                    self.book.clip_threshold = threshold
                    self.book.record("clip_grad")
                    done.append(f"clip_grad: gradient norm clipped at {threshold:.4g}")
            if self.book.can_apply("lr_backoff"):
                for optimizer in parts.optimizers:
                    done.append(lr_backoff_(optimizer, parts.schedulers, self.lr_backoff_factor))
                self.book.record("lr_backoff")
                self._since_snapshot.append("lr_backoff")
        return done

    # ------------------------------------------------------------------ checkpoint

    def make_checkpoint_finite_(self, checkpoint: dict[str, Any], action: str | None = None) -> str | None:
        """Never let a checkpoint hold NaN/Inf weights: put the last good snapshot in, or refuse.

        Returns:
            ``None`` when the weights are finite (nothing changed), else a description of the substitution.

        ``action``: the run's ``NanGuard(action=...)``, for a message that fits it.

        Raises:
            NonFiniteTrainingError: the weights are not finite and there is no snapshot to save instead.
        """
        state = checkpoint.get("state_dict", {})
        if all_finite([t for t in state.values() if isinstance(t, Tensor)]):
            return None
        if self.snapshot.available:
            checkpoint["state_dict"] = {k: v.clone() for k, v in self.snapshot.module.value().items()}
            checkpoint["optimizer_states"] = [mirror.value() for mirror in self.snapshot.optimizers]
            checkpoint["nanguard_substituted_step"] = self.snapshot.global_step
            step = self.snapshot.global_step
            return f"the weights hold NaN/Inf; the checkpoint holds the last good snapshot (step {step})"
        bad = nonfinite_names((k, v) for k, v in state.items() if isinstance(v, Tensor) and v.is_floating_point())
        raise NonFiniteTrainingError(checkpoint_refusal(bad, action), [])

    def state_dict(self) -> dict[str, Any]:
        """Remedy state and rollback count (primitives only)."""
        return {"remedies": self.book.state_dict(), "rollbacks_total": self.rollbacks_total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.book.load_state_dict(state.get("remedies", {}))
        self.rollbacks_total = int(state.get("rollbacks_total", 0))


def _is_float(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def apply_module_eps(module: nn.Module, module_eps: dict[str, float]) -> None:
    """Set the ``eps`` that ``raise_eps`` chose (kept in checkpoints: module attributes are not state)."""
    for name, eps in module_eps.items():
        target = _submodule(module, name)
        if target is not None and _is_float(getattr(target, "eps", None)):
            setattr(target, "eps", eps)  # noqa: B010


def _submodule(module: nn.Module, name: str) -> nn.Module | None:
    if name == "":
        return module
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None
