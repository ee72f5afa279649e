"""``NanGuard`` in the Fabric loops people really write: one process, real ``lightning.Fabric`` on CPU.

``test_fabric.py`` covers the loop of Fabric's docs. These are the variations around it: the model set
up with ``setup_module``/``setup_optimizers`` (LitGPT's LoRA recipe), loaders set up before the model
(LitGPT's fine-tuning recipes), a validation loop between training steps, mixed precision, two models
with two optimizers (a GAN), ``fabric.save`` of a state holding a watched loader, and
``sync_free=True`` with an optimizer that cannot skip on the device.

The model normalises its input (``x / ||x||``): an all-zero record makes the step that holds it NaN.
Every dataset carries its records' indices as a last column the loss ignores, so a test reads which
records each step drew from the batch itself (a shuffled loader's indices are not its positions).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.plugins import MixedPrecision
from states import clone_state, states_equal
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, TensorDataset

from lightning_nanguard import NanEvent, NanGuard

RECORDS = 32
BATCH = 8
BAD_RECORDS = (5, 21)  # all-zero records: 0/0 in the forward


class Normalised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x / x.norm(dim=-1, keepdim=True)  # NaN for an all-zero record
        return self.l2(torch.relu(self.l1(x))).squeeze(-1)


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    """MSE in float32 (under autocast the output is bf16/fp16); the batch's index column is ignored."""
    x, y = batch[0], batch[1]
    return nn.functional.mse_loss(model(x).float(), y)


def _dataset(bad: tuple[int, ...] = BAD_RECORDS, records: int = RECORDS, seed: int = 1) -> TensorDataset:
    """``(x, y, index)`` records; the records in ``bad`` are all zeros."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(records, 4, generator=g), torch.randn(records, generator=g)
    x[list(bad)] = 0.0
    return TensorDataset(x, y, torch.arange(records))


def _shuffled(dataset: TensorDataset) -> DataLoader:
    return DataLoader(dataset, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(1))


@dataclass
class Run:
    """What a training loop saw: the weights around each optimizer step and the records of each step."""

    before: list[dict[str, torch.Tensor]] = field(default_factory=list)  # the weights before step i
    after: list[dict[str, torch.Tensor]] = field(default_factory=list)  # the weights after step i
    records: list[list[int]] = field(default_factory=list)  # the dataset indices step i drew

    def skipped(self) -> list[int]:
        """The steps that left the weights bitwise as they were."""
        return [i for i, (a, b) in enumerate(zip(self.before, self.after, strict=True)) if states_equal(a, b)]

    def expected(self, bad: tuple[int, ...] = BAD_RECORDS) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
        """``(step, positions, dataset indices)`` of every step that drew a bad record."""
        found = []
        for step, records in enumerate(self.records):
            positions = tuple(p for p, record in enumerate(records) if record in bad)
            if positions:
                found.append((step, positions, tuple(records[p] for p in positions)))
        return found


def _train(
    fabric: L.Fabric,
    model: Any,
    optimizer: Any,
    loader: Any,
    module: nn.Module,
    between: Callable[[], None] | None = None,
    clip: bool = True,
) -> Run:
    """One epoch of the docs' loop; ``between()`` runs after every optimizer step (a validation loop)."""
    run = Run()
    for batch in loader:
        run.records.append(batch[2].tolist())
        run.before.append(clone_state(module.state_dict()))
        fabric.backward(loss_fn(model, batch))
        if clip:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        run.after.append(clone_state(module.state_dict()))
        if between is not None:
            between()
    return run


def _finite(*modules: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for module in modules for p in module.parameters())


def _named(events: list[NanEvent]) -> list[tuple[int, tuple[int, ...] | None, tuple[int, ...] | None]]:
    return [(e.global_step, e.offending_samples, e.dataset_indices) for e in events]


@pytest.fixture(autouse=True)
def _events_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NANGUARD_DIR", str(tmp_path))


# ------------------------------------------------------------------------------------ setup_module


