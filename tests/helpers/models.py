"""Tiny, deterministic models that go non-finite for a known reason on known samples.

One failure class per model. Each failing op carries a trailing ``# ORIGIN: <name>`` comment so a
test can find its line with :func:`origin_line` (forensics features report ``file.py:LINE``).
Every model fails only on the samples listed in ``FailureCase.bad_indices`` and is healthy on
every other sample, whatever the (finite) weights are: the failure is structural, not a matter of
unlucky initialisation. The expectations (``kinds``, ``nonfinite_grads``, ``nonfinite_buffers``)
were measured with plain PyTorch and are checked again by ``test_guard_failure_classes.py``.

Failure classes (``KINDS``):

- ``cosine_norm``: zero-norm division in a cosine-normalised linear layer. A blank input makes the
  bias-free features exactly zero; ``sqrt`` of a zero squared norm has an infinite derivative and
  the incoming gradient is exactly zero, so ``SqrtBackward0`` returns 0/0 = NaN. Forward is finite
  because ``eps`` is added *after* the square root.
- ``power_pool``: generalised-mean (LP) pooling with a learnable exponent ``p`` over all-zero
  (padding) positions: ``mean(x**p) ** (1/p)`` at 0 has an infinite derivative; the backward of
  the inner ``x**p`` multiplies it by 0 (and by ``0**p * log(0)`` for ``p``): NaN in ``p.grad``
  and in the feature weights. Forward finite.
- ``bn_overflow``: one corrupted sample (1e21) in the input of an input-normalising BatchNorm.
  The batch statistics are accumulated in float64 on CPU, so the normalised output and every
  gradient stay finite, but the float32 ``running_var`` overflows to +Inf. Only
  ``net.input_bn.running_var`` goes bad (``running_mean`` stays finite, ~1e19).
- ``masked_div``: ``torch.where(count != 0, a / count, 0)``: the loss is finite, but the masked-out
  branch still back-propagates ``0 / 0 = NaN`` into ``a``'s parameters.
- ``acos``: angle between two views of a sample, ``acos(clamp(cos, -1, 1))``. For a duplicated
  pair with a single non-zero feature, ``cos`` is exactly 1.0 (structurally: ``c*c / (|c|*|c|)``)
  and ``AcosBackward0`` returns -Inf. Forward finite.
- ``log_zero``: hand-written cross-entropy ``-(onehot * log(softmax)).sum()``. An un-normalised
  sample (x 1e4) makes some probabilities underflow to exactly 0: ``log(0) = -Inf`` and
  ``0 * -Inf = NaN`` in the loss itself.
- ``input_data``: NaN, +Inf or -Inf in the input tensor (``value``); it poisons the loss, every
  gradient and the BatchNorm running statistics.

``norm_overflow`` is not a failure class: every gradient element is 1e20, finite, but the float32 L2
norm overflows to Inf; a guard must not report it.

Use :func:`make_case` for the dataset and the expectations, :func:`make_module` for a
LightningModule of either namespace (``"lightning"`` = ``lightning.pytorch``, or
``"pytorch_lightning"``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import lightning.pytorch as lightning_pytorch
import pytorch_lightning
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

__all__ = [
    "BATCH_SIZE",
    "KINDS",
    "NAMESPACES",
    "FailureCase",
    "make_case",
    "make_loader",
    "make_module",
    "make_net",
    "namespace",
    "origin_line",
]

KINDS: tuple[str, ...] = (
    "cosine_norm",
    "power_pool",
    "bn_overflow",
    "masked_div",
    "acos",
    "log_zero",
    "input_data",
)
NAMESPACES: dict[str, ModuleType] = {"lightning": lightning_pytorch, "pytorch_lightning": pytorch_lightning}
BATCH_SIZE = 8
N_SAMPLES = 32
DEFAULT_BAD: tuple[int, ...] = (11,)  # batch 1 (the second optimizer step), position 3
BN_CORRUPT_VALUE = 1e21  # squared / batch size overflows float32 by far: running_var -> +Inf


# --------------------------------------------------------------------------------------------
# Building blocks: each failing op is marked with "# ORIGIN: <name>".


class CosineNormLinear(nn.Module):
    """Cosine-normalised linear layer: ``(x / |x|) @ (W / |W|).T`` with ``eps`` outside the root."""

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features) / math.sqrt(in_features))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xnorm = (x * x).sum(-1, keepdim=True).sqrt()  # ORIGIN: cosine_norm
        wnorm = (self.weight * self.weight).sum(-1, keepdim=True).sqrt()
        return (x / (xnorm + self.eps)) @ (self.weight / (wnorm + self.eps)).T


class PowerPool(nn.Module):
    """Generalised-mean pooling over the last dimension with a learnable exponent ``p``."""

    def __init__(self, p: float = 3.0) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor(p))

    def forward(self, x: Tensor) -> Tensor:
        powered = x.pow(self.p).mean(-1)
        return powered.pow(1.0 / self.p)  # ORIGIN: power_pool


class MaskedRatio(nn.Module):
    """``a / count`` where ``count != 0``, else 0 (the NaN hides in the discarded branch)."""

    def forward(self, a: Tensor, count: Tensor) -> Tensor:
        return torch.where(count != 0, a / count, 0.0)  # ORIGIN: masked_div


class AngleBetween(nn.Module):
    """Angle between two feature vectors after a learnable per-feature scale."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(features) + 0.1 * torch.randn(features))

    def forward(self, x1: Tensor, x2: Tensor) -> Tensor:
        e1, e2 = x1 * self.scale, x2 * self.scale
        cos = (e1 * e2).sum(-1) / (e1.norm(dim=-1) * e2.norm(dim=-1))
        return torch.acos(cos.clamp(-1.0, 1.0))  # ORIGIN: acos


