"""Data pipelines whose rows are not the sampler's records one for one (issue 21), with tiny models.

Every record carries its own id (``uid = UID_BASE + dataset index``), which the guard is never told
about: the tests read it from the batches the Trainer gave (:class:`SeenRecords`) to know, without
the guard, which record sat in which row and which records were trained on after an incident.

Datasets:

- :class:`Utterances`: variable-length frame sequences ``(L, FEATURES)``; ``silent`` ones are all
  zeros (per-utterance normalisation divides 0 by 0); ``duplicates`` copies one record onto another
  (same content and ``key``, own ``uid``).
- :class:`Powers`: positive power features; a ``corrupt`` record holds a negative power (``sqrt``
  of it is NaN, and blending it with a healthy record in mixup stays negative).
- :class:`Tokens`: token sequences for masked-LM training.
- ``pm.blank_rows`` (``pattern_models``) serves the batch-statistic model :class:`BatchStd`.

Collates (each a plain callable, as a ``DataLoader`` takes it):

- :func:`sort_by_length`: pads and sorts each batch by length, longest first (``pack_padded_sequence``);
  :class:`SortWithoutIds` the same with no record id in the batch (logged aside for the test).
- :class:`DropLonger`: bucketing: drops the records longer than ``max_len``.
- :func:`dedup`: drops a record whose content ``key`` appeared earlier in the batch.
- :class:`PackPairs`: concatenates two consecutive records into one row (packed sequences).
- :class:`Mixup`: each row blends its record with a random partner of the batch.
- :class:`MultiCrop`: two random crops of each record, all first crops then all second crops.
- :class:`MaskTokens`: masks 15% of the tokens, drawn from a generator seeded by the batch's records.

The ``with_index`` collates add an ``"index"`` field of dataset indices (2-D for packed rows and
mixup: one row of record indices per batch row, ``-1`` = padding; 1-D with repeats for multi-crop)
for ``NanGuard(index_key="index")``. Without it the batch holds no dataset index at all.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler

from lightning_nanguard.trainer._compat import CALLBACK_BASES

__all__ = [
    "CLASSES",
    "FEATURES",
    "UID_BASE",
    "BatchStd",
    "CropClassifier",
    "DropLonger",
    "LoggedDistributedSampler",
    "MaskTokens",
    "MaskedLM",
    "Mixup",
    "MixupRegressor",
    "MultiCrop",
    "PackPairs",
    "PackedClassifier",
    "Powers",
    "Seen",
    "SeenRecords",
    "SortWithoutIds",
    "Tokens",
    "UtteranceClassifier",
    "Utterances",
    "dedup",
    "loader",
    "lone_bad",
    "planned_order",
    "sort_by_length",
]

FEATURES, CLASSES, HIDDEN = 4, 3, 8
UID_BASE = 1000  # uid = UID_BASE + dataset index: never mistaken for a dataset index
VOCAB, MASK_ID = 24, 1


def _uid(index: int) -> Tensor:
    return torch.tensor(UID_BASE + index)


# ------------------------------------------------------------------------------------ datasets


class Utterances(Dataset):
    """Frame sequences ``{"x": (L, FEATURES), "y": label, "uid": id, "key": content key}``.

    Args:
        n: number of records.
        silent: records whose frames are all zero.
        min_len, max_len: the random lengths' range (inclusive).
        duplicates: ``{copy: original}``: record ``copy`` gets ``original``'s frames, label and key.
        random_gain: every read scales the frames by a random gain in ``[0.5, 2]`` (the global torch
            RNG): a silent record stays silent, every other record reads differently each time.
        seed: the generator's seed.
    """

    def __init__(
        self,
        n: int,
        silent: Sequence[int] = (),
        min_len: int = 2,
        max_len: int = 8,
        duplicates: Mapping[int, int] | None = None,
        random_gain: bool = False,
        seed: int = 0,
    ) -> None:
        self.random_gain = random_gain
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
        self.frames = [torch.randn(length, FEATURES, generator=g) for length in self.lengths]
        self.labels = torch.randint(0, CLASSES, (n,), generator=g)
        self.keys = list(range(n))
        for copy, original in (duplicates or {}).items():
            self.frames[copy], self.lengths[copy] = self.frames[original].clone(), self.lengths[original]
            self.labels[copy], self.keys[copy] = self.labels[original], self.keys[original]
        for index in silent:
            self.frames[index] = torch.zeros_like(self.frames[index])

    def __len__(self) -> int:
        return len(self.frames)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        gain = 0.5 + 1.5 * torch.rand(()) if self.random_gain else 1.0  # volume perturbation: a new draw every read
        return {
            "x": self.frames[index] * gain,
            "y": self.labels[index],
            "uid": _uid(index),
            "key": torch.tensor(self.keys[index]),
        }


class Powers(Dataset):
    """Positive power features ``{"x": (FEATURES,), "y": target, "uid": id}``; ``corrupt`` ones hold -1000."""

    def __init__(self, n: int, corrupt: Sequence[int] = (), seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.rand(n, FEATURES, generator=g) * 0.9 + 0.1
        self.x[list(corrupt), 0] = -1000.0
        self.y = torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"x": self.x[index], "y": self.y[index], "uid": _uid(index)}


class Tokens(Dataset):
    """Token sequences ``{"ids": (length,), "uid": id}`` (ids from 2: 0 is padding, 1 the mask token)."""

    def __init__(self, n: int, length: int = 4, seed: int = 0) -> None:
        self.ids = torch.randint(2, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"ids": self.ids[index], "uid": _uid(index)}


# ------------------------------------------------------------------------------------ collates


def _pad(items: Sequence[Mapping[str, Tensor]], with_index: bool = False) -> dict[str, Tensor]:
    """``x`` zero-padded to the longest record, ``lengths``, ``y``, ``uid`` (and ``index``)."""
    lengths = torch.tensor([len(item["x"]) for item in items])
    x = torch.zeros(len(items), int(lengths.max()), FEATURES)
    for row, item in enumerate(items):
        x[row, : len(item["x"])] = item["x"]
    batch = {
        "x": x,
        "lengths": lengths,
        "y": torch.stack([item["y"] for item in items]),
        "uid": torch.stack([item["uid"] for item in items]),
    }
    if with_index:
        batch["index"] = batch["uid"] - UID_BASE
    return batch


def sort_by_length(items: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Pad, then sort the rows by length, longest first (stable), as ``pack_padded_sequence`` wants."""
    return _pad(sorted(items, key=lambda item: -len(item["x"])))


