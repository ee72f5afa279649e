"""Copies and bitwise comparisons of training state (weights, buffers, optimizer state): plain torch, no Trainer."""

from __future__ import annotations

import copy
import pickle
import random
from typing import Any

import numpy as np
import torch

__all__ = ["bitwise_equal", "clone_state", "rng_states", "states_equal"]


def clone_state(value: Any) -> Any:
    """Deep copy with every tensor detached and cloned (optimizer state, buffers, parameters)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: clone_state(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(clone_state(item) for item in value)
    return copy.deepcopy(value)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (``torch.equal`` on the raw bits: NaN equals the same NaN, -0.0 != 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(_bytes(a), _bytes(b))


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(-1).view(torch.uint8)


def states_equal(a: Any, b: Any) -> bool:
    """Bitwise equality of nested states (dicts, lists, tensors, numbers)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and bitwise_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(states_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(states_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def rng_states() -> dict[str, Any]:
    """The global RNG streams (torch, Python, numpy), comparable with :func:`states_equal`."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": pickle.dumps(np.random.get_state())}
