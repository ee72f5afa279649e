"""Manual-optimisation loops of issue 34: several optimizers, closures, GANs, WGAN-GP, REINFORCE.

Every LightningModule here sets ``automatic_optimization = False`` and can run two ways:

- **guarded** (``drop_by_hand=False``): it calls ``opt.step()`` on every step, as a user who relies
  on ``NanGuard`` does; the guard must drop each step whose gradients hold NaN/Inf;
- **by hand** (``drop_by_hand=True``): the reference. Before each ``opt.step()`` it checks the
  gradients of the parameters *that optimizer updates*; when one holds NaN/Inf it does not call
  ``opt.step()`` (nor its LR scheduler's ``step()``), puts back the BatchNorm buffers saved before
  the forward that touched them, and calls ``opt.zero_grad()``. ``dropped_by_hand`` lists the
  ``(batch_idx, optimizer index)`` of each step it dropped.

A guarded run must end bit for bit where the hand-dropped run ends (parameters, buffers, optimizer
state). Counting steps with ``max_steps`` would break that comparison (in manual optimisation
``trainer.global_step`` counts ``opt.step()`` calls, dropped or not), so every run here is one
epoch over a small map-style dataset (``shuffle=False``) with a planted record at a known index.

Each module seeds torch in ``on_train_start`` (``seed + global_rank``): a guarded run and its
reference draw the same noise (GAN latents, WGAN-GP interpolation weights), on every rank.

The loops (optimizer indices as in ``trainer.optimizers``):

- :class:`TwoTasks`: two regressors, ``steady`` (0) and ``fragile`` (1, with BatchNorm, stepped
  first); the planted record holds NaN/Inf in ``fragile``'s features only.
- :class:`ManualRegressor`: one optimizer; manual gradient accumulation, ``self.clip_gradients``,
  a StepLR stepped by the user.
- :class:`LbfgsRegressor` and :func:`lbfgs_fabric_run`: ``torch.optim.LBFGS`` with a closure,
  automatic and manual (Trainer) and in a Fabric loop; an all-zero record gives ``0 / 0`` inside
  the closure.
- :class:`DCGAN`: generator (0, BatchNorm) and discriminator (1); the loss
  ``-(log D(x) + log(1 - D(G(z)))).mean()`` unclamped; a record of magnitude 1e30 drives
  ``D(x)`` to exactly 0 (:func:`saturating_record`).
- :class:`WGANGP`: generator (0) and critic (1), five critic steps per generator step, a gradient
  penalty whose norm is written ``sqrt(sum(g ** 2))`` without an epsilon; a record in the critic's
  dead ReLU region (:func:`dead_record`) makes the input gradient exactly 0 and the penalty's
  gradient NaN (the loss stays finite).
- :class:`Reinforce`: policy (0) and value baseline (1) over logged ``(state, action, reward,
  mask)`` records; a record whose logged action is masked out gives ``log(prob = 0)``.

``loss_fn``-style functions (``*_loss_fn(module, batch, optimizer)``) and the ``Named*`` subclasses
(with ``nanguard_loss(batch, optimizer)``) let the guard recompute a step's loss to name records.
They receive the optimizer being stepped, as the user holds it: the ``LightningOptimizer`` that
``self.optimizers()`` returns or the torch optimizer inside it; :func:`optimizer_index` accepts
either and raises on anything else.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import lightning as L
import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

__all__ = [
    "BATCH",
    "DCGAN",
    "WGANGP",
    "BatchStates",
    "Critic",
    "Discriminator",
    "Generator",
    "LbfgsRegressor",
    "ManualLoop",
    "ManualRegressor",
    "NamedReinforce",
    "NamedTwoTasks",
    "Normalised",
    "Reinforce",
    "TwoTasks",
    "bn_buffers",
    "critic_loss",
    "dcgan_data",
    "dcgan_loss_fn",
    "dead_record",
    "discriminator_loss",
    "generator_loss",
    "gradient_penalty",
    "grads_finite",
    "lbfgs_data",
    "lbfgs_fabric_run",
    "lbfgs_optimizer",
    "loader",
    "optimizer_index",
    "optimizer_params",
    "regression_data",
    "regression_loss_fn",
    "reinforce_data",
    "restore_buffers",
    "saturating_record",
    "two_task_data",
    "two_task_loss_fn",
    "wgan_data",
    "wgan_loss_fn",
]

BATCH = 4  # rows per batch in every loop here


# ------------------------------------------------------------------------------------ plain torch


def grads_finite(params: Iterable[Tensor]) -> bool:
    """Whether every existing gradient of ``params`` is finite (parameters without one are ignored)."""
    return all(bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None)


def bn_buffers(module: nn.Module) -> dict[str, Tensor]:
    """Copies of the BatchNorm buffers (running statistics, ``num_batches_tracked``) of ``module``."""
    return {
        f"{name}.{key}": buffer.detach().clone()
        for name, child in module.named_modules()
        if isinstance(child, nn.modules.batchnorm._BatchNorm)
        for key, buffer in child.named_buffers(recurse=False)
        if buffer is not None
    }


def restore_buffers(module: nn.Module, saved: dict[str, Tensor]) -> None:
    """Copy :func:`bn_buffers` output back into ``module``'s buffers, in place."""
    buffers = dict(module.named_buffers())
    with torch.no_grad():
        for name, value in saved.items():
            buffers[name].copy_(value)


