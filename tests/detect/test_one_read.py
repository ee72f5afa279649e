"""The healthy step's one-read check: the loss read back as it is, the total finite iff every value is."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from lightning_nanguard.detect import one_read
from lightning_nanguard.detect.check import CPU_SUM_NUMEL, SMALL_NUMEL
from lightning_nanguard.detect.one_read import loss_and_total

# small, repeated, large (normed), 0-dim, largest (summed on a CPU)
SHAPES = [(3, 4), (4,), (3, 4), (4,), (SMALL_NUMEL,), (2, SMALL_NUMEL), (), (5,), (CPU_SUM_NUMEL,)]


def _params(shapes: list[tuple[int, ...]] = SHAPES) -> list[Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]


def _grads(params: list[Tensor]) -> list[Tensor]:
    return [torch.rand(p.shape, generator=torch.Generator().manual_seed(i)) for i, p in enumerate(params)]


def test_a_healthy_list_reads_its_loss_and_a_finite_total() -> None:
    params = _params()
    grads = _grads(params)
    value, total = loss_and_total(grads, torch.tensor(0.25), params)  # type: ignore[misc]
    assert value == 0.25
    expected = sum(g.double().sum().item() for g in grads if g.numel() < SMALL_NUMEL) + 0.25
    large = sum(g.double().norm().item() for g in grads if SMALL_NUMEL <= g.numel() < CPU_SUM_NUMEL)  # normed
    largest = sum(g.double().sum().item() for g in grads if g.numel() >= CPU_SUM_NUMEL)  # summed one by one on a CPU
    assert total == pytest.approx(expected + large + largest, rel=1e-5)


@pytest.mark.parametrize("position", range(len(SHAPES)))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_one_nonfinite_element_anywhere_makes_the_total_nonfinite(position: int, bad: float) -> None:
    params = _params()
    grads = _grads(params)
    grads[position].view(-1)[-1] = bad
    value, total = loss_and_total(grads, torch.tensor(1.5), params)  # type: ignore[misc]
    assert value == 1.5 and not math.isfinite(total)


def test_opposite_infinities_in_two_tensors_do_not_cancel() -> None:
    params = _params()
    grads = _grads(params)
    grads[0][0, 0], grads[-1][0] = math.inf, -math.inf  # a small and a large one (summed on a CPU)
    assert math.isnan(loss_and_total(grads, torch.tensor(1.0), params)[1])  # type: ignore[index]
    grads = _grads(params)
    grads[0][0, 0], grads[4][0] = math.inf, -math.inf  # a small and a normed one: its norm is +inf
    assert math.isinf(loss_and_total(grads, torch.tensor(1.0), params)[1])  # type: ignore[index]


@pytest.mark.parametrize("loss", [math.nan, math.inf])
def test_a_nonfinite_loss_makes_the_total_nonfinite(loss: float) -> None:
    params = _params()
    value, total = loss_and_total(_grads(params), torch.tensor(loss), params)  # type: ignore[misc]
    assert not math.isfinite(total) and (math.isnan(value) if math.isnan(loss) else value == loss)


def test_a_float64_loss_is_read_as_float32() -> None:
    params = _params()
    value, _ = loss_and_total(_grads(params), torch.tensor(0.1, dtype=torch.float64), params)  # type: ignore[misc]
    assert value == torch.tensor(0.1, dtype=torch.float32).item()


def test_the_plan_is_made_once_per_layout_and_nothing_checked_is_written() -> None:
    params = _params()
    grads = _grads(params)
    versions = [g._version for g in grads]
    loss_and_total(grads, torch.tensor(1.0), params)
    plan = one_read._PLANS.of(params)
    grads[1][0] = math.nan  # the same layout, another step's values
    assert not math.isfinite(loss_and_total(grads, torch.tensor(1.0), params)[1])  # type: ignore[index]
    assert one_read._PLANS.of(params) is plan
    assert [g._version for g in grads] == [v + (i == 1) for i, v in enumerate(versions)]  # only our own write


@pytest.mark.parametrize(
    "case",
    ["float64 gradients", "another list length", "a loss of two elements", "an integer loss", "sparse gradients"],
)
def test_where_the_plan_does_not_apply_it_says_so(case: str) -> None:
    params = _params([(3,), (4,)])
    grads, loss = _grads(params), torch.tensor(1.0)
    if case == "float64 gradients":
        params = [nn.Parameter(p.detach().double()) for p in params]
        grads = [g.double() for g in grads]
    elif case == "another list length":
        grads = grads[:1]
    elif case == "a loss of two elements":
        loss = torch.ones(2)
    elif case == "an integer loss":
        loss = torch.tensor(1)
    else:
        grads = [g.to_sparse() for g in grads]
    assert loss_and_total(grads, loss, params) is None


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(
        st.sampled_from([(), (1,), (7,), (2, 3), (SMALL_NUMEL - 1,), (SMALL_NUMEL,), (SMALL_NUMEL + 3,)]),
        min_size=1,
        max_size=8,
    ),
    bad=st.one_of(
        st.none(), st.tuples(st.integers(0, 7), st.integers(0, 10**6), st.sampled_from([math.nan, math.inf]))
    ),
)
def test_the_total_is_finite_exactly_when_every_value_is(
    shapes: list[tuple[int, ...]], bad: tuple[int, int, float] | None
) -> None:
    params = _params(shapes)
    grads = _grads(params)
    if bad is not None:
        tensor = grads[bad[0] % len(grads)].view(-1)
        tensor[bad[1] % tensor.numel()] = bad[2]
    result = loss_and_total(grads, torch.tensor(2.0), params)
    assert result is not None
    assert math.isfinite(result[1]) == (bad is None)
    assert result[0] == 2.0


# ---------------------------------------------------------------------------- BatchNorm statistics


def _batchnorm_buffers(net: nn.Module) -> tuple[list[Tensor], list[Tensor]]:
    buffers = [(n, b) for n, b in net.named_buffers() if b.is_floating_point()]
    return [b for _, b in buffers], [b for n, b in buffers if n.endswith("running_var")]


def _batchnorm_net() -> nn.Module:
    net = nn.Sequential(nn.BatchNorm1d(4), nn.BatchNorm2d(4), nn.BatchNorm1d(8), nn.BatchNorm1d(SMALL_NUMEL))
    for bn in net:
        bn.running_mean.uniform_(-1.0, 1.0)  # negative means are fine
        bn.running_var.uniform_(0.0, 2.0)
    net[2].running_var[0] = 0.0  # a zero variance is fine too
    return net


@pytest.mark.parametrize(
    ("corruption", "finite"),
    [
        (None, True),
        ("a NaN mean", False),
        ("an Inf variance", False),
        ("a negative variance", False),
        ("-0.0 variance", True),
    ],
)
def test_batchnorm_totals_are_finite_exactly_when_the_statistics_are_valid(
    corruption: str | None, finite: bool
) -> None:
    net = _batchnorm_net()
    floating, variances = _batchnorm_buffers(net)
    totals = one_read.BatchNormTotals(floating, variances)
    assert totals.usable
    assert all(math.isfinite(t) for t in totals.totals())  # built once, reused below
    if corruption == "a NaN mean":
        net[3].running_mean[-1] = math.nan
    elif corruption == "an Inf variance":
        net[1].running_var[2] = math.inf
    elif corruption == "a negative variance":
        net[2].running_var[5] = -1e-12
    elif corruption == "-0.0 variance":
        net[0].running_var[1] = -0.0
    versions = [b._version for b in floating]
    values = [float(t) for t in totals.totals()]
    assert all(math.isfinite(v) for v in values) == finite
    assert [b._version for b in floating] == versions  # the live statistics are only read (their copy is rooted)
    params = _params()
    result = loss_and_total(_grads(params), torch.tensor(1.0), params, totals.totals())
    assert result is not None and math.isfinite(result[1]) == finite and result[0] == 1.0


def test_batchnorm_totals_of_several_dtypes_are_left_to_the_general_check() -> None:
    net = _batchnorm_net()
    net[0].double()
    assert not one_read.BatchNormTotals(*_batchnorm_buffers(net)).usable


def test_extra_totals_get_their_own_buffer_and_none_is_stale() -> None:
    params = _params()
    grads = _grads(params)
    bad = torch.tensor(math.nan)
    assert not math.isfinite(loss_and_total(grads, torch.tensor(1.0), params, [torch.tensor(0.0), bad])[1])  # type: ignore[index]
    assert math.isfinite(loss_and_total(grads, torch.tensor(1.0), params)[1])  # type: ignore[index]
    assert math.isfinite(loss_and_total(grads, torch.tensor(1.0), params, [torch.tensor(2.0)])[1])  # type: ignore[index]


# ---------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("position", [0, 4, None])  # a small gradient, a large one (one _foreach_norm), none
def test_cuda_one_read_is_one_synchronisation_and_sees_every_tensor(position: int | None) -> None:
    params = [p.detach().cuda().requires_grad_() for p in _params()]
    grads = [g.cuda() for g in _grads(params)]
    if position is not None:
        grads[position].view(-1)[-1] = math.nan
    loss = torch.tensor(1.0, device="cuda")
    loss_and_total(grads, loss, params)  # builds the plan
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")  # each synchronisation warns
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss_and_total(grads, loss, params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len([w for w in caught if "synchroniz" in str(w.message)]) == 1, [str(w.message) for w in caught]
    value, total = loss_and_total(grads, loss, params)  # type: ignore[misc]
    assert value == 1.0 and math.isfinite(total) == (position is None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_loss_on_another_device_than_the_gradients_declines() -> None:
    params = [p.detach().cuda().requires_grad_() for p in _params()]
    assert loss_and_total([g.cuda() for g in _grads(params)], torch.tensor(1.0), params) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("corrupt", [False, True])
def test_cuda_batchnorm_totals_join_the_one_synchronisation(corrupt: bool) -> None:
    net = _batchnorm_net().cuda()
    totals = one_read.BatchNormTotals(*_batchnorm_buffers(net))
    params = [p.detach().cuda().requires_grad_() for p in _params()]
    grads = [g.cuda() for g in _grads(params)]
    loss = torch.tensor(1.0, device="cuda")
    loss_and_total(grads, loss, params, totals.totals())  # builds the buffers
    if corrupt:
        net[2].running_var[3] = -1.0
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = loss_and_total(grads, loss, params, totals.totals())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len([w for w in caught if "synchroniz" in str(w.message)]) == 1, [str(w.message) for w in caught]
    assert result is not None and math.isfinite(result[1]) == (not corrupt)
