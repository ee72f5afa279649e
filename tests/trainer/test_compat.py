"""One ``NanGuard`` for both Lightning namespaces (``lightning_nanguard.trainer._compat``)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as lightning_pytorch
import pytorch_lightning

from lightning_nanguard import NanGuard
from lightning_nanguard.trainer._compat import (
    CALLBACK_BASES,
    TENSORBOARD_LOGGER_TYPES,
    lightning_namespaces,
    tensorboard_logger_types,
)


def test_both_installed_namespaces_lightning_pytorch_first() -> None:
    assert lightning_namespaces() == (lightning_pytorch, pytorch_lightning)


def test_the_callback_bases_of_every_namespace() -> None:
    assert (lightning_pytorch.Callback, pytorch_lightning.Callback) == CALLBACK_BASES
    guard = NanGuard(verbose=False)
    assert all(isinstance(guard, base) for base in CALLBACK_BASES)


def test_tensorboard_loggers_of_every_namespace(tmp_path: Path) -> None:
    assert (
        (
            lightning_pytorch.loggers.TensorBoardLogger,
            pytorch_lightning.loggers.TensorBoardLogger,
        )
        == TENSORBOARD_LOGGER_TYPES
        == tensorboard_logger_types()
    )
    for logger_type in TENSORBOARD_LOGGER_TYPES:
        assert isinstance(logger_type(str(tmp_path)), TENSORBOARD_LOGGER_TYPES)
    assert not isinstance(lightning_pytorch.loggers.CSVLogger(str(tmp_path)), TENSORBOARD_LOGGER_TYPES)
