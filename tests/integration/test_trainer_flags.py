"""Trainer flags and calls that change the step or the loop: under each, a NaN at a known step is skipped.

Each test runs a real ``Trainer`` with ``NanGuard(verbose=False)`` on :mod:`flag_models`' BatchNorm
regression (64 samples, batches of 8, no shuffling: sample ``i`` is in batch ``i // 8`` at position
``i % 8``) with a NaN in known samples, and checks:

- the bad step is skipped: the weights, BatchNorm buffers and Adam state are bitwise the same before and
  after it, and the whole run equals, bit for bit and step by step, a reference run with no guard in
  which :class:`~flag_models.HandSkip` dropped that step's update by hand. The reference has no guard,
  so this equality also shows that the guard changed none of the healthy steps around the bad one;
- a healthy run (no NaN) with the guard equals one without, bit for bit (:func:`_check_flag`);
- the event names the right step, batch, position and dataset index;
- the flag still does what it does (validation at the same points, the run ends at the same step...).

Gradient accumulation, AMP overflows and DDP decisions have their own files (``test_accumulation.py``,
``test_amp.py``, ``test_ddp.py``); checkpoint round trips of the guard's state are in
``tests/trainer/test_callback.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fitting
import lightning.pytorch as pl
import pytest
import torch
from fitting import StepRecorder, build_trainer
from flag_models import (
    BATCH_SIZE,
    N_SAMPLES,
    HandSkip,
    ValidationPoints,
    flag_module,
    model_state,
    nan_data,
    nan_loader,
)
from launcher import launch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from states import states_equal
from torch.utils.data import DataLoader

from lightning_nanguard import NanGuard, read_events
from lightning_nanguard.engine.failure import UnguardableSetupError

Loader = Callable[[tuple[int, ...]], DataLoader]


def compat(feature: str, note: str) -> pytest.MarkDecorator:
    """The compatibility row (docs/guide/compatibility.md) of a Trainer flag or call that works with the guard."""
    return pytest.mark.compat(feature=feature, kind="flag", status="works", note=note)


# ------------------------------------------------------------------------------------ running and comparing


@dataclass
class Run:
    """One finished ``fit``: its Trainer and module, per-step states, validation points, guard or hand skip."""

    trainer: Any
    module: Any
    steps: StepRecorder
    points: ValidationPoints
    guard: NanGuard | None
    hand: HandSkip | None

    @property
    def state(self) -> dict[str, Any]:
        return model_state(self.module, self.trainer.optimizers[0] if self.trainer.optimizers else None)

    def unchanged_steps(self) -> list[int]:
        """Global steps whose batch left weights, buffers and optimizer state bitwise as they were."""
        return [r.global_step for r in self.steps.records if r.unchanged()]

    def per_step(self) -> list[dict[str, torch.Tensor]]:
        return _after_each_step(self.steps)

    def events(self) -> list[tuple[Any, ...]]:
        """``(global_step, epoch, batch_idx, offending_samples, dataset_indices, action)`` of each event."""
        assert self.guard is not None
        return [
            (e.global_step, e.epoch, e.batch_idx, e.offending_samples, e.dataset_indices, e.action)
            for e in self.guard.events
        ]


def _fit(
    root: Path,
    callback: Any,
    train: DataLoader | None,
    val: DataLoader | None = None,
    module: Any = None,
    extra_callbacks: Iterable[Any] = (),
    **flags: Any,
) -> Run:
    steps, points = StepRecorder(), ValidationPoints()
    guard = callback if isinstance(callback, NanGuard) else None
    others = [c for c in (callback, steps, points, *extra_callbacks) if c is not None and c is not guard]
    module = module if module is not None else flag_module()
    trainer, _ = fitting.fit(module, train, val, root=root, guard=guard, callbacks=others, require_active=True, **flags)
    return Run(trainer, module, steps, points, guard, callback if isinstance(callback, HandSkip) else None)


def _check_flag(
    tmp_path: Path,
    nan_at: tuple[int, ...],
    skipped: Iterable[int],
    *,
    loader: Loader | None = nan_loader,
    val: Callable[[], DataLoader] | None = None,
    module: Callable[[], Any] = flag_module,
    reference_module: Callable[[], Any] | None = None,
    extra: Callable[[], Iterable[Any]] = tuple,
    per_fit: Callable[[], dict[str, Any]] = dict,
    healthy: bool = True,
    **flags: Any,
) -> tuple[Run, Run]:
    """Fit with the guard and with :class:`HandSkip` at ``skipped`` (NaN at ``nan_at``); both must be equal.

    ``loader=None``: the module's own ``train_dataloader``. ``reference_module``: the module of the
    hand-skipped run, when it is not ``module``. ``extra``: more callbacks, ``per_fit``: more Trainer
    arguments, new for each fit. ``healthy``: also fit without any NaN, with and without the guard, and
    require bitwise equality.
    """
    skipped = sorted(skipped)

    def fit(name: str, callback: Any, nan: tuple[int, ...], make: Callable[[], Any] = module) -> Run:
        train = loader(nan) if loader is not None else None
        return _fit(tmp_path / name, callback, train, val() if val else None, make(), extra(), **flags, **per_fit())

    guarded = fit("guarded", NanGuard(verbose=False), nan_at)
    reference = fit("reference", HandSkip(skipped), nan_at, reference_module or module)
    assert reference.hand is not None and reference.hand.skipped == skipped  # the reference did skip those steps
    assert guarded.unchanged_steps() == reference.unchanged_steps() == skipped
    assert states_equal(guarded.per_step(), reference.per_step()), "a step differs from the hand-skipped run"
    assert states_equal(guarded.state, reference.state)
    assert guarded.points.points == reference.points.points
    assert guarded.points.train_batches == reference.points.train_batches
    assert guarded.trainer.global_step == reference.trainer.global_step
    assert guarded.guard is not None and guarded.guard.skipped_total == len(skipped)
    assert _finite(guarded.module)
    if healthy:
        clean_guarded = fit("healthy_guarded", NanGuard(verbose=False), ())
        clean = fit("healthy", None, ())
        assert clean_guarded.guard is not None and clean_guarded.guard.events == []
        assert states_equal(clean_guarded.per_step(), clean.per_step())
        assert states_equal(clean_guarded.state, clean.state), "the guard changed a healthy run"
    return guarded, reference


def _finite(module: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in module.state_dict().values() if t.is_floating_point())


def _val_losses_equal(a: Run, b: Run) -> bool:
    return len(a.module.val_losses) > 0 and states_equal(a.module.val_losses, b.module.val_losses)


def _permuted_loader(nan_at: tuple[int, ...], epoch: int = 0, stride: int = 37) -> DataLoader:
    """Epoch ``epoch``'s data (its own values) read in a fixed non-trivial order (a plain list as the sampler)."""
    return DataLoader(nan_data(nan_at, seed=epoch), batch_size=BATCH_SIZE, sampler=_order(epoch, stride))


