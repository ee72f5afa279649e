"""Batches of several training loaders, without a Trainer: layout, cutting, fillers, the search, the event."""

from __future__ import annotations

import math
from collections import namedtuple
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.diagnose.batch_diagnosis import diagnose
from lightning_nanguard.diagnose.batching import UnsliceableBatchError
from lightning_nanguard.diagnose.combined import CombinedBatch, CombinedIndices, CombinedLayout, LoaderSplit
from lightning_nanguard.diagnose.event_fields import event_with_diagnosis
from lightning_nanguard.diagnose.runner import SubBatchRunner

AB = CombinedLayout.from_paths([("a",), ("b",)])
Pair = namedtuple("Pair", ["x", "y"])


def test_layout_finds_and_replaces_parts_in_nested_collections() -> None:
    layout = CombinedLayout.from_paths([("main",), ("aux", 0), ("aux", 1)])
    batch = {"main": torch.arange(4), "aux": (torch.arange(3), Pair(torch.ones(2), torch.zeros(2)))}
    assert layout.keys == ("main", "aux.0", "aux.1")
    assert layout.part(batch, 2) is batch["aux"][1]
    out = layout.with_parts(batch, {1: "first aux", 2: "second aux"})
    assert out == {"main": batch["main"], "aux": ("first aux", "second aux")}
    assert isinstance(out["aux"], tuple) and batch["aux"][0] is not out["aux"][0]  # the original is untouched
    assert not layout.matches({"main": batch["main"]})
    with pytest.raises(UnsliceableBatchError, match=r"no part for training loader 'aux\.0'"):
        layout.part({"main": 1}, 1)


def test_each_part_is_cut_on_its_own_and_kept_in_its_container() -> None:
    batch = [(torch.arange(4.0), ["w", "x", "y", "z"]), {"t": torch.arange(10, 13)}]
    combined = CombinedBatch(batch, CombinedLayout.from_paths([(0,), (1,)]))
    assert (combined.keys, combined.sizes, combined.total) == ((0, 1), (4, 3), 7)
    cut = combined.cut([6, 1, 3, 4])
    assert cut[0][0].tolist() == [1.0, 3.0] and cut[0][1] == ["x", "z"] and isinstance(cut, list)
    assert cut[1]["t"].tolist() == [12, 10]  # the order given
    with pytest.raises(UnsliceableBatchError, match=r"loader\(s\) \[1\] would be left empty"):
        combined.cut([0, 1])


def test_an_exhausted_loader_has_no_samples_and_stays_none() -> None:
    combined = CombinedBatch({"a": torch.arange(4), "b": None}, AB)
    assert (combined.keys, combined.sizes) == (("a",), (4,))
    assert combined.cut([2]) == {"a": torch.tensor([2]), "b": None}


def test_rows_spread_over_every_part_and_follow_sizes() -> None:
    combined = CombinedBatch({"a": torch.arange(8), "b": torch.arange(4)}, AB)
    assert combined.rows(3) == [[1, 8], [4, 10], [6, 11]]
    assert CombinedBatch({"a": torch.arange(8), "b": torch.arange(2)}, AB).rows(3) == []  # b too small to spread
    assert CombinedBatch({"a": torch.arange(8), "b": torch.arange(2)}, AB).rows(3, spread=False) == [
        [1, 8],
        [4, 9],
        [6, 9],
    ]
    assert combined.rows_by_size([10]) == {8: [], 4: [2]}
    same = CombinedBatch({"a": torch.arange(4), "b": torch.arange(4)}, AB)
    assert same.rows_by_size([1, 6]) == {4: [1, 2]}  # equal sizes cannot be told apart: both rows followed
    assert combined.first_rows(2) == [0, 1, 8, 9]


def test_nonfinite_fields_are_named_by_loader_with_flat_positions() -> None:
    x = torch.ones(4, 2)
    x[1, 0] = math.inf
    batch = {"a": {"x": torch.ones(3, 2), "mask": torch.zeros(3, 2)}, "b": x}
    assert CombinedBatch(batch, AB).nonfinite_fields() == {"b": [4]}


# ------------------------------------------------------------------------------------ runner and search


class TwoTasks(nn.Module):
    """One loss per loader; ``sqrt`` of a squared norm: an infinite derivative for a blank row, in either loader.

    With ``batchnorm`` loader a's features also go through a BatchNorm in train mode (a second term).
    """

    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3, bias=False)
        self.b = nn.Linear(3, 3, bias=False)
        self.norm = nn.BatchNorm1d(3) if batchnorm else None
        self.register_buffer("scale", torch.ones(()))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        losses = []
        for key, layer in (("a", self.a), ("b", self.b)):
            h = layer(batch[key])
            losses.append(h.pow(2).sum(-1).sqrt().mean())  # the mean of no row would be NaN: parts never empty
            if key == "a" and self.norm is not None:
                losses.append(self.norm(h).pow(2).mean())
            if key == "b":
                losses.append((h * self.scale).sum())
        return torch.stack(losses).sum()