class OneHotCrossEntropy(nn.Module):
    """Hand-written cross-entropy ``-(onehot * log(softmax(logits))).sum(-1).mean()``."""

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        probs = logits.softmax(-1)
        log_probs = probs.log()  # ORIGIN: log_zero
        return -(F.one_hot(target, logits.shape[-1]) * log_probs).sum(-1).mean()


# --------------------------------------------------------------------------------------------
# One nn.Module per failure class; ``loss(batch)`` is what ``training_step`` returns.


class CosineNormNet(nn.Module):
    """Bias-free features, then a cosine classifier; blank inputs give all-zero features."""

    def __init__(self) -> None:
        super().__init__()
        self.feature = nn.Linear(8, 16, bias=False)
        self.norm = CosineNormLinear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        return 10.0 * self.norm(self.feature(x))

    def loss(self, batch: Any) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)


class PowerPoolNet(nn.Module):
    """Per-position features, ``abs``, GeM pooling over positions, linear regression head."""

    def __init__(self) -> None:
        super().__init__()
        self.feature = nn.Linear(4, 8, bias=False)
        self.pool = PowerPool(3.0)
        self.head = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:  # x: (batch, positions, 4)
        features = self.feature(x).abs().transpose(1, 2)  # (batch, 8, positions)
        return self.head(self.pool(features)).squeeze(-1)

    def loss(self, batch: Any) -> Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)


class BatchNormOverflowNet(nn.Module):
    """A BatchNorm normalises the raw input; a second one sits in the hidden layer."""

    def __init__(self) -> None:
        super().__init__()
        self.input_bn = nn.BatchNorm1d(6)
        self.hidden = nn.Linear(6, 8, bias=False)  # a bias before BatchNorm is cancelled anyway
        self.hidden_bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        x = self.input_bn(x)  # ORIGIN: bn_overflow
        return self.head(torch.relu(self.hidden_bn(self.hidden(x)))).squeeze(-1)

    def loss(self, batch: Any) -> Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)


