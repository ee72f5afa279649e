"""Read one record of a training loader again, as the fit loop would hand it to ``training_step``.

The check that a dataset index names the record really in a row
(:mod:`~lightning_nanguard.diagnose.records`) compares the row with the record read again. A
:class:`RecordReader` is kept per training loader, next to its recording batch sampler
(:class:`~lightning_nanguard.engine.data.loaders.TrainingLoaders`): it reads ``dataset[i]`` and collates
it alone with the loader's own ``collate_fn``. :func:`as_training_batch` then does to that record
what Lightning's fit loop does to every collated batch before ``training_step`` sees it
(``loops/training_epoch_loop.py``): the precision plugin's ``convert_input``, the
``on_before_batch_transfer`` hook, and the strategy's ``batch_to_device``, which calls the
``transfer_batch_to_device`` and ``on_after_batch_transfer`` hooks (of the LightningModule, or of the
datamodule when it defines them), always with ``dataloader_idx=0`` as the fit loop does.

With several training loaders those hooks receive the combined batch: the record is put in its
loader's place in a copy of the step's batch (the other loaders' parts as they are), the hooks run
on that, and the record's part is taken back out.

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

from lightning_nanguard.diagnose.combined import CombinedLayout

__all__ = ["RecordReader", "as_training_batch"]


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


def as_training_batch(
    trainer: Any, record: Any, layout: CombinedLayout | None = None, part: int = 0, batch: Any = None
) -> Any:
    """``record`` transformed as the fit loop transforms a collated batch (see the module docs).

    Args:
        trainer: the Trainer (its precision plugin, LightningModule or datamodule hooks, strategy).
        record: a batch of one record, straight from the collate.
        layout: with several training loaders, where each loader's part sits in ``batch``.
        part: the loader (its position in ``layout``) the record is from.
        batch: with several loaders, the step's combined batch (the other loaders' parts are kept).

    Raises:
        Exception: whatever a hook raises (the caller leaves the row unverified with the reason).
    """
    combined = record if layout is None else layout.with_parts(batch, {part: record})
    combined = trainer.precision_plugin.convert_input(combined)
    combined = trainer.lightning_module._on_before_batch_transfer(combined, dataloader_idx=0)
    combined = trainer.strategy.batch_to_device(combined, dataloader_idx=0)
    return combined if layout is None else layout.part(combined, part)
