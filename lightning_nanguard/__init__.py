"""lightning_nanguard: catch NaN/Inf in PyTorch Lightning training, keep the weights finite, explain why.

Example:
    >>> from lightning.pytorch import Trainer
    >>> from lightning_nanguard import NanGuard
    >>> trainer = Trainer(callbacks=[NanGuard()], logger=False)  # doctest: +SKIP
"""

from typing import TYPE_CHECKING, Any

from lightning_nanguard import _moved
from lightning_nanguard.core.events import GuardInternalError, NanEvent, NonFiniteTrainingError
from lightning_nanguard.decide.policy import Counters
from lightning_nanguard.detect.check import fused_health_check
from lightning_nanguard.detect.confirm import nonfinite_names
from lightning_nanguard.detect.spikes import SpikeDetector, SpikeStats
from lightning_nanguard.recover.batchnorm import BatchNormSnapshot
from lightning_nanguard.reporting import read_events

if TYPE_CHECKING:
    from lightning_nanguard.fabric.guard import FabricGuard
    from lightning_nanguard.trainer.callback import NanGuard

__all__ = [
    "BatchNormSnapshot",
    "Counters",
    "FabricGuard",
    "GuardInternalError",
    "NanEvent",
    "NanGuard",
    "NonFiniteTrainingError",
    "SpikeDetector",
    "SpikeStats",
    "fused_health_check",
    "nonfinite_names",
    "read_events",
]

__version__ = "0.4.0"

_moved.install()  # the module paths of 0.2.0 keep working, with a DeprecationWarning


def __getattr__(name: str) -> Any:
    # The front-ends are imported on first use: importing the package, as Fabric's entry point does
    # in every ``Fabric()``, loads no Lightning namespace and makes no guard.
    if name == "NanGuard":
        from lightning_nanguard.trainer.callback import NanGuard

        globals()["NanGuard"] = NanGuard
        return NanGuard
    if name == "FabricGuard":
        from lightning_nanguard.fabric.guard import FabricGuard

        globals()["FabricGuard"] = FabricGuard
        return FabricGuard
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})  # NanGuard included before its first use (tab completion, griffe)