class MaskedDivNet(nn.Module):
    """Predicts a per-item rate ``head(x) / count``; items with ``count == 0`` predict 0."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(5, 1)
        self.ratio = MaskedRatio()
        self.offset = nn.Parameter(torch.zeros(()))

    def forward(self, x: Tensor, count: Tensor) -> Tensor:
        return self.ratio(self.head(x).squeeze(-1), count) + self.offset

    def loss(self, batch: Any) -> Tensor:
        x, count, y = batch
        return F.mse_loss(self(x, count), y)


class AngleNet(nn.Module):
    """Regresses the angle between two views of a sample."""

    def __init__(self) -> None:
        super().__init__()
        self.angle = AngleBetween(6)
        self.bias = nn.Parameter(torch.zeros(()))

    def forward(self, x1: Tensor, x2: Tensor) -> Tensor:
        return self.angle(x1, x2) + self.bias

    def loss(self, batch: Any) -> Tensor:
        x1, x2, y = batch
        return F.mse_loss(self(x1, x2), y)


class LogZeroNet(nn.Module):
    """Linear classifier trained with the hand-written :class:`OneHotCrossEntropy`."""

    def __init__(self) -> None:
        super().__init__()
        self.classifier = nn.Linear(4, 3)
        self.criterion = OneHotCrossEntropy()

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(x)

    def loss(self, batch: Any) -> Tensor:
        x, y = batch
        return self.criterion(self(x), y)


class InputDataNet(nn.Sequential):
    """``Linear -> BatchNorm1d -> ReLU -> Linear`` regression (names ``net.0`` ... ``net.3``)."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))

    def loss(self, batch: Any) -> Tensor:
        x, y = batch
        prediction = self(x).squeeze(-1)  # ORIGIN: input_data
        return F.mse_loss(prediction, y)


class NormOverflowNet(nn.Module):
    """Healthy but extreme: every gradient element is 1e20 (finite), so the float32 L2 norm overflows to Inf.

    Not a failure class: a step with finite gradients must never be reported, whatever its norm.
    """

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(16))

    def loss(self, batch: Any) -> Tensor:
        (x,) = batch
        return (self.weight * x.mean() * 1e20).sum()


_NETS: dict[str, type[nn.Module]] = {
    "cosine_norm": CosineNormNet,
    "power_pool": PowerPoolNet,
    "bn_overflow": BatchNormOverflowNet,
    "masked_div": MaskedDivNet,
    "acos": AngleNet,
    "log_zero": LogZeroNet,
    "input_data": InputDataNet,
    "norm_overflow": NormOverflowNet,
}


def make_net(kind: str, seed: int = 0) -> nn.Module:
    """The plain ``nn.Module`` of a failure class, initialised from ``seed`` (global RNG untouched)."""
    if kind not in _NETS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _NETS[kind]()


# --------------------------------------------------------------------------------------------
# LightningModules for both namespaces.


class _FailureModuleMixin:
    """``training_step`` returns ``net.loss(batch)``; Adam or SGD with momentum."""

    def __init__(self, net: nn.Module, optimizer: str = "adam", lr: float = 1e-2) -> None:
        super().__init__()
        self.net = net
        self.optimizer_name = optimizer
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.net.loss(batch)  # type: ignore[operator]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = self.parameters()  # type: ignore[attr-defined]
        if self.optimizer_name == "adam":
            return torch.optim.Adam(params, lr=self.lr)
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=0.9)
        raise ValueError(f"unknown optimizer {self.optimizer_name!r}")


class LightningFailureModule(_FailureModuleMixin, lightning_pytorch.LightningModule):
    """A failure-class model as a ``lightning.pytorch.LightningModule``."""


class PLFailureModule(_FailureModuleMixin, pytorch_lightning.LightningModule):
    """A failure-class model as a ``pytorch_lightning.LightningModule``."""


_MODULE_CLASSES: dict[str, type[Any]] = {
    "lightning": LightningFailureModule,
    "pytorch_lightning": PLFailureModule,
}