class SortWithoutIds:
    """:func:`sort_by_length` with no record id in the batch (as in the issue's pipeline).

    The records of each batch's rows are logged in ``made`` instead, one list per call: the test's
    side channel (the guard's re-reads are calls with one record).
    """

    def __init__(self) -> None:
        self.made: list[list[int]] = []

    def __call__(self, items: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
        batch = sort_by_length(items)
        self.made.append([int(u) - UID_BASE for u in batch.pop("uid")])
        return batch


@dataclass(frozen=True)
class DropLonger:
    """Bucketing: drop the records longer than ``max_len``, pad the rest (in the sampler's order)."""

    max_len: int

    def __call__(self, items: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
        return _pad([item for item in items if len(item["x"]) <= self.max_len])


def dedup(items: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Drop a record whose content ``key`` appeared earlier in the batch; pad the rest (in order)."""
    seen: set[int] = set()
    kept = []
    for item in items:
        key = int(item["key"])
        if key not in seen:
            seen.add(key)
            kept.append(item)
    out = _pad(kept)
    out["key"] = torch.stack([item["key"] for item in kept])
    return out


@dataclass(frozen=True)
class PackPairs:
    """Packed sequences: records ``2k`` and ``2k + 1`` of the batch share row ``k``, one after the other.

    The batch: ``x`` ``(rows, T, FEATURES)``, ``segment`` ``(rows, T)`` (0 or 1: which record of the
    row, -1 padding), ``labels`` ``(rows, 2)`` (-100 for a missing second record), ``uids``
    ``(rows, 2)`` (-1 padding), and with ``with_index`` ``index`` ``(rows, 2)`` (-1 padding).
    """

    with_index: bool = False

    def __call__(self, items: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
        rows = [items[k : k + 2] for k in range(0, len(items), 2)]
        width = max(sum(len(item["x"]) for item in row) for row in rows)
        x = torch.zeros(len(rows), width, FEATURES)
        segment = torch.full((len(rows), width), -1)
        labels = torch.full((len(rows), 2), -100)
        uids = torch.full((len(rows), 2), -1)
        for r, row in enumerate(rows):
            start = 0
            for s, item in enumerate(row):
                end = start + len(item["x"])
                x[r, start:end], segment[r, start:end] = item["x"], s
                labels[r, s], uids[r, s] = item["y"], item["uid"]
                start = end
        batch = {"x": x, "segment": segment, "labels": labels, "uids": uids}
        if self.with_index:
            batch["index"] = torch.where(uids >= 0, uids - UID_BASE, -1)
        return batch


class Mixup:
    """Each row blends its record with a random partner of the batch: ``lam * a + (1 - lam) * b``.

    ``lam`` in ``[0.3, 0.7]`` and the partners come from the collate's own generator (a new draw
    every call, as in training). The batch: ``x``, ``y``, ``lam``, ``uids`` ``(rows, 2)`` (the row's
    record, its partner) and with ``with_index`` ``index`` ``(rows, 2)``.
    """

    def __init__(self, seed: int = 0, with_index: bool = False) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.with_index = with_index

    def __call__(self, items: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
        x = torch.stack([item["x"] for item in items])
        y = torch.stack([item["y"] for item in items])
        uid = torch.stack([item["uid"] for item in items])
        partner = torch.randperm(len(items), generator=self.generator)
        lam = 0.3 + 0.4 * torch.rand(len(items), generator=self.generator)
        batch = {
            "x": lam[:, None] * x + (1 - lam[:, None]) * x[partner],
            "y": lam * y + (1 - lam) * y[partner],
            "lam": lam,
            "uids": torch.stack([uid, uid[partner]], dim=1),
        }
        if self.with_index:
            batch["index"] = batch["uids"] - UID_BASE
        return batch


class MultiCrop:
    """Two random crops of ``crop`` frames from each record: all first crops, then all second crops.

    The batch: ``x`` ``(2 * records, crop, FEATURES)``, ``y`` and ``uid`` repeated, and with
    ``with_index`` ``index`` (each record's dataset index twice).
    """

    def __init__(self, crop: int = 4, seed: int = 0, with_index: bool = False) -> None:
        self.crop = crop
        self.generator = torch.Generator().manual_seed(seed)
        self.with_index = with_index

    def __call__(self, items: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
        views = []
        for _ in range(2):
            for item in items:
                start = int(torch.randint(0, len(item["x"]) - self.crop + 1, (1,), generator=self.generator))
                views.append(item["x"][start : start + self.crop])
        y = torch.stack([item["y"] for item in items])
        uid = torch.stack([item["uid"] for item in items])
        batch = {"x": torch.stack(views), "y": y.repeat(2), "uid": uid.repeat(2)}
        if self.with_index:
            batch["index"] = batch["uid"] - UID_BASE
        return batch


@dataclass(frozen=True)
class MaskTokens:
    """Masked-LM collate: each token is masked with probability ``prob``; ``labels`` is -100 elsewhere.

    The draw comes from a generator seeded by ``salt`` and the batch's record ids, so the same records
    always draw the same mask (a re-read of the batch gives the batch), and a test can find the
    batches that draw no mask at all before training (:meth:`draws_no_mask`).
    """

    salt: int = 0
    prob: float = 0.15

    def mask(self, ids: Tensor, uids: Tensor) -> Tensor:
        seed = self.salt * 1_000_003 + int(uids.sum())
        return torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed)) < self.prob

    def draws_no_mask(self, dataset: Tokens, indices: Sequence[int]) -> bool:
        """Whether the batch of these dataset indices draws no masked token."""
        return not bool(self.mask(dataset.ids[list(indices)], torch.tensor(indices) + UID_BASE).any())

    def __call__(self, items: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
        ids = torch.stack([item["ids"] for item in items])
        uid = torch.stack([item["uid"] for item in items])
        mask = self.mask(ids, uid)
        return {
            "input_ids": torch.where(mask, MASK_ID, ids),
            "labels": torch.where(mask, ids, -100),
            "uid": uid,
        }


# ------------------------------------------------------------------------------------ modules


class _Adam(pl.LightningModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _rms(energy: Tensor, count: Tensor) -> Tensor:
    return (energy / count).sqrt()


class UtteranceClassifier(_Adam):
    """Per-utterance RMS normalisation (0/0 for a silent one), a GRU over the packed frames, a classifier.

    ``sorted_rows``: the batch comes sorted by length (``pack_padded_sequence(enforce_sorted=True)``).
    """

    def __init__(self, sorted_rows: bool = True) -> None:
        super().__init__()
        self.sorted_rows = sorted_rows
        self.gru = nn.GRU(FEATURES, HIDDEN, batch_first=True)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        x, lengths = batch["x"], batch["lengths"]
        rms = _rms(x.pow(2).sum((1, 2)), lengths * FEATURES)
        x = x / rms[:, None, None]  # ORIGIN: utterance_rms
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=self.sorted_rows)
        _, last = self.gru(packed)
        return F.cross_entropy(self.head(last[0]), batch["y"])


class PackedClassifier(_Adam):
    """Packed rows: each record (segment) normalised on its own (0/0 for a silent one), pooled, classified."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(FEATURES, HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        x, segment = batch["x"], batch["segment"]
        onehot = (segment[..., None] == torch.arange(2)).float()  # (rows, T, 2)
        count = onehot.sum(1)  # frames per record of the row
        rms = _rms(torch.einsum("rts,rtf->rs", onehot, x.pow(2)), count.clamp(min=1) * FEATURES)
        x = x / (onehot @ rms[..., None] + (segment < 0).float()[..., None])  # ORIGIN: segment_rms
        h = torch.tanh(self.proj(x))
        pooled = torch.einsum("rts,rth->rsh", onehot, h) / count.clamp(min=1)[..., None]
        logits = self.head(pooled)
        return F.cross_entropy(logits.reshape(-1, CLASSES), batch["labels"].reshape(-1), ignore_index=-100)


class MixupRegressor(_Adam):
    """Amplitudes from powers (``sqrt``: NaN for a negative power), a small MLP, mean squared error."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        amplitude = batch["x"].sqrt()  # ORIGIN: amplitude
        return F.mse_loss(self.net(amplitude).squeeze(-1), batch["y"])


class CropClassifier(_Adam):
    """Each crop normalised by its RMS (0/0 for a silent record), mean-pooled, classified."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(FEATURES, HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        x = batch["x"]
        rms = _rms(x.pow(2).sum((1, 2)), torch.tensor(float(x.shape[1] * FEATURES)))
        x = x / rms[:, None, None]  # ORIGIN: crop_rms
        return F.cross_entropy(self.head(torch.tanh(self.proj(x)).mean(1)), batch["y"])


class MaskedLM(_Adam):
    """Masked-LM on token ids: ``"embedding"`` (an embedding and a linear head) or a tiny Hugging Face ``"bert"``.

    The loss is ``cross_entropy(..., ignore_index=-100)``: a mean over the masked tokens, NaN when
    the batch has none.
    """

    def __init__(self, kind: str = "embedding") -> None:
        super().__init__()
        self.kind = kind
        if kind == "bert":
            from transformers import BertConfig, BertForMaskedLM  # tiny config, no download

            config = BertConfig(
                vocab_size=VOCAB,
                hidden_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                intermediate_size=32,
                max_position_embeddings=16,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
            self.bert = BertForMaskedLM(config)
        elif kind == "embedding":
            self.embed = nn.Embedding(VOCAB, 16)
            self.head = nn.Linear(16, VOCAB)
        else:
            raise ValueError(f"kind must be 'embedding' or 'bert', got {kind!r}")

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        if self.kind == "bert":
            return self.bert(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        logits = self.head(self.embed(batch["input_ids"]))
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1), ignore_index=-100)


class BatchStd(pl.LightningModule):
    """Standardises features over the batch: the unbiased std of a batch of one sample is NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        h = self.lin(x)
        return ((h - h.mean(0)) / (h.std(0) + 1e-5)).sum(-1).sub(y).pow(2).mean()  # ORIGIN: batch_std

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


# ------------------------------------------------------------------------------------ ground truth


def planned_order(n: int, seed: int, passes: int = 1) -> list[list[int]]:
    """The passes of ``RandomSampler(range(n), generator=manual_seed(seed))``: what :func:`loader` will yield.

    Each pass takes ``n`` indices and stops, as the Trainer does (it knows the loader's length): a
    sampler iterated to exhaustion draws one more (empty) permutation and shifts the next pass.
    """
    sampler = RandomSampler(range(n), generator=torch.Generator().manual_seed(seed))
    return [[int(i) for i in itertools.islice(iter(sampler), n)] for _ in range(passes)]


def _finite(tensors: Sequence[Tensor | None]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t is not None)


def lone_bad(
    make: Callable[[], nn.Module],
    dataset: Dataset,
    collate: Callable[[list[Any]], Any],
    indices: Iterable[int] | None = None,
) -> list[int]:
    """Records (of ``indices``, default all) whose batch of one through ``collate`` is non-finite on a fresh model."""
    bad = []
    for index in range(len(dataset)) if indices is None else sorted(indices):  # type: ignore[arg-type]
        torch.manual_seed(0)
        module = make()
        loss = module.training_step(collate([dataset[index]]), 0)  # type: ignore[operator]
        loss.backward()
        if not _finite([loss, *(p.grad for p in module.parameters())]):
            bad.append(index)
    return bad


@dataclass(frozen=True)
class Seen:
    """One batch the Trainer gave ``training_step``: when, and the records of each row (dataset indices)."""

    epoch: int
    batch_idx: int
    global_step: int
    rows: tuple[tuple[int, ...], ...]
    batch: Any = field(repr=False, compare=False)

    @property
    def records(self) -> set[int]:
        return {record for row in self.rows for record in row}


class SeenRecords(*CALLBACK_BASES):  # type: ignore[misc]
    """Records, at ``on_train_batch_start``, the records of every row of every real training batch.

    ``field``: the batch field of record ids (``uid``: 1-D, or 2-D with -1 padding); ``None`` when
    the batch holds none (then :meth:`fill_rows` gives the rows from a side channel). The guard's
    own re-runs of ``training_step`` are not training batches and are not recorded.
    """

    def __init__(self, field: str | None = "uid") -> None:
        self.field = field
        self.seen: list[Seen] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        rows: tuple[tuple[int, ...], ...] = ()
        if self.field is not None:
            uids = batch[self.field]
            table = uids[:, None] if uids.dim() == 1 else uids
            rows = tuple(tuple(int(u) - UID_BASE for u in row if u >= 0) for row in table.tolist())
        batch_copy = {k: v.clone() for k, v in batch.items()} if isinstance(batch, dict) else batch
        self.seen.append(Seen(trainer.current_epoch, batch_idx, trainer.global_step, rows, batch_copy))

    def fill_rows(self, rows_per_batch: Sequence[Sequence[int]]) -> None:
        """The records of each batch's rows (one record per row), in training order, from a side channel."""
        assert len(rows_per_batch) == len(self.seen), (len(rows_per_batch), len(self.seen))
        self.seen = [
            dataclasses.replace(s, rows=tuple((record,) for record in rows))
            for s, rows in zip(self.seen, rows_per_batch, strict=True)
        ]

    def at(self, global_step: int) -> Seen:
        (found,) = [s for s in self.seen if s.global_step == global_step]
        return found

    def trained_after(self, global_step: int) -> set[int]:
        """Every record in a batch after ``global_step``."""
        return {record for s in self.seen if s.global_step > global_step for record in s.records}

    def __iter__(self) -> Iterator[Seen]:
        return iter(self.seen)


class LoggedDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` that logs the indices it yields, one list per pass."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.passes: list[list[int]] = []

    def __iter__(self) -> Iterator[int]:
        order = [int(i) for i in super().__iter__()]
        self.passes.append(order)
        return iter(order)


def loader(dataset: Dataset, batch_size: int, collate: Callable[[list[Any]], Any], seed: int = 7) -> DataLoader:
    """A shuffled loader (its sampler logs its order: ``loader.sampler.passes``) with ``collate``."""
    from multitask_models import OrderLog

    sampler = OrderLog(RandomSampler(dataset, generator=torch.Generator().manual_seed(seed)))  # type: ignore[arg-type]
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate)
