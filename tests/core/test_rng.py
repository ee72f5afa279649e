"""The state of every random number generator, put back bitwise (``lightning_nanguard.core.rng``)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lightning_nanguard.core.rng import RngState


def test_rng_state_round_trip_for_every_generator() -> None:
    state = RngState.capture()
    first = (torch.rand(3), random.random(), np.random.rand(2))
    state.restore()
    again = (torch.rand(3), random.random(), np.random.rand(2))
    assert torch.equal(first[0], again[0]) and first[1] == again[1] and np.array_equal(first[2], again[2])


def test_restore_can_repeat_and_leaves_the_snapshot_unchanged() -> None:
    state = RngState.capture()
    draws = []
    for _ in range(3):
        state.restore()
        draws.append((torch.randint(0, 10**9, (4,)).tolist(), random.getrandbits(64), int(np.random.randint(10**9))))
    assert draws[0] == draws[1] == draws[2]


def test_capture_does_not_advance_any_generator() -> None:
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    expected = (torch.rand(2), random.random(), np.random.rand())
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    RngState.capture()
    assert (
        torch.equal(torch.rand(2), expected[0]) and random.random() == expected[1] and np.random.rand() == expected[2]
    )


def test_restore_undoes_reseeding() -> None:
    """A re-run that reseeds (e.g. a user's ``seed_everything`` in ``training_step``) is undone too."""
    state = RngState.capture()
    expected = torch.rand(1)
    state.restore()
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    state.restore()
    assert torch.equal(torch.rand(1), expected)


def test_the_cpu_state_is_a_copy() -> None:
    state = RngState.capture()
    before = state.cpu.clone()
    torch.rand(100)
    assert torch.equal(state.cpu, before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_generators_round_trip_once_cuda_is_initialised() -> None:
    torch.cuda.init()
    state = RngState.capture()
    assert len(state.cuda) == torch.cuda.device_count()
    first = torch.rand(3, device="cuda")
    state.restore()
    assert torch.equal(torch.rand(3, device="cuda"), first)
