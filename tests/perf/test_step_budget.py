"""A healthy step's budget inside NanGuard: operator calls and host reads, counted, never timed.

A real ``Trainer`` (CPU, no logger unless the feature needs one) trains a tiny model for
:data:`STEPS` steps with the guard's clock swapped for a counting one (``tests/helpers/op_budget.py``):
every region the guard runs under ``guard.clock`` (its hooks, the strategy's after-step work, the
batch sampler) is counted, whatever the hooks are called. Counted per step:

- ``ops``: aten operator calls inside the guard (on a GPU, about one kernel launch each, views aside);
- ``reads``: host reads inside the guard (each a synchronisation on a GPU);
- ``total``: operator calls of the guarded run minus those of the same seeded run without a guard,
  which also holds what the guard does outside its hooks (the attention probe inside a sampled
  step's forward). Where a budget names no ``total``, it must equal ``ops`` on every step: nothing
  escapes the clock.
- Python and C function calls inside the guard (``sys.setprofile``), for the default guard only:
  :data:`PYTHON_CALLS`, the host's share of a healthy step that the operator counts cannot see.

Only the steady steps count (:data:`STEADY`): step 0 builds caches (staging buffers, device
constants), step 1 is the first with a sync-free step pending, and the last step also runs the
end-of-fit work. The spike statistic refreshes its threshold every 4th healthy step (one ``fill_``):
a budget is the most any steady step may use.

Every feature is measured on a model of 4 parameter tensors and on one of 1,500 with the same
shapes: the counts must be equal (one multi-tensor kernel per device and dtype, one ``stack`` per
repeated shape: never one call per tensor).

A feature that adds work to the healthy step states its cost here: raise its entry of
:data:`BUDGET` (or add one) in the same change, with a comment saying what the new calls are.
A change that makes a step cheaper may lower an entry.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from op_budget import OpCounter, PythonCalls, StepCounts, install
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_nanguard.detect.one_read as one_read
from lightning_nanguard import NanGuard

STEPS = 8
STEADY = range(2, STEPS - 1)
SMALL, LARGE = 2, 750  # layers of a weight (8, 8) and a bias (8,): 4 and 1,500 parameter tensors


@dataclass(frozen=True)
class Budget:
    """What one healthy step may do inside the guard (see module docs)."""

    ops: int  # operator calls inside the guard, at most
    reads: int  # host reads inside the guard, exactly
    total: int | None = None  # guarded minus unguarded operator calls, at most; None: equal to ``ops``


BUDGET: dict[str, Budget] = {
    # the loss kept (detach); the check in one buffer (detect/one_read.py): the small gradients staged
    # (one stack per repeated shape: 2 here), the loss copied beside them (one _foreach_copy_), one sum
    # into the buffer's last slot; one read of [loss, total]; the host tests the total and compares the
    # loss with the spike threshold (no kernel, no fill_ when the threshold changes). 5 calls
    "default": Budget(ops=5, reads=1),
    # the default's one buffer (4 calls and the loss's detach), its total made the skip flag on the device
    # (total - total, nan_to_num; the loss compared with the spike threshold, one gt; both joined, one
    # maximum; 3 views), handed to fused AdamW as found_inf; [loss, total] copied to the host without
    # waiting (a detach and a copy) and read a step later (a view; no read). Was 29 with the general flags.
    # Outside the hooks: the fused optimizer, handed found_inf, takes its step counts back (one _foreach_sub_)
    "sync_free=True": Budget(ops=15, reads=0, total=16),
    "spike_action='off'": Budget(ops=5, reads=1),
    # Lightning's logging steps (log_every_n_steps): the gradients' total is their L2 norm, the
    # vector_norm of the staging buffer instead of its sum (5 calls, as the default)
    "logging step": Budget(ops=5, reads=1),
    # BatchNorm: its buffers copied at the batch's start (one _foreach_copy_, to put them back if the step
    # is dropped); in the one read, the running means staged (one stack per shape) and summed, the running
    # variances staged, square-rooted in the copy and summed (detect/one_read.py's BatchNormTotals). 11 calls
    "BatchNorm statistics": Budget(ops=11, reads=1),
    # the probe keeps the attention call's query and key and measures the calls of one shape together
    # when the forward returns (detect/attention.py): 20 calls outside the hooks for the one call.
    # The second read is CPU only: on CUDA the samples are copied to pinned memory without waiting
    # and read once their event has completed
    "precursors, attention model, sampled step": Budget(ops=4, reads=2, total=24),
    "precursors, attention model, other step": Budget(ops=4, reads=1),
}


# ---------------------------------------------------------------------------- models


class Stacked(pl.LightningModule):
    """``layers`` weights (8, 8) and biases (8,), applied side by side: a forward of a few calls whatever ``layers``.

    Fused AdamW: a few operator calls whatever the number of tensors (on CPU the ``foreach`` one
    reads every step count to the host), and the optimizer ``sync_free=True`` needs.
    """

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(8, 8) * 0.1) for _ in range(layers))
        self.biases = nn.ParameterList(nn.Parameter(torch.zeros(8)) for _ in range(layers))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        hidden = torch.matmul(x.unsqueeze(0), torch.stack(list(self.weights))) + torch.stack(list(self.biases))[:, None]
        return nn.functional.mse_loss(torch.tanh(hidden).mean((0, 2)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)


class StackedBatchNorm(Stacked):
    """:class:`Stacked` with a ``BatchNorm1d(8)`` after each layer: ``layers`` running means and variances."""

    def __init__(self, layers: int) -> None:
        super().__init__(layers)
        self.norms = nn.ModuleList(nn.BatchNorm1d(8) for _ in range(layers))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        hidden = torch.matmul(x.unsqueeze(0), torch.stack(list(self.weights))) + torch.stack(list(self.biases))[:, None]
        normed = torch.stack([norm(h) for norm, h in zip(self.norms, hidden, strict=True)])
        return nn.functional.mse_loss(torch.tanh(normed).mean((0, 2)), y)


class _SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (t.unsqueeze(1) for t in self.qkv(x).split(8, dim=-1))
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).squeeze(1)


class Attention(pl.LightningModule):
    """One causal self-attention over 2 tokens of width 8."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = _SelfAttention()
        self.out = nn.Linear(8, 1)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.out(self.attn(x.view(-1, 2, 4).repeat(1, 1, 2))).mean((1, 2)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)


