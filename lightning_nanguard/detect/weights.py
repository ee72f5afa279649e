"""A module's weights as its ``state_dict`` holds them, found once and followed from check to check.

The check of the weights (every ``check_params_every_n_steps`` steps, and before each snapshot)
read ``module.state_dict(keep_vars=True)``: a walk of every module with its hooks and an ordered
dict of prefixed names, ~1.8 ms for a model of 1,500 parameter tensors, then a Python step per
tensor to sort them. :class:`ModuleWeights` finds the same tensors once (every module's parameters
and persistent buffers), and at each check tests that every slot still holds the tensor it found:
an identity test per slot, made in C (a ``map`` over the slots' dicts, no Python per tensor). Code
that assigns a new tensor to a slot (``module.weight = ...``, ``load_state_dict(assign=True)``) is
followed at once; a module or parameter added later is found at the next :meth:`~ModuleWeights.find`
(the guard calls it at each epoch's start, when it finds the model's parameters again, so that the
walk and the check's plan cost nothing at the check itself).

Example:
    >>> net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    >>> weights = ModuleWeights()
    >>> len(weights.tensors(net)), weights.all_finite(net)  # 2 + 2 parameters, 3 buffers
    (7, True)
    >>> net[0].bias = nn.Parameter(torch.tensor([0.0, float("nan")]))  # a new tensor in a slot
    >>> weights.all_finite(net)
    False
"""

from __future__ import annotations

from operator import is_not
from typing import Any

import torch  # noqa: F401  (the examples)
from torch import Tensor, nn

from lightning_nanguard.core.dtensor import any_dtensor
from lightning_nanguard.detect.check import plan_layout
from lightning_nanguard.detect.confirm import all_finite

__all__ = ["ModuleWeights", "reassigned"]


def reassigned(owners: list[dict[str, Any]], names: list[str], tensors: list[Tensor]) -> bool:
    """Whether some slot ``owners[i][names[i]]`` no longer holds ``tensors[i]``: code assigned another tensor.

    An identity test per slot, made in C (no Python frame per tensor), no value read.

    Example:
        >>> net = nn.Linear(2, 1)
        >>> slots = [net._parameters], ["bias"], [net.bias]
        >>> reassigned(*slots)
        False
        >>> net.bias = nn.Parameter(torch.zeros(1))
        >>> reassigned(*slots)
        True
    """
    return any(map(is_not, map(dict.get, owners, names), tensors))


class ModuleWeights:
    """The tensors ``module.state_dict()`` holds (parameters, persistent buffers), found once (see module docs)."""

    def __init__(self) -> None:
        self._module: nn.Module | None = None
        self._owners: list[dict[str, Any]] = []  # the dict each tensor sits in (``_parameters``, ``_buffers``)
        self._names: list[str] = []  # its key there
        self._tensors: list[Tensor] = []
        self._floats: list[Tensor] | None = None  # the floating-point ones; None: sharded, local shards read anew

    def find(self, module: nn.Module) -> None:
        """Find the tensors of ``module`` now and plan their check (modules or parameters may have been added)."""
        self._find(module)
        if self._floats is not None:
            plan_layout(self._floats)

    def tensors(self, module: nn.Module) -> list[Tensor]:
        """The parameters and persistent buffers of ``module``, in ``state_dict`` order."""
        if module is not self._module or reassigned(self._owners, self._names, self._tensors):
            self._find(module)
        return self._tensors

    def all_finite(self, module: nn.Module) -> bool:
        """No NaN/Inf in any floating-point weight of ``module`` (one host read; element-wise only if flagged)."""
        tensors = self.tensors(module)
        floats = self._floats
        return all_finite(tensors) if floats is None else all_finite(floats, planned=True)

    def _find(self, module: nn.Module) -> None:
        owners: list[dict[str, Any]] = []
        names: list[str] = []
        tensors: list[Tensor] = []
        for sub in module.modules():  # state_dict's order: a module's parameters, then its persistent buffers
            for slots, transient in ((sub._parameters, ()), (sub._buffers, sub._non_persistent_buffers_set)):
                for name, tensor in slots.items():
                    if tensor is not None and name not in transient:
                        owners.append(slots)
                        names.append(name)
                        tensors.append(tensor)
        self._module, self._owners, self._names, self._tensors = module, owners, names, tensors
        floats = [t for t in tensors if t.is_floating_point() or t.is_complex()]
        self._floats = None if any_dtensor(floats) else floats
