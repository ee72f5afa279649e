"""The attention functions seen through wrappers: no function mode around modules whose calls they see.

Issue 35, item 4: the function mode cost a Python dispatch on every torch call of an attention
module (~20 per attention call). Once the probe knows its attention modules, the ones whose every
attention call goes through ``F.scaled_dot_product_attention``, ``F.softmax``, ``torch.softmax`` or
``Tensor.softmax`` are watched through wrappers of those four functions only; a module calling a
function bound before the wrappers were installed, or attention inside another torch function
(``nn.MultiheadAttention``), keeps the mode. Every pass measures the same values either way.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from attention_blocks import CausalSelfAttention
from torch import Tensor, nn

from lightning_nanguard.detect import attention_calls
from lightning_nanguard.detect.attention import AttentionProbe

BOUND_SDPA = F.scaled_dot_product_attention  # bound at import, as `from torch.nn.functional import ...` does
ORIGINAL_SDPA = torch._C._nn.scaled_dot_product_attention


def _mode_on() -> bool:
    return torch._C._is_torch_function_mode_enabled()


class Spy(nn.Module):
    """Attention written four ways; records whether a function mode was on during each forward."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.qk = nn.Linear(8, 16)
        self.modes: list[bool] = []

    def forward(self, x: Tensor) -> Tensor:
        self.modes.append(_mode_on())
        q, k = self.qk(x).view(x.size(0), x.size(1), 2, 8).transpose(1, 2).chunk(2, dim=-1)
        logits = q @ k.transpose(-2, -1)
        if self.how == "sdpa":
            return F.scaled_dot_product_attention(q, k, k).sum(1)
        if self.how == "bound sdpa":
            return BOUND_SDPA(q, k, k).sum(1)
        if self.how == "F.softmax":
            return (F.softmax(logits, dim=-1) @ k).sum(1)
        if self.how == "torch.softmax":
            return (torch.softmax(logits, -1) @ k).sum(1)
        return (logits.softmax(-1) @ k).sum(1)


HOWS = ["sdpa", "F.softmax", "torch.softmax", "Tensor.softmax"]


def _passes(net: nn.Module, x: Tensor, passes: int, probe: AttentionProbe) -> list[dict[str, float]]:
    out = []
    for _ in range(passes):
        with probe.measuring():
            net(x).sum().backward()
        out.append({name: float(s.max_logit) for name, s in probe.take().items()})
    return out


@pytest.mark.parametrize("how", HOWS)
def test_after_the_first_pass_a_module_seen_through_the_wrappers_runs_without_the_mode(how: str) -> None:
    spy = Spy(how)
    net = nn.Sequential(spy)
    x = torch.randn(3, 5, 8)
    measured = _passes(net, x, 4, AttentionProbe(net, rediscover_every=3))
    assert spy.modes == [True, False, False, True]  # the mode on the passes that look at every module only
    assert len(measured[0]) == 1 and measured[0] == measured[1] == measured[2] == measured[3]


def test_a_function_bound_before_the_wrappers_keeps_the_mode_and_is_measured_on_every_pass() -> None:
    bound, wrapped = Spy("bound sdpa"), Spy("sdpa")
    net = nn.ModuleDict({"bound": bound, "wrapped": wrapped})
    x = torch.randn(3, 5, 8)
    probe = AttentionProbe(net, rediscover_every=3)
    measured = []
    for _ in range(4):
        with probe.measuring():
            (bound(x).sum() + wrapped(x).sum()).backward()
        measured.append({name: float(s.max_logit) for name, s in probe.take().items()})
    assert bound.modes == [True, True, True, True] and wrapped.modes == [True, False, False, True]
    assert sorted(measured[0]) == ["bound", "wrapped"]
    assert measured[0] == measured[1] == measured[2] == measured[3]


