"""Recovery after incidents: last-good snapshots, rollback and remedies, for one Trainer.

:class:`Recovery` is the Trainer-facing half of :mod:`~lightning_nanguard.recover.snapshot` and
:mod:`~lightning_nanguard.recover.remedies`: it knows where a Trainer keeps its optimizers, GradScaler and
LR schedulers, decides which remedies fit an incident, and keeps the counts that go into
checkpoints and TensorBoard.

Which remedy for which incident, decided by the incident's ``cause`` at the first incident:

- ``"data"`` or ``"input"`` (samples named, dataset indices known) -> ``quarantine`` them;
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
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from lightning_nanguard.core.events import NonFiniteTrainingError
from lightning_nanguard.detect.confirm import all_finite, nonfinite_names
from lightning_nanguard.recover.remedies import RemedyBook, clip_threshold, lr_backoff_, raise_eps_
from lightning_nanguard.recover.snapshot import TrainingSnapshot

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

__all__ = ["Recovery", "apply_module_eps", "grad_scaler"]


def _schedulers(trainer: Trainer) -> list[Any]:
    return [config.scheduler for config in getattr(trainer, "lr_scheduler_configs", [])]


def grad_scaler(trainer: Trainer) -> Any:
    """The Trainer's GradScaler (``16-mixed``), or ``None`` (32-bit, bf16)."""
    return getattr(trainer.precision_plugin, "scaler", None)


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
        max_remedy_applications: int = 3,
        lr_backoff_factor: float = 0.5,
        eps_factor: float = 10.0,
        max_eps: float = 1e-2,
    ) -> None:
        self.book = RemedyBook(enabled=remedies, max_applications=max_remedy_applications)
        self.snapshot = TrainingSnapshot()
        self.lr_backoff_factor = lr_backoff_factor
        self.eps_factor = eps_factor
        self.max_eps = max_eps
        self.rollbacks_total = 0
        self._since_snapshot: list[str] = []  # optimizer-state remedies the snapshot predates

    # ------------------------------------------------------------------ snapshots

    def capture(self, trainer: Trainer, pl_module: LightningModule, extra: dict[str, Any]) -> None:
        """Take a last-good snapshot (the caller checked that the weights are finite)."""
        self.snapshot.capture(
            pl_module, trainer.optimizers, grad_scaler(trainer), _schedulers(trainer), trainer.global_step, extra
        )
        self._since_snapshot = []

    def rollback(self, trainer: Trainer, pl_module: LightningModule) -> str | None:
        """Restore the last good snapshot; return a description, ``None`` without a snapshot.

        ``lr_backoff`` and ``raise_eps`` applied since the snapshot are applied again to the
        restored optimizer and scheduler state, so a rollback never undoes a remedy.
        """
        if not self.snapshot.available:
            return None
        self.snapshot.restore(pl_module, trainer.optimizers, grad_scaler(trainer), _schedulers(trainer))
        self.rollbacks_total += 1
        for remedy in self._since_snapshot:
            self._reapply(trainer, remedy)
        megabytes = self.snapshot.nbytes / 2**20
        kept = f", kept {', '.join(self._since_snapshot)}" if self._since_snapshot else ""
        return f"rollback: restored the state of step {self.snapshot.global_step} ({megabytes:.1f} MiB snapshot{kept})"

    def _reapply(self, trainer: Trainer, remedy: str) -> None:
        """Apply an optimizer-state remedy again (module ``eps`` is not in the snapshot: it stays)."""
        if remedy == "lr_backoff":
            for optimizer in trainer.optimizers:
                lr_backoff_(optimizer, _schedulers(trainer), self.lr_backoff_factor)
        elif remedy == "raise_eps":
            raise_eps_(None, trainer.optimizers, self.eps_factor, self.max_eps)

    # ------------------------------------------------------------------ remedies

    def remember_healthy_norm(self, grad_norm: float) -> None:
        """Feed the clipping threshold with the norm of a healthy step."""
        self.book.healthy_norms.append(grad_norm)

    def apply(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        cause: str | None,
        quarantine: Sequence[int] = (),
        culprit_module: str | None = None,
        rolled_back: bool = False,
        quarantine_items: Sequence[tuple[str | int, int]] = (),
    ) -> list[str]:
        """Apply the remedies that fit the shared verdict of an incident; return their descriptions.

        The same call runs on every rank with the same arguments, so every rank changes the same things.

        Args:
            trainer: the Trainer (optimizers, LR schedulers).
            pl_module: the model (for ``raise_eps`` on ``culprit_module``).
            cause: the verdict: ``"data"``/``"input"`` quarantine samples; ``"state"``, ``"interaction"``
                or ``None`` (not attributable to samples) clip gradients and back off the learning rate.
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
            culprit = _submodule(pl_module, culprit_module)
            change = raise_eps_(culprit, trainer.optimizers, self.eps_factor, self.max_eps)
            if change:
                if culprit is not None and _is_float(getattr(culprit, "eps", None)):
                    self.book.module_eps[culprit_module] = float(culprit.eps)  # type: ignore[arg-type]
                self.book.record("raise_eps")
                self._since_snapshot.append("raise_eps")
                done.append(change)
        if rolled_back or cause not in ("data", "input"):
            if self.book.can_apply("clip_grad"):
                threshold = clip_threshold(self.book.healthy_norms, self.book.clip_threshold)
                if threshold is not None:
                    self.book.clip_threshold = threshold
                    self.book.record("clip_grad")
                    done.append(f"clip_grad: gradient norm clipped at {threshold:.4g}")
            if self.book.can_apply("lr_backoff"):
                for optimizer in trainer.optimizers:
                    done.append(lr_backoff_(optimizer, _schedulers(trainer), self.lr_backoff_factor))
                self.book.record("lr_backoff")
                self._since_snapshot.append("lr_backoff")
        return done

    # ------------------------------------------------------------------ checkpoint

    def make_checkpoint_finite_(self, checkpoint: dict[str, Any]) -> str | None:
        """Never let a checkpoint hold NaN/Inf weights: put the last good snapshot in, or refuse.

        Returns:
            ``None`` when the weights are finite (nothing changed), else a description of the substitution.

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
        raise NonFiniteTrainingError(
            f"NanGuard refuses to save a checkpoint with non-finite weights ({bad[:5]}). Use action='skip' or "
            "'rollback' so NaN/Inf never reaches the weights.",
            [],
        )

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
