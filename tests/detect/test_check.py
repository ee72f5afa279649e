"""``lightning_nanguard.detect.check`` without a Trainer: the fused check and the element-wise confirmation."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_nanguard import fused_health_check, nonfinite_names
from lightning_nanguard.core.timing import GuardClock
from lightning_nanguard.detect.check import grouped_norms, nonfinite_candidate
from lightning_nanguard.detect.confirm import negative_names
from lightning_nanguard.detect.streaming import GradientCheck

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


def test_nonfinite_names_keeps_order_and_finds_all() -> None:
    named = [
        ("a", torch.ones(2)),
        ("b", torch.tensor([1.0, math.inf])),
        ("c", torch.ones(2)),
        ("d", torch.tensor([math.nan])),
        ("e", torch.tensor(-math.inf)),
    ]
    assert nonfinite_names(iter(named)) == ["b", "d", "e"]  # any iterable, e.g. a generator


def test_nonfinite_names_detaches_tensors_that_require_grad() -> None:
    weight = torch.nn.Parameter(torch.tensor([1.0, math.nan]))
    assert nonfinite_names([("weight", weight)]) == ["weight"]


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


# ---------------------------------------------------------------------------- GradientCheck


class _Net(torch.nn.Module):
    """One hooked (large) parameter and two staged ones; ``loss(mask)`` makes each gradient equal its mask."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.large = torch.nn.Parameter(torch.ones(64, 128, dtype=dtype))
        self.small = torch.nn.Parameter(torch.ones(16, dtype=dtype))
        self.scalar = torch.nn.Parameter(torch.ones((), dtype=dtype))

    def loss(self, masks: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        masks = masks or {}
        total = torch.zeros((), dtype=self.large.dtype)
        for name, param in self.named_parameters():
            total = total + (param * masks.get(name, torch.ones_like(param))).sum()
        return total


def _mask(net: _Net, name: str, value: float) -> dict[str, torch.Tensor]:
    mask = torch.ones_like(getattr(net, name))
    mask.view(-1)[-1] = value
    return {name: mask}


@NONFINITE
@pytest.mark.parametrize("name", ["large", "small", "scalar"])
@pytest.mark.parametrize("stream", [True, False], ids=["hooks", "after-backward"])
def test_gradient_check_flags_nonfinite_gradients(value: float, name: str, stream: bool) -> None:
    net = _Net()
    check = GradientCheck(net.parameters(), stream=stream)
    assert check.streaming is stream
    net.loss().backward()
    assert check.health_check(with_norm=False).tolist() == [0.0, -1.0, 0.0]
    net.zero_grad(set_to_none=True)
    net.loss(_mask(net, name, value)).backward()
    assert check.health_check(others=[torch.tensor(1.0)], with_norm=False).tolist() == [1.0, -1.0, 0.0]
    assert nonfinite_names((n, p.grad) for n, p in net.named_parameters()) == [name]
    check.remove()


def test_gradient_check_reads_hooked_gradients_once_and_writes_nothing() -> None:
    net = _Net()
    check = GradientCheck(net.parameters())
    net.loss().backward()
    versions = [p.grad._version for p in net.parameters()]
    assert check.health_check(with_norm=False).tolist()[0] == 0.0
    assert check.rechecked == 0  # the hooked gradient was summed during backward, not read again
    assert [p.grad._version for p in net.parameters()] == versions
    check.remove()


@pytest.mark.parametrize("how", ["in-place", "replaced"])
def test_gradient_changed_after_its_hook_is_read_again(how: str) -> None:
    """e.g. a user's ``on_after_backward`` or DDP's all-reduce writes the gradient after autograd."""
    net = _Net()
    check = GradientCheck(net.parameters())
    net.loss().backward()
    if how == "in-place":
        with torch.no_grad():
            net.large.grad[3, 4] = math.nan
    else:
        net.large.grad = torch.full_like(net.large, math.inf)
    assert check.health_check(with_norm=False).tolist()[0] == 1.0
    assert check.rechecked == 1
    check.remove()


def test_accumulated_micro_batches_and_stale_slots() -> None:
    net = _Net()
    check = GradientCheck(net.parameters())
    net.loss(_mask(net, "large", math.nan)).backward()  # first micro-batch
    net.loss().backward()  # second: the accumulated gradient keeps the NaN
    assert check.health_check(with_norm=False).tolist()[0] == 1.0
    net.zero_grad(set_to_none=True)
    net.small.sum().backward()  # next step: the large parameter gets no gradient at all
    assert check.health_check(with_norm=False).tolist()[0] == 0.0  # its slot was reset
    check.remove()


def test_disabled_hooks_do_no_work_and_the_check_stays_right() -> None:
    net = _Net()
    check = GradientCheck(net.parameters())
    check.enabled = False
    net.loss(_mask(net, "large", -math.inf)).backward()
    assert check.health_check(with_norm=False).tolist()[0] == 1.0
    assert check.rechecked == 1  # not seen by a hook: read after backward
    check.remove()


def test_hooks_are_removed_when_every_gradient_is_rewritten_after_backward() -> None:
    """Under DDP or a GradScaler every gradient is written after its hook: the hooks would only cost."""
    net = _Net()
    check = GradientCheck(net.parameters())
    for _ in range(3):
        net.zero_grad(set_to_none=True)
        net.loss().backward()
        net.large.grad.mul_(0.5)  # e.g. the all-reduce's division by the world size
        assert check.health_check(with_norm=False).tolist()[0] == 0.0
    assert not check.streaming
    net.zero_grad(set_to_none=True)
    net.loss(_mask(net, "large", math.nan)).backward()
    assert check.health_check(with_norm=False).tolist()[0] == 1.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_gradient_check_dtypes(dtype: torch.dtype) -> None:
    net = _Net(dtype)
    check = GradientCheck(net.parameters())
    net.loss({"large": torch.full((64, 128), 60000.0 if dtype == torch.float16 else 1e30, dtype=dtype)}).backward()
    assert check.health_check(with_norm=False).tolist()[0] == 0.0  # large finite values, float32 accumulation
    net.zero_grad(set_to_none=True)
    net.loss(_mask(net, "large", math.nan)).backward()
    assert check.health_check(with_norm=False).tolist()[0] == 1.0
    check.remove()


def test_gradient_check_with_norm_gives_the_global_norm() -> None:
    net = _Net()
    check = GradientCheck(net.parameters())
    net.loss().backward()
    result = check.health_check(others=[torch.tensor(2.0)], with_norm=True).tolist()
    assert result[0] == 0.0 and result[2] == 0.0
    assert result[1] == pytest.approx(math.sqrt(64 * 128 + 16 + 1))
    check.remove()


@NONFINITE
def test_sparse_and_complex_gradients(value: float) -> None:
    embedding = torch.nn.Embedding(100, 64, sparse=True)  # 6,400 weights: hooked, sparse gradient
    rotation = torch.nn.Parameter(torch.ones(64, 64, dtype=torch.complex64))  # hooked, complex
    check = GradientCheck([embedding.weight, rotation])
    tokens = torch.tensor([1, 5, 5])
    (embedding(tokens).sum() + (rotation * torch.ones(64, 64)).real.sum()).backward()
    assert check.health_check(with_norm=False).tolist()[0] == 0.0
    embedding.zero_grad()
    rotation.grad = None
    (embedding(tokens) * value).sum().backward()
    assert check.health_check(with_norm=False).tolist()[0] == 1.0
    embedding.weight.grad = None
    mask = torch.ones(64, 64, dtype=torch.complex64)
    mask[0, 0] = complex(0, value)
    (rotation * mask).real.sum().backward()
    # d(real(w * m))/dw = conj(m): the imaginary part carries the NaN/Inf
    assert check.health_check(with_norm=False).tolist()[0] == 1.0
    check.remove()


@NONFINITE
@pytest.mark.parametrize("where", ["stacked", "single"])
def test_many_small_gradients_some_missing(value: float, where: str) -> None:
    """Same-shape small gradients are staged by one stack per shape, the rest by one copy; missing ones read 0."""
    layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(20))  # 40 small tensors in 2 shapes
    odd = torch.nn.Parameter(torch.ones(3, 5))  # a shape of its own
    check = GradientCheck([*layers.parameters(), odd])
    assert check._large == []

    def backward(skip: int | None = None) -> None:
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        odd.grad = None
        h = torch.ones(2, 4)
        for index, layer in enumerate(layers):
            h = h if index == skip else h + layer(h).tanh()
        (h.sum() + odd.sum()).backward()

    backward(skip=7)  # layer 7 has no gradient
    assert layers[7].weight.grad is None
    assert check.health_check(with_norm=False).tolist()[0] == 0.0
    grad = layers[3].bias.grad if where == "stacked" else odd.grad
    grad.view(-1)[-1] = value
    assert check.health_check(with_norm=False).tolist()[0] == 1.0
    backward()  # all present again: the stale NaN/Inf is overwritten
    assert check.health_check(with_norm=False).tolist()[0] == 0.0
    odd.grad = None
    layers[3].weight.grad = None
    assert check.health_check(with_norm=False).tolist()[0] == 0.0
    check.remove()


