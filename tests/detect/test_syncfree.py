"""``lightning_nanguard.detect.syncfree``: skipping on the device, restoring by select, reading later.

CPU tests use torch's real fused optimizers (their CPU kernels honour ``found_inf`` like the CUDA
ones) and a real GradScaler; the pinned-memory, event and multi-device paths need CUDA. The blocks
wired into a real Trainer are tested in ``tests/integration/test_syncfree_blocks.py``.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from batchnorm_models import mlp_batch, mlp_with_batchnorm
from host_reads import HostReadCounter
from torch import Tensor, nn

from lightning_nanguard.detect.batchnorm import batchnorm_buffers, batchnorm_running_vars
from lightning_nanguard.detect.check import fused_health_check
from lightning_nanguard.detect.streaming import GradientCheck
from lightning_nanguard.detect.syncfree import (
    DeferredRead,
    DeviceSkip,
    SelectRestore,
    device_skip_unsupported,
    scaler_found_inf,
)

NONFINITE = pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "+inf", "-inf"])
FUSED = pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (torch.optim.Adam, {}),
        (torch.optim.AdamW, {"amsgrad": True, "weight_decay": 0.1}),
        (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
        (torch.optim.SGD, {}),
        (torch.optim.Adagrad, {}),
    ],
    ids=["Adam", "AdamW-amsgrad", "SGD-nesterov", "SGD", "Adagrad"],
)


_net, _batch = mlp_with_batchnorm, mlp_batch


def _equal(a: Any, b: Any) -> bool:
    """Bitwise equality of nested state (tensors compared by their bits, NaN == NaN)."""
    if isinstance(a, Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _state(net: nn.Module, opt: torch.optim.Optimizer) -> tuple[Any, Any]:
    return copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())


def _step(
    net: nn.Module, opt: torch.optim.Optimizer, x: Tensor, skip: DeviceSkip | None, bn: SelectRestore | None
) -> Tensor:
    """One training step in the sync-free style: check, arm, restore, step; returns the step's summary."""
    if bn is not None:
        bn.capture()
    opt.zero_grad(set_to_none=True)
    loss = net(x).square().mean()
    loss.backward()
    buffers = batchnorm_buffers(net)
    summary = fused_health_check(
        [p.grad for p in net.parameters() if p.grad is not None],
        others=[loss.detach(), *(t for _, t in buffers if t.is_floating_point())],
        nonnegative=batchnorm_running_vars(buffers),
        with_norm=False,
    )
    if skip is not None and not skip.arm(summary[0]):  # fused SGD's first step: the host read, as usual
        assert isinstance(opt, torch.optim.SGD) and not opt.state
        if summary.tolist()[0]:
            opt.zero_grad(set_to_none=True)
    if bn is not None:
        bn.restore_where_(summary[0])
    opt.step()
    return summary


@FUSED
@NONFINITE
def test_bad_step_is_a_bitwise_no_op_and_training_continues_as_without_it(
    cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], value: float
) -> None:
    """The run with a bad batch (skipped on the device) ends bitwise where the run without that batch ends."""
    torch.manual_seed(1)
    batches = [_batch() for _ in range(4)]
    bad = _batch(value)

    guarded, reference = _net(), _net()
    opt = cls(guarded.parameters(), lr=0.01, fused=True, **kwargs)
    ref_opt = cls(reference.parameters(), lr=0.01, fused=True, **kwargs)
    skip = DeviceSkip(opt)
    bn = SelectRestore([t for _, t in batchnorm_buffers(guarded)])
    for x in batches[:2]:
        assert _step(guarded, opt, x, skip, bn).tolist()[0] == 0.0
        _step(reference, ref_opt, x, None, None)

    before = _state(guarded, opt)
    assert _step(guarded, opt, bad, skip, bn).tolist()[0] == 1.0
    assert _equal(_state(guarded, opt), before)  # weights, BatchNorm statistics, moments and step counts
    assert not hasattr(opt, "found_inf")  # nothing left for the next step

    for x in batches[2:]:
        _step(guarded, opt, x, skip, bn)
        _step(reference, ref_opt, x, None, None)
    assert _equal(_state(guarded, opt), _state(reference, ref_opt))
    skip.remove()


