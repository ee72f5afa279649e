"""Rollback's building blocks: ``HostCopy`` and ``TrainingSnapshot`` (module, optimizer, scheduler, scaler, RNG).

``action="rollback"`` on a real Trainer is tested in ``tests/integration/test_rollback.py``.
"""

from __future__ import annotations

import copy
import math
import random
import time
from typing import Any

import numpy as np
import pytest
import torch
from states import clone_state, rng_states, states_equal
from torch import nn

from lightning_nanguard.recover.snapshot import HostCopy, TrainingSnapshot

# ------------------------------------------------------------------------------------ HostCopy


def test_host_copy_mirrors_tensors_and_copies_other_leaves() -> None:
    live: dict[str, Any] = {"w": torch.arange(4.0), "nested": {"step": 3, "betas": (0.9, 0.99), "ids": [1, 2]}}
    mirror = HostCopy()
    mirror.update(live)
    live["w"].add_(10.0)
    live["nested"]["ids"].append(3)
    value = mirror.value()
    assert value["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert value["nested"] == {"step": 3, "betas": (0.9, 0.99), "ids": [1, 2]}
    assert mirror.nbytes == 4 * 4


def test_host_copy_reuses_its_buffers_in_place() -> None:
    mirror = HostCopy()
    mirror.update({"a": torch.zeros(3), "b": torch.ones(2, dtype=torch.float64)})
    first = [t.data_ptr() for t in mirror._buffers]
    mirror.update({"a": torch.full((3,), 7.0), "b": torch.zeros(2, dtype=torch.float64)})
    assert [t.data_ptr() for t in mirror._buffers] == first  # refreshed in place, not reallocated
    assert mirror.value()["a"].tolist() == [7.0, 7.0, 7.0]
    mirror.update({"a": torch.zeros(5), "b": torch.zeros(2, dtype=torch.float64)})  # shape changed
    assert mirror.value()["a"].shape == (5,)
    assert mirror.nbytes == 5 * 4 + 2 * 8


def test_host_copy_value_before_update_raises() -> None:
    with pytest.raises(RuntimeError, match="before update"):
        HostCopy().value()


# ------------------------------------------------------------------------------------ TrainingSnapshot


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 1))


def _train_steps(net: nn.Module, opt: torch.optim.Optimizer, sched: Any, n: int) -> None:
    for _ in range(n):
        opt.zero_grad()
        net(torch.randn(6, 4)).pow(2).mean().backward()
        opt.step()
        sched.step()


def _everything(net: nn.Module, opt: torch.optim.Optimizer, sched: Any, scaler: Any) -> dict[str, Any]:
    return {
        "module": clone_state(net.state_dict()),
        "optimizer": clone_state(opt.state_dict()),
        "scheduler": copy.deepcopy(sched.state_dict()),
        "scaler": copy.deepcopy(scaler.state_dict()),
        "rng": rng_states(),
    }


def test_snapshot_restores_module_optimizer_scheduler_scaler_and_rng_bitwise() -> None:
    net = _net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))  # the scaler creates its scale tensor lazily
    _train_steps(net, opt, sched, 3)
    snapshot = TrainingSnapshot()
    snapshot.capture(net, [opt], scaler, [sched], global_step=3, extra={"skipped_total": 1})
    expected = _everything(net, opt, sched, scaler)
    params = [p for p in net.parameters()]

    _train_steps(net, opt, sched, 2)  # moves weights, BN stats, Adam state, LR and RNG on
    scaler.update(new_scale=2.0)
    random.random()
    np.random.rand()
    with torch.no_grad():
        net[0].weight.fill_(math.nan)
    assert not states_equal(_everything(net, opt, sched, scaler), expected)

    snapshot.restore(net, [opt], scaler, [sched])
    assert states_equal(_everything(net, opt, sched, scaler), expected)
    assert [p for p in net.parameters()] == params  # in place: the optimizer still holds the same tensors
    assert opt.state_dict()["state"][0]["step"] == torch.tensor(3.0)
    assert (snapshot.global_step, snapshot.count, snapshot.extra) == (3, 1, {"skipped_total": 1})