@NONFINITE
def test_small_sparse_gradient_takes_the_generic_path(value: float) -> None:
    embedding = torch.nn.Embedding(10, 8, sparse=True)
    bias = torch.nn.Parameter(torch.zeros(8))
    large = torch.nn.Parameter(torch.zeros(64, 64))  # hooked: its sum shares the small gradients' buffer
    check = GradientCheck([embedding.weight, bias, large])
    (embedding(torch.tensor([1, 2])) + bias).sum().backward()
    assert embedding.weight.grad.is_sparse
    assert check.health_check(with_norm=False).tolist()[0] == 0.0
    embedding.weight.grad = None
    (embedding(torch.tensor([1, 2])) * value).sum().backward()
    assert check.health_check(with_norm=False).tolist()[0] == 1.0
    embedding.weight.grad = None
    (embedding(torch.tensor([1])).sum() + (large * value).sum()).backward()
    assert check.health_check(with_norm=False).tolist()[0] == 1.0
    assert check.rechecked == 0  # the large gradient was summed by its hook, not read again
    check.remove()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_backward_does_not_break_the_hooks() -> None:
    net = _Net()
    check = GradientCheck(net.parameters())
    (net.large**2).sum().backward(create_graph=True)
    assert net.large.grad.requires_grad
    assert check.health_check(with_norm=False).tolist()[0] == 0.0
    assert check.rechecked == 0  # checked by the hook, on a detached view
    net.large.grad = None  # break the parameter <-> gradient reference cycle
    check.remove()


def test_gradient_hooks_are_timed_by_the_guard_clock() -> None:
    net = _Net()
    clock = GuardClock(enabled=True)
    check = GradientCheck(net.parameters(), clock=clock)
    net.loss().backward()
    assert clock.calls["gradient_hooks"] == 1  # one large parameter
    clock.enabled = False
    net.loss().backward()
    assert clock.calls["gradient_hooks"] == 1
    check.remove()
    assert not check.streaming


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
def test_cuda_gradient_check_hooks_never_synchronise() -> None:
    net = _Net().cuda()
    check = GradientCheck(net.parameters())
    net.loss().backward()
    check.health_check(with_norm=False)
    torch.cuda.synchronize()
    net.zero_grad(set_to_none=True)
    loss = net.loss(_mask(net, "large", math.nan))
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss.backward()
        result = check.health_check(with_norm=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert result.tolist() == [1.0, -1.0, 0.0]
    check.remove()


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
