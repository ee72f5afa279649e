"""Read one record of a training loader again, as the loop would hand it to its training step.

The check that a dataset index names the record really in a row
(:mod:`~lightning_nanguard.diagnose.reread`) compares the row with the record read again. A
:class:`RecordReader` is kept per training loader, next to its recording batch sampler
(:class:`~lightning_nanguard.engine.data.loaders.TrainingLoaders`): it reads ``dataset[i]`` and collates
it alone with the loader's own ``collate_fn``. The front-end's ``as_training_batch`` then does to
that record what its loop does to every collated batch before the training step sees it (the
Trainer's: :meth:`~lightning_nanguard.trainer.frontend.TrainerFrontEnd.as_training_batch`).

Not re-readable (its indices are then reported unverified, with the reason):

- an ``IterableDataset`` (no index to read; name an index field with ``index_key=``);
- a loader with ``batch_size=None`` (it does not collate records into rows);
- a dataset whose attribute ``nanguard_reread`` is ``False`` (reads with side effects, e.g. a
  stream cursor or a cache that must not be touched).

Example:
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> reader = RecordReader.of(DataLoader(TensorDataset(torch.arange(10.0)), batch_size=4))
    >>> reader.reason, reader.read(7)
    ('', [tensor([7.])])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch  # noqa: F401 (doctests)
from torch.utils.data import DataLoader, IterableDataset

__all__ = ["RecordReader"]


@dataclass(frozen=True, eq=False)  # compared by identity: never compares or hashes a dataset
class RecordReader:
    """Reads records of one training loader: ``collate_fn([dataset[index]])``.

    Attributes:
        dataset: the loader's dataset (``None`` when not re-readable).
        collate_fn: the loader's collate function.
        reason: why the loader's records cannot be read again (empty when they can).
    """

    dataset: Any
    collate_fn: Callable[[list[Any]], Any] | None
    reason: str = ""

    @classmethod
    def of(cls, loader: Any) -> RecordReader:
        """The reader of a training ``loader`` (with a reason when its records cannot be read again).

        Example:
            >>> from torch.utils.data import DataLoader, TensorDataset
            >>> RecordReader.of(DataLoader(TensorDataset(torch.zeros(4)), batch_size=None)).reason
            'batch_size=None: the loader does not collate records into rows'
        """
        if not isinstance(loader, DataLoader):
            return cls(None, None, f"a {type(loader).__name__} is not a torch DataLoader")
        dataset = loader.dataset
        if isinstance(dataset, IterableDataset):
            return cls(None, None, "an IterableDataset cannot be read by index")
        if loader.batch_sampler is None:
            return cls(None, None, "batch_size=None: the loader does not collate records into rows")
        if getattr(dataset, "nanguard_reread", True) is False:
            return cls(None, None, "the dataset sets nanguard_reread = False (its reads have side effects)")
        return cls(dataset, loader.collate_fn)

    def read(self, index: int) -> Any:
        """A batch of the one record ``index``, collated as the loader collates.

        Raises:
            RuntimeError: the loader's records cannot be read again (:attr:`reason`).
        """
        if self.reason or self.collate_fn is None:
            raise RuntimeError(self.reason or "no collate function")
        return self.collate_fn([self.dataset[index]])