@pytest.mark.parametrize("flag", [1.0, 2.0, 5.0, math.nan, -1.0], ids=["1", "2", "5", "nan", "-1"])
def test_any_nonzero_flag_skips_exactly_once(flag: float) -> None:
    """Fused kernels skip only on ``found_inf == 1`` and subtract it from the step count: the flag is made exact."""
    net = _net()
    opt = torch.optim.Adam(net.parameters(), lr=0.01, fused=True)
    skip = DeviceSkip(opt)
    _step(net, opt, _batch(), skip, None)
    net.eval()  # BatchNorm statistics stay put: only the update is compared
    before = _state(net, opt)
    net(_batch()).sum().backward()
    assert skip.arm(torch.tensor([flag]))
    opt.step()
    assert _equal(_state(net, opt), before)
    assert skip.arm(torch.tensor(0.0))
    opt.step()
    assert not _equal(_state(net, opt), before)
    assert opt.state[net[0].weight]["step"].item() == 2.0
    skip.remove()


def test_unarmed_steps_are_untouched() -> None:
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, fused=True)
    skip = DeviceSkip(opt)
    assert skip.arm(torch.tensor(1.0))
    opt.zero_grad()
    net(_batch()).sum().backward()
    opt.step()  # skipped
    before = _state(net, opt)
    opt.step()  # not armed again: a normal update
    assert not _equal(_state(net, opt), before)
    skip.remove()


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.Adam(ps),
        lambda ps: torch.optim.AdamW(ps, foreach=True),
        lambda ps: torch.optim.RMSprop(ps),
        lambda ps: torch.optim.LBFGS(ps),
    ],
    ids=["Adam", "AdamW-foreach", "RMSprop", "LBFGS"],
)
def test_optimizers_without_a_fused_kernel_keep_the_host_read(make: Any) -> None:
    net = _net()
    opt = make(net.parameters())
    reason = device_skip_unsupported(opt)
    assert reason is not None and "fused=True" in reason and type(opt).__name__ in reason
    skip = DeviceSkip(opt)
    assert skip.arm(torch.tensor(1.0)) is False
    assert not hasattr(opt, "found_inf") and not opt._optimizer_step_pre_hooks
    assert device_skip_unsupported(torch.optim.Adam(net.parameters(), fused=True)) is None
    mixed = torch.optim.SGD([{"params": net[0].parameters(), "fused": True}, {"params": net[3].parameters()}], lr=0.1)
    assert device_skip_unsupported(mixed) is not None  # one group without the fused kernel


def test_fused_sgd_with_momentum_keeps_the_host_read_on_its_first_step() -> None:
    """Its first step allocates momentum buffers uninitialised; a skipped first step would keep garbage."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, fused=True)
    skip = DeviceSkip(opt)
    net(_batch()).sum().backward()
    assert skip.arm(torch.tensor(0.0)) is False
    opt.step()
    assert skip.arm(torch.tensor(0.0)) is True
    opt.step()
    skip.remove()


def _scaled_step(net: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler, unscale: bool) -> None:
    opt.zero_grad()
    scaler.scale(net(_batch()).square().mean()).backward()
    if unscale:  # what Lightning does for optimizers that do not unscale in their kernel
        scaler.unscale_(opt)


@pytest.mark.parametrize("fused", [False, True], ids=["Adam+unscale_", "fused-Adam"])
@pytest.mark.parametrize("flag", [0.0, 1.0], ids=["healthy", "bad"])
def test_with_a_grad_scaler(fused: bool, flag: float) -> None:
    """The flag joins the scaler's: skipped by ``scaler.step``; the scale backs off only where the scaler decides."""
    net, reference = _net(), _net()
    opt = torch.optim.Adam(net.parameters(), lr=0.01, fused=fused)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01, fused=fused)
    scaler, ref_scaler = torch.amp.GradScaler("cpu", init_scale=256.0), torch.amp.GradScaler("cpu", init_scale=256.0)
    skip = DeviceSkip(opt, scaler)
    for seed in (3, 4):  # a healthy step first: the optimizer state exists before the compared one
        for model, optimizer, its_scaler in ((net, opt, scaler), (reference, ref_opt, ref_scaler)):
            torch.manual_seed(seed)
            _scaled_step(model, optimizer, its_scaler, unscale=not fused)
            if seed == 3:
                its_scaler.step(optimizer)
                its_scaler.update()
    before = _state(net, opt)
    assert skip.arm(torch.tensor([flag]))
    scaler.step(opt)
    scaler.update()
    ref_scaler.step(ref_opt)
    ref_scaler.update()
    if flag:
        assert _equal(_state(net, opt), before)
        # non-fused: the flag went into the scaler's own, which backs off the scale as for an overflow
        assert scaler.get_scale() == (256.0 if fused else 128.0)
    else:
        assert _equal(_state(net, opt), _state(reference, ref_opt))
        assert scaler.get_scale() == ref_scaler.get_scale() == 256.0
    assert not hasattr(opt, "found_inf")
    skip.remove()


