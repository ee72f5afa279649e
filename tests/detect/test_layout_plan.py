"""The check through a layout (``fused_health_check(..., layout=params)``): the same answer, element by element.

The plan of a layout (grouping by device and dtype, sizes, staging slices) is worked out once from the
parameter list and serves every step; these tests hold it to the general path's answers on every
layout hypothesis draws, with a NaN or Inf planted at every position, and through what can change
under it: other shapes, sparse gradients, fewer gradients than tensors.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_nanguard import fused_health_check
from lightning_nanguard.detect import check as check_module

SHAPES = st.sampled_from([(3,), (2, 2), (1,), (4, 3), (70, 70), (5,)])  # (70, 70): above SMALL_NUMEL
DTYPES = st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.int64])


def _raw(grads: list[torch.Tensor], layout: list[torch.Tensor] | None, norm: bool) -> list[float]:
    return fused_health_check(grads, raw=True, with_norm=norm, layout=layout, device=torch.device("cpu")).tolist()


def _layout(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tensors = []
    for shape, dtype in specs:
        values = torch.rand(shape, generator=generator) + 0.5
        tensors.append(values.to(dtype) if dtype.is_floating_point else (values * 10).to(dtype))
    return tensors


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(SHAPES, DTYPES), min_size=1, max_size=12), st.booleans())
def test_a_planned_check_finds_a_planted_value_wherever_it_sits(
    specs: list[tuple[tuple[int, ...], torch.dtype]], norm: bool
) -> None:
    params = _layout(specs)
    grads = [p.clone() for p in params]
    healthy = _raw(grads, params, norm)
    assert all(math.isfinite(v) for v in healthy[:2])
    assert healthy[0] == pytest.approx(_raw(grads, None, norm)[0], rel=1e-3)  # the same total or norm
    for position, grad in enumerate(grads):
        if not grad.is_floating_point():
            continue
        for bad in (math.nan, math.inf, -math.inf):
            planted = [g.clone() for g in grads]
            planted[position].view(-1)[-1] = bad
            assert not math.isfinite(_raw(planted, params, norm)[0]), (position, bad, specs)
    assert _raw(grads, params, norm)[0] == pytest.approx(healthy[0])  # nothing written to the tensors


def test_the_norm_through_a_layout_is_the_global_l2_norm() -> None:
    params = _layout([((3,), torch.float32), ((70, 70), torch.float32), ((3,), torch.float32), ((2, 2), torch.float64)])
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.double()) for p in params]))
    total, _, _, norm = _raw(params, params, norm=True)
    assert norm == pytest.approx(expected.item(), rel=1e-5) and total == norm


def test_gradients_of_other_shapes_than_the_layout_are_still_checked_exactly() -> None:
    params = _layout([((2, 2), torch.float32), ((2, 2), torch.float32), ((3,), torch.float32)])
    _raw([p.clone() for p in params], params, norm=False)  # the plan is built
    other = [torch.ones(4), torch.ones(1, 4), torch.tensor([1.0, math.nan, 1.0])]  # same count, other shapes
    assert not math.isfinite(_raw(other, params, norm=False)[0])
    assert math.isfinite(_raw([torch.ones(4), torch.ones(1, 4), torch.ones(3)], params, norm=False)[0])


def test_sparse_gradients_leave_the_plan_for_the_general_path() -> None:
    params = [torch.ones(5, 3), torch.ones(3)]
    sparse = torch.sparse_coo_tensor([[1, 3]], torch.tensor([[1.0, 2.0, 3.0], [math.inf, 0.0, 1.0]]), (5, 3))
    assert not math.isfinite(_raw([sparse, torch.ones(3)], params, norm=False)[0])
    assert not check_module._PLANS.of(params).usable  # no retry on every step
    healthy = torch.sparse_coo_tensor([[1]], torch.tensor([[1.0, 2.0, 3.0]]), (5, 3))
    assert math.isfinite(_raw([healthy, torch.ones(3)], params, norm=False)[0])


def test_fewer_gradients_than_tensors_take_the_general_path() -> None:
    params = _layout([((3,), torch.float32), ((2, 2), torch.float32)])
    assert not math.isfinite(_raw([torch.tensor([math.nan])], params, norm=False)[0])