# ---------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class Feature:
    """A guard configuration and the steps of its run that a budget entry covers."""

    model: Callable[[int], pl.LightningModule]
    guard: dict[str, Any] = field(default_factory=dict)
    logger: bool = False
    steps: tuple[int, ...] = tuple(STEADY)
    sizes: tuple[int, ...] = (SMALL, LARGE)


_PRECURSORS = {"precursor_every_n_steps": 2, "precursor_max_cost": None}  # no wall-clock governor
FEATURES: dict[str, Feature] = {
    "default": Feature(Stacked),
    "sync_free=True": Feature(Stacked, {"sync_free": True}),
    "spike_action='off'": Feature(Stacked, {"spike_action": "off"}),
    "logging step": Feature(Stacked, logger=True),
    "BatchNorm statistics": Feature(StackedBatchNorm),
    "precursors, attention model, sampled step": Feature(
        lambda n: Attention(), _PRECURSORS, steps=tuple(s for s in STEADY if s % 2 == 0), sizes=(1,)
    ),
    "precursors, attention model, other step": Feature(
        lambda n: Attention(), _PRECURSORS, steps=tuple(s for s in STEADY if s % 2), sizes=(1,)
    ),
}


@dataclass(frozen=True)
class StepCount:
    ops: int
    reads: int
    all_ops: int
    python_calls: int


@dataclass
class Run:
    steps: dict[int, StepCount]
    counter: OpCounter


class _Marker(pl.Callback):
    """Marks where each step begins (placed before the guard: the guard's batch start counts in its step)."""

    def __init__(self, counts: StepCounts) -> None:
        self.counts = counts

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.counts.mark(trainer.global_step)