def optimizer_params(optimizer: Any) -> list[Tensor]:
    """The parameters an optimizer (torch or ``LightningOptimizer``) updates."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def optimizer_index(module: pl.LightningModule, optimizer: Any) -> int:
    """Which of ``trainer.optimizers`` ``optimizer`` is.

    ASSUMPTION (issue 34, naming under manual optimisation): the guard hands a ``loss_fn`` or
    ``nanguard_loss`` the optimizer being stepped *as the user holds it*: either the
    ``LightningOptimizer`` that ``self.optimizers()`` returns or the torch optimizer inside it
    (``.optimizer``). Both are accepted, compared by identity; anything else (an index, a copy)
    raises, so a wrong argument fails loudly instead of recomputing the other network's loss.
    """
    inner = getattr(optimizer, "optimizer", optimizer)  # LightningOptimizer -> torch optimizer
    for index, candidate in enumerate(module.trainer.optimizers):
        if inner is candidate:
            return index
    raise AssertionError(
        f"the loss function got optimizer={optimizer!r} ({type(optimizer).__name__}), which is neither "
        "a LightningOptimizer of self.optimizers() nor one of trainer.optimizers"
    )


def loader(dataset: TensorDataset) -> DataLoader:
    """The training loader of every loop here: ``BATCH`` rows, in order, no workers."""
    return DataLoader(dataset, batch_size=BATCH, shuffle=False)


# ------------------------------------------------------------------------------------ state recorder


class BatchStates(pl.Callback):
    """Parameters, buffers and every optimizer's state at the start and the end of each training batch.

    ``before[i]`` / ``after[i]`` are dicts ``{"params", "buffers", "optimizers"}`` (cloned) of batch ``i``.
    """

    def __init__(self) -> None:
        self.before: dict[int, dict[str, Any]] = {}
        self.after: dict[int, dict[str, Any]] = {}

    @staticmethod
    def capture(trainer: Any, module: nn.Module) -> dict[str, Any]:
        """The cloned state of ``module`` and of ``trainer.optimizers`` now."""
        return {
            "params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "buffers": {n: b.detach().clone() for n, b in module.named_buffers()},
            "optimizers": [_clone(opt.state_dict()) for opt in trainer.optimizers],
        }

    def on_train_batch_start(self, trainer: Any, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self.before[i] = self.capture(trainer, pl_module)

    def on_train_batch_end(self, trainer: Any, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int) -> None:
        self.after[i] = self.capture(trainer, pl_module)


def _clone(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _clone(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(item) for item in value)
    return value


# ------------------------------------------------------------------------------------ the base loop


class ManualLoop(pl.LightningModule):
    """Base of the manual loops: one :meth:`finish_step` per ``opt.step()``, guarded or dropped by hand.

    Args:
        drop_by_hand: the reference run: check the optimizer's own gradients before each step and
            drop a bad step by hand (no ``opt.step()``, no scheduler step, BatchNorm buffers put
            back); ``False``: always call ``opt.step()`` (the guard's job).
        check_guard: a ``NanGuard`` the loop asks with ``guard.check(self, loss)`` after each
            ``manual_backward`` (the way the docs told users before issue 34).
        skip_checked: with ``check_guard``: skip ``opt.step()`` by hand when ``check`` returns an
            event (and put the BatchNorm buffers back); ``False``: step anyway.
        seed: torch is seeded with ``seed + global_rank`` in ``on_train_start``.
    """

    def __init__(
        self, *, drop_by_hand: bool = False, check_guard: Any = None, skip_checked: bool = True, seed: int = 0
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.drop_by_hand = drop_by_hand
        self.check_guard = check_guard
        self.skip_checked = skip_checked
        self.seed = seed
        self.dropped_by_hand: list[tuple[int, int]] = []  # (batch_idx, optimizer index) of each step dropped here
        self.checked: list[tuple[int, int]] = []  # (batch_idx, optimizer index) where guard.check returned an event

    def on_train_start(self) -> None:
        torch.manual_seed(self.seed + self.global_rank)

    def optimizer(self, index: int) -> Any:
        """``self.optimizers()[index]`` (also with a single optimizer)."""
        optimizers = self.optimizers()
        return optimizers[index] if isinstance(optimizers, list) else optimizers

    def finish_step(
        self,
        index: int,
        loss: Tensor,
        batch_idx: int,
        *,
        restore: tuple[nn.Module, dict[str, Tensor]] | None = None,
        before_step: Callable[[Any], None] | None = None,
        scheduler: Any = None,
    ) -> bool:
        """Step optimizer ``index`` (or drop the step by hand), then ``zero_grad()`` it.

        Args:
            index: the optimizer's index in ``trainer.optimizers``.
            loss: the loss just back-propagated (for ``guard.check``).
            batch_idx: the batch.
            restore: ``(module, bn_buffers(module))`` saved before the forward of this step: put
                back when the step is dropped by hand.
            before_step: called with the optimizer right before ``opt.step()`` (gradient clipping).
            scheduler: an LR scheduler the user steps after ``opt.step()`` (not after a dropped step).

        Returns:
            ``False`` when the step was dropped here (by hand), else ``True``.
        """
        opt = self.optimizer(index)
        if before_step is not None:
            before_step(opt)
        drop = False
        if self.check_guard is not None and self.check_guard.check(self, loss) is not None:
            self.checked.append((batch_idx, index))
            drop = self.skip_checked
        if self.drop_by_hand and not grads_finite(optimizer_params(opt)):
            drop = True
        if drop:
            self.dropped_by_hand.append((batch_idx, index))
            if restore is not None:
                restore_buffers(*restore)
        else:
            opt.step()
            if scheduler is not None:
                scheduler.step()
        opt.zero_grad()
        return not drop


# ------------------------------------------------------------------------------------ two regressors


def two_task_data(n: int = 32, bad: Sequence[int] = (), value: float = math.nan, seed: int = 0) -> TensorDataset:
    """``(xa, xb, y)`` records: ``xa`` and ``xb`` 3 features each, ``y`` a target; ``xb[bad, 1] = value``."""
    g = torch.Generator().manual_seed(seed)
    xa, xb, y = torch.randn(n, 3, generator=g), torch.randn(n, 3, generator=g), torch.randn(n, generator=g)
    for index in bad:
        xb[index, 1] = value
    return TensorDataset(xa, xb, y)


class TwoTasks(ManualLoop):
    """Two regressors with their own Adam: ``steady`` (optimizer 0) and ``fragile`` (optimizer 1).

    ``fragile`` (``Linear -> BatchNorm1d -> ReLU -> Linear``) predicts ``y`` from ``xb`` plus
    ``steady``'s prediction from ``xa``, so without ``toggle`` its backward reaches ``steady``'s
    parameters too; ``steady`` predicts ``y`` from ``xa``. ``fragile`` is stepped first, so the
    optimizer's index (1) is not its place in the batch (first). Each optimizer is zeroed before its
    own backward. A NaN/Inf in a record's ``xb`` makes ``fragile``'s step bad (and its BatchNorm
    statistics non-finite) and leaves ``steady``'s finite.

    Args:
        toggle: wrap each optimizer's part in ``self.toggle_optimizer(opt)`` / ``untoggle_optimizer``.
        batchnorm: ``False``: ``fragile`` without its BatchNorm layer.
        kwargs: :class:`ManualLoop`'s.
    """

    def __init__(self, *, toggle: bool = False, batchnorm: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.toggle = toggle
        torch.manual_seed(0)
        self.steady = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))
        norm: nn.Module = nn.BatchNorm1d(8) if batchnorm else nn.Identity()
        self.fragile = nn.Sequential(nn.Linear(3, 8), norm, nn.ReLU(), nn.Linear(8, 1))

    def fragile_loss(self, batch: Sequence[Tensor]) -> Tensor:
        """``fragile``'s loss on ``batch`` (non-finite on a record whose ``xb`` is)."""
        xa, xb, y = batch
        return nn.functional.mse_loss((self.fragile(xb) + self.steady(xa)).squeeze(-1), y)

    def steady_loss(self, batch: Sequence[Tensor]) -> Tensor:
        """``steady``'s loss on ``batch`` (finite whatever ``xb`` holds)."""
        xa, _, y = batch
        return nn.functional.mse_loss(self.steady(xa).squeeze(-1), y)

    def training_step(self, batch: Sequence[Tensor], batch_idx: int) -> None:
        for index, loss_of, module in ((1, self.fragile_loss, self.fragile), (0, self.steady_loss, self.steady)):
            opt = self.optimizer(index)
            if self.toggle:
                self.toggle_optimizer(opt)
            opt.zero_grad()
            saved = bn_buffers(module)
            loss = loss_of(batch)
            self.manual_backward(loss)
            self.finish_step(index, loss, batch_idx, restore=(module, saved))
            if self.toggle:
                self.untoggle_optimizer(opt)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.Adam(self.steady.parameters(), lr=1e-2),
            torch.optim.Adam(self.fragile.parameters(), lr=1e-2),
        ]