def test_setup_module_and_setup_optimizers_are_guarded() -> None:
    """No ``fabric.setup``: ``setup_module`` takes hold; the bad steps are dropped bitwise, the others applied."""
    guard = NanGuard(verbose=False, loss_fn=loss_fn, save_repro=False)
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[guard])
    module = Normalised()
    model = fabric.setup_module(module)
    assert type(fabric.strategy).__name__ == "NanGuardSingleDeviceStrategy"  # held before any optimizer
    optimizer = fabric.setup_optimizers(torch.optim.SGD(module.parameters(), lr=0.1))
    loader = fabric.setup_dataloaders(DataLoader(_dataset(), batch_size=BATCH))
    run = _train(fabric, model, optimizer, loader, module)

    assert run.expected() == [(0, (5,), (5,)), (2, (5,), (21,))]
    assert [(e.global_step, e.action, e.kinds) for e in guard.events] == [
        (0, "skipped", ("loss", "grad")),
        (2, "skipped", ("loss", "grad")),
    ]
    assert _named(guard.events) == [(0, (5,), (5,)), (2, (5,), (21,))]
    assert run.skipped() == [0, 2]  # bitwise unchanged across the bad steps; steps 1 and 3 did train
    assert _finite(module) and guard.counters.skipped_total == 2 and guard.active


# ------------------------------------------------------------------------------------ loaders before the model


def test_loaders_set_up_before_the_model_name_the_dataset_indices() -> None:
    """LitGPT's order: ``setup_dataloaders`` first. The shuffled loader's records are named, not positions."""
    guard = NanGuard(verbose=False, loss_fn=loss_fn, save_repro=False)
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[guard])
    loader = fabric.setup_dataloaders(_shuffled(_dataset()))
    module = Normalised()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    run = _train(fabric, model, optimizer, loader, module)

    expected = run.expected()
    assert len(expected) == 2 and any(positions != indices for _, positions, indices in expected)  # shuffled
    assert _named(guard.events) == expected
    assert all((e.action, e.cause, e.indices_verified) == ("skipped", "data", True) for e in guard.events)
    assert run.skipped() == [step for step, _, _ in expected]
    assert _finite(module)


# ------------------------------------------------------------------------------------ a validation loop


VALIDATION_ZEROS = (2, 9)  # validation records that are all zeros too (NaN validation losses)


@pytest.mark.parametrize("loaders_first", [False, True], ids=["model-first", "loaders-first"])
def test_a_validation_loop_between_steps_is_never_blamed(loaders_first: bool) -> None:
    """A validation loop under ``torch.no_grad()`` after every step: its NaN batches are not training's."""
    guard = NanGuard(verbose=False, loss_fn=loss_fn, save_repro=False)
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[guard])
    train_data, val_data = _shuffled(_dataset()), DataLoader(_dataset(VALIDATION_ZEROS, records=16, seed=2), 8)
    module = Normalised()
    if loaders_first:  # both in one call, before the model
        train, val = fabric.setup_dataloaders(train_data, val_data)
        model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    else:
        model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
        train, val = fabric.setup_dataloaders(train_data, val_data)
    val_losses: list[float] = []

    def validate() -> None:
        with torch.no_grad():
            val_losses.extend(float(loss_fn(model, batch)) for batch in val)

    run = _train(fabric, model, optimizer, train, module, between=validate)

    assert len(val_losses) == 2 * len(run.records) and math.isnan(val_losses[0])  # validation saw its zeros
    expected = run.expected()
    assert len(expected) == 2 and _named(guard.events) == expected  # training's records, never validation's
    assert all(e.indices_verified for e in guard.events)
    assert {i for e in guard.events for i in e.dataset_indices or ()} == set(BAD_RECORDS)
    assert run.skipped() == [step for step, _, _ in expected]
    assert guard.counters.bad_steps_total == 2 and _finite(module)


# ------------------------------------------------------------------------------------ mixed precision


def test_bf16_mixed_a_bad_step_is_dropped_and_its_records_named() -> None:
    guard = NanGuard(verbose=False, loss_fn=loss_fn, save_repro=False)
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed", callbacks=[guard])
    module = Normalised()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    loader = fabric.setup_dataloaders(_shuffled(_dataset()))
    run = _train(fabric, model, optimizer, loader, module)

    expected = run.expected()
    assert len(expected) == 2 and _named(guard.events) == expected
    assert all((e.action, e.cause) == ("skipped", "data") for e in guard.events)
    assert run.skipped() == [step for step, _, _ in expected]
    assert _finite(module) and all(p.dtype == torch.float32 for p in module.parameters())
    assert guard.amp_overflow_total == 0


FP16_BAD_RECORD = 45  # batch 5 of 8: after the scale has come down from 65536
INIT_SCALE = 65536.0  # GradScaler's default: the first three steps overflow fp16 on this data