def test_scaler_found_inf_is_the_scalers_own_gradient_check() -> None:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    assert scaler_found_inf(None, opt) is None
    _scaled_step(net, opt, scaler, unscale=False)
    assert scaler_found_inf(scaler, opt) is None  # not unscaled yet
    scaler.unscale_(opt)
    assert scaler_found_inf(scaler, opt).item() == 0.0
    scaler.update()
    _scaled_step(net, opt, scaler, unscale=False)
    net[0].weight.grad[0, 0] = math.inf
    scaler.unscale_(opt)
    assert scaler_found_inf(scaler, opt).item() == 1.0


# ---------------------------------------------------------------------------- SelectRestore


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.BatchNorm1d(4), nn.BatchNorm1d(3).double(), nn.BatchNorm2d(2))


def _bn_forward(model: nn.Module, bad: float | None = None) -> None:
    x = torch.randn(8, 4)
    if bad is not None:
        x[0, 1] = bad
    model[0](x)
    model[1](torch.randn(8, 3, dtype=torch.float64))
    model[2](torch.randn(4, 2, 3, 3))


@NONFINITE
def test_select_restore_is_exact_for_every_dtype(value: float) -> None:
    model = _bn_model()
    _bn_forward(model)  # non-trivial statistics
    live = [t for _, t in batchnorm_buffers(model)]
    assert {t.dtype for t in live} == {torch.float32, torch.float64, torch.int64}
    restore = SelectRestore(live)
    captured = [t.clone() for t in live]
    _bn_forward(model, bad=value)
    assert not torch.isfinite(model[0].running_mean).all() or not torch.isfinite(model[0].running_var).all()
    restore.restore_where_(torch.tensor([1.0]))
    assert _equal(live, captured)


def test_select_restore_keeps_healthy_updates_and_special_bits() -> None:
    model = _bn_model()
    live = [t for _, t in batchnorm_buffers(model)]
    with torch.no_grad():  # values arithmetic blending would not keep: NaN payloads, -0.0
        model[0].running_mean.view(torch.int32)[0] = 0x7FC00123
        model[0].running_mean[1] = -0.0
    restore = SelectRestore(live)
    captured = [t.clone() for t in live]
    _bn_forward(model)
    updated = [t.clone() for t in live]
    assert not _equal(updated, captured)
    restore.restore_where_(torch.tensor(0.0))  # healthy: keep this step's updates, bitwise
    assert _equal(live, updated)
    restore.capture()
    _bn_forward(model)
    restore.restore_where_(torch.tensor(math.nan))  # a NaN flag counts as set
    assert _equal(live, updated)
    assert SelectRestore([]).nbytes == 0 and restore.nbytes > 0
    SelectRestore([]).restore_where_(torch.tensor(1.0))  # nothing to do


# ---------------------------------------------------------------------------- DeferredRead