def measure(
    model: pl.LightningModule,
    guard_kwargs: dict[str, Any] | None,
    log_dir: Any = None,
    counter: OpCounter | None = None,
    **trainer_kwargs: Any,
) -> Run:
    """Fit ``model`` for :data:`STEPS` steps (``guard_kwargs`` None: without a guard) and count every step."""
    counter = counter if counter is not None else OpCounter()
    counts = StepCounts(counter)
    callbacks: list[pl.Callback] = [_Marker(counts)]
    guard = None
    if guard_kwargs is not None:
        guard = NanGuard(verbose=False, **guard_kwargs)
        install(guard, counter)
        callbacks.append(guard)
    trainer = pl.Trainer(
        max_steps=STEPS,
        callbacks=callbacks,
        logger=CSVLogger(log_dir) if log_dir is not None else False,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
        **trainer_kwargs,
    )
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=generator), torch.randn(64, generator=generator))
    modes = counter.modes() if not isinstance(counter, PythonCalls) else contextlib.nullcontext()
    # no garbage collection inside a counted region: after other tests in the same process it would run their
    # leftovers' finalizers there (Python calls that are not the guard's, more often on the larger model)
    gc.collect()
    gc.disable()
    try:
        with modes:
            trainer.fit(model, DataLoader(data, batch_size=4))
    finally:
        gc.enable()
    if guard is not None:
        assert guard.events == [] and guard.active, "the budget is a healthy step's"
        assert counter.regions >= 3 * STEPS, "the guard's hooks no longer run under guard.clock: count them elsewhere"
    return Run({step: StepCount(*values) for step, values in counts.per_step().items()}, counter)


def violations(name: str, guarded: Run, bare: Run | None, steps: tuple[int, ...]) -> list[str]:
    """How ``guarded`` exceeds ``BUDGET[name]`` on ``steps`` (``bare``: the same run without a guard)."""
    budget = BUDGET[name]
    found = []
    for step in steps:
        count = guarded.steps[step]
        if count.ops > budget.ops:
            found.append(f"step {step}: {count.ops} operator calls inside the guard, budget {budget.ops}")
        if count.reads != budget.reads:
            found.append(f"step {step}: {count.reads} host reads inside the guard, budget {budget.reads}")
        if bare is not None:
            added = count.all_ops - bare.steps[step].all_ops
            if budget.total is None and added != count.ops:
                found.append(
                    f"step {step}: the guard adds {added} operator calls to the step but runs {count.ops} in its "
                    "hooks: work outside guard.clock (give it a `total` budget, or run it under the clock)"
                )
            elif budget.total is not None and added > budget.total:
                found.append(f"step {step}: the guard adds {added} operator calls to the step, budget {budget.total}")
    if found:
        top = ", ".join(f"{op} x{n}" for op, n in guarded.counter.ops.most_common(6))
        reads = dict(guarded.counter.reads)
        found.append(f"{name}: the whole run's calls inside the guard: {top}; host reads: {reads}")
    return found


def _per_step(run: Run, steps: tuple[int, ...]) -> list[tuple[int, int]]:
    return [(run.steps[s].ops, run.steps[s].reads) for s in steps]


# ---------------------------------------------------------------------------- the budget


def test_counter_sees_what_a_planted_loop_does() -> None:
    """The counter itself: one call per tensor of a loop, one read per ``item``, none for a host copy."""
    counter = OpCounter()
    grads = [torch.ones(3) for _ in range(5)]
    with counter.modes():
        _ = torch.ones(1).item()  # outside a region: not counted
        with counter.counting():
            for g in grads:
                g.sum()
            flags = torch.stack([g.sum() for g in grads])
            flags.tolist()
            bool(flags.sum() > 0)
            copy = flags.to("cpu", copy=True)
            copy.tolist()
            copy.reshape(-1).tolist()  # a view of the copy
    assert counter.ops["aten.sum.default"] == 11
    assert dict(counter.reads) == {"tolist": 1, "_local_scalar_dense": 1}


@pytest.mark.parametrize("name", list(FEATURES))
def test_healthy_step_stays_within_its_budget(name: str, tmp_path: Any) -> None:
    feature = FEATURES[name]
    problems: list[str] = []
    per_size = {}
    for size in feature.sizes:
        model = feature.model(size)
        tensors = len(list(model.parameters()))
        guarded = measure(model, feature.guard, tmp_path / str(size) if feature.logger else None)
        bare = None
        if size == feature.sizes[0]:  # the guard's work outside its hooks, on the small model (cheap)
            bare = measure(feature.model(size), None, tmp_path / "bare" if feature.logger else None)
        problems += [f"[{tensors} tensors] {line}" for line in violations(name, guarded, bare, feature.steps)]
        per_size[tensors] = _per_step(guarded, feature.steps)
    if len(set(map(tuple, per_size.values()))) > 1:
        problems.append(f"the calls grow with the number of tensors: (ops, reads) per step by tensors {per_size}")
    assert not problems, "\n".join(problems)


