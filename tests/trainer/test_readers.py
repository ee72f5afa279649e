"""A record read again is what ``training_step`` would get: the loader's collate, then the fit loop's batch hooks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import record_pipelines as rp
import torch
from conftest import build_trainer
from torch.utils.data import DataLoader

from lightning_nanguard.diagnose.combined import CombinedLayout
from lightning_nanguard.engine.data.readers import RecordReader
from lightning_nanguard.trainer._compat import CALLBACK_BASES
from lightning_nanguard.trainer.frontend import TrainerFrontEnd


def test_a_map_style_loader_reads_with_its_own_collate() -> None:
    reader = RecordReader.of(DataLoader(rp.TokenRecords(8), batch_size=4, collate_fn=rp.sorting_collate))
    assert reader.reason == "" and reader.collate_fn is rp.sorting_collate
    record = reader.read(3)
    assert record["x"].tolist() == [rp.tokens(3).tolist()] and record["mask"].all()


@pytest.mark.parametrize(
    ("loader", "reason"),
    [
        (DataLoader(rp.TokenStream(8), batch_size=4), "an IterableDataset cannot be read by index"),
        (DataLoader(rp.TokenRecords(8), batch_size=None), "batch_size=None: the loader does not collate records"),
        (DataLoader(rp.TokenRecords(8, reread=False), batch_size=4), "the dataset sets nanguard_reread = False"),
        ([1, 2, 3], "a list is not a torch DataLoader"),
    ],
)
def test_what_cannot_be_read_again_says_why(loader: Any, reason: str) -> None:
    reader = RecordReader.of(loader)
    assert reader.reason.startswith(reason)
    with pytest.raises(RuntimeError, match=reason.split(":")[0]):
        reader.read(0)


class HalvingData(pl.LightningDataModule):
    """The same transform in a datamodule's hook (Lightning calls the datamodule's when it defines it)."""

    def __init__(self, loader: DataLoader) -> None:
        super().__init__()
        self.loader = loader

    def train_dataloader(self) -> DataLoader:
        return self.loader

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return {**batch, "x": batch["x"] * 0.5}


class ReadAgain(*CALLBACK_BASES):  # type: ignore[misc]
    """At each batch start, reads the batch's second record again and transforms it as the fit loop did."""

    def __init__(self, loader: Any, layout: CombinedLayout | None = None, part: int = 0) -> None:
        self.loader, self.layout, self.part = loader, layout, part
        self.pairs: list[tuple[Any, Any]] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        reader = RecordReader.of(self.loader)
        front = TrainerFrontEnd(trainer, pl_module)
        again = front.as_training_batch(reader.read(8 * batch_idx + 1), self.layout, self.part, batch)
        row = batch if self.layout is None else self.layout.part(batch, self.part)
        self.pairs.append(({key: value[1:2] for key, value in row.items()}, again))


def _same(row: dict[str, Any], again: dict[str, Any]) -> bool:
    """The padded row holds the record (its transformed values exactly, then padding)."""
    width = again["x"].shape[1]
    return row.keys() == again.keys() and all(
        torch.equal(row[k][:, :width] if row[k].dim() == 2 else row[k], again[k]) for k in row
    )


@pytest.mark.parametrize("where", ["module", "datamodule"])
def test_the_batch_hooks_apply_to_a_record_read_again(tmp_path: Path, where: str) -> None:
    loader = DataLoader(rp.TokenRecords(16), batch_size=8, collate_fn=rp.pad)
    watch = ReadAgain(loader)
    trainer = build_trainer("lightning", tmp_path, callbacks=[watch])
    if where == "module":
        trainer.fit(rp.HookedModule(), loader)
        assert set(watch.pairs[0][1]) == {"x", "mask", "seen"}
    else:
        trainer.fit(rp.SqrtModule(), datamodule=HalvingData(loader))
    assert len(watch.pairs) == 2 and all(_same(row, again) for row, again in watch.pairs)
    assert watch.pairs[1][1]["x"][0, 0].item() == (10 * 9 + 1) * 0.5


def test_with_several_loaders_the_hooks_see_the_combined_batch(tmp_path: Path) -> None:
    loaders = {"a": DataLoader(rp.TokenRecords(16), batch_size=8, collate_fn=rp.pad)}
    loaders["b"] = DataLoader(rp.TokenRecords(16), batch_size=8, collate_fn=rp.sorting_collate)
    layout = CombinedLayout.from_paths([("a",), ("b",)])
    watch = ReadAgain(loaders["a"], layout, part=0)
    build_trainer("lightning", tmp_path, callbacks=[watch]).fit(rp.HookedModule(), loaders)
    assert len(watch.pairs) == 2 and all(_same(row, again) for row, again in watch.pairs)