def _fp16_dataset() -> TensorDataset:
    """Positive inputs and far negative targets: the scaled gradients overflow fp16 (to +Inf) at first."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(64, 4, generator=g) + 0.5, torch.full((64,), -4.0)
    x[FP16_BAD_RECORD] = 0.0
    return TensorDataset(x, y, torch.arange(64))


def _fp16_run(fabric: L.Fabric, guard: NanGuard) -> tuple[Run, nn.Module]:
    module = Normalised()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=1e-3))
    loader = fabric.setup_dataloaders(DataLoader(_fp16_dataset(), batch_size=BATCH))
    # the guard unscales before its check, as the Trainer's precision plugin does: a dropped step's
    # scaler.step still finds the inf checks (it raised "No inf checks were recorded" before that)
    return _train(fabric, model, optimizer, loader, module, clip=False), module


def _assert_fp16(run: Run, module: nn.Module, guard: NanGuard, scaler: torch.amp.GradScaler) -> None:
    assert _named(guard.events) == [(5, (5,), (FP16_BAD_RECORD,))]  # the data's NaN: an event
    assert (guard.events[0].action, guard.events[0].cause) == ("skipped", "data")
    assert guard.amp_overflow_total == 3  # the overflows: the GradScaler's, counted, not events
    assert run.skipped() == [0, 1, 2, 5]  # three overflow steps skipped by the scaler, the NaN step by the guard
    assert scaler.get_scale() in (INIT_SCALE / 8, INIT_SCALE / 16)  # (the dropped NaN step may back it off too)
    assert _finite(module) and guard.counters.skipped_total == 1


def test_fp16_with_a_grad_scaler_on_cpu_overflow_is_counted_a_nan_is_an_event() -> None:
    """A real GradScaler on CPU (Fabric turns ``precision="16-mixed"`` into bf16 there: the plugin is explicit)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    guard = NanGuard(verbose=False, loss_fn=loss_fn, save_repro=False)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin], callbacks=[guard])
    run, module = _fp16_run(fabric, guard)
    _assert_fp16(run, module, guard, scaler)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_16_mixed_overflow_is_counted_a_nan_is_an_event() -> None:
    """``precision="16-mixed"`` on CUDA: Fabric's own GradScaler."""
    guard = NanGuard(verbose=False, loss_fn=loss_fn, save_repro=False)
    fabric = L.Fabric(accelerator="cuda", devices=1, precision="16-mixed", callbacks=[guard])
    scaler = fabric._precision.scaler  # type: ignore[attr-defined]
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.get_scale() == INIT_SCALE
    run, module = _fp16_run(fabric, guard)
    _assert_fp16(run, module, guard, scaler)


# ------------------------------------------------------------------------------------ two models (a GAN)


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 4)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(z))


class Discriminator(Normalised):
    """Normalises its input: a real all-zero record gives NaN in the discriminator's step only."""


def test_two_models_a_nan_in_the_discriminator_drops_its_update_only() -> None:
    guard = NanGuard(verbose=False, save_repro=False)
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[guard])
    gen, disc = Generator(), Discriminator()
    generator, opt_g = fabric.setup(gen, torch.optim.SGD(gen.parameters(), lr=0.1))
    discriminator, opt_d = fabric.setup(disc, torch.optim.SGD(disc.parameters(), lr=0.1))
    loader = fabric.setup_dataloaders(DataLoader(_dataset(), batch_size=BATCH))
    bce = nn.functional.binary_cross_entropy_with_logits
    ones, zeros = torch.ones(BATCH), torch.zeros(BATCH)
    noise = torch.Generator().manual_seed(3)
    d_kept, g_kept = [], []  # per iteration: whether the discriminator's / generator's update was applied
    for real, _, _ in loader:
        fake = generator(torch.randn(BATCH, 2, generator=noise))
        before = clone_state(disc.state_dict())
        opt_d.zero_grad()
        fabric.backward(bce(discriminator(real), ones) + bce(discriminator(fake.detach()), zeros))
        opt_d.step()
        d_kept.append(not states_equal(before, disc.state_dict()))
        before = clone_state(gen.state_dict())
        opt_g.zero_grad()
        fabric.backward(bce(discriminator(fake), ones))
        opt_g.step()
        g_kept.append(not states_equal(before, gen.state_dict()))

    assert d_kept == [False, True, False, True]  # real batches 0 and 2 hold records 5 and 21
    assert g_kept == [True, True, True, True]  # the generator trains on through the discriminator's NaN
    assert [(e.global_step, e.action) for e in guard.events] == [(0, "skipped"), (4, "skipped")]  # D steps: even
    for event in guard.events:
        assert event.nonfinite_grads and all(name.startswith("discriminator.") for name in event.nonfinite_grads)
        assert "grad" in event.kinds
    assert _finite(gen, disc) and guard.counters.skipped_total == 2