def two_task_loss_fn(module: TwoTasks, batch: Sequence[Tensor], optimizer: Any) -> Tensor:
    """``NanGuard(loss_fn=...)`` for :class:`TwoTasks`: the loss of the network ``optimizer`` steps."""
    return module.fragile_loss(batch) if optimizer_index(module, optimizer) == 1 else module.steady_loss(batch)


class NamedTwoTasks(TwoTasks):
    """:class:`TwoTasks` with the module hook ``nanguard_loss(batch, optimizer)``."""

    def nanguard_loss(self, batch: Sequence[Tensor], optimizer: Any) -> Tensor:
        """The loss of the network ``optimizer`` steps, on ``batch`` (for naming records)."""
        return two_task_loss_fn(self, batch, optimizer)


# ------------------------------------------------------------------------------------ one optimizer


def regression_data(n: int = 32, bad: Sequence[int] = (), value: float = math.nan, seed: int = 0) -> TensorDataset:
    """``(x, y)`` records, 3 features; ``x[bad, 0] = value``."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 3, generator=g), torch.randn(n, generator=g)
    for index in bad:
        x[index, 0] = value
    return TensorDataset(x, y)


def regression_loss_fn(module: ManualRegressor, batch: Sequence[Tensor]) -> Tensor:
    """``NanGuard(loss_fn=...)`` with two parameters, for the single optimizer of :class:`ManualRegressor`."""
    x, y = batch
    return nn.functional.mse_loss(module.net(x).squeeze(-1), y)


class ManualRegressor(ManualLoop):
    """One MLP, one optimizer, stepped by hand.

    Args:
        accumulate: ``manual_backward`` every batch (the loss divided by ``accumulate``),
            ``opt.step()`` every ``accumulate`` batches (on the last batch of each group).
        clip: ``self.clip_gradients(opt, gradient_clip_val=clip, gradient_clip_algorithm="norm")``
            before each ``opt.step()``.
        scheduler: a ``StepLR(step_size=1, gamma=0.5)`` the loop steps right after each ``opt.step()``
            (``self.lr_schedulers().step()``); ``lrs`` records the learning rate at each batch's end.
        kwargs: :class:`ManualLoop`'s.
    """

    def __init__(self, *, accumulate: int = 1, clip: float | None = None, scheduler: bool = False, **kwargs: Any):
        super().__init__(**kwargs)
        self.accumulate, self.clip, self.scheduler = accumulate, clip, scheduler
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))
        self.lrs: list[float] = []

    def training_step(self, batch: Sequence[Tensor], batch_idx: int) -> None:
        loss = regression_loss_fn(self, batch) / self.accumulate
        self.manual_backward(loss)
        if (batch_idx + 1) % self.accumulate == 0:
            clip = None
            if self.clip is not None:
                value = self.clip

                def clip(opt: Any) -> None:
                    self.clip_gradients(opt, gradient_clip_val=value, gradient_clip_algorithm="norm")

            self.finish_step(
                0, loss, batch_idx, before_step=clip, scheduler=self.lr_schedulers() if self.scheduler else None
            )
        self.lrs.append(float(self.optimizer(0).param_groups[0]["lr"]))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.net.parameters(), lr=1e-2)
        if not self.scheduler:
            return opt
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


# ------------------------------------------------------------------------------------ LBFGS (closures)


def lbfgs_data(n: int = 24, bad: Sequence[int] = (), seed: int = 0) -> TensorDataset:
    """``(x, y)`` records, 4 features; the records ``bad`` are all zeros (``x / ||x||`` is ``0 / 0``)."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 4, generator=g), torch.randn(n, generator=g)
    x[list(bad)] = 0.0
    return TensorDataset(x, y)


