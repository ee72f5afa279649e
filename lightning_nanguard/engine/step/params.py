"""Which tensors a step updates, and their names: the model's parameters and what each optimizer steps.

An optimizer may update tensors the model no longer holds (replaced by
``load_state_dict(..., assign=True)``) or gain parameter groups mid-run (``BackboneFinetuning``):
:class:`StepParams` finds the tensors an optimizer really updates, cached per optimizer under a
one-``id``-per-group signature, and names every one of them.

Example:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Linear(2, 1)
    >>> params = StepParams()
    >>> params.attach(net)
    >>> sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> [name for name, _ in params.named] , len(params.of(net, sgd))
    (['weight', 'bias'], 2)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

__all__ = ["StepParams", "optimizer_params"]


class StepParams:
    """The model's named parameters and, per optimizer, the tensors it updates (see module docs)."""

    def __init__(self) -> None:
        self.named: list[tuple[str, nn.Parameter]] = []
        self.model_named: list[tuple[str, nn.Parameter]] = []  # the model's own (no optimizer-only tensors)
        # per optimizer: the signature of its parameter groups and the parameters it updates
        self._by_optimizer: dict[int, tuple[list[tuple[int, int]], list[Tensor]]] = {}

    def attach(self, module: nn.Module) -> None:
        """Name ``module``'s parameters; forget every optimizer's (found again at its next step)."""
        self.name(module)
        self._by_optimizer = {}

    def name(self, module: nn.Module, extra: Sequence[Tensor] = ()) -> None:
        """The model's named parameters, and a name for each tensor of ``extra`` that the model lacks."""
        model = list(module.named_parameters())
        known = {id(p) for _, p in model}
        lacking = [(f"<optimizer tensor {i} not in the model>", p) for i, p in enumerate(extra) if id(p) not in known]
        self.named = [*model, *lacking]  # type: ignore[list-item]
        self.model_named = model

    def of(self, module: nn.Module, optimizer: Any) -> list[Tensor]:
        """The tensors ``optimizer`` updates, the ones its step is checked on (cached; see module docs)."""
        signature = [(id(group["params"]), len(group["params"])) for group in optimizer.param_groups]  # no generator
        cached = self._by_optimizer.get(id(optimizer))
        if cached is not None and cached[0] == signature:
            return cached[1]
        params = optimizer_params(optimizer)
        named = {id(p) for _, p in self.named}
        if cached is not None or any(id(p) not in named for p in params):
            self.name(module, params)  # new or replaced tensors: name them
        self._by_optimizer[id(optimizer)] = (signature, params)
        return params

    def stray(self, optimizers: Sequence[Any]) -> int:
        """How many tensors ``optimizers`` update that are not the model's parameters."""
        model = {id(p) for _, p in self.named}
        return sum(id(p) not in model for optimizer in optimizers for p in optimizer_params(optimizer))


def optimizer_params(optimizer: Any) -> list[Tensor]:
    """The parameters ``optimizer`` updates, in its order."""
    return [p for group in optimizer.param_groups for p in group["params"]]
