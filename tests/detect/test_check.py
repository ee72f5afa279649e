"""``lightning_nanguard.detect.check`` without a Trainer: the fused check, its candidates and its norms."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_nanguard import fused_health_check, nonfinite_names
from lightning_nanguard.detect.check import grouped_norms, nonfinite_candidate
from lightning_nanguard.detect.confirm import negative_names

NONFINITE = pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "+inf", "-inf"])
FLOAT_DTYPES = pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])


def _grads() -> list[torch.Tensor]:
    return [torch.randn(3, 4), torch.randn(4), torch.randn(2, 2, 2), torch.randn(())]


def _flag(result: torch.Tensor) -> float:
    """``result[0]``: some tensor may hold NaN/Inf (or a negative value where none is allowed)."""
    return result.tolist()[0]


def _norm(result: torch.Tensor) -> float:
    """``result[1]``: global L2 norm of the gradients."""
    return result.tolist()[1]


def _others_flag(result: torch.Tensor) -> float:
    """``result[2]``: the flag for ``others`` and ``nonnegative`` alone."""
    return result.tolist()[2]


def test_healthy_result_is_flag_zero_and_global_norm() -> None:
    grads = _grads()
    result = fused_health_check(grads, others=[torch.tensor(0.25), torch.ones(5)])
    assert result.dtype == torch.float32
    assert result.shape == (3,)  # [flag, grad_norm, others_flag]
    assert (_flag(result), _others_flag(result)) == (0.0, 0.0)
    norm = _norm(result)
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])).item()
    assert norm == pytest.approx(expected, rel=1e-6)


def test_others_do_not_count_in_the_grad_norm() -> None:
    result = fused_health_check([torch.tensor([3.0, 4.0])], others=[torch.full((10,), 100.0)])
    assert _norm(result) == pytest.approx(5.0)


@NONFINITE
@pytest.mark.parametrize("tensor_index", [0, 1, 3])
@pytest.mark.parametrize("element", ["first", "last"])
def test_nonfinite_in_any_grad_is_flagged(value: float, tensor_index: int, element: str) -> None:
    grads = _grads()
    flat = grads[tensor_index].view(-1)
    flat[0 if element == "first" else -1] = value
    result = fused_health_check(grads, others=[torch.tensor(1.0)])
    assert _flag(result) == 1.0
    assert _others_flag(result) == 0.0  # only the gradients are bad
    # The global grad norm is NaN for a NaN, +Inf for +/-Inf (AMP overflow classification relies on it).
    assert math.isnan(_norm(result)) if math.isnan(value) else _norm(result) == math.inf
    names = [f"g{i}" for i in range(len(grads))]
    assert nonfinite_names(zip(names, grads, strict=True)) == [f"g{tensor_index}"]


@NONFINITE
def test_nonfinite_in_others_is_flagged_but_grad_norm_stays_finite(value: float) -> None:
    loss = torch.tensor(value)
    bn_mean = torch.zeros(8)
    result = fused_health_check([torch.tensor([3.0, 4.0])], others=[bn_mean, loss])
    assert _flag(result) == 1.0
    assert _others_flag(result) == 1.0
    assert _norm(result) == pytest.approx(5.0)


def test_nan_wins_over_inf_in_the_grad_norm() -> None:
    assert math.isnan(_norm(fused_health_check([torch.tensor([math.inf, math.nan])])))
    assert math.isnan(_norm(fused_health_check([torch.tensor([-math.inf]), torch.tensor([math.nan])])))
    mixed = [torch.tensor([-math.inf], dtype=torch.float16), torch.tensor([math.nan], dtype=torch.bfloat16)]
    assert math.isnan(_norm(fused_health_check(mixed)))


@NONFINITE
@FLOAT_DTYPES
def test_mixed_dtypes(value: float, dtype: torch.dtype) -> None:
    grads = [
        torch.randn(5, dtype=torch.float16),
        torch.randn(5, dtype=torch.bfloat16),
        torch.randn(5, dtype=torch.float32),
        torch.randn(5, dtype=torch.float64),
    ]
    result = fused_health_check(grads)
    assert _flag(result) == 0.0
    norm = _norm(result)
    expected = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    assert norm == pytest.approx(expected, rel=1e-3)

    position = [g.dtype for g in grads].index(dtype)
    grads[position][2] = value
    assert _flag(fused_health_check(grads)) == 1.0
    assert nonfinite_names((str(g.dtype), g) for g in grads) == [str(dtype)]


def test_result_lives_on_the_requested_device_as_float32() -> None:
    result = fused_health_check([torch.ones(2, dtype=torch.float64)], device=torch.device("cpu"))
    assert result.device == torch.device("cpu")
    assert result.dtype == torch.float32


def test_empty_inputs() -> None:
    assert fused_health_check([]).tolist() == [0.0, 0.0, 0.0]
    assert fused_health_check([], others=[]).tolist() == [0.0, 0.0, 0.0]
    assert fused_health_check([torch.empty(0)]).tolist() == [0.0, 0.0, 0.0]
    assert fused_health_check([], others=[torch.tensor(math.nan)]).tolist() == [1.0, 0.0, 1.0]
    assert grouped_norms([]).numel() == 0
    assert nonfinite_names([]) == []
    assert negative_names([]) == []


def test_empty_nonnegative_tensor_is_ignored() -> None:
    """A zero-element ``running_var`` (e.g. ``BatchNorm1d(0)``) must not break the check."""
    result = fused_health_check([torch.ones(4)], nonnegative=[torch.empty(0)])
    assert result.tolist() == [0.0, 2.0, 0.0]
    result = fused_health_check([torch.ones(4)], nonnegative=[torch.empty(0), torch.tensor([-1.0])])
    assert result.tolist() == [1.0, 2.0, 1.0]


@pytest.mark.parametrize(
    ("tensor", "candidate"),
    [(torch.full((4,), 60000.0, dtype=torch.float16), 0.0), (torch.full((16,), 1e30), 1.0)],
    ids=["fp16-60000", "fp32-1e30"],
)
def test_finite_tensor_whose_norm_overflows_is_not_named(tensor: torch.Tensor, candidate: float) -> None:
    """The flag is only a candidate: finite values with an overflowing norm are never reported.

    fp32 ``1e30``: the squared norm overflows, so the flag is raised and the confirmation clears it;
    fp16 ``60000``: the norm accumulates in fp32 and stays finite, so the flag is not even raised.
    """
    assert torch.isfinite(tensor).all()
    assert _flag(fused_health_check([tensor, torch.ones(3)])) == candidate
    assert nonfinite_names([("big", tensor), ("ok", torch.ones(3))]) == []


def test_fp16_norm_accumulates_in_float32() -> None:
    result = fused_health_check([torch.full((4,), 60000.0, dtype=torch.float16)])
    assert _flag(result) == 0.0
    assert _norm(result) == pytest.approx(120000.0)


@NONFINITE
def test_sparse_grads(value: float) -> None:
    indices = torch.tensor([[0, 3, 3]])  # uncoalesced: index 3 twice
    healthy = torch.sparse_coo_tensor(indices, torch.tensor([3.0, 1.0, 3.0]), (6,), check_invariants=True)
    result = fused_health_check([healthy, torch.tensor([0.0])])
    assert _flag(result) == 0.0
    assert _norm(result) == pytest.approx(5.0)  # coalesced values [3, 4]
    bad = torch.sparse_coo_tensor(indices, torch.tensor([1.0, value, 2.0]), (6,), check_invariants=True)
    assert _flag(fused_health_check([healthy, bad])) == 1.0
    assert nonfinite_names([("embedding.weight", healthy), ("other.weight", bad)]) == ["other.weight"]


def test_nonnegative_tensors() -> None:
    grads = [torch.ones(2)]
    assert _flag(fused_health_check(grads, nonnegative=[torch.tensor([0.0, 1.0, -0.0])])) == 0.0
    negative = fused_health_check(grads, nonnegative=[torch.ones(3), torch.tensor([2.0, -1e-30])])
    assert _flag(negative) == 1.0
    assert _others_flag(negative) == 1.0
    assert negative_names([("a.running_var", torch.tensor([1.0, -2.0])), ("b.running_var", torch.ones(2))]) == [
        "a.running_var"
    ]
    assert negative_names([("zero", torch.tensor([0.0, -0.0]))]) == []


def test_grouped_norms_values() -> None:
    norms = grouped_norms([torch.tensor([3.0, 4.0]), torch.tensor([1.0], dtype=torch.float64), torch.zeros(3)])
    assert norms.dtype == torch.float32
    assert sorted(norms.tolist()) == [0.0, 1.0, 5.0]


def test_non_contiguous_tensors() -> None:
    base = torch.arange(16.0).reshape(4, 4)
    column = base[:, 1]
    assert not column.is_contiguous()
    assert _norm(fused_health_check([column])) == pytest.approx(float(column.norm()))
    base[2, 1] = math.nan
    assert _flag(fused_health_check([column])) == 1.0
    assert nonfinite_names([("column", column)]) == ["column"]


@NONFINITE
@pytest.mark.parametrize("n_tensors", [3, 600], ids=["few", "many"])
def test_without_norm_the_flag_is_the_same(value: float, n_tensors: int) -> None:
    """``with_norm=False`` (no global norm, GradScaler's kernel for many tensors) flags exactly the same."""
    grads = [torch.randn(4) for _ in range(n_tensors)]
    healthy = fused_health_check(grads, others=[torch.tensor(0.5)], with_norm=False)
    assert healthy.tolist() == [0.0, -1.0, 0.0]  # -1: norm not computed
    grads[n_tensors // 2][1] = value
    result = fused_health_check(grads, others=[torch.tensor(0.5)], with_norm=False)
    assert result.tolist() == [1.0, -1.0, 0.0]


@pytest.mark.parametrize("n_tensors", [3, 600], ids=["few", "many"])
def test_without_norm_values_stay_bitwise_equal(n_tensors: int) -> None:
    """The GradScaler kernel multiplies by 1.0 in place: NaN payloads, -0.0 and subnormals must survive."""
    special = torch.tensor([-0.0, 1e-45, -1e-40, 3.0e38, math.inf, -math.inf])
    special_bits = [*special.view(torch.int32).tolist(), 0x7FC00001, -0x003FFFFF]  # NaNs with payload / sign bit
    grads = [torch.randn(5) for _ in range(n_tensors)]
    grads[-1] = torch.tensor(special_bits, dtype=torch.int32).view(torch.float32)
    before = [g.clone() for g in grads]
    assert fused_health_check(grads, with_norm=False).tolist()[0] == 1.0
    assert all(torch.equal(g.view(torch.int32), b.view(torch.int32)) for g, b in zip(grads, before, strict=True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_without_norm_many_low_precision_tensors(dtype: torch.dtype) -> None:
    grads = [torch.ones(3, dtype=dtype) for _ in range(600)]
    assert fused_health_check(grads, with_norm=False).tolist()[0] == 0.0
    grads[599][2] = math.nan
    assert fused_health_check(grads, with_norm=False).tolist()[0] == 1.0


# ---------------------------------------------------------------------------- read-only


def _mixed_grads() -> list[torch.Tensor]:
    """Large and small tensors, several dtypes: every path of the check."""
    return [
        torch.randn(64, 128),  # large: norm path
        torch.randn(128),  # small: staged
        torch.randn(5000, dtype=torch.float64),
        torch.randn(3, 3, dtype=torch.float16),
        torch.randn(7, dtype=torch.bfloat16),
        torch.randn(()),
        *[torch.randn(8) for _ in range(300)],
    ]


@pytest.mark.parametrize("with_norm", [False, True], ids=["fast", "with-norm"])
def test_healthy_check_writes_nothing(with_norm: bool) -> None:
    grads = _mixed_grads()
    others = [torch.tensor(0.3), torch.zeros(16), torch.randn(6000)]
    nonnegative = [torch.ones(16), torch.rand(5000)]
    tensors = [*grads, *others, *nonnegative]
    versions = [t._version for t in tensors]
    before = [t.clone() for t in tensors]
    result = fused_health_check(grads, others=others, nonnegative=nonnegative, with_norm=with_norm)
    assert _flag(result) == 0.0
    assert [t._version for t in tensors] == versions
    assert all(torch.equal(t, b) for t, b in zip(tensors, before, strict=True))


@NONFINITE
@pytest.mark.parametrize(
    "position", [0, 1, 2, 3, 4, 5, 200], ids=["large", "small", "f64", "f16", "bf16", "0-dim", "many"]
)
def test_fast_path_flags_every_tensor_kind(value: float, position: int) -> None:
    grads = _mixed_grads()
    grads[position].view(-1)[-1] = value
    assert fused_health_check(grads, with_norm=False).tolist() == [1.0, -1.0, 0.0]
    nonnegative = [torch.ones(5000), torch.ones(16)]
    nonnegative[position % 2].view(-1)[0] = value
    assert fused_health_check([torch.ones(2)], nonnegative=nonnegative, with_norm=False).tolist() == [1.0, -1.0, 1.0]


@pytest.mark.parametrize("numel", [10, 6000], ids=["staged", "norm"])
def test_fast_path_flags_negative_values_where_none_are_allowed(numel: int) -> None:
    running_var = torch.ones(numel)
    assert fused_health_check([], nonnegative=[running_var], with_norm=False).tolist() == [0.0, -1.0, 0.0]
    running_var[-1] = -1e-30
    assert fused_health_check([], nonnegative=[running_var], with_norm=False).tolist() == [1.0, -1.0, 1.0]
    assert running_var[-1].item() == pytest.approx(-1e-30)  # the staged copy took the square root, not the tensor


def test_staging_follows_changing_shapes() -> None:
    """The stateless path caches its staging buffers by shapes: lists of the same length alternate freely."""
    from lightning_nanguard.detect.check import _STAGING

    first = [torch.ones(4), torch.ones(1)]
    assert nonfinite_candidate(first).item() == 0.0
    second = [torch.ones(1), torch.tensor([1.0, 2.0, 3.0, math.nan])]  # same count, other shapes
    assert nonfinite_candidate(second).item() == 1.0
    third = [torch.tensor([math.inf]), torch.ones(2, 2)]
    assert nonfinite_candidate(third).item() == 1.0
    cached = len(_STAGING)
    for _ in range(3):  # alternating lists reuse their buffers instead of rebuilding them every call
        assert nonfinite_candidate([torch.ones(1), torch.ones(2, 2)]).item() == 0.0
        assert nonfinite_candidate([torch.ones(4), torch.full((1,), -math.inf)]).item() == 1.0
    assert len(_STAGING) == cached


@NONFINITE
def test_staging_with_the_same_sizes_in_other_shapes(value: float) -> None:
    """Same numels, other shapes (a stacked shape group and single tensors): still every element, exactly."""
    for shapes in ([(2, 3), (2, 3), (5,)], [(3, 2), (3, 2), (1, 5)], [(6,), (1, 6), (5, 1)]):
        tensors = [torch.ones(shape) for shape in shapes]
        assert nonfinite_candidate(tensors).item() == 0.0
        for index in range(len(tensors)):
            bad = [t.clone() for t in tensors]
            bad[index].view(-1)[-1] = value
            assert nonfinite_candidate(bad).item() == 1.0


def test_integer_tensors_are_always_finite_and_complex_parts_are_both_read() -> None:
    assert nonfinite_candidate([torch.arange(5), torch.ones(3, dtype=torch.int64)]).item() == 0.0
    assert nonfinite_candidate([torch.tensor([1 + 2j, 3 + 0j])]).item() == 0.0
    assert nonfinite_candidate([torch.tensor([1 + 2j, complex(0, math.nan)])]).item() == 1.0
    assert nonfinite_candidate([torch.full((5000,), complex(1, math.inf))]).item() == 1.0


def test_finite_values_that_overflow_a_sum_are_only_a_candidate() -> None:
    big = torch.full((100,), 3e38)
    assert torch.isfinite(big).all()
    assert nonfinite_candidate([big]).item() == 1.0  # the sum (3e40) overflows float32: a candidate
    assert nonfinite_names([("big", big)]) == []  # the element-wise confirmation clears it


# ---------------------------------------------------------------------------- GPU


def _cuda_grads() -> list[torch.Tensor]:
    return [g.cuda() for g in _mixed_grads()]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("with_norm", [False, True], ids=["fast", "with-norm"])
def test_cuda_check_never_synchronises(with_norm: bool) -> None:
    grads = _cuda_grads()
    others = [torch.tensor(0.5, device="cuda"), torch.zeros(64, device="cuda")]
    nonnegative = [torch.ones(64, device="cuda")]
    fused_health_check(grads, others, nonnegative, with_norm=with_norm)  # warm-up: allocations, caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = fused_health_check(grads, others, nonnegative, with_norm=with_norm)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert result.device.type == "cuda"
    assert result.tolist()[0] == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@NONFINITE
def test_tensors_on_several_devices(value: float) -> None:
    """Grouped by device: one result on the requested device whatever device holds the NaN/Inf."""
    devices = ["cpu", *[f"cuda:{i}" for i in range(torch.cuda.device_count())]]
    grads = [torch.randn(5000, device=d) for d in devices] + [torch.randn(10, device=d) for d in devices]
    for target in devices:
        assert fused_health_check(grads, device=torch.device(target), with_norm=False).tolist()[0] == 0.0
    for index in range(len(grads)):
        bad = [g.clone() for g in grads]
        bad[index][-1] = value
        result = fused_health_check(bad, device=torch.device(devices[-1]), with_norm=False)
        assert result.device == torch.device(devices[-1])
        assert result.tolist()[0] == 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("loss", [0.5, -3.0, 3e300, math.nan, math.inf, -math.inf])
def test_a_single_scalar_loss_is_its_own_total(loss: float, dtype: torch.dtype) -> None:
    """The fast path uses a lone 0-dim loss as it is; the flags are those of staging it with the others."""
    value = torch.tensor(loss, dtype=torch.float64).to(dtype)
    bad = not math.isfinite(float(value.float()))  # 3e300 overflows float32: a candidate, as a staged sum would be
    grads = [torch.ones(3), torch.ones(2, 2)]
    expected = [1.0 if bad else 0.0, -1.0, 1.0 if bad else 0.0]
    assert fused_health_check(grads, others=[value], with_norm=False).tolist() == expected
    assert fused_health_check([], others=[value], with_norm=False).tolist() == expected
    assert fused_health_check(grads, others=[value, torch.tensor(1.0)], with_norm=False).tolist() == expected
    tracked = value.float().clone().requires_grad_()
    assert fused_health_check(grads, others=[tracked], with_norm=False).tolist() == expected  # staged, not used