class Normalised(nn.Module):
    """``Linear(Linear(x / ||x||))``: NaN for an all-zero row (the division, in the closure's forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        x = x / x.norm(dim=-1, keepdim=True)
        return self.l2(torch.tanh(self.l1(x))).squeeze(-1)


def lbfgs_optimizer(params: Iterable[Tensor]) -> torch.optim.LBFGS:
    """The LBFGS of every closure run here (few inner iterations: a few dozen closure calls per run)."""
    return torch.optim.LBFGS(params, lr=0.1, max_iter=3)


class LbfgsRegressor(pl.LightningModule):
    """:class:`Normalised` trained with LBFGS, automatic (``manual=False``) or manual (``opt.step(closure)``).

    Args:
        manual: ``automatic_optimization = False`` and ``opt.step(closure)`` in ``training_step``.
        skip_batches: the reference: no optimizer step for these batches (automatic: the closure
            still runs, as Lightning requires, but ``optimizer.step`` is not called; manual: nothing
            runs).
    """

    def __init__(self, *, manual: bool = False, skip_batches: Sequence[int] = ()) -> None:
        super().__init__()
        self.automatic_optimization = not manual
        self.skip_batches = tuple(skip_batches)
        torch.manual_seed(0)
        self.model = Normalised()

    def loss(self, batch: Sequence[Tensor]) -> Tensor:
        """The regression loss of ``batch`` (NaN when it holds an all-zero record)."""
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y)

    def training_step(self, batch: Sequence[Tensor], batch_idx: int) -> Tensor | None:
        if self.automatic_optimization:
            return self.loss(batch)
        if batch_idx in self.skip_batches:
            return None
        opt: Any = self.optimizers()

        def closure() -> Tensor:
            opt.zero_grad()
            loss = self.loss(batch)
            self.manual_backward(loss)
            return loss

        opt.step(closure=closure)
        return None

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        if batch_idx in self.skip_batches:
            optimizer_closure()  # Lightning checks that the closure ran; the step itself is left out
            return
        optimizer.step(closure=optimizer_closure)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return lbfgs_optimizer(self.parameters())


def lbfgs_fabric_run(
    guard: Any, dataset: TensorDataset, skip_batches: Sequence[int] = ()
) -> tuple[nn.Module, list[dict[str, Tensor]], Any]:
    """One epoch of a Fabric loop: ``fabric.setup(model, LBFGS)``, ``optimizer.step(closure)`` per batch.

    Args:
        guard: the ``NanGuard`` given to ``L.Fabric(callbacks=[guard])``, or ``None``.
        dataset: the records (:func:`lbfgs_data`).
        skip_batches: the reference: no ``optimizer.step`` for these batches.

    Returns:
        The module, its weights before the first batch and after each batch (``len + 1`` dicts of
        clones), and the torch optimizer.
    """
    torch.manual_seed(0)
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[guard] if guard is not None else [])
    module = Normalised()
    inner = lbfgs_optimizer(module.parameters())
    model, optimizer = fabric.setup(module, inner)
    states = [{n: p.detach().clone() for n, p in module.named_parameters()}]
    for batch_idx, (x, y) in enumerate(DataLoader(dataset, batch_size=BATCH, shuffle=False)):
        if batch_idx not in skip_batches:

            def closure(x: Tensor = x, y: Tensor = y) -> Tensor:
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                fabric.backward(loss)
                return loss

            optimizer.step(closure)
        states.append({n: p.detach().clone() for n, p in module.named_parameters()})
    return module, states, inner


# ------------------------------------------------------------------------------------ DCGAN

NOISE = 4
SAMPLE = 4
SATURATING = 1e30  # the magnitude of the planted record: D's logit ~ -1e29, sigmoid exactly 0


class Generator(nn.Module):
    """``z -> tanh(Linear(ReLU(BatchNorm(Linear(z)))))``: DCGAN's generator in miniature (BatchNorm included)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(NOISE, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, SAMPLE), nn.Tanh())

    def forward(self, z: Tensor) -> Tensor:
        return self.net(z)


