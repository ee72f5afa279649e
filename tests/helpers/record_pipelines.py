"""Records and pipelines for the tests of the record check: padded token records, collates that reorder, drop, pack.

The ground truth of every test comes from what the records carry (their tokens say which record they
are), never from the guard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, IterableDataset

# record i: a sequence of (i % 4) + 2 tokens, each token 10 * i + position, and a name
RECORDS = {i: torch.arange(10 * i, 10 * i + (i % 4) + 2) for i in range(20, 28)}


def collate(items: Sequence[Tensor], left: bool = False) -> dict[str, Any]:
    """Pad to the longest sequence (right, or ``left``), with a mask and the record's name."""
    width = max(len(t) for t in items)
    ids = torch.zeros(len(items), width, dtype=torch.long)
    mask = torch.zeros(len(items), width, dtype=torch.bool)
    for row, t in enumerate(items):
        where = slice(width - len(t), width) if left else slice(0, len(t))
        ids[row, where], mask[row, where] = t, True
    return {"ids": ids, "mask": mask, "name": [f"r{int(t[0]) // 10}" for t in items]}


def reader(left: bool = False, counter: list[int] | None = None) -> Callable[[int], Any]:
    def read(index: int) -> Any:
        if counter is not None:
            counter.append(index)
        return collate([RECORDS[index]], left=left)

    return read


# ------------------------------------------------------------------------------ pipelines on a real Trainer


def tokens(index: int) -> Tensor:
    """Record ``index``: ``(index % 4) + 2`` tokens ``10 * index + 1 + position`` (what a row's values tell)."""
    return torch.arange(10 * index + 1, 10 * index + (index % 4) + 3, dtype=torch.float32)


def record_of(row: Tensor) -> int:
    """The record a row of tokens (padded or not, negated for a bad record) holds: read off its values."""
    values = row[row != 0].abs()
    return int(values.min().item()) // 10


class TokenRecords(Dataset):
    """``n`` token records; the ``bad`` ones are negated (``sqrt`` of them is NaN); ``noise`` makes reads random.

    ``with_index`` adds the record's index to the item (for collates that build an index field).
    """

    def __init__(
        self, n: int, bad: Sequence[int] = (), noise: bool = False, with_index: bool = False, reread: bool = True
    ) -> None:
        self.n, self.bad, self.noise, self.with_index = n, set(bad), noise, with_index
        if not reread:
            self.nanguard_reread = False

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        x = tokens(index) * (-1.0 if index in self.bad else 1.0)
        if self.noise:
            x = x + 0.01 * torch.rand(len(x))  # random augmentation: two reads differ
        return {"x": x, "index": index} if self.with_index else x


class TokenStream(IterableDataset):
    """The records of :class:`TokenRecords` as a stream, each with its index (no batch sampler to record)."""

    def __init__(self, n: int, bad: Sequence[int] = ()) -> None:
        self.records = TokenRecords(n, bad, with_index=True)

    def __iter__(self) -> Iterator[Any]:
        return (self.records[i] for i in range(len(self.records)))


def _x(item: Any) -> Tensor:
    return item["x"] if isinstance(item, dict) else item


def pad(items: Sequence[Any]) -> dict[str, Tensor]:
    """Right-pad the records' tokens: ``{"x", "mask"}`` (plus ``"index"`` when the items carry it)."""
    xs = [_x(item) for item in items]
    width = max(len(x) for x in xs)
    x = torch.zeros(len(xs), width)
    mask = torch.zeros(len(xs), width, dtype=torch.bool)
    for row, values in enumerate(xs):
        x[row, : len(values)], mask[row, : len(values)] = values, True
    out = {"x": x, "mask": mask}
    if items and isinstance(items[0], dict):
        out["index"] = torch.tensor([item["index"] for item in items])
    return out


def sorting_collate(items: Sequence[Any]) -> dict[str, Tensor]:
    """Longest record first (as ``pack_padded_sequence`` wants): rows no longer in the sampler's order."""
    return pad(sorted(items, key=lambda item: -len(_x(item))))


def dropping_collate(items: Sequence[Any]) -> dict[str, Tensor]:
    """Drops the records of 5 tokens (a length filter): fewer rows than records."""
    kept = [item for item in items if len(_x(item)) != 5]
    return pad(kept or list(items[:1]))


def packing_collate(items: Sequence[Any]) -> dict[str, Tensor]:
    """Packs records two by two into one row (LLM packing), with a 2-D ``"records"`` field when they carry indices."""
    pairs = [items[k : k + 2] for k in range(0, len(items), 2)]
    out = pad([torch.cat([_x(item) for item in pair]) for pair in pairs])
    if items and isinstance(items[0], dict):
        out["records"] = torch.tensor([[p["index"] for p in pair] + [-1] * (2 - len(pair)) for pair in pairs])
    return out


def packed_rows(batch: Any, indices: list[int] | None) -> list[list[int]]:
    """A ``row_records`` hook for :func:`packing_collate`: row ``k`` holds the records ``2k`` and ``2k + 1``."""
    assert indices is not None
    return [indices[k : k + 2] for k in range(0, len(indices), 2)]


def sqrt_loss(batch: dict[str, Tensor], scale: Tensor) -> Tensor:
    """Mean of ``sqrt(scale * x)`` over the valid tokens: NaN for a negated (bad) record only."""
    x, mask = batch["x"], batch["mask"]
    safe = torch.where(mask, x, torch.ones_like(x))
    return (torch.sqrt(scale * safe) * mask).sum() / mask.sum()


class SqrtModule(pl.LightningModule):
    """Trains a scale on token records; a batch of several loaders (a dict of batches) sums their losses."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if "x" in batch:
            return sqrt_loss(batch, self.scale)
        return sum(sqrt_loss(part, self.scale) for part in batch.values())  # type: ignore[return-value]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class PackedModule(SqrtModule):
    """:class:`SqrtModule` that maps packed rows to their records itself (``nanguard_row_records``)."""

    def nanguard_row_records(self, batch: Any, indices: list[int] | None) -> list[list[int]]:
        return packed_rows(batch, indices)


class HookedModule(SqrtModule):
    """Transforms every batch in the batch hooks, as a user might: adds a field, halves the tokens."""

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return {**batch, "seen": torch.ones(len(batch["x"]))} if "x" in batch else batch

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if "x" in batch:
            return {**batch, "x": batch["x"] * 0.5}
        return {key: {**part, "x": part["x"] * 0.5} for key, part in batch.items()}