def test_deferred_read_on_cpu_is_a_copy_first_in_first_out() -> None:
    reader = DeferredRead()
    assert reader.ready() and reader.pending == 0
    values = torch.tensor([0.0, 1.5, -1.0])
    reader.start(values)
    values.fill_(7.0)  # the copy was taken at start()
    reader.start(torch.tensor([[2.0]]))
    assert reader.pending == 2 and reader.ready()
    assert reader.result() == [0.0, 1.5, -1.0]
    assert reader.result() == [2.0]
    with pytest.raises(RuntimeError, match="no read was started"):
        reader.result()
    reader.start(values)
    reader.clear()
    assert reader.pending == 0


def test_the_building_blocks_never_read_the_device() -> None:
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, fused=True)
    skip = DeviceSkip(opt)
    check = GradientCheck(net.parameters())
    restore = SelectRestore([t for _, t in batchnorm_buffers(net)])
    reader = DeferredRead()
    counter = HostReadCounter()
    for bad in (None, math.nan):
        with counter:
            restore.capture()
            loss = net(_batch(bad)).square().mean()
            opt.zero_grad()
            loss.backward()
            summary = check.health_check(others=[loss.detach()], with_norm=False)
            assert skip.arm(summary[0])
            restore.restore_where_(summary[0])
            reader.start(summary)
            opt.step()
        assert sum(counter.reads.values()) == 0
        assert reader.result()[0] == (0.0 if bad is None else 1.0)  # the one read, deferred
    skip.remove()
    check.remove()


# ---------------------------------------------------------------------------- GPU


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_cuda_deferred_read_uses_pinned_memory_and_never_synchronises_at_start() -> None:
    reader = DeferredRead()
    values = torch.tensor([0.0, 3.0, 1.0], device="cuda")
    reader.start(values)
    assert reader.result() == [0.0, 3.0, 1.0]  # warm: the pinned buffer now exists
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        big = torch.randn(4096, 4096, device="cuda")
        summary = torch.stack((big.square().sum() * 0, big.sum() * 0 + 2.0))  # queued behind real work
        reader.start(summary)
        assert reader.pending == 1
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert reader.result() == [0.0, 2.0]
    assert reader._free and reader._free[0].is_pinned()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fused", [True, False], ids=["fused-AdamW", "Adam+GradScaler"])
def test_cuda_step_decision_never_synchronises(fused: bool) -> None:
    """Check, arm, restore, start the read: the whole per-step path under ``set_sync_debug_mode("error")``."""
    net = _net().cuda()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, fused=fused)
    scaler = None if fused else torch.amp.GradScaler("cuda")
    skip = DeviceSkip(opt, scaler)
    check = GradientCheck(net.parameters())
    restore = SelectRestore([t for _, t in batchnorm_buffers(net)])
    reader = DeferredRead()

    def step(x: Tensor, strict: bool) -> None:
        restore.capture()
        opt.zero_grad()
        loss = net(x).square().mean()
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        torch.cuda.set_sync_debug_mode("error" if strict else "default")
        try:
            summary = check.health_check(others=[loss.detach()], with_norm=False)
            assert skip.arm(summary[0])
            restore.restore_where_(summary[0])
            reader.start(summary)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if scaler is not None:
            scaler.step(opt)  # the scaler's own read (non-fused), outside the guard's code
            scaler.update()
        else:
            opt.step()

    step(_batch().cuda(), strict=False)
    assert reader.result()[0] == 0.0
    before = copy.deepcopy(net.state_dict())
    step(_batch(math.nan).cuda(), strict=True)
    assert reader.result()[0] == 1.0
    assert _equal(net.state_dict(), before)
    skip.remove()
    check.remove()


@pytest.mark.gpu
@needs_cuda
def test_cuda_select_restore_across_devices() -> None:
    tensors = [torch.zeros(3, device="cuda"), torch.zeros(2), torch.zeros((), dtype=torch.long, device="cuda")]
    restore = SelectRestore(tensors)
    for t in tensors:
        t.add_(5)
    restore.restore_where_(torch.tensor(1.0, device="cuda"))
    assert all(t.sum().item() == 0 for t in tensors)
