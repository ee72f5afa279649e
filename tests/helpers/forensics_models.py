"""Extra models for the forensics tests (importable in a fresh process for ``replay``).

Every failing op carries a trailing ``# ORIGIN: <name>`` comment; find its line with
``origin_line(name, forensics_models.__file__)``. The failure-class networks themselves come
from :mod:`models`.
"""

from __future__ import annotations

import math
from collections import UserDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset

if __package__:  # imported as ``tests.helpers.forensics_models`` (by ``python -m studies.spike_margins``)
    from .models import make_net
else:  # ``tests/helpers`` on the path: pytest, and the fresh processes of the replay tests
    from models import make_net

__all__ = [
    "one_thread",
    "DataclassBatch",
    "DictBatchModule",
    "DivergingMLP",
    "InteractionModule",
    "IsolationModule",
    "NamedBatch",
    "NestedModule",
    "ReplayModule",
    "StepOriginModule",
    "WideBatchNormModule",
    "diverge",
    "diverging_data",
    "interaction_values",
    "nan_sample_data",
]


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run a test with one intra-op thread (``pytestmark = pytest.mark.usefixtures("one_thread")``).

    These models are tiny: on a busy 2-core machine, OpenMP threads waiting for each other made a
    BatchNorm forward/backward ~60x slower (110 ms instead of 1.7 ms per step).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class ReplayModule(pl.LightningModule):
    """A failure-class network that ``replay`` can rebuild from its saved hyperparameters."""

    def __init__(self, kind: str = "cosine_norm", seed: int = 0, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = make_net(kind, seed)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.net.loss(batch)  # type: ignore[operator]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


# ---------------------------------------------------------------------------- nested modules


class ZeroSensitiveNorm(nn.Module):
    """``x / |x|`` with ``eps`` outside the root: NaN gradient for an all-zero row."""

    def forward(self, x: Tensor) -> Tensor:
        norm = x.pow(2).sum(-1, keepdim=True).sqrt()  # ORIGIN: nested_norm
        return x / (norm + 1e-6)


class Inner(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(features, features, bias=False)
        self.norm = ZeroSensitiveNorm()

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        return self.norm(self.proj(x) * gate.unsqueeze(-1))


class Block(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.inner = Inner(features)

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        return x + self.inner(x, gate)


class NestedModule(pl.LightningModule):
    """``blocks`` is a ``ModuleList``; the gate zeroes the input of ``blocks.1.inner.norm`` for bad samples.

    Bad samples have ``gate == 0``: only block 1 uses the gate (the others get ones), so the
    origin is ``blocks.1.inner.norm`` and nothing else.
    """

    def __init__(self, features: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(features) for _ in range(3))
        self.head = nn.Linear(features, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, gate, y = batch
        ones = torch.ones_like(gate)
        for i, block in enumerate(self.blocks):
            x = block(x, gate if i == 1 else ones)
        return F.mse_loss(self.head(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


# ---------------------------------------------------------------------------- origin in training_step


class StepOriginModule(pl.LightningModule):
    """The failing op is written in ``training_step`` itself: ``culprit_module == ""``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 3, bias=False)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        h = self.layer(x)
        length = (h * h).sum(-1).sqrt()  # ORIGIN: step_sqrt
        return F.mse_loss(length, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


# ---------------------------------------------------------------------------- batch interaction


def interaction_values(n: int) -> list[float]:
    """``n`` values whose sum is exactly 0, while every non-empty proper subset has a non-zero sum."""
    values = [float(2**i) for i in range(n - 1)]
    return [*values, -sum(values)]


class InteractionModule(pl.LightningModule):
    """``sqrt((w * sum(x))**2)``: non-finite gradient only when the whole batch sums to exactly 0."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(0.5))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (x,) = batch
        total = x.sum() * self.w
        return total.pow(2).sqrt()  # ORIGIN: interaction

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


# ---------------------------------------------------------------------------- structured batches


class NamedBatch(NamedTuple):
    x: Tensor
    y: Tensor
    names: list[str]


@dataclass
class DataclassBatch:
    x: Tensor
    y: Tensor
    names: list[str]
    scale: float = 1.0


class StructuredDataset(Dataset):
    """Items ``{"x", "y", "name", "index"}``; ``x`` is blank (all zeros) for ``bad`` indices."""

    def __init__(self, n: int, bad: tuple[int, ...], seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.x[list(bad)] = 0.0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "y": self.y[i], "name": f"item-{i}", "index": i}


def collate(style: str) -> Any:
    """A ``collate_fn`` producing batches of the given structure from :class:`StructuredDataset` items."""

    def fn(items: list[dict[str, Any]]) -> Any:
        x = torch.stack([item["x"] for item in items])
        y = torch.stack([item["y"] for item in items])
        names = [item["name"] for item in items]
        index = torch.tensor([item["index"] for item in items])
        if style == "dict":
            return {"x": x, "y": y, "names": names, "index": index, "tag": "train"}
        if style == "userdict":
            return UserDict({"x": x, "y": y, "names": names})
        if style == "namedtuple":
            return NamedBatch(x, y, names)
        if style == "dataclass":
            return DataclassBatch(x, y, names)
        if style == "seq_first":  # (features, batch): the built-in slicer cannot tell the batch size
            return {"x": x.T.contiguous(), "y": y, "names": names}
        raise ValueError(style)

    return fn


def unpack(batch: Any) -> tuple[Tensor, Tensor, list[str]]:
    if isinstance(batch, DataclassBatch | NamedBatch):
        return batch.x, batch.y, batch.names
    if "x" in batch and batch["x"].shape[0] != len(batch["names"]):  # sequence-first
        return batch["x"].T, batch["y"], batch["names"]
    return batch["x"], batch["y"], batch["names"]


class DictBatchModule(pl.LightningModule):
    """The cosine-norm network of :mod:`models` fed by dict / dataclass / namedtuple / UserDict batches.

    ``training_step`` checks that the per-sample string list was sliced along with the tensors.
    """

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net("cosine_norm")
        self.seen_sizes: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y, names = unpack(batch)
        assert len(names) == x.shape[0] == y.shape[0], "per-sample leaves were not sliced with the tensors"
        self.seen_sizes.append(x.shape[0])
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


# ---------------------------------------------------------------------------- isolation


class IsolationModule(pl.LightningModule):
    """Dropout, BatchNorm, ``self.log`` and a torchmetrics metric around a cosine-norm origin.

    Blank inputs make ``norm`` take the square root of exactly 0 (NaN gradient), every other
    sample is healthy. The forward uses the RNG (dropout) and updates BatchNorm statistics and a
    metric, so any trace a re-run leaves shows in the final state.
    """

    def __init__(self) -> None:
        super().__init__()
        self.feature = nn.Linear(8, 16, bias=False)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(16, 4)
        self.mse = torchmetrics.MeanSquaredError()
        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=4)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        h = self.feature(x)
        norm = (h * h).sum(-1, keepdim=True).sqrt()  # ORIGIN: isolation
        h = self.drop(torch.relu(self.bn(h / (norm + 1e-6))))
        logits = self.head(h)
        loss = F.cross_entropy(logits, y)
        self.mse(logits.softmax(-1).max(-1).values, torch.ones_like(y, dtype=torch.float))
        self.acc(logits, y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        self.log("train_mse", self.mse, on_step=True, on_epoch=True)
        self.log_dict({"train_acc": self.acc, "noise": torch.rand(())}, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# (culprit_module, culprit_op, phase) NanGuard must report per failure class of models.py,
# names relative to the LightningModule (shared by the forensics and localisation tests);
# NaN/Inf in the batch is the origin before any op: no module
EXPECTED: dict[str, tuple[str | None, str, str]] = {
    "cosine_norm": ("net.norm", "SqrtBackward0", "backward"),
    "power_pool": ("net.pool", "PowBackward1", "backward"),
    "bn_overflow": ("net.input_bn", "running_var", "forward"),
    "masked_div": ("net.ratio", "DivBackward0", "backward"),
    "acos": ("net.angle", "AcosBackward0", "backward"),
    "log_zero": ("net.criterion", "LogBackward0", "forward"),
    "input_data": (None, "<input>", "forward"),
}
# the torch function of each origin (``None``: not an op)
FUNCTIONS: dict[str, str | None] = {
    "cosine_norm": "torch.sqrt",
    "power_pool": "torch.pow",
    "bn_overflow": None,
    "masked_div": "torch.div",
    "acos": "torch.acos",
    "log_zero": "torch.log",
    "input_data": None,
}


# ---------------------------------------------------------------------------- divergence (model state)


def diverging_data(n: int = 64, seed: int = 0) -> TensorDataset:
    """Inputs and targets large enough that SGD with ``lr=0.1`` diverges within 8 steps (measured: step 7)."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 8, generator=g) * 3, torch.randn(n, generator=g) * 10)


class DivergingMLP(pl.LightningModule):
    """A small MLP that SGD at ``lr=0.1`` drives to huge but finite weights, until every sample's loss is Inf.

    No sample is at fault: the model state is (issue 9, item 1).
    """

    def __init__(self, lr: float = 0.1, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch[0], batch[1]
        return F.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def diverge(module: DivergingMLP, dataset: TensorDataset, batch_size: int = 8) -> tuple[Tensor, ...]:
    """Train ``module`` with plain SGD until a batch is non-finite; return that batch (weights as they are then)."""
    optimizer = module.configure_optimizers()
    for step in range(len(dataset) // batch_size):
        batch = tuple(t[step * batch_size : (step + 1) * batch_size] for t in dataset.tensors)
        loss = module.training_step(batch, step)
        optimizer.zero_grad()
        loss.backward()
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        if not torch.isfinite(loss) or not all(bool(torch.isfinite(g).all()) for g in grads):
            optimizer.zero_grad()
            return batch
        optimizer.step()
    raise AssertionError("the model did not diverge")


# ---------------------------------------------------------------------------- many BatchNorm channels


class WideBatchNormModule(pl.LightningModule):
    """``layers`` BatchNorm layers of ``width`` channels: once the weights are NaN, every channel of every layer is."""

    def __init__(self, layers: int = 6, width: int = 16) -> None:
        super().__init__()
        blocks: list[nn.Module] = [nn.Linear(8, width)]
        for _ in range(layers):
            blocks += [nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, width)]
        self.net = nn.Sequential(*blocks)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.net(x).mean(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def nan_sample_data(n: int = 32, bad: tuple[int, ...] = (11,), seed: int = 0) -> TensorDataset:
    """Regression data with NaN inputs at ``bad``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    x[list(bad)] = math.nan
    return TensorDataset(x, torch.randn(n, generator=g))