def test_two_models_the_loss_fn_gets_the_stepped_model_and_optimizer_and_names_the_record() -> None:
    """``loss_fn(model, batch, optimizer)``: the discriminator's step re-runs the discriminator's loss."""
    seen: list[tuple[str, bool]] = []
    gen, disc = Generator(), Discriminator()
    opt_d_raw = torch.optim.SGD(disc.parameters(), lr=0.1)

    def gan_loss(model: nn.Module, batch: Any, optimizer: Any) -> torch.Tensor:
        seen.append((type(model).__name__, optimizer is opt_d_raw))
        real = batch[0]
        ones = torch.ones(real.shape[0])
        return nn.functional.binary_cross_entropy_with_logits(model(real), ones)  # the real half of D's loss

    guard = NanGuard(verbose=False, save_repro=False, loss_fn=gan_loss)
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[guard])
    generator, opt_g = fabric.setup(gen, torch.optim.SGD(gen.parameters(), lr=0.1))
    discriminator, opt_d = fabric.setup(disc, opt_d_raw)
    loader = fabric.setup_dataloaders(DataLoader(_dataset(), batch_size=BATCH))
    bce = nn.functional.binary_cross_entropy_with_logits
    noise = torch.Generator().manual_seed(3)
    for real, _, _ in loader:
        fake = generator(torch.randn(BATCH, 2, generator=noise))
        opt_d.zero_grad()
        fabric.backward(
            bce(discriminator(real), torch.ones(BATCH)) + bce(discriminator(fake.detach()), torch.zeros(BATCH))
        )
        opt_d.step()
        opt_g.zero_grad()
        fabric.backward(bce(discriminator(fake), torch.ones(BATCH)))
        opt_g.step()
    # Fabric numbers the optimizers in the order they first step: the discriminator steps first
    assert [(e.global_step, e.optimizer, e.dataset_indices) for e in guard.events] == [(0, 0, (5,)), (4, 0, (21,))]
    assert seen and set(seen) == {("Discriminator", True)}  # only the discriminator's steps were re-run
    assert _finite(gen, disc)


# ------------------------------------------------------------------------------------ fabric.save


def test_fabric_save_of_a_watched_loader_pickles_the_plain_dataloader(tmp_path: Path) -> None:
    guard = NanGuard(verbose=False, loss_fn=loss_fn, save_repro=False)
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[guard])
    module = Normalised()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    loader: Any = fabric.setup_dataloaders(DataLoader(_dataset(), batch_size=BATCH))
    inner = loader._dataloader
    assert type(inner).__name__ == "NanGuardDataLoader"  # watched (the guard swapped its class)
    assert type(inner.batch_sampler).__name__ != "BatchSampler"  # recording its indices

    run = Run()
    for step, batch in enumerate(loader):
        run.records.append(batch[2].tolist())
        run.before.append(clone_state(module.state_dict()))
        fabric.backward(loss_fn(model, batch))
        optimizer.step()
        optimizer.zero_grad()
        run.after.append(clone_state(module.state_dict()))
        if step == 1:  # mid-epoch, between the two bad steps
            fabric.save(tmp_path / "run.ckpt", {"model": model, "optimizer": optimizer, "loader": loader})

    saved = torch.load(tmp_path / "run.ckpt", weights_only=False)
    restored = saved["loader"]
    assert type(restored) is DataLoader and type(restored.batch_sampler) is BatchSampler
    assert not [k for k in vars(restored) if "nanguard" in k] and not [
        k for k in vars(restored.batch_sampler) if "nanguard" in k
    ]
    assert [b[2].tolist() for b in restored] == run.records  # it loads and iterates as the original
    assert states_equal(saved["model"], run.after[1])
    # the live loader is still watched after the save: the second bad step is named too
    assert _named(guard.events) == [(0, (5,), (5,)), (2, (5,), (21,))]
    assert run.skipped() == [0, 2] and _finite(module)


# ------------------------------------------------------------------------------------ sync_free


