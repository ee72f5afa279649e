"""``GradientCheck`` (``lightning_nanguard.detect.streaming``): large gradients summed by hooks during backward."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_nanguard import nonfinite_names
from lightning_nanguard.core.timing import GuardClock
from lightning_nanguard.detect.streaming import GradientCheck

NONFINITE = pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "+inf", "-inf"])


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