def two_parts(bad_a: tuple[int, ...] = (), bad_b: tuple[int, ...] = ()) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 3, generator=g) + 3, torch.randn(5, 3, generator=g) + 3
    a[list(bad_a)] = 0.0
    b[list(bad_b)] = 0.0
    return {"a": a, "b": b}


def test_padded_runs_give_every_part_a_filler_and_batchnorm_two() -> None:
    runner = SubBatchRunner(TwoTasks(), two_parts(), layout=AB)
    runner.known_good = [2, 9]
    assert runner.padded([10]) == ([10, 2], False)  # a gets its known-good sample
    assert runner.padded([3, 11]) == ([3, 11], False)
    bn = SubBatchRunner(TwoTasks(batchnorm=True), two_parts(), layout=AB)
    bn.known_good = [2, 5, 9]
    assert bn.padded([10]) == ([10, 2, 5, 9], False)  # two samples of every part under BatchNorm in train mode
    assert bn.padded([3, 11]) == ([3, 11, 2, 9], False)
    bn.known_good = []
    assert bn.padded([10]) == ([10, 0], True)  # no known-good sample yet: a's first, BatchNorm in eval mode


@pytest.mark.parametrize("bad", [("a", 0), ("a", 5), ("a", 7), ("b", 0), ("b", 2), ("b", 4)])
@pytest.mark.parametrize("batchnorm", [False, True], ids=["plain", "batchnorm"])
def test_the_search_finds_the_sample_in_its_own_loader(bad: tuple[str, int], batchnorm: bool) -> None:
    key, position = bad
    batch = two_parts(**{f"bad_{key}": (position,)})
    found = diagnose(TwoTasks(batchnorm), batch, layout=AB)
    assert found.cause == "data" and found.loaders == LoaderSplit(("a", "b"), (8, 5))
    assert [found.loaders.locate(p) for p in found.offending or ()] == [bad]
    assert found.passes <= 2 * math.ceil(math.log2(13)) + 4
    assert found.localization is not None and found.localization.op == "SqrtBackward0"


def test_two_samples_of_two_loaders_in_one_batch() -> None:
    found = diagnose(TwoTasks(), two_parts(bad_a=(6,), bad_b=(1,)), layout=AB)
    assert found.loaders is not None
    assert [found.loaders.locate(p) for p in found.offending or ()] == [("a", 6), ("b", 1)]


def test_a_loader_whose_every_sample_fails_is_not_guessed() -> None:
    """b has one sample and it fails: no sub-batch can be run without it, so no sample is named."""
    batch = two_parts()
    batch["b"] = torch.zeros(1, 3)
    found = diagnose(TwoTasks(), batch, layout=AB)
    assert found.offending is None and "no group of one sample of each training loader" in found.reason


def test_the_state_check_probes_one_sample_per_loader() -> None:
    module = TwoTasks()
    module.scale.fill_(math.inf)  # a diverged buffer, not a weight: every combination of samples fails
    found = diagnose(module, two_parts(), layout=AB)
    assert found.cause == "state" and found.state_passes == 4
    assert "every combination of one sample per training loader" in found.reason


# ------------------------------------------------------------------------------------ the event


def test_event_names_each_samples_loader_and_index_or_says_why_not() -> None:
    event = NanEvent(3, 0, 3, 0, ("grad",), "skipped")
    found = diagnose(TwoTasks(), two_parts(bad_a=(6,), bad_b=(1,)), layout=AB)
    indices = CombinedIndices(AB, ([100 + i for i in range(8)], [200 + i for i in range(5)]))
    filled = event_with_diagnosis(event, found, dataset_indices=indices.flat(found.loaders))  # type: ignore[arg-type]
    assert (filled.sample_loaders, filled.offending_samples, filled.dataset_indices) == (("a", "b"), (6, 1), (106, 201))
    assert filled.details["loader_batch_sizes"] == [["a", 8], ["b", 5]] and filled.details["batch_size"] == 13
    unknown = CombinedIndices(AB, ([100 + i for i in range(8)], None), ("", "an IterableDataset"))
    note = unknown.why_unknown(["a", "b"])
    partial = event_with_diagnosis(event, found, dataset_indices=unknown.flat(found.loaders), indices_note=note)  # type: ignore[arg-type]
    assert partial.dataset_indices is None and partial.sample_loaders == ("a", "b")
    assert partial.details["dataset_indices_unknown"] == "loader 'b': an IterableDataset"


def test_one_loader_events_do_not_change() -> None:
    class One(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3, bias=False)

        def training_step(self, x: Tensor, batch_idx: int) -> Tensor:
            return F.mse_loss(self.lin(x).pow(2).sum(-1).sqrt(), torch.zeros(len(x)))

    x = two_parts(bad_a=(4,))["a"]
    filled = event_with_diagnosis(
        NanEvent(3, 0, 3, 0, ("grad",), "skipped"), diagnose(One(), x), dataset_indices=range(8)
    )
    assert filled.sample_loaders is None and "sample_loaders" not in filled.to_dict()
    assert "loader_batch_sizes" not in filled.details and filled.dataset_indices == (4,)