class Discriminator(nn.Module):
    """``x -> sigmoid(Linear(LeakyReLU(Linear(x))))``: the probability that ``x`` is real."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(SAMPLE, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def forward(self, x: Tensor) -> Tensor:
        return torch.sigmoid(self.net(x)).squeeze(-1)


def discriminator_loss(discriminator: nn.Module, real: Tensor, fake: Tensor) -> Tensor:
    """``-(log D(x) + log(1 - D(G(z)))).mean()``, unclamped: ``D(x) == 0`` gives ``log(0) = -inf``."""
    return -(torch.log(discriminator(real)) + torch.log(1 - discriminator(fake))).mean()


def generator_loss(discriminator: nn.Module, fake: Tensor) -> Tensor:
    """The non-saturating generator loss ``-log D(G(z))``."""
    return -torch.log(discriminator(fake)).mean()


def saturating_record(discriminator: Discriminator) -> Tensor:
    """A record of magnitude 1e30 for which ``discriminator`` gives exactly 0.

    Far from the origin the (piecewise linear) logit is ``1e30 * g(v)`` for a direction ``v``; the
    direction among ``±e_k`` and ``±(1, ..., 1)`` with the most negative ``g`` is taken, with the
    initial weights (seeded, the same on every rank). Its ``g`` is far from 0, so the few dozen small
    Adam steps before the record is met do not flip its sign: ``D(x)`` is exactly 0 when it comes.
    """
    eye = torch.eye(SAMPLE)
    candidates = torch.cat([eye, -eye, torch.ones(1, SAMPLE), -torch.ones(1, SAMPLE)])
    with torch.no_grad():
        slopes = discriminator.net(candidates).squeeze(-1) - discriminator.net(torch.zeros(1, SAMPLE)).squeeze(-1)
        best = int(slopes.argmin())
        record = SATURATING * candidates[best]
        assert float(slopes[best]) < -0.05, f"no direction saturates D clearly enough: {slopes.tolist()}"
        assert float(discriminator(record[None])[0]) == 0.0
    return record


def dcgan_data(n: int = 48, bad: Sequence[int] = (), seed: int = 0) -> TensorDataset:
    """``(x,)`` records around ``(0.5, -0.5, 0.5, -0.5)``; the records ``bad`` are :func:`saturating_record`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.tensor([0.5, -0.5, 0.5, -0.5]) + 0.3 * torch.randn(n, SAMPLE, generator=g)
    if bad:
        torch.manual_seed(0)
        x[list(bad)] = saturating_record(Discriminator())  # the same initial D as DCGAN's
    return TensorDataset(x)