def namespace(ns: str | ModuleType) -> str:
    """Normalise a namespace given as a module or a name to ``"lightning"``/``"pytorch_lightning"``."""
    if isinstance(ns, ModuleType):
        ns = {"lightning.pytorch": "lightning", "pytorch_lightning": "pytorch_lightning"}.get(ns.__name__, ns.__name__)
    if ns == "lightning.pytorch":
        ns = "lightning"
    if ns not in _MODULE_CLASSES:
        raise ValueError(f"unknown namespace {ns!r}; expected one of {list(_MODULE_CLASSES)}")
    return ns


def make_module(
    ns: str | ModuleType, kind: str, *, optimizer: str | None = None, lr: float = 1e-2, seed: int = 0
) -> Any:
    """A LightningModule of namespace ``ns`` wrapping ``make_net(kind, seed)`` as ``self.net``.

    The default optimizer is SGD with momentum for ``bn_overflow`` and Adam otherwise, so both
    kinds of optimizer state are exercised.
    """
    if optimizer is None:
        optimizer = "sgd" if kind == "bn_overflow" else "adam"
    return _MODULE_CLASSES[namespace(ns)](make_net(kind, seed), optimizer=optimizer, lr=lr)


# --------------------------------------------------------------------------------------------
# Datasets and expectations.