@pytest.mark.parametrize("fused", [False, True], ids=["adam", "fused-adam"])
def test_sync_free_with_setup_optimizers_warns_about_an_optimizer_it_cannot_skip_in(
    fused: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A non-fused Adam cannot skip on the device: one warning naming ``sync_free=True``; the steps are still
    dropped (its flag read to the host). A fused Adam draws no warning."""
    guard = NanGuard(verbose=False, sync_free=True, save_repro=False)
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[guard])
    module = Normalised()
    model = fabric.setup_module(module)
    optimizer: Any = fabric.setup_optimizers(torch.optim.Adam(module.parameters(), lr=1e-2, fused=fused))
    loader = fabric.setup_dataloaders(DataLoader(_dataset(), batch_size=BATCH))
    with caplog.at_level(logging.WARNING, logger="lightning_nanguard"):
        run = _train(fabric, model, optimizer, loader, module, clip=False)

    notices = [r.getMessage() for r in caplog.records if "sync_free=True" in r.getMessage()]
    if fused:
        assert notices == []
    else:
        assert len(notices) == 1 and notices[0].startswith("NanGuard(sync_free=True): Adam is not fused")
    assert [(e.global_step, e.action) for e in guard.events] == [(0, "skipped"), (2, "skipped")]
    assert run.skipped() == [0, 2] and _finite(module)
    assert int(optimizer.state_dict()["state"][0]["step"]) == 2  # Adam counted the two applied steps only


def test_fp16_clip_gradients_after_the_guard_unscaled_does_not_unscale_twice() -> None:
    """``fabric.clip_gradients`` unscales too: after the guard's own unscale it must not raise, and clips."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)  # no overflow: only the data's NaN
    guard = NanGuard(verbose=False, loss_fn=loss_fn, save_repro=False)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin], callbacks=[guard])
    module = Normalised()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=1e-3))
    loader = fabric.setup_dataloaders(DataLoader(_fp16_dataset(), batch_size=BATCH))
    norms: list[float] = []
    for batch in loader:
        fabric.backward(loss_fn(model, batch))
        norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=1.0)))
        optimizer.step()
        optimizer.zero_grad()
    assert _named(guard.events) == [(5, (5,), (FP16_BAD_RECORD,))]
    assert norms[5] == 0.0 and all(math.isfinite(n) and n > 0 for i, n in enumerate(norms) if i != 5)
    assert guard.amp_overflow_total == 0 and _finite(module)


def test_lbfgs_with_a_closure_is_checked_after_the_closure_and_its_bad_step_undone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``optimizer.step(closure)``: the gradients exist only once the closure ran; a bad LBFGS step is undone."""
    torch.manual_seed(0)
    guard = NanGuard(verbose=False, save_repro=False)
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[guard])
    module = Normalised()
    model = fabric.setup_module(module)
    optimizer = fabric.setup_optimizers(torch.optim.LBFGS(module.parameters(), lr=0.1, max_iter=3))
    loader = fabric.setup_dataloaders(DataLoader(_dataset(), batch_size=BATCH))
    with caplog.at_level(logging.WARNING, logger="lightning_nanguard"):
        for batch in loader:
            before, seen = [p.detach().clone() for p in module.parameters()], len(guard.events)

            def closure(batch: Any = batch) -> torch.Tensor:
                optimizer.zero_grad()
                loss = loss_fn(model, batch)
                fabric.backward(loss)
                return loss

            optimizer.step(closure)
            if len(guard.events) > seen:  # this step was bad: it left the weights as they were
                assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
    # steps 0 and 2 hold records 5 and 21: each reported once (for its many closure evaluations) and undone,
    # so the weights stay finite and the other steps are healthy
    assert [(e.global_step, e.action) for e in guard.events] == [(0, "skipped"), (2, "skipped")]
    assert guard.events[0].kinds[:1] == ("loss",)
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert "LBFGS" not in caplog.text  # nothing left to warn about


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sync_free_fabric_steps_never_synchronise_on_a_healthy_step(caplog: pytest.LogCaptureFixture) -> None:
    """``sync_free=True`` in a Fabric loop: backward and optimizer step under ``set_sync_debug_mode("error")``.

    The batches sit on the GPU already (no host copy in the loop), the optimizer is fused SGD and the
    loop does not clip (``clip_grad_norm_`` reads its norm to the host). A synchronising call inside the
    guard would disable it ("internal error"); one in the loop would raise here. The first two steps
    are left out: they allocate the pinned host buffer and take the reference sample.
    """
    torch.manual_seed(0)
    guard = NanGuard(verbose=False, sync_free=True, check_params_every_n_steps=0, save_repro=False)
    fabric = L.Fabric(accelerator="cuda", devices=1, callbacks=[guard])
    module = Normalised()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.01, fused=True))
    x, y = torch.randn(12, BATCH, 4, device=fabric.device), torch.randn(12, BATCH, device=fabric.device)
    with caplog.at_level(logging.WARNING, logger="lightning_nanguard"):
        for step in range(12):
            torch.cuda.set_sync_debug_mode("error" if step >= 2 else "default")
            try:
                fabric.backward(nn.functional.mse_loss(model(x[step]), y[step]))
                optimizer.step()
                optimizer.zero_grad()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert guard.active and guard.events == [], caplog.text
    assert "internal error" not in caplog.text