class DCGAN(ManualLoop):
    """A DCGAN-style loop: generator (optimizer 0, BatchNorm) and discriminator (optimizer 1), Adam(2e-4, 0.5).

    Per batch, in the order of Lightning's own GAN example: the generator's step (toggled; a fresh
    ``fake = G(z)``, loss ``-log D(fake)``), then the discriminator's (toggled) on the real batch and
    the same ``fake``, detached. The discriminator's forward touches no BatchNorm, so dropping its step
    restores none; the generator's BatchNorm update belongs to the generator's (healthy) step and stays.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        torch.manual_seed(0)
        self.discriminator = Discriminator()  # built first: the same initial weights as saturating_record's
        self.generator = Generator()
        self.d_steps: list[int] = []  # batch_idx of every discriminator step attempted (up to a raise)

    def training_step(self, batch: Sequence[Tensor], batch_idx: int) -> None:
        (real,) = batch
        g_opt, d_opt = self.optimizer(0), self.optimizer(1)
        z = torch.randn(real.shape[0], NOISE)
        self.toggle_optimizer(g_opt)
        fake = self.generator(z)
        g_loss = generator_loss(self.discriminator, fake)
        self.manual_backward(g_loss)
        self.finish_step(0, g_loss, batch_idx)
        self.untoggle_optimizer(g_opt)

        self.toggle_optimizer(d_opt)
        d_loss = discriminator_loss(self.discriminator, real, fake.detach())
        self.manual_backward(d_loss)
        self.d_steps.append(batch_idx)
        self.finish_step(1, d_loss, batch_idx)
        self.untoggle_optimizer(d_opt)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        betas = (0.5, 0.999)
        return [
            torch.optim.Adam(self.generator.parameters(), lr=2e-4, betas=betas),
            torch.optim.Adam(self.discriminator.parameters(), lr=2e-4, betas=betas),
        ]


def dcgan_loss_fn(module: DCGAN, batch: Sequence[Tensor], optimizer: Any) -> Tensor:
    """``NanGuard(loss_fn=...)`` for :class:`DCGAN`: the loss of the network ``optimizer`` steps (fresh ``z``)."""
    (real,) = batch
    fake = module.generator(torch.randn(real.shape[0], NOISE))
    if optimizer_index(module, optimizer) == 1:
        return discriminator_loss(module.discriminator, real, fake.detach())
    return generator_loss(module.discriminator, fake)


# ------------------------------------------------------------------------------------ WGAN-GP

WGAN_NOISE = 4
WGAN_SAMPLE = 8
CRITIC_STEPS = 5  # critic steps per generator step
GP_WEIGHT = 10.0
DEAD = 1e8  # how far into the critic's dead region the planted record lies


class Critic(nn.Module):
    """``Linear(8, 8) -> ReLU -> Linear(8, 8) -> ReLU -> Linear(8, 1)``: an unbounded score, no BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(WGAN_SAMPLE, WGAN_SAMPLE), nn.ReLU(), nn.Linear(WGAN_SAMPLE, 8), nn.ReLU(), nn.Linear(8, 1)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x).squeeze(-1)


