"""lightning_nanguard: catch NaN/Inf in PyTorch Lightning training, keep the weights finite, explain why.

Example:
    >>> from lightning.pytorch import Trainer
    >>> from lightning_nanguard import NanGuard
    >>> trainer = Trainer(callbacks=[NanGuard()], logger=False)  # doctest: +SKIP
"""

from lightning_nanguard.batchnorm_buffers import BatchNormSnapshot
from lightning_nanguard.decision import Counters
from lightning_nanguard.detection import fused_health_check, nonfinite_names
from lightning_nanguard.events import NanEvent, NonFiniteTrainingError
from lightning_nanguard.guard import NanGuard
from lightning_nanguard.reporting import read_events
from lightning_nanguard.spikes import SpikeDetector, SpikeStats

__all__ = [
    "BatchNormSnapshot",
    "Counters",
    "NanEvent",
    "NanGuard",
    "NonFiniteTrainingError",
    "SpikeDetector",
    "SpikeStats",
    "fused_health_check",
    "nonfinite_names",
    "read_events",
]

__version__ = "0.2.0"