@dataclass(frozen=True)
class FailureCase:
    """A dataset of one failure class with the samples that break it and what the guard must see.

    Names are relative to the LightningModule (the network is its ``net`` attribute).
    ``culprit_module``/``culprit_op``/``phase`` describe the first op that produces a non-finite
    value, for forensics tests (``culprit_op`` is ``None`` when no autograd op is at fault, e.g. a
    BatchNorm running-statistics update); ``origin`` is the ``# ORIGIN:`` tag of its line in this file.
    """

    kind: str
    dataset: TensorDataset
    bad_indices: tuple[int, ...]
    kinds: tuple[str, ...]
    nonfinite_grads: tuple[str, ...]
    nonfinite_buffers: tuple[str, ...]
    finite_loss: bool
    origin: str
    culprit_module: str
    culprit_op: str | None
    phase: str
    value: float | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def bad_batches(self) -> tuple[int, ...]:
        """Indices of the batches (``BATCH_SIZE``, no shuffling) holding a bad sample."""
        return tuple(sorted({i // BATCH_SIZE for i in self.bad_indices}))

    @property
    def has_batchnorm(self) -> bool:
        return self.kind in ("bn_overflow", "input_data")


_INPUT_DATA_GRADS = ("net.0.weight", "net.0.bias", "net.1.weight", "net.1.bias", "net.3.weight", "net.3.bias")


def make_case(
    kind: str,
    *,
    n: int = N_SAMPLES,
    bad: tuple[int, ...] = DEFAULT_BAD,
    value: float | None = None,
    seed: int = 0,
) -> FailureCase:
    """Build the dataset of ``kind`` with ``n`` samples, of which exactly ``bad`` are broken.

    Args:
        kind: one of :data:`KINDS`.
        n: number of samples.
        bad: dataset indices of the broken samples (may be empty for an all-healthy dataset).
        value: for ``input_data`` the injected value (NaN, +Inf or -Inf, default NaN); for
            ``bn_overflow`` the corrupted magnitude (default :data:`BN_CORRUPT_VALUE`).
        seed: seed of the data generator.
    """
    g = torch.Generator().manual_seed(seed)
    bad = tuple(bad)
    idx = list(bad)

    if kind == "cosine_norm":
        x = torch.randn(n, 8, generator=g)
        y = torch.randint(0, 4, (n,), generator=g)
        x[idx] = 0.0  # blank samples
        return FailureCase(
            kind,
            TensorDataset(x, y),
            bad,
            ("grad",),
            ("net.feature.weight",),
            (),
            True,
            "cosine_norm",
            "net.norm",
            "SqrtBackward0",
            "backward",
        )
    if kind == "power_pool":
        x = torch.randn(n, 6, 4, generator=g)
        y = torch.rand(n, generator=g)
        x[idx] = 0.0  # all positions padded
        return FailureCase(
            kind,
            TensorDataset(x, y),
            bad,
            ("grad",),
            ("net.feature.weight", "net.pool.p"),
            (),
            True,
            "power_pool",
            "net.pool",
            "PowBackward1",
            "backward",
        )
    if kind == "bn_overflow":
        corrupt = BN_CORRUPT_VALUE if value is None else value
        x = torch.randn(n, 6, generator=g)
        y = torch.randn(n, generator=g)
        x[idx, 2] = corrupt
        return FailureCase(
            kind,
            TensorDataset(x, y),
            bad,
            ("bn_stats",),
            (),
            ("net.input_bn.running_var",),
            True,
            "bn_overflow",
            "net.input_bn",
            None,
            "forward",
            value=corrupt,
        )
    if kind == "masked_div":
        x = torch.randn(n, 5, generator=g)
        count = torch.randint(1, 5, (n,), generator=g).float()
        y = torch.randn(n, generator=g)
        count[idx] = 0.0
        return FailureCase(
            kind,
            TensorDataset(x, count, y),
            bad,
            ("grad",),
            ("net.head.weight", "net.head.bias"),
            (),
            True,
            "masked_div",
            "net.ratio",
            "DivBackward0",
            "backward",
        )
    if kind == "acos":
        x1 = torch.randn(n, 6, generator=g)
        x2 = torch.randn(n, 6, generator=g)
        y = torch.rand(n, generator=g) + 0.5
        for i in idx:  # a duplicated pair with a single non-zero feature: cos == 1.0 exactly
            x1[i] = 0.0
            x1[i, i % 6] = 0.5 + 0.1 * (i % 5)
            x2[i] = x1[i]
        return FailureCase(
            kind,
            TensorDataset(x1, x2, y),
            bad,
            ("grad",),
            ("net.angle.scale",),
            (),
            True,
            "acos",
            "net.angle",
            "AcosBackward0",
            "backward",
        )
    if kind == "log_zero":
        x = torch.randn(n, 4, generator=g)
        y = torch.randint(0, 3, (n,), generator=g)
        x[idx] *= 1e4  # un-normalised samples: logit gaps in the thousands, softmax underflows to 0
        return FailureCase(
            kind,
            TensorDataset(x, y),
            bad,
            ("loss", "grad"),
            ("net.classifier.weight", "net.classifier.bias"),
            (),
            False,
            "log_zero",
            "net.criterion",
            "LogBackward0",
            "forward",
        )
    if kind == "input_data":
        injected = math.nan if value is None else value
        x = torch.randn(n, 4, generator=g)
        y = torch.randn(n, generator=g)
        x[idx, 1] = injected
        return FailureCase(
            kind,
            TensorDataset(x, y),
            bad,
            ("loss", "grad", "bn_stats"),
            _INPUT_DATA_GRADS,
            ("net.1.running_mean", "net.1.running_var"),
            False,
            "input_data",
            "net.0",
            "AddmmBackward0",
            "forward",
            value=injected,
        )
    if kind == "norm_overflow":  # healthy: no bad samples, whatever ``bad`` says
        x = torch.ones(n, 1)
        return FailureCase(kind, TensorDataset(x), (), (), (), (), True, "", "", None, "forward")
    raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")


def make_loader(dataset: TensorDataset, batch_size: int = BATCH_SIZE) -> DataLoader:
    """A deterministic loader (no shuffling, no workers) so batch ``b`` holds samples ``b*bs ...``."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=0)


# --------------------------------------------------------------------------------------------
# Source locations.

_ORIGIN = re.compile(r"#\s*ORIGIN:\s*(\w+)\s*$")


def origin_line(name: str, path: str | Path = __file__) -> int:
    """1-based line number of the op tagged ``# ORIGIN: <name>`` in ``path`` (this file by default)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    found = [number for number, line in enumerate(lines, start=1) if (m := _ORIGIN.search(line)) and m[1] == name]
    if len(found) != 1:
        raise LookupError(f"expected exactly one '# ORIGIN: {name}' in {path}, found {len(found)}")
    return found[0]
