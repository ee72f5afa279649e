"""The weights as state_dict holds them, found once: the same tensors, followed when code replaces them."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

from lightning_nanguard.detect.weights import ModuleWeights


class _WithBuffers(nn.Module):
    """A persistent and a transient buffer (a causal mask with -inf: not part of the state, not checked)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.register_buffer("scale", torch.ones(3))
        self.register_buffer("mask", torch.full((3, 3), -math.inf).triu(1), persistent=False)
        self.register_parameter("unused", None)


def _tied() -> nn.Module:
    embedding, head = nn.Embedding(5, 4), nn.Linear(4, 5, bias=False)
    head.weight = embedding.weight  # tied: state_dict lists it under both names
    return nn.Sequential(embedding, nn.LayerNorm(4), head)


def _tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=8, vocab_size=16, n_positions=8))


MODELS = {
    "buffers": _WithBuffers,
    "batchnorm": lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.BatchNorm1d(2, affine=False)),
    "tied": _tied,
    "weight norm": lambda: nn.Sequential(parametrizations.weight_norm(nn.Linear(3, 3)), nn.ReLU()),
    "transformers GPT-2": _tiny_gpt2,
}


@pytest.mark.parametrize("name", list(MODELS))
def test_the_tensors_are_those_state_dict_holds_in_its_order(name: str) -> None:
    module = MODELS[name]()
    found = ModuleWeights().tensors(module)
    expected = list(module.state_dict(keep_vars=True).values())
    assert len(found) == len(expected) and all(a is b for a, b in zip(found, expected, strict=True))


def test_a_transient_buffer_with_inf_is_not_a_weight() -> None:
    module = _WithBuffers()
    assert ModuleWeights().all_finite(module)
    module.scale[1] = math.nan
    assert not ModuleWeights().all_finite(module)


@pytest.mark.parametrize("slot", ["parameter", "buffer", "removed"])
def test_a_tensor_assigned_to_a_slot_is_followed_at_the_next_check(slot: str) -> None:
    module = MODELS["batchnorm"]()
    weights = ModuleWeights()
    assert weights.all_finite(module)
    if slot == "parameter":
        module[0].weight = nn.Parameter(torch.full_like(module[0].weight, math.nan))
    elif slot == "buffer":
        module[1].running_var = torch.tensor([1.0, math.inf])  # e.g. StochasticWeightAveraging's reset
    else:
        module[0].bias = None  # a slot emptied: found again without it
    assert weights.all_finite(module) == (slot == "removed")
    expected = list(module.state_dict(keep_vars=True).values())
    assert all(a is b for a, b in zip(weights.tensors(module), expected, strict=True))


def test_values_written_in_place_are_read_at_each_check() -> None:
    module = MODELS["tied"]()
    weights = ModuleWeights()
    tensors = weights.tensors(module)
    assert weights.all_finite(module)
    with torch.no_grad():
        module[2].weight[0, 0] = math.inf  # the tied tensor, in place: the same tensors, new values
    assert not weights.all_finite(module) and weights.tensors(module) is tensors  # not found again
    with torch.no_grad():
        module[2].weight[0, 0] = 1e30  # finite; its square overflows a norm, not the element-wise confirmation
    assert weights.all_finite(module)


def test_a_module_added_later_is_found_by_find_and_another_module_at_once() -> None:
    module = MODELS["buffers"]()
    weights = ModuleWeights()
    assert weights.all_finite(module)
    module.extra = nn.Linear(2, 2)
    with torch.no_grad():
        module.extra.weight.fill_(math.nan)
    assert weights.all_finite(module)  # the tensors found before
    weights.find(module)  # the guard finds them again at each epoch's start
    assert not weights.all_finite(module)
    other = MODELS["batchnorm"]()
    assert weights.all_finite(other) and len(weights.tensors(other)) == len(other.state_dict())