def test_snapshot_is_not_aliased_by_the_restored_optimizer() -> None:
    """Every rollback to the same snapshot restores the same state (a second rollback used to restore Adam state
    that the steps after the first rollback had written into the snapshot's host buffers)."""
    net = _net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu")
    _train_steps(net, opt, sched, 2)
    snapshot = TrainingSnapshot()
    snapshot.capture(net, [opt], scaler, [sched])
    expected = _everything(net, opt, sched, scaler)
    for _ in range(3):
        _train_steps(net, opt, sched, 2)
        snapshot.restore(net, [opt], scaler, [sched])
        assert states_equal(_everything(net, opt, sched, scaler), expected)


def test_snapshot_restore_before_capture_raises() -> None:
    snapshot = TrainingSnapshot()
    assert not snapshot.available
    with pytest.raises(RuntimeError, match="no snapshot"):
        snapshot.restore(nn.Linear(1, 1), [])


def test_snapshot_cost_of_a_few_megabytes(capsys: pytest.CaptureFixture[str]) -> None:
    """Measured cost of one snapshot (printed; run with ``-s`` to see it): host memory and time."""
    net = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))  # 1,050,112 parameters: 4.0 MiB
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    net(torch.randn(2, 512)).sum().backward()
    opt.step()  # Adam state exists: exp_avg + exp_avg_sq double the weights
    n_params = sum(p.numel() for p in net.parameters())
    snapshot = TrainingSnapshot()
    snapshot.capture(net, [opt])  # first capture allocates the host buffers
    timings = []
    for _ in range(5):
        start = time.perf_counter()
        snapshot.capture(net, [opt])
        timings.append(time.perf_counter() - start)
    expected_bytes = 3 * n_params * 4 + 4 * 4  # weights, exp_avg, exp_avg_sq (float32) + 4 Adam step scalars
    assert snapshot.nbytes == expected_bytes
    assert snapshot.count == 6
    start = time.perf_counter()
    snapshot.restore(net, [opt])
    restore_ms = (time.perf_counter() - start) * 1e3
    with capsys.disabled():
        print(
            f"\n[snapshot cost] {n_params * 4 / 2**20:.1f} MiB of weights + Adam state: "
            f"{snapshot.nbytes / 2**20:.1f} MiB host memory, capture {min(timings) * 1e3:.2f} ms "
            f"(median {sorted(timings)[2] * 1e3:.2f} ms), restore {restore_ms:.2f} ms"
        )


# ------------------------------------------------------------------------------------ sharded state (DTensor)


def test_sharded_state_is_kept_as_local_shards_and_restored_bitwise() -> None:
    """Each rank keeps its own shards on the host (nothing gathered) and writes them back into the live shards."""
    from fake_mesh import fake_world
    from torch.distributed.tensor import DTensor, Replicate, Shard

    with fake_world(4, rank=1) as world:
        mesh = world.mesh((2, 2), ("data_parallel", "tensor_parallel"))
        net = nn.Linear(4, 2)
        net.weight = nn.Parameter(DTensor.from_local(torch.randn(1, 2), mesh, [Shard(0), Shard(1)]))
        net.bias = nn.Parameter(DTensor.from_local(torch.randn(1), mesh, [Shard(0), Replicate()]))
        optimizer = torch.optim.Adam(net.parameters(), lr=0.1)
        for p in net.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
        snapshot = TrainingSnapshot()
        snapshot.capture(net, [optimizer], global_step=7)
        assert snapshot.sharded
        assert snapshot.nbytes == (2 + 1) * 4 * 3 + 2 * 4  # local shards: weights, exp_avg, exp_avg_sq; 2 steps
        before = {k: v.to_local().clone() for k, v in net.state_dict().items()}
        state_before = [s["exp_avg"].to_local().clone() for s in optimizer.state.values()]
        value = snapshot.module.value()
        assert isinstance(value["weight"], DTensor) and value["weight"].shape == (2, 4)
        assert value["weight"].placements == (Shard(0), Shard(1))

        optimizer.step()  # the live shards move on, and are poisoned
        with torch.no_grad():
            net.weight.to_local().fill_(float("nan"))
        snapshot.restore(net, [optimizer])

        assert all(torch.equal(net.state_dict()[k].to_local(), v) for k, v in before.items())
        assert isinstance(net.weight, DTensor)  # the same parameters, still sharded
        restored = [s["exp_avg"] for s in optimizer.state.values()]
        assert all(isinstance(s, DTensor) for s in restored)
        assert all(torch.equal(s.to_local(), b) for s, b in zip(restored, state_before, strict=True))