def gradient_penalty(critic: nn.Module, real: Tensor, fake: Tensor) -> Tensor:
    """WGAN-GP's penalty ``(||grad_x C(x_hat)|| - 1) ** 2`` at random interpolates, the norm without epsilon.

    ``sqrt(sum(g ** 2))`` is 0 where the critic is flat (every first-layer ReLU dead): the penalty is
    finite there (``(0 - 1) ** 2``) but the derivative of ``sqrt`` at 0 is infinite and meets a zero
    gradient, ``inf * 0 = NaN`` in every critic weight's gradient.
    """
    eps = torch.rand(real.shape[0], 1)
    x_hat = (eps * real + (1 - eps) * fake).requires_grad_(True)
    (grad,) = torch.autograd.grad(critic(x_hat).sum(), x_hat, create_graph=True)
    norm = grad.pow(2).sum(dim=1).sqrt()
    return ((norm - 1) ** 2).mean()


def critic_loss(critic: nn.Module, real: Tensor, fake: Tensor) -> Tensor:
    """``C(fake) - C(real) + 10 * penalty``, means over the batch."""
    return critic(fake).mean() - critic(real).mean() + GP_WEIGHT * gradient_penalty(critic, real, fake)


def dead_record(critic: Critic) -> Tensor:
    """A record deep in ``critic``'s dead region: every first-layer pre-activation is ``-1e8`` (initial weights).

    ``x = -1e8 * W1^-1 (1, ..., 1)`` gives ``W1 x = -1e8``; the interpolates ``eps * x + (1 - eps) * fake``
    stay there (unless ``eps < ~1e-7``), and a few small Adam steps do not leave it.
    """
    first = critic.net[0]
    with torch.no_grad():
        direction = torch.linalg.solve(first.weight.double(), -torch.ones(WGAN_SAMPLE, dtype=torch.float64))
        record = (DEAD * direction).float()
        assert bool((first(record[None]) < -1e6).all()), "the planted record is not in the critic's dead region"
    return record


def wgan_data(n: int = 40, bad: Sequence[int] = (), seed: int = 0) -> TensorDataset:
    """``(x,)`` records, 8 features around 1; the records ``bad`` are :func:`dead_record`."""
    g = torch.Generator().manual_seed(seed)
    x = 1.0 + 0.5 * torch.randn(n, WGAN_SAMPLE, generator=g)
    if bad:
        torch.manual_seed(0)
        x[list(bad)] = dead_record(Critic())  # the same initial critic as WGANGP's
    return TensorDataset(x)


