"""How ranks agree (``lightning_nanguard.decide.agreement``) without a process group.

With ``world_size=1`` every call is local; with more ranks the calls go through the strategy,
here a recording stand-in (the real collectives run in ``tests/integration/test_ddp.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_nanguard.decide.agreement import RankAgreement


class SummingStrategy:
    """A strategy whose ``reduce`` multiplies by the world size, as a sum over identical ranks would."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.root_device = torch.device("cpu")
        self.reduced: list[tuple[torch.Tensor, str]] = []

    def reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        self.reduced.append((tensor, reduce_op))
        return tensor.mul_(self.world_size)


@pytest.mark.parametrize("strategy", [None, SummingStrategy(1)])
def test_one_process_is_local(strategy: Any) -> None:
    agreement = RankAgreement(strategy, world_size=1)
    assert not agreement.distributed
    flags = torch.tensor([1.0, 0.0, 2.0])
    assert agreement.sum(flags) is flags  # no copy, no collective
    assert agreement.gather({"rank": 0}) == [{"rank": 0}]
    assert agreement.any(True) is True and agreement.any(False) is False
    if strategy is not None:
        assert strategy.reduced == []


def test_sum_over_ranks_reduces_a_copy_with_the_sum_op() -> None:
    strategy = SummingStrategy(3)
    agreement = RankAgreement(strategy, world_size=3)
    assert agreement.distributed
    flags = torch.tensor([1.0, 0.0])
    total = agreement.sum(flags)
    assert total.tolist() == [3.0, 0.0]
    assert flags.tolist() == [1.0, 0.0]  # the caller's flags are not reduced in place
    ((reduced, op),) = strategy.reduced
    assert op == "sum" and reduced is not flags


@pytest.mark.parametrize(("flag", "expected"), [(True, True), (False, False)])
def test_any_over_ranks_is_one_reduce_on_the_root_device(flag: bool, expected: bool) -> None:
    strategy = SummingStrategy(2)
    assert RankAgreement(strategy, world_size=2).any(flag) is expected
    ((reduced, op),) = strategy.reduced
    assert op == "sum" and reduced.device == strategy.root_device and reduced.shape == (1,)


def test_gather_without_an_initialised_process_group_is_this_ranks_item() -> None:
    """A world size above 1 but no process group (e.g. before setup): nothing to gather from."""
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())
    assert RankAgreement(SummingStrategy(2), world_size=2).gather(("found", 1)) == [("found", 1)]