def _order(epoch: int, stride: int = 37) -> list[int]:
    return [(i * stride + 5 * epoch) % N_SAMPLES for i in range(N_SAMPLES)]  # a permutation: stride is odd


def _where(index: int, epoch: int = 0) -> tuple[int, int]:
    """``(batch_idx, position)`` of dataset index ``index`` in :func:`_order`'s epoch ``epoch``."""
    return divmod(_order(epoch).index(index), BATCH_SIZE)


# ------------------------------------------------------------------------------------ validation schedule


@compat("val_check_interval", "mid-epoch validation runs at the same steps and sees the skipped step's weights")
@pytest.mark.parametrize(("interval", "points"), [(3, [(0, 3), (0, 6)]), (0.5, [(0, 4), (0, 8)])])
def test_val_check_interval(tmp_path: Path, interval: float, points: list[tuple[int, int]]) -> None:
    """The NaN is in the batch right before a mid-epoch validation (sample 19: step 2; sample 27: step 3)."""
    nan_at, step = ((19,), 2) if interval == 3 else ((27,), 3)
    guarded, reference = _check_flag(
        tmp_path, nan_at, [step], val=lambda: nan_loader(n=16), val_check_interval=interval
    )
    assert guarded.events() == [(step, 0, step, (3,), nan_at, "skipped")]
    assert guarded.points.points == points
    assert [s for sanity, s in guarded.module.validated] == [s for _, s in points]
    assert _val_losses_equal(guarded, reference)
    assert all(torch.isfinite(loss) for loss in guarded.module.val_losses)


