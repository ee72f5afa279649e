"""Multi-process runs under ``ModelParallelStrategy`` on CPU (gloo); run by ``integration/test_sharded.py``.

Usage: ``python tests/helpers/sharded_script.py MESH RUN OUTPUT_DIR`` with ``MESH`` one of ``fsdp2`` (data
parallel 2, a BatchNorm layer), ``tp`` (tensor parallel 2), ``2d`` (data parallel 2 x tensor
parallel 2, 4 processes) and ``one`` (FSDP2 on a single process), and ``RUN`` one of :data:`RUNS`: a
list of fits made one after the other in the same processes (a multi-process start costs more than
a fit of this model).

``abort``: the bisection cannot cut half a batch on the last rank: the diagnosis must stop on
every rank at the same pass, say why in the event, and training go on.

``loaders`` (not part of ``all``; ``fsdp2`` only; run by ``integration/test_sharded_loaders.py``):
two training loaders given to ``fit`` as a dict (a ``CombinedLoader``), of different then of equal
batch sizes, each with an all-zero record on data-parallel rank 1 (:data:`LOADERS_FITS`).

Every fit writes ``<fit>-rank<N>.json`` per rank: the steps whose update left every local shard
bitwise unchanged, the events, counters, learning rate, whether the guard is still active, a hash
of each parameter's *full* tensor (gathered at the end, on every rank) and of the BatchNorm
buffers, and what the fit's probes saw (rollback bitwise, checkpoint contents).

The faults are all on data-parallel rank 1 (its batches, through a ``DistributedSampler`` over
the data-parallel dimension only, which is what Lightning injects: tensor-parallel ranks share a
batch): an all-zero record (``x / x.norm()`` gives NaN in the forward), a record whose first
feature is exactly 0 (the ``sqrt`` of :class:`Gate` is finite in the forward, NaN in the backward:
its gradient lands in one shard of ``gate.weight``, which data-parallel rank 0 holds), a label typo
(a loss spike), and a divergence injected into the weights of every rank (the model state).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_nanguard import NanGuard, NonFiniteTrainingError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_reads import HostReadCounter  # the tests' helper, next to this script
from multitask_models import MultiTaskModule
from process_group import finish_script, leave_process_group_at_exit

leave_process_group_at_exit()  # every process of the run, ddp_spawn's workers too (they import this file)

BATCH = 8
FEATURES = 4
MESHES: dict[str, tuple[int, int]] = {"fsdp2": (2, 1), "tp": (1, 2), "2d": (2, 2), "one": (1, 1)}  # (dp, tp)
BAD_DP_RANK = 1  # all faults are in the batches of this data-parallel rank (the last one when there is one)


@dataclass(frozen=True)
class Fit:
    """One ``fit`` and its faults (steps are global steps; positions are in data-parallel rank 1's batch)."""

    name: str
    steps: int
    guard: dict[str, Any] = field(default_factory=dict)
    zero_record: tuple[int, int] | None = None  # (step, position): an all-zero record, NaN in the forward
    backward_record: tuple[int, int] | None = None  # (step, position): first feature exactly 0, NaN in backward
    typo: tuple[int, int] | None = None  # (step, position): label 1e4 instead of ~1, a loss spike
    diverge_at: int | None = None  # every rank multiplies its shards of net.down.weight by 1e20 before this step
    nonfinite_weights_at: int | None = None  # every rank writes NaN into net.down.weight right before a save
    fused: bool = False
    checkpoint_every: int | None = None
    resume_from: str | None = None  # a fit name: resume from its last checkpoint
    tensorboard: bool = False  # a TensorBoardLogger (else no logger)


MAIN = Fit(
    "main",
    steps=11,
    guard={
        "action": "rollback",
        "rollback_after_consecutive": 1,
        "snapshot_every_n_steps": 1,
        "remedies": ["lr_backoff", "quarantine", "clip_grad"],
        "spike_warmup_steps": 3,
        "spike_window": 8,
        "save_repro": True,
    },
    tensorboard=True,
    zero_record=(1, 3),
    backward_record=(3, 5),
    typo=(6, 2),
    diverge_at=8,
)
SYNC_FREE = Fit(
    "sync_free",
    steps=6,
    guard={"sync_free": True, "spike_action": "off"},
    zero_record=(1, 3),
    backward_record=(3, 5),
    fused=True,
)
SAVE = Fit(
    "save",
    steps=6,
    guard={
        "action": "rollback",
        "snapshot_every_n_steps": 1,
        "check_params_every_n_steps": 1,
        "remedies": ["quarantine"],
        "spike_warmup_steps": 3,
        "spike_window": 8,
    },
    zero_record=(1, 3),
    nonfinite_weights_at=5,
    checkpoint_every=6,
)
RESUME = Fit(
    "resume",
    steps=10,
    guard=SAVE.guard | {"rollback_after_consecutive": 1},
    diverge_at=8,
    resume_from="save",
)


class FailingSlicer:
    """Cuts a batch like the built-in slicer, except that the last rank cannot cut half a batch (4 samples).

    (A reference sample and a dummy pass take 2, a BatchNorm model's single sample is run as a pair.)
    """

    def __call__(self, batch: Any, positions: Any) -> Any:
        if len(positions) == BATCH // 2 and torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
            raise ValueError("the last rank cannot cut half a batch")
        return tuple(t[list(positions)] for t in batch)


ABORT = Fit("abort", steps=3, guard={"batch_slicer": FailingSlicer()}, zero_record=(1, 3))
FITS: dict[str, Fit] = {fit.name: fit for fit in (MAIN, SYNC_FREE, SAVE, RESUME, ABORT)}
RUNS: dict[str, tuple[Fit, ...]] = {"all": tuple(FITS.values()), **{name: (fit,) for name, fit in FITS.items()}}


class Gate(nn.Module):
    """``x + |w * x|``, the magnitude written as ``sqrt((w * x) ** 2)``: finite in the forward, NaN backward at 0."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        magnitude = (self.weight * x).pow(2).sqrt()  # BACKWARD ORIGIN
        return x + magnitude


class Net(nn.Module):
    def __init__(self, batchnorm: bool) -> None:
        super().__init__()
        self.gate = Gate(FEATURES)
        self.norm = nn.BatchNorm1d(FEATURES) if batchnorm else nn.Identity()
        self.up = nn.Linear(FEATURES, 16)
        self.act = nn.ReLU()
        self.down = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(self.norm(self.gate(x)))))


class Sharded(pl.LightningModule):
    def __init__(self, mesh: str = "fsdp2", fit: str = "main") -> None:
        super().__init__()
        self.save_hyperparameters()  # a repro bundle rebuilds the module (unsharded) from them
        torch.manual_seed(0)  # the same initial weights on every rank
        self.mesh_name, self.fit_config = mesh, FITS[fit]
        self.net = Net(batchnorm=mesh == "fsdp2")

    def configure_model(self) -> None:
        dp_mesh, tp_mesh = self.device_mesh["data_parallel"], self.device_mesh["tensor_parallel"]
        if tp_mesh.size() > 1:
            parallelize_module(self.net, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        if dp_mesh.size() > 1 or tp_mesh.size() == 1:  # FSDP2 on one device too
            for module in (self.net.gate, self.net.norm, self.net.up, self.net.down):
                if any(True for _ in module.parameters()):
                    fully_shard(module, mesh=dp_mesh)
            fully_shard(self.net, mesh=dp_mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        x = x / x.norm(dim=1, keepdim=True)  # FORWARD ORIGIN
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def train_dataloader(self) -> DataLoader:
        dp_mesh = self.device_mesh["data_parallel"]
        dp, dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
        fit = self.fit_config
        n = BATCH * dp * fit.steps
        g = torch.Generator().manual_seed(7)
        x, y = torch.randn(n, FEATURES, generator=g), torch.randn(n, generator=g) * 0.1 + 1.0
        bad = min(BAD_DP_RANK, dp - 1)
        if fit.zero_record is not None:
            x[dataset_index(*fit.zero_record, dp, bad)] = 0.0
        if fit.backward_record is not None:
            x[dataset_index(*fit.backward_record, dp, bad), 0] = 0.0
        if fit.typo is not None:
            y[dataset_index(*fit.typo, dp, bad)] = 1e4
        sampler = DistributedSampler(TensorDataset(x, y), num_replicas=dp, rank=dp_rank, shuffle=False)
        return DataLoader(TensorDataset(x, y), batch_size=BATCH, sampler=sampler)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # torch's fused Adam refuses a group mixing DTensor and plain parameters (tensor parallel leaves the gate
        # plain): one group of each
        params = list(self.parameters())
        groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
        return torch.optim.Adam([{"params": g} for g in groups if g], lr=1e-2, fused=self.fit_config.fused)


def dataset_index(step: int, position: int, dp: int, dp_rank: int) -> int:
    """The dataset index that data-parallel rank ``dp_rank`` sees at ``position`` of its batch ``step``."""
    return dp_rank + (step * BATCH + position) * dp


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _shards(module: nn.Module) -> list[torch.Tensor]:
    return [_local(p.detach()).clone() for p in module.parameters()]


def _optimizer_shards(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = []
    for state in optimizer.state.values():
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor):
                out.append(_local(value.detach()).clone())
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class Probe(pl.Callback):
    """Skipped steps (every local shard bitwise unchanged), injected faults, and the rollback's bitwise check."""

    def __init__(self, fit: Fit, guard: NanGuard) -> None:
        self.fit, self.guard = fit, guard
        self.loaded: dict[str, Any] | None = None  # the guard's state when training starts (after a resume)
        self.skipped: list[int] = []
        self.events_at_batch_end: list[int] = []  # the guard's event count (sync-free: one step late)
        self.lr: list[float] = []
        self.reference_norms: list[float] = []  # the global gradient norm, from the full gradients
        self.guard_norms: list[float | None] = []  # what the guard used for clip_grad at the same step
        self.rollback_bitwise: bool | None = None
        self.first_weights_finite: bool | None = None
        self._before: list[torch.Tensor] = []
        self._before_divergence: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        optimizer = trainer.optimizers[0]
        if self.loaded is None:
            self.loaded = json.loads(json.dumps(self.guard.state_dict()))
        if self.first_weights_finite is None:
            self.first_weights_finite = all(bool(torch.isfinite(_local(p)).all()) for p in pl_module.parameters())
        if self._before_divergence is not None and step == self.fit.diverge_at + 1:  # type: ignore[operator]
            shards, states = self._before_divergence
            self.rollback_bitwise = _same(shards, _shards(pl_module)) and _same(states, _optimizer_shards(optimizer))
        if step == self.fit.diverge_at:
            self._before_divergence = (_shards(pl_module), _optimizer_shards(optimizer))
            with torch.no_grad():
                _local(pl_module.net.down.weight).mul_(1e20)
        self._before = _shards(pl_module)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        """Before the guard (earlier in the callbacks): the global norm from the gathered gradients (every rank)."""
        total = 0.0
        for param in pl_module.parameters():
            if param.grad is not None:
                grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
                total += float(grad.double().pow(2).sum())
        self.reference_norms.append(total**0.5)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step - 1
        self.guard_norms.append(self.guard.last_grad_norm)
        self.lr.append(float(trainer.optimizers[0].param_groups[0]["lr"]))
        self.events_at_batch_end.append(len(self.guard.events))
        if step != self.fit.diverge_at and _same(self._before, _shards(pl_module)):
            self.skipped.append(step)
        if self.fit.diverge_at is not None and step == self.fit.diverge_at and self.rollback_bitwise is None:
            shards, _ = self._before_divergence or ([], [])
            if _same(shards, _shards(pl_module)):
                self.skipped.append(step)  # rolled back to the state before the injection
        if self.fit.nonfinite_weights_at is not None and step == self.fit.nonfinite_weights_at:
            with torch.no_grad():
                _local(pl_module.net.down.weight).fill_(float("nan"))  # NaN weights right before the save


class CountingNanGuard(NanGuard):
    """NanGuard counting the host reads of its per-step hooks (sync-free ones of its own host copy excluded)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reads_per_step: list[int] = []
        self._counter = HostReadCounter(ignore_host_copies=True)

    def on_train_batch_start(self, *args: Any) -> None:
        self._counter.reads.clear()
        with self._counter:
            super().on_train_batch_start(*args)

    def on_before_backward(self, *args: Any) -> None:
        with self._counter:
            super().on_before_backward(*args)

    def on_before_optimizer_step(self, *args: Any) -> None:
        with self._counter:
            super().on_before_optimizer_step(*args)
        self.reads_per_step.append(sum(self._counter.reads.values()))


class CheckpointContents(pl.Callback):
    """What ``on_save_checkpoint`` left in the checkpoint (after the guard, which runs first)."""

    def __init__(self) -> None:
        self.saved: list[dict[str, Any]] = []

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        state = checkpoint.get("state_dict", {})
        finite = all(bool(torch.isfinite(_local(v)).all()) for v in state.values() if torch.is_floating_point(v))
        self.saved.append(
            {
                "step": trainer.global_step,
                "finite": finite,
                "substituted_step": checkpoint.get("nanguard_substituted_step"),
                "per_rank_states": [
                    len(per_rank)
                    for key, state in checkpoint.get("callbacks", {}).items()
                    if "NanGuard" in str(key) and (per_rank := state.get("per_rank")) is not None
                ],
            }
        )


def _full_hashes(module: nn.Module) -> dict[str, str]:
    """sha256 of every parameter's full tensor (a gather per DTensor: every rank calls this in the same order)."""
    out = {}
    for name, param in module.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        out[name] = hashlib.sha256(full.detach().cpu().numpy().tobytes()).hexdigest()
    return out


def run_fit(mesh: str, fit: Fit, out_dir: str) -> None:
    dp, tp = MESHES[mesh]
    guard = CountingNanGuard(verbose=False, **fit.guard)
    probe, contents = Probe(fit, guard), CheckpointContents()
    callbacks: list[pl.Callback] = [probe, guard, contents]
    checkpoint_dir = os.path.join(out_dir, f"checkpoints-{fit.name}")
    if fit.checkpoint_every is not None:
        callbacks.append(
            ModelCheckpoint(dirpath=checkpoint_dir, every_n_train_steps=fit.checkpoint_every, save_top_k=-1)
        )
    trainer = pl.Trainer(
        strategy=ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp),
        accelerator="cpu",
        devices=dp * tp,
        max_steps=fit.steps,
        max_epochs=-1,  # max_steps ends the fit (a resumed fit starts a new epoch)
        logger=TensorBoardLogger(out_dir, name=fit.name, version=0) if fit.tensorboard else False,
        enable_checkpointing=fit.checkpoint_every is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # the module's DistributedSampler splits over data parallel only
        default_root_dir=os.path.join(out_dir, fit.name),
        callbacks=callbacks,
    )
    module = Sharded(mesh, fit.name)
    ckpt_path = None
    if fit.resume_from is not None:
        folder = os.path.join(out_dir, f"checkpoints-{fit.resume_from}")
        ckpt_path = os.path.join(folder, sorted(os.listdir(folder))[-1])
    error = None
    try:
        trainer.fit(module, ckpt_path=ckpt_path)
    except NonFiniteTrainingError as caught:
        error = {"message": str(caught), "step": trainer.global_step}
    dp_mesh = module.device_mesh["data_parallel"]
    buffers = b"".join(_local(b).detach().numpy().tobytes() for b in module.buffers())
    spikes = guard.controller.spikes
    result = {
        "rank": trainer.global_rank,
        "dp_rank": dp_mesh.get_local_rank(),
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "active": guard.active,
        "error": error,
        "skipped_steps": probe.skipped,
        "reads_per_step": guard.reads_per_step,
        "events_at_batch_end": probe.events_at_batch_end,
        "lr": probe.lr,
        "reference_norms": probe.reference_norms,
        "guard_norms": probe.guard_norms,
        "rollback_bitwise": probe.rollback_bitwise,
        "loaded": probe.loaded,
        "saved_state": json.loads(json.dumps(guard.state_dict())),
        "first_weights_finite": probe.first_weights_finite,
        "finite": all(bool(torch.isfinite(_local(p)).all()) for p in module.parameters()),
        "full_hashes": _full_hashes(module),
        "buffers_sha256": hashlib.sha256(buffers).hexdigest(),
        "buffers_finite": all(bool(torch.isfinite(_local(b)).all()) for b in module.buffers() if b.is_floating_point()),
        "counters": {
            "bad_steps_total": guard.bad_steps_total,
            "skipped_total": guard.skipped_total,
            "spikes_total": guard.counters.spikes_total,
        },
        "quarantined": sorted(guard.remedy_book.quarantined),
        "rollbacks_total": guard.recovery.rollbacks_total,
        "spike_history": spikes.state_dict() if spikes is not None else None,
        "events": [event.to_dict() for event in guard.events],
        "checkpoints": contents.saved,
        "dataset_index": {
            name: dataset_index(*where, dp, min(BAD_DP_RANK, dp - 1))
            for name, where in (("zero", fit.zero_record), ("backward", fit.backward_record), ("typo", fit.typo))
            if where is not None
        },
        "log_dir": guard.log_dir,
    }
    with open(os.path.join(out_dir, f"{fit.name}-rank{trainer.global_rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(result, handle)


# ------------------------------------------------------------------------------------ several training loaders


@dataclass(frozen=True)
class LoadersFit:
    """A fit on two training loaders, ``a`` and ``b``: each one's batch size (per data-parallel rank) and zero record.

    ``zero_records``: loader -> (step, position in its part of data-parallel rank 1's batch) of an
    all-zero record (a NaN loss). A healthy step 0's first samples become the guard's reference
    sub-batch (what the rank that does not search runs in its dummy passes); at a bad step 0 there
    is none yet, and that rank cuts its dummy batch from the step's batch, loader by loader.
    """

    name: str
    batch: dict[str, int]
    zero_records: dict[str, tuple[int, int]]
    steps: int = 5


LOADERS_FITS = (  # parts of different sizes; of equal sizes (a batch cut as one is cut at the same rows of both)
    LoadersFit("loaders", batch={"a": 8, "b": 4}, zero_records={"b": (1, 2), "a": (3, 5)}),
    LoadersFit("loaders_equal", batch={"a": 4, "b": 4}, zero_records={"b": (1, 2), "a": (3, 1)}),
    LoadersFit("loaders_first_step", batch={"a": 8, "b": 4}, zero_records={"b": (0, 2), "a": (3, 5)}),  # no reference
)
LOADER_SEED = 0  # the seed of the DistributedSampler Lightning puts into each loader (PL_GLOBAL_SEED unset)


class ShardedMultiTask(MultiTaskModule):
    """``multitask_models.MultiTaskModule`` (a shared projection, one head per loader) under FSDP2.

    Each loader's ``x`` is normalised first: an all-zero record gives ``0 / 0``, a NaN loss on the
    rank whose batch holds it (and NaN gradients on every rank, through the reduction).
    """

    def __init__(self) -> None:
        torch.manual_seed(0)  # the same initial weights on every rank
        super().__init__((("a",), ("b",)))

    def configure_model(self) -> None:
        dp_mesh = self.device_mesh["data_parallel"]
        for module in (self.shared, *self.heads):
            fully_shard(module, mesh=dp_mesh)

    def task_loss(self, x: torch.Tensor, y: torch.Tensor, head: nn.Module) -> torch.Tensor:
        x = x / x.norm(dim=-1, keepdim=True)  # LOADERS FORWARD ORIGIN
        return super().task_loss(x, y, head)


def loader_datasets(fit: LoadersFit, dp: int) -> tuple[dict[str, TensorDataset], dict[str, int]]:
    """Each loader's dataset (the same in every process) and the dataset index of its zero record.

    The record is put where data-parallel rank 1 meets it (``fit.zero_records``), in the order of the
    shuffling ``DistributedSampler`` Lightning gives a training loader (epoch 0).
    """
    datasets, zero = {}, {}
    for seed, (key, batch) in enumerate(fit.batch.items(), start=11):
        n = batch * dp * fit.steps  # as many batches in each loader: no loader cycles
        g = torch.Generator().manual_seed(seed)
        dataset = TensorDataset(torch.randn(n, FEATURES, generator=g), torch.randn(n, generator=g))
        sampler = DistributedSampler(dataset, num_replicas=dp, rank=min(BAD_DP_RANK, dp - 1), seed=LOADER_SEED)
        step, position = fit.zero_records[key]
        zero[key] = list(sampler)[step * batch + position]
        dataset.tensors[0][zero[key]] = 0.0
        datasets[key] = dataset
    return datasets, zero


class ZeroRecordsSeen(pl.Callback):
    """Where the batches ``training_step`` received held an all-zero record: ``[step, loader, position]``."""

    def __init__(self) -> None:
        self.seen: list[list[Any]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any) -> None:
        for key, (x, _) in batch.items():
            for position in (x.abs().sum(dim=-1) == 0).nonzero().flatten().tolist():
                self.seen.append([trainer.global_step, key, position])


def run_loaders_fit(mesh: str, fit: LoadersFit, out_dir: str) -> None:
    """Two training loaders as a dict, ``trainer.fit(model, {"a": ..., "b": ...})``, under FSDP2 (2 ranks).

    Lightning puts a shuffling ``DistributedSampler`` over the data-parallel ranks into each loader.
    Writes ``<fit>-rank<N>.json``: skipped steps, events, full-weight hashes, the dataset index of
    each loader's zero record (``zero_index``) and where this rank's batches held one (``zero_seen``).
    """
    if mesh != "fsdp2":
        raise ValueError(f"the loaders run is an FSDP2 run over 2 ranks, not {mesh!r}")
    dp, tp = MESHES[mesh]
    guard = NanGuard(verbose=False)
    probe, seen = Probe(Fit(fit.name, fit.steps), guard), ZeroRecordsSeen()
    trainer = pl.Trainer(
        strategy=ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp),
        accelerator="cpu",
        devices=dp * tp,
        max_steps=fit.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=os.path.join(out_dir, fit.name),
        callbacks=[seen, probe, guard],
    )
    module = ShardedMultiTask()
    datasets, zero_index = loader_datasets(fit, dp)
    loaders = {key: DataLoader(datasets[key], batch_size=size) for key, size in fit.batch.items()}
    error = None
    try:
        trainer.fit(module, train_dataloaders=loaders)
    except NonFiniteTrainingError as caught:
        error = {"message": str(caught), "step": trainer.global_step}
    result = {
        "rank": trainer.global_rank,
        "dp_rank": module.device_mesh["data_parallel"].get_local_rank(),
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "active": guard.active,
        "error": error,
        "skipped_steps": probe.skipped,
        "finite": all(bool(torch.isfinite(_local(p)).all()) for p in module.parameters()),
        "full_hashes": _full_hashes(module),
        "events": [event.to_dict() for event in guard.events],
        "zero_index": zero_index,
        "zero_seen": seen.seen,
    }
    with open(os.path.join(out_dir, f"{fit.name}-rank{trainer.global_rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(result, handle)


def main(mesh: str, run: str, out_dir: str) -> None:
    if run == "loaders":
        for loaders_fit in LOADERS_FITS:
            run_loaders_fit(mesh, loaders_fit, out_dir)
        return
    for fit in RUNS[run]:
        run_fit(mesh, fit, out_dir)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
    finish_script()