class WGANGP(ManualLoop):
    """WGAN-GP: generator (optimizer 0) and critic (optimizer 1), Adam(1e-4, betas=(0.5, 0.9)).

    Every batch is a critic step (a fresh detached ``fake``, :func:`critic_loss`); every
    ``CRITIC_STEPS``-th batch (``batch_idx % 5 == 4``) is also a generator step (``-C(G(z)).mean()``),
    after the critic's. No toggling: the generator's backward leaves gradients on the critic, which
    the critic's ``zero_grad`` (after its step) and the next batch's clear. No BatchNorm.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        torch.manual_seed(0)
        self.critic = Critic()  # built first: the same initial weights as dead_record's
        self.generator = nn.Sequential(nn.Linear(WGAN_NOISE, 16), nn.ReLU(), nn.Linear(16, WGAN_SAMPLE))

    def training_step(self, batch: Sequence[Tensor], batch_idx: int) -> None:
        (real,) = batch
        fake = self.generator(torch.randn(real.shape[0], WGAN_NOISE)).detach()
        c_loss = critic_loss(self.critic, real, fake)
        self.manual_backward(c_loss)
        self.finish_step(1, c_loss, batch_idx)
        if batch_idx % CRITIC_STEPS == CRITIC_STEPS - 1:
            g_loss = -self.critic(self.generator(torch.randn(real.shape[0], WGAN_NOISE))).mean()
            self.manual_backward(g_loss)
            self.finish_step(0, g_loss, batch_idx)
            self.optimizer(1).zero_grad()  # the generator's backward reached the critic too

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        betas = (0.5, 0.9)
        return [
            torch.optim.Adam(self.generator.parameters(), lr=1e-4, betas=betas),
            torch.optim.Adam(self.critic.parameters(), lr=1e-4, betas=betas),
        ]


def wgan_loss_fn(module: WGANGP, batch: Sequence[Tensor], optimizer: Any) -> Tensor:
    """``NanGuard(loss_fn=...)`` for :class:`WGANGP`: the critic's loss (with the penalty) or the generator's."""
    (real,) = batch
    if optimizer_index(module, optimizer) == 1:
        fake = module.generator(torch.randn(real.shape[0], WGAN_NOISE)).detach()
        return critic_loss(module.critic, real, fake)
    return -module.critic(module.generator(torch.randn(real.shape[0], WGAN_NOISE))).mean()


# ------------------------------------------------------------------------------------ REINFORCE

STATE = 4
ACTIONS = 3


def reinforce_data(n: int = 40, bad: Sequence[int] = (), seed: int = 0) -> TensorDataset:
    """Logged transitions ``(state, action, reward, mask)``: ``mask`` the actions allowed in ``state``.

    Every logged action is allowed, except in the records ``bad``, whose action is masked out (a
    logging bug): the policy gives it probability exactly 0.
    """
    g = torch.Generator().manual_seed(seed)
    state = torch.randn(n, STATE, generator=g)
    mask = torch.rand(n, ACTIONS, generator=g) > 0.3
    action = torch.zeros(n, dtype=torch.long)
    for i in range(n):
        mask[i, int(torch.randint(ACTIONS, (1,), generator=g))] = True  # at least one allowed action
        allowed = mask[i].nonzero().flatten()
        action[i] = allowed[int(torch.randint(len(allowed), (1,), generator=g))]
    reward = torch.rand(n, generator=g) + 0.1  # positive: the advantage is rarely 0, the loss is +inf or -inf
    for index in bad:
        mask[index] = True
        mask[index, action[index]] = False
    return TensorDataset(state, action, reward, mask)


class Reinforce(ManualLoop):
    """REINFORCE with a baseline over logged transitions: policy (optimizer 0) and value (optimizer 1), Adam.

    Policy loss ``-(log(prob[action]) * (reward - V(state))).mean()`` with the probabilities a softmax
    over logits whose disallowed actions are set to ``-inf``; value loss ``mse(V(state), reward)``.
    The policy is stepped first; neither is toggled (the losses share no parameters). No BatchNorm.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        torch.manual_seed(0)
        self.policy = nn.Sequential(nn.Linear(STATE, 16), nn.Tanh(), nn.Linear(16, ACTIONS))
        self.value = nn.Sequential(nn.Linear(STATE, 16), nn.Tanh(), nn.Linear(16, 1))

    def policy_loss(self, batch: Sequence[Tensor]) -> Tensor:
        """The policy-gradient loss; ``log(0) = -inf`` on a record whose action is disallowed."""
        state, action, reward, mask = batch
        logits = self.policy(state).masked_fill(~mask, float("-inf"))
        prob = torch.softmax(logits, dim=-1).gather(1, action[:, None]).squeeze(1)
        advantage = reward - self.value(state).squeeze(-1).detach()
        return -(torch.log(prob) * advantage).mean()

    def value_loss(self, batch: Sequence[Tensor]) -> Tensor:
        """The baseline's regression loss (finite on every record)."""
        state, _, reward, _ = batch
        return nn.functional.mse_loss(self.value(state).squeeze(-1), reward)

    def training_step(self, batch: Sequence[Tensor], batch_idx: int) -> None:
        for index, loss_of in ((0, self.policy_loss), (1, self.value_loss)):
            loss = loss_of(batch)
            self.manual_backward(loss)
            self.finish_step(index, loss, batch_idx)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.Adam(self.policy.parameters(), lr=1e-2), torch.optim.Adam(self.value.parameters(), lr=1e-2)]


class NamedReinforce(Reinforce):
    """:class:`Reinforce` with the module hook ``nanguard_loss(batch, optimizer)``."""

    def nanguard_loss(self, batch: Sequence[Tensor], optimizer: Any) -> Tensor:
        """The loss of the network ``optimizer`` steps, on ``batch`` (for naming records)."""
        return self.policy_loss(batch) if optimizer_index(self, optimizer) == 0 else self.value_loss(batch)