def _plant(monkeypatch: pytest.MonkeyPatch, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``staged_loss_and_total`` wherever the package refers to it (the healthy step's check, in one read)."""
    original = one_read.staged_loss_and_total
    planted = wrap(original)
    names = [
        name
        for name, module in list(sys.modules.items())
        if name.startswith("lightning_nanguard") and getattr(module, "staged_loss_and_total", None) is original
    ]
    for name in names:
        monkeypatch.setattr(sys.modules[name], "staged_loss_and_total", planted)
    assert len(names) > 1, "nothing but its own module refers to staged_loss_and_total: plant elsewhere"


def _per_tensor_loop(original: Callable[..., Any]) -> Callable[..., Any]:
    def planted(grads: list[Tensor], *args: Any, **kwargs: Any) -> Any:
        for grad in grads:  # one kernel per tensor
            grad.sum()
        return original(grads, *args, **kwargs)

    return planted


def _extra_read(original: Callable[..., Any]) -> Callable[..., Any]:
    def planted(grads: list[Tensor], *args: Any, **kwargs: Any) -> Any:
        values = original(grads, *args, **kwargs)
        if grads[0].sum() > 0:  # a host read
            pass
        return values

    return planted


def test_budget_catches_a_planted_per_tensor_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    _plant(monkeypatch, _per_tensor_loop)
    found = violations("default", measure(Stacked(LARGE), {}), None, tuple(STEADY))
    assert found and all("operator calls" in line for line in found[:-1]), found
    assert "step 2: 1505 operator calls inside the guard, budget 5" in found, found


def test_budget_catches_a_planted_host_read(monkeypatch: pytest.MonkeyPatch) -> None:
    _plant(monkeypatch, _extra_read)
    found = violations("default", measure(Stacked(SMALL), {}), None, tuple(STEADY))
    assert any("2 host reads inside the guard, budget 1" in line for line in found), found


# ---------------------------------------------------------------------------- known findings (issue 35)


def test_weight_check_step_does_not_grow_with_tensors() -> None:
    """The weight check every ``check_params_every_n_steps`` steps: staged sums, no call per tensor (was 3,030)."""
    steps = (3, 5)  # after the optimizer steps of global steps 3 and 5: (step + 1) % 2 == 0
    runs = {size: measure(Stacked(size), {"check_params_every_n_steps": 2}) for size in (SMALL, LARGE)}
    assert _per_step(runs[LARGE], steps) == _per_step(runs[SMALL], steps)


PYTHON_CALLS = 287
"""Python and C function calls inside the guard on a steady healthy step of the default guard (``sys.setprofile``).

The most any steady step makes: 242 on most, 287 on the spike statistic's refresh (every 4th healthy
step). 321 before the cuts of issue 35's last stop (an LBFGS-only hook on every step, properties read
through their calls). A change that adds calls to the healthy step raises this in the same change, with
a comment saying what they are; one that removes some may lower it.
"""


def test_a_healthy_step_makes_no_more_python_calls_than_its_budget() -> None:
    counter = PythonCalls()
    run = measure(Stacked(SMALL), {}, counter=counter)
    calls = max(run.steps[s].python_calls for s in STEADY)
    assert calls <= PYTHON_CALLS, (
        f"{calls} calls on a healthy step, the budget is {PYTHON_CALLS}; the most frequent over the run: "
        f"{counter.calls.most_common(15)}"
    )


def test_python_calls_do_not_grow_with_tensors() -> None:
    """The healthy step's Python calls are the same on 4 and 1,500 tensors (the layout's plan is worked out once).

    The gradient list itself (``p.grad`` of each tensor) is the one per-tensor Python left: attribute
    reads, not calls, and the optimizer would make the same Python objects next.
    """
    calls = {}
    for size in (SMALL, LARGE):
        run = measure(Stacked(size), {}, counter=PythonCalls())
        calls[size] = max(run.steps[s].python_calls for s in STEADY)
    assert calls[LARGE] <= calls[SMALL] + 50, calls