@compat("check_val_every_n_epoch", "validation every 2nd epoch unchanged; the NaN of every epoch skipped")
def test_check_val_every_n_epoch(tmp_path: Path) -> None:
    """Four batches an epoch, sample 11 (batch 1) is NaN in every epoch: steps 1, 5, 9, 13."""
    guarded, reference = _check_flag(
        tmp_path,
        (11,),
        [1, 5, 9, 13],
        loader=lambda nan: nan_loader(nan, n=32),
        val=lambda: nan_loader(n=16),
        check_val_every_n_epoch=2,
        max_epochs=4,
    )
    assert guarded.events() == [(s, s // 4, 1, (3,), (11,), "skipped") for s in (1, 5, 9, 13)]
    assert guarded.points.points == [(1, 8), (3, 16)]
    assert _val_losses_equal(guarded, reference)


# ------------------------------------------------------------------------------------ where the loop ends


@compat("limit_train_batches", "only the batches within the limit are checked; the NaN among them is skipped")
def test_limit_train_batches(tmp_path: Path) -> None:
    """Sample 19 (batch 2, the last one allowed) is NaN, and sample 43 (batch 5, never read)."""
    guarded, _ = _check_flag(tmp_path, (19, 43), [2, 5], limit_train_batches=3, max_epochs=2)
    assert guarded.events() == [(2, 0, 2, (3,), (19,), "skipped"), (5, 1, 2, (3,), (19,), "skipped")]
    assert guarded.points.train_batches == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert guarded.trainer.global_step == 6


@compat("max_steps", "a run ending mid-epoch on a bad step ends at max_steps with that step skipped")
def test_max_steps_ending_mid_epoch_on_the_bad_step(tmp_path: Path) -> None:
    """Sample 35 (batch 4) is NaN and ``max_steps=5``: the last step of the run is the bad one."""
    guarded, _ = _check_flag(tmp_path, (35,), [4], max_steps=5, max_epochs=-1)
    assert guarded.events() == [(4, 0, 4, (3,), (35,), "skipped")]
    assert guarded.trainer.global_step == 5  # a skipped step still counts toward max_steps
    assert guarded.points.train_batches == [(0, b) for b in range(5)]


class FakeClock(pl.Callback):
    """The clock of Lightning's ``Timer`` in a test: 0 at each ``fit``'s start, 10 s more at every training batch."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def on_fit_start(self, *args: Any) -> None:
        self.now = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self.now += 10.0


@compat("max_time", "the run still ends at the step where max_time runs out; the NaN before it is skipped")
def test_max_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each batch takes 10 s of a fake clock: with ``max_time`` 45 s Lightning's Timer stops after 5 batches.

    The clock is fake so that the stop is exact however long the guard's diagnosis takes.
    """
    import lightning.pytorch.callbacks.timer as timer_module

    clock = FakeClock()
    monkeypatch.setattr(timer_module, "time", clock)  # the Timer's `time.monotonic()`
    guarded, _ = _check_flag(tmp_path, (27,), [3], extra=lambda: [clock], max_time={"seconds": 45}, max_epochs=3)
    assert guarded.events() == [(3, 0, 3, (3,), (27,), "skipped")]
    assert guarded.trainer.global_step == 5  # 50 s >= 45 s after the fifth batch
    assert guarded.points.train_batches == [(0, b) for b in range(5)]


@compat("overfit_batches", "the repeated batches keep their dataset indices (Lightning's unshuffled sampler)")
def test_overfit_batches(tmp_path: Path) -> None:
    """A shuffling loader: Lightning turns the shuffle off; batch 1 (sample 11 NaN) comes back every epoch."""
    guarded, _ = _check_flag(
        tmp_path, (11,), [1, 3, 5], loader=lambda nan: nan_loader(nan, shuffle=True), overfit_batches=2, max_epochs=3
    )
    assert guarded.events() == [(s, s // 2, 1, (3,), (11,), "skipped") for s in (1, 3, 5)]
    assert guarded.points.train_batches == [(e, b) for e in range(3) for b in range(2)]


@compat("fast_dev_run", "the few batches of a dev run are guarded; validation still runs once at the end")
def test_fast_dev_run(tmp_path: Path) -> None:
    guarded, reference = _check_flag(tmp_path, (11,), [1], val=lambda: nan_loader(n=32), fast_dev_run=3)
    assert guarded.events() == [(1, 0, 1, (3,), (11,), "skipped")]
    assert guarded.trainer.global_step == 3
    assert guarded.points.points == [(0, 3)]
    assert len(guarded.module.val_losses) == 3  # fast_dev_run=3 limits validation to 3 batches too
    assert _val_losses_equal(guarded, reference)


@compat("num_sanity_val_steps", "with or without the sanity check, a NaN in the very first step is skipped")
@pytest.mark.parametrize("sanity_steps", [0, 2])
def test_num_sanity_val_steps(tmp_path: Path, sanity_steps: int) -> None:
    """Sample 3 (batch 0: global step 0, before any update) is NaN."""
    guarded, reference = _check_flag(
        tmp_path, (3,), [0], val=lambda: nan_loader(n=32), num_sanity_val_steps=sanity_steps
    )
    assert guarded.events() == [(0, 0, 0, (3,), (3,), "skipped")]
    assert guarded.module.validated == [(True, 0)] * bool(sanity_steps) + [(False, 8)]
    assert len(guarded.module.val_losses) == sanity_steps + 4
    assert _val_losses_equal(guarded, reference)


# ------------------------------------------------------------------------------------ which data


@compat("reload_dataloaders_every_n_epochs", "each reloaded loader's own order and data name the right index")
def test_reload_dataloaders_every_n_epochs(tmp_path: Path) -> None:
    """A new dataset and order each epoch (from the module's ``train_dataloader``); NaN at 21 in epoch 1, 50 in 2.

    Indices kept from the loader of the epoch before would name other samples (the order changes).
    """
    nan_by_epoch = {0: (), 1: (21,), 2: (50,)}

    def module() -> Any:
        return flag_module(train_loader=lambda epoch: _permuted_loader(nan_by_epoch[epoch], epoch))

    expected = []
    for epoch, (index,) in ((1, (21,)), (2, (50,))):
        batch, position = _where(index, epoch)
        expected.append((8 * epoch + batch, epoch, batch, (position,), (index,), "skipped"))
    guarded, _ = _check_flag(
        tmp_path,
        (),
        [e[0] for e in expected],
        loader=None,
        module=module,
        healthy=False,  # the NaN comes with the module's loaders
        reload_dataloaders_every_n_epochs=1,
        max_epochs=3,
    )
    assert guarded.events() == expected
    assert guarded.module.loaders_built == [0, 1, 2]
    assert guarded.guard is not None and all(e.indices_verified for e in guarded.guard.events)


@compat("use_distributed_sampler=False", "the user's own sampler is kept and its order names the right index")
def test_use_distributed_sampler_false(tmp_path: Path) -> None:
    """A plain list as the sampler (a fixed permutation); Lightning leaves it alone. See ``test_ddp.py`` for DDP."""
    batch, position = _where(21)
    guarded, _ = _check_flag(tmp_path, (21,), [batch], loader=_permuted_loader, use_distributed_sampler=False)
    assert guarded.events() == [(batch, 0, batch, (position,), (21,), "skipped")]
    assert guarded.trainer.train_dataloader.sampler == _order(0)


# ------------------------------------------------------------------------------------ the step itself


class Grads(pl.Callback):
    """Every step's gradients before clipping (``on_before_optimizer_step``) and after the step (clipped)."""

    def __init__(self) -> None:
        self.before: list[list[torch.Tensor] | None] = []
        self.after: list[list[torch.Tensor] | None] = []

    @staticmethod
    def _grads(pl_module: Any) -> list[torch.Tensor] | None:
        grads = [p.grad.detach().clone() for p in pl_module.parameters() if p.grad is not None]
        return grads or None

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.before.append(self._grads(pl_module))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self.after.append(self._grads(pl_module))


def _check_clipping(tmp_path: Path, algorithm: str, clip: float) -> None:
    grads: list[Grads] = []

    def extra() -> list[Grads]:
        grads.append(Grads())
        return grads[-1:]

    guarded, _ = _check_flag(
        tmp_path,
        (11,),
        [1],
        reference_module=lambda: flag_module(clip_without_grads=False),
        extra=extra,
        gradient_clip_val=clip,
        gradient_clip_algorithm=algorithm,
    )
    assert guarded.events() == [(1, 0, 1, (3,), (11,), "skipped")]
    recorded = grads[0]  # the guarded run's
    assert recorded.after[1] is None  # the skipped step: no gradient reached the update
    for step in (0, *range(2, 8)):
        before, after = recorded.before[step], recorded.after[step]
        assert before is not None and after is not None
        if algorithm == "norm":
            size, clipped = (
                torch.stack([g.norm() for g in before]).norm(),
                torch.stack([g.norm() for g in after]).norm(),
            )
        else:
            size, clipped = max(g.abs().max() for g in before), max(g.abs().max() for g in after)
        assert size > clip and clipped <= clip * (1 + 1e-5), (step, float(size), float(clipped))  # clipping acted


@compat("gradient_clip_val", "norm clipping of the healthy steps unchanged; the bad step's NaN never reaches it")
def test_gradient_clip_val(tmp_path: Path) -> None:
    _check_clipping(tmp_path, "norm", 0.05)


@compat(
    'gradient_clip_algorithm="value"', "value clipping of the healthy steps unchanged; a skipped step is not clipped"
)
def test_gradient_clip_algorithm_value(tmp_path: Path) -> None:
    _check_clipping(tmp_path, "value", 0.01)


@pytest.mark.compat(
    feature="detect_anomaly=True",
    kind="flag",
    status="refused",
    note="anomaly mode raises inside the bad step's backward before a skip: refused when fit starts, with the fix",
)
def test_detect_anomaly_is_refused_at_setup(tmp_path: Path) -> None:
    """``detect_anomaly=True`` raises at the first NaN in a backward, before the guard can skip the step.

    So the combination is refused when ``fit`` starts, with a message naming the setting and the fix (the
    guard names the op and line of a bad step itself; anomaly mode also slows every healthy step).
    Without the refusal the fit crashed inside the bad step's backward with autograd's
    ``RuntimeError("Function 'MseLossBackward0' returned nan values in its 0th output.")``.
    """
    steps = StepRecorder()
    trainer = build_trainer("lightning", tmp_path, callbacks=[NanGuard(verbose=False), steps], detect_anomaly=True)
    with pytest.raises(UnguardableSetupError) as info:
        trainer.fit(flag_module(), nan_loader((11,)))
    message = str(info.value)
    assert "NanGuard" in message and "detect_anomaly=True" in message, message  # the user's setting
    assert "detect_anomaly=False" in message or "Remove detect_anomaly=True" in message, message  # the fix
    assert steps.records == []  # refused before the first step
    assert type(trainer.strategy).__name__ == "SingleDeviceStrategy"  # left as it was


@pytest.fixture
def torch_flags(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Put back the global torch flags that ``deterministic``/``benchmark`` set (Lightning never resets them)."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    benchmark = torch.backends.cudnn.benchmark
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # set by deterministic=True; restored after
    yield
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.backends.cudnn.benchmark = benchmark


@compat("deterministic=True", "the guard's checks and re-runs need no non-deterministic op; runs bitwise identical")
def test_deterministic(tmp_path: Path, torch_flags: Any) -> None:
    class Deterministic(pl.Callback):
        def __init__(self) -> None:
            self.enabled: list[bool] = []

        def on_train_batch_end(self, *args: Any) -> None:
            self.enabled.append(torch.are_deterministic_algorithms_enabled())

    flags: list[Deterministic] = []

    def extra() -> list[Deterministic]:
        flags.append(Deterministic())
        return flags[-1:]

    guarded, _ = _check_flag(tmp_path, (11,), [1], extra=extra, deterministic=True)
    assert guarded.events() == [(1, 0, 1, (3,), (11,), "skipped")]
    assert all(flag.enabled == [True] * 8 for flag in flags)


@compat("benchmark=True", "no effect on the guard (cuDNN autotuning only); skip and healthy runs as without it")
def test_benchmark(tmp_path: Path, torch_flags: Any) -> None:
    guarded, _ = _check_flag(tmp_path, (11,), [1], benchmark=True)
    assert guarded.events() == [(1, 0, 1, (3,), (11,), "skipped")]
    assert torch.backends.cudnn.benchmark


@compat("inference_mode=False", "validation still runs under no_grad (not inference mode) with the guard")
def test_inference_mode_false(tmp_path: Path) -> None:
    guarded, reference = _check_flag(
        tmp_path, (11,), [1], val=lambda: nan_loader(n=16), inference_mode=False, val_check_interval=2
    )
    assert guarded.events() == [(1, 0, 1, (3,), (11,), "skipped")]
    assert guarded.points.points == [(0, 2), (0, 4), (0, 6), (0, 8)]
    assert set(guarded.module.val_grad_modes) == {(False, False)}  # no_grad, not inference mode
    assert _val_losses_equal(guarded, reference)


@compat("barebones=True", "skip and diagnosis work with Lightning's logging, progress bar and summary all off")
def test_barebones(tmp_path: Path) -> None:
    quiet = {
        key: None
        for key in (
            "logger",
            "enable_progress_bar",
            "enable_model_summary",
            "enable_checkpointing",
            "log_every_n_steps",
        )
    }
    guarded, _ = _check_flag(
        tmp_path,
        (11,),
        [1],
        module=lambda: flag_module(log=False),  # self.log raises under barebones
        barebones=True,
        num_sanity_val_steps=None,
        **quiet,
    )
    assert guarded.trainer.barebones
    assert guarded.events() == [(1, 0, 1, (3,), (11,), "skipped")]


@compat('profiler="simple"', "every hook is profiled as often as without the guard; re-runs are no training_step")
def test_profiler_simple(tmp_path: Path) -> None:
    """The profiler's report is the same with and without the guard (its strategy's class name aside).

    At the incident the guard re-reads the offending record through the batch hooks (``verify_indices``):
    those hooks are the only ones profiled more often than in the hand-skipped run.
    """
    guarded, reference = _check_flag(tmp_path, (11,), [1], val=lambda: nan_loader(n=16), profiler="simple")
    assert guarded.events() == [(1, 0, 1, (3,), (11,), "skipped")]

    def actions(run: Run) -> dict[str, int]:
        """Action -> count, with the guard's strategy class and the callbacks' names made alike."""
        out: dict[str, int] = {}
        for name, durations in run.trainer.profiler.recorded_durations.items():
            name = name.replace("NanGuardSingleDeviceStrategy", "SingleDeviceStrategy")
            for callback in ("NanGuard", "HandSkip"):
                name = name.replace(f"[Callback]{callback}.", "[Callback]X.")
            out[name] = out.get(name, 0) + len(durations)
        return out

    healthy = [
        actions(_fit(tmp_path / name, callback, nan_loader(), nan_loader(n=16), profiler="simple"))
        for name, callback in (("healthy_guarded", NanGuard(verbose=False)), ("healthy", HandSkip([])))
    ]
    assert healthy[0] == healthy[1]
    bad, hand = actions(guarded), actions(reference)
    assert bad.keys() == hand.keys()
    transfer = {
        f"[LightningModule]FlagModule.{hook}"
        for hook in ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")
    }
    assert {name: bad[name] for name in bad.keys() - transfer} == {name: hand[name] for name in hand.keys() - transfer}
    assert len({bad[name] - hand[name] for name in transfer}) == 1 and bad[min(transfer)] > hand[min(transfer)]
    assert bad["[Strategy]SingleDeviceStrategy.training_step"] == 8  # the diagnosis's re-runs are not profiled steps
    assert bad["[Strategy]SingleDeviceStrategy.validation_step"] == 2


# ------------------------------------------------------------------------------------ precision


@pytest.mark.parametrize(
    ("precision", "plugin", "dtype"),
    [
        pytest.param(
            "64-true", "64-true", torch.float64, marks=compat('precision="64-true"', "float64 weights, checks, skip")
        ),
        pytest.param(
            "bf16-true", "bf16-true", torch.bfloat16, marks=compat('precision="bf16-true"', "bf16 weights and skip")
        ),
        pytest.param(
            "bf16-mixed",
            "bf16-mixed",
            torch.float32,
            marks=compat('precision="bf16-mixed"', "autocast; BatchNorm buffers restored, run equals a hand skip"),
        ),
        pytest.param(
            "16-mixed",
            "bf16-mixed",
            torch.float32,
            marks=compat('precision="16-mixed"', "on CPU Lightning runs it as bf16-mixed: skip as there"),
        ),
    ],
)
def test_precision(tmp_path: Path, precision: str, plugin: str, dtype: torch.dtype) -> None:
    guarded, _ = _check_flag(tmp_path, (11,), [1], precision=precision)
    assert guarded.trainer.precision_plugin.precision == plugin
    assert {p.dtype for p in guarded.module.parameters()} == {dtype}
    assert guarded.events() == [(1, 0, 1, (3,), (11,), "skipped")]


@compat('precision="16-mixed"', "with a GradScaler (MixedPrecision plugin): skip equals a hand skip, scale alike")
def test_16_mixed_with_a_grad_scaler(tmp_path: Path) -> None:
    """``plugins=[MixedPrecision("16-mixed", "cpu", scaler)]``: fp16 autocast and a real GradScaler on CPU.

    The scaler sees the NaN too and backs off by itself, in the guarded run as in the hand-skipped one.
    (GradScaler overflows, which are not incidents, are tested in ``test_amp.py``.)
    """
    scalers: list[torch.amp.GradScaler] = []

    def per_fit() -> dict[str, Any]:
        scalers.append(torch.amp.GradScaler("cpu", init_scale=1024.0))
        return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scalers[-1])]}

    guarded, _ = _check_flag(tmp_path, (11,), [1], per_fit=per_fit)
    assert guarded.events() == [(1, 0, 1, (3,), (11,), "skipped")]
    assert guarded.guard is not None and guarded.guard.amp_overflow_total == 0  # a NaN from the data: an incident
    assert [s.get_scale() for s in scalers] == [512.0, 512.0, 1024.0, 1024.0]  # guarded, reference, healthy x2


# ------------------------------------------------------------------------------------ calls on the Trainer


class StageProbe(pl.Callback):
    """The strategy class and the loader's batch sampler class when validation, test or prediction starts."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []

    def _probe(self, trainer: Any, stage: str, loaders: Any) -> None:
        self.seen.append((stage, type(trainer.strategy).__name__, type(loaders.batch_sampler).__name__))

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.training:  # trainer.validate, not the validation inside fit
            self._probe(trainer, "validate", trainer.val_dataloaders)

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._probe(trainer, "test", trainer.test_dataloaders)

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._probe(trainer, "predict", trainer.predict_dataloaders)


def _outputs(call: str, module: Any, returned: Any) -> Any:
    """What an evaluation call produced: the step losses it computed, or the predictions."""
    if call == "validate":
        return list(module.val_losses)
    if call == "test":
        return list(module.test_losses)
    return returned


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(
            name, marks=compat(f"trainer.{name}", "before and after fit, NaN in its data: no event, no change")
        )
        for name in ("validate", "test", "predict")
    ],
)
def test_evaluation_calls(tmp_path: Path, call: str) -> None:
    """``trainer.<call>`` on NaN data, then ``fit`` (a bad step), then ``<call>`` again, on one Trainer.

    The calls leave the guard, the model and the loaders alone, and give exactly what they give in the
    same session without a guard (whose fit skipped the bad step by hand).
    """

    def session(root: Path, callback: Any) -> tuple[Any, Any, list[Any], StageProbe]:
        probe = StageProbe()
        trainer = build_trainer("lightning", root, callbacks=[callback, probe])
        module, outputs = flag_module(), []
        for when in ("before", "fit", "after"):
            if when == "fit":
                trainer.fit(module, nan_loader((11,)))
                continue
            state = model_state(module)
            guard_state = callback.state_dict() if isinstance(callback, NanGuard) else None
            returned = getattr(trainer, call)(module, nan_loader((3, 20), n=24))
            outputs.append(_outputs(call, module, returned))
            assert states_equal(model_state(module), state), f"{call} ({when} fit) changed the model"
            if guard_state is not None:
                assert callback.state_dict() == guard_state, f"{call} ({when} fit) changed the guard's state"
        return trainer, module, outputs, probe

    guard = NanGuard(verbose=False)
    trainer, module, outputs, probe = session(tmp_path / "guarded", guard)
    _, reference_module, reference_outputs, reference_probe = session(tmp_path / "reference", HandSkip([1]))
    assert [(e.global_step, e.dataset_indices) for e in guard.events] == [(1, (11,))]  # the fit's, nothing more
    assert states_equal(outputs, reference_outputs)
    assert states_equal(model_state(module), model_state(reference_module))
    assert probe.seen == reference_probe.seen  # predict wraps the batch sampler its own way, with or without a guard
    assert [(stage, strategy) for stage, strategy, _ in probe.seen] == [(call, "SingleDeviceStrategy")] * 2
    assert not any(sampler.startswith("NanGuard") for _, _, sampler in probe.seen)  # not recording indices
    assert type(trainer.strategy).__name__ == "SingleDeviceStrategy"
    losses = outputs[1] if call != "predict" else [torch.cat(outputs[1])]
    assert any(bool(torch.isnan(loss).any()) for loss in losses)  # the NaN data did reach the call


@compat("trainer.fit (twice)", "a second fit on one Trainer is guarded again; counters and events carry on")
def test_fit_twice_on_one_trainer(tmp_path: Path) -> None:
    """Fit one epoch, raise ``max_epochs`` and fit again: the second fit trains epoch 1 with its own loader."""

    def session(root: Path, callback: Any) -> tuple[Any, Any, StepRecorder, list[str]]:
        steps = StepRecorder()
        trainer = build_trainer("lightning", root, callbacks=[callback, steps])
        module, strategies = flag_module(), []
        trainer.fit(module, nan_loader((11,)))
        strategies.append(type(trainer.strategy).__name__)
        trainer.fit_loop.max_epochs = 2
        trainer.fit(module, nan_loader((11, 43)))
        strategies.append(type(trainer.strategy).__name__)
        return trainer, module, steps, strategies

    guard = NanGuard(verbose=False)
    trainer, module, steps, strategies = session(tmp_path / "guarded", guard)
    reference_trainer, reference_module, reference_steps, _ = session(tmp_path / "reference", HandSkip([1, 9, 13]))
    assert [(e.global_step, e.epoch, e.batch_idx, e.offending_samples, e.dataset_indices) for e in guard.events] == [
        (1, 0, 1, (3,), (11,)),
        (9, 1, 1, (3,), (11,)),
        (13, 1, 5, (3,), (43,)),
    ]
    assert (guard.bad_steps_total, guard.skipped_total) == (3, 3)
    assert [r.global_step for r in steps.records if r.unchanged()] == [1, 9, 13]
    assert states_equal(_after_each_step(steps), _after_each_step(reference_steps))
    assert trainer.global_step == reference_trainer.global_step == 16
    assert states_equal(
        model_state(module, trainer.optimizers[0]), model_state(reference_module, reference_trainer.optimizers[0])
    )
    assert strategies == ["SingleDeviceStrategy"] * 2  # unwrapped after each fit


@compat('ckpt_path="last"', "resumed mid-epoch: counters and events carried over, the re-read data named right")
def test_ckpt_path_last_resumes_mid_epoch(tmp_path: Path) -> None:
    """Fit 4 steps (NaN at sample 11: step 1), then resume from ``"last"`` with a fresh guard to the epoch's end.

    Lightning resumes a non-resumable loader mid-epoch from its first batch while ``batch_idx`` goes on
    from 4 (it warns): step 5 reads batch 1 again, sample 11 among it, and the event names it.
    """

    def session(root: Path, make: Callable[[int], Any]) -> tuple[Any, Any, Any, StepRecorder]:
        first = make(0)
        trainer = build_trainer(
            "lightning", root, callbacks=[first, _last_checkpoint(root)], max_steps=4, enable_checkpointing=True
        )
        trainer.fit(flag_module(), nan_loader((11, 51)))
        second, steps = make(1), StepRecorder()
        trainer = build_trainer(
            "lightning", root, callbacks=[second, steps, _last_checkpoint(root)], enable_checkpointing=True
        )
        module = flag_module()
        trainer.fit(module, nan_loader((11, 51)), ckpt_path="last")
        return first, second, (trainer, module), steps

    first, resumed, (trainer, module), steps = session(tmp_path / "guarded", lambda _: NanGuard(verbose=False))
    _, _, (reference_trainer, reference_module), reference_steps = session(
        tmp_path / "reference", lambda fit: HandSkip([1] if fit == 0 else [5])
    )
    assert [(e.global_step, e.batch_idx, e.dataset_indices) for e in first.events] == [(1, 1, (11,))]
    assert [e.to_dict() for e in resumed.events[:1]] == [e.to_dict() for e in first.events]
    assert [(e.global_step, e.batch_idx, e.offending_samples, e.dataset_indices) for e in resumed.events[1:]] == [
        (5, 5, (3,), (11,))
    ]
    assert (resumed.bad_steps_total, resumed.skipped_total) == (2, 2)
    assert len(read_events(tmp_path / "guarded" / "nanguard" / "events.jsonl")) == 2
    assert [r.batch_idx for r in steps.records] == [4, 5, 6, 7]
    assert [r.global_step for r in steps.records if r.unchanged()] == [5]
    assert states_equal(_after_each_step(steps), _after_each_step(reference_steps))
    assert states_equal(
        model_state(module, trainer.optimizers[0]), model_state(reference_module, reference_trainer.optimizers[0])
    )


def _after_each_step(steps: StepRecorder) -> list[dict[str, torch.Tensor]]:
    return [r.params_after | r.buffers_after for r in steps.records]


def _last_checkpoint(root: Path) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=str(root / "checkpoints"), save_last=True, every_n_train_steps=2)


# ------------------------------------------------------------------------------------ sync_batchnorm (two processes)


@compat(
    "sync_batchnorm=True", "DDP on 2 ranks: both skip the step alike (diagnosis off, said once); bitwise = hand skip"
)
@pytest.mark.slow
def test_sync_batchnorm(tmp_path: Path) -> None:
    """Two gloo processes, each its own data; rank 1's sample 11 (step 1) is NaN, and the shared BatchNorm
    statistics carry it to rank 0 too. The run is compared, per step, with a hand-skipped one.

    torch runs SyncBatchNorm on GPUs only: the script lets it train on CPU with the same math through
    ``all_reduce`` (:func:`flag_models.cpu_sync_batchnorm`).
    """
    # a rank left alone in a collective would hang: the timeout turns it into a failure
    results = launch("flag_models.py", "syncbn", tmp_path, nprocs=2, out_dir=tmp_path, timeout=240).results()
    ranks = [results[r] for r in (0, 1)]
    for rank in ranks:
        guarded, reference = rank["guard"], rank["reference"]
        assert guarded["batchnorm"] == reference["batchnorm"] == "SyncBatchNorm"
        assert guarded["active"] and guarded["finite"] and guarded["global_step"] == 4
        assert guarded["unchanged"] == reference["unchanged"] == [1]
        assert guarded["hashes"] == reference["hashes"]  # every step bitwise as the hand-skipped run
        assert guarded["counters"] == [1, 1]
        (event,) = guarded["events"]  # the NaN reached both ranks through the shared statistics
        assert (event["global_step"], event["action"], event["offending_samples"]) == (1, "skipped", None)
        assert {"grad", "bn_stats"} <= set(event["kinds"])
        assert len(guarded["warnings"]) == 1 and "SyncBatchNorm" in guarded["warnings"][0]
        assert "bisection and localisation are off" in guarded["warnings"][0]
    assert ranks[0]["guard"]["hashes"] == ranks[1]["guard"]["hashes"]  # one model on both ranks, buffers included