class AroundMultihead(nn.Module):
    """A module with its own softmax attention and an ``nn.MultiheadAttention`` inside (its inner SDPA)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.modes: list[bool] = []

    def forward(self, x: Tensor) -> Tensor:
        self.modes.append(_mode_on())
        y, _ = self.mha(x, x, x, need_weights=False)
        return torch.softmax(x @ x.transpose(-2, -1), dim=-1) @ y


def test_attention_inside_another_torch_function_is_counted_once_as_the_mode_counts_it() -> None:
    around = AroundMultihead()
    net = nn.Sequential(around)
    x = torch.randn(2, 4, 8)
    probe = AttentionProbe(net, rediscover_every=5)
    counts = []
    for _ in range(3):
        with probe.measuring():
            net(x).sum().backward()
        counts.append(sorted(name for part in probe.take_calls() for name in part.names))
    assert counts[0] == counts[1] == counts[2] == ["0", "0.mha"]  # not the MHA's inner SDPA as "0"'s
    assert around.modes == [True, True, True]  # the wrappers alone would see the inner call: it keeps the mode


def test_the_originals_are_back_after_each_pass_even_when_the_forward_raises() -> None:
    class Failing(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            F.scaled_dot_product_attention(x, x, x)
            raise ValueError("the user's forward fails")

    net = nn.Sequential(Failing())
    probe = AttentionProbe(net)
    for _ in range(2):
        with pytest.raises(ValueError, match="user's forward"), probe.measuring():
            net(torch.randn(1, 2, 3, 4))
        assert F.scaled_dot_product_attention is ORIGINAL_SDPA and torch.softmax is torch._C._VariableFunctions.softmax
        assert "softmax" not in Tensor.__dict__ and F.softmax is attention_calls.ORIGINALS[2][2]
        assert not _mode_on() and attention_calls.STATE.sinks == [] and attention_calls.STATE.depth == 0


def test_two_probes_at_once_each_measure_and_nothing_global_outlives_the_forward() -> None:
    net = nn.Sequential(CausalSelfAttention(sdpa=True))
    x = torch.randn(2, 5, 8)
    first, second = AttentionProbe(net), AttentionProbe(net)
    for _ in range(2):  # discovery, then the wrappers
        one, two = first.measuring(), second.measuring()
        one.__enter__()
        two.__enter__()
        net(x)
        assert F.scaled_dot_product_attention is ORIGINAL_SDPA  # the forward returned: the wrappers are out
        one.__exit__(None, None, None)  # not nested: the first stops first
        two.__exit__(None, None, None)
        a, b = first.take(), second.take()
        assert list(a) == list(b) == ["0"] and float(a["0"].max_logit) == float(b["0"].max_logit)
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA and attention_calls.STATE.sinks == []


def test_a_forward_that_raises_inside_a_measuring_never_closed_leaves_no_wrapper() -> None:
    """A fit that crashes on a sampled step leaves its ``measuring()`` open: torch's functions are still its own."""
    seen: list[bool] = []

    class Failing(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            seen.append(F.scaled_dot_product_attention is not ORIGINAL_SDPA)
            F.scaled_dot_product_attention(x, x, x)
            raise ValueError("the user's forward fails")

    net = nn.Sequential(Failing())
    probe = AttentionProbe(net)
    for _ in range(2):  # the pass that looks at every module, then one through the wrappers
        context = probe.measuring()
        context.__enter__()  # never exited, as a crashed fit leaves it
        with pytest.raises(ValueError, match="user's forward"):
            net(torch.randn(1, 2, 3, 4))
        assert F.scaled_dot_product_attention is ORIGINAL_SDPA and "softmax" not in Tensor.__dict__
        assert attention_calls.STATE.sinks == [] and not _mode_on()
        probe.attention = {"0"}  # as if the first pass had returned: the next pass watches "0" only
    assert seen == [True, True]


def test_calls_on_another_thread_are_not_measured_and_a_probe_there_uses_the_mode() -> None:
    net = nn.Sequential(CausalSelfAttention(sdpa=True))
    other = nn.Sequential(CausalSelfAttention(sdpa=True))
    x = torch.randn(2, 5, 8)
    here = AttentionProbe(net)
    there = AttentionProbe(other)
    _passes(net, x, 1, here)  # both know their modules: the next passes use the wrappers
    _passes(other, x, 1, there)
    found: dict[str, object] = {}

    def run_there() -> None:
        with there.measuring():  # the wrappers serve the main thread: this pass uses the mode
            other(x)
            heads = x.view(2, 5, 2, 4)
            found["attention"] = F.scaled_dot_product_attention(heads, heads, heads)
        found["there"] = sorted(there.take())

    with here.measuring():
        thread = threading.Thread(target=run_there)
        thread.start()
        thread.join()
        net(x)
    assert found["there"] == ["0"] and sorted(here.take()) == ["0"]
    assert len(here.take_calls()) == 0  # the other thread's calls were not this probe's
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA


def test_a_watched_pass_costs_no_python_dispatch_on_the_modules_other_torch_calls() -> None:
    """Counted, not timed: the mode's handler runs on a discovery pass only."""
    net = nn.Sequential(*(CausalSelfAttention(sdpa=True, dim=16, heads=2, residual=True) for _ in range(4)))
    x = torch.randn(4, 8, 16)
    probe = AttentionProbe(net, rediscover_every=10)
    handled = []
    original = type(probe._mode).__torch_function__

    def counting(self: object, func: object, *rest: object, **kwargs: object) -> object:
        handled.append(func)
        return original(self, func, *rest, **kwargs)  # type: ignore[arg-type]

    type(probe._mode).__torch_function__ = counting  # type: ignore[method-assign]
    try:
        per_pass = []
        for _ in range(3):
            handled.clear()
            with probe.measuring():
                net(x)
            per_pass.append(len(handled))
            assert len(probe.take()) == 4
    finally:
        type(probe._mode).__torch_function__ = original  # type: ignore[method-assign]
    assert per_pass[0] > 40 and per_pass[1] == per_pass[2] == 0


def test_a_compiled_model_keeps_the_function_mode_and_is_measured_on_every_pass() -> None:
    """torch.compile traces the wrappers into its graph and then misses the calls: compiled models keep the mode."""
    torch.manual_seed(0)
    block = CausalSelfAttention(sdpa=True)
    net = nn.Sequential(torch.compile(block, backend="aot_eager"))
    probe = AttentionProbe(net, rediscover_every=3)
    assert probe.compiled
    x = torch.randn(2, 5, 8)
    measured = _passes(net, x, 3, probe)
    assert len(measured[0]) == 1 and measured[0] == measured[1] == measured[2]
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA
    in_place = nn.Sequential(CausalSelfAttention(sdpa=True))
    in_place[0].compile(backend="aot_eager")  # module.compile(): compiled in place
    assert AttentionProbe(in_place).compiled and not AttentionProbe(nn.Sequential(block)).compiled


def test_another_librarys_patch_of_an_attention_function_is_wrapped_and_put_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A library that replaced ``F.scaled_dot_product_attention`` after the guard was imported keeps its function."""
    called: list[int] = []

    def patched(*args: object, **kwargs: object) -> Tensor:
        called.append(1)
        return ORIGINAL_SDPA(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", patched)
    spy = Spy("sdpa")
    net = nn.Sequential(spy)
    measured = _passes(net, torch.randn(3, 5, 8), 3, AttentionProbe(net))
    assert F.scaled_dot_product_attention is patched and len(called) == 3
    assert spy.modes == [True, False, False] and len(measured[0]) == 1 and measured[0] == measured[1] == measured[2]
