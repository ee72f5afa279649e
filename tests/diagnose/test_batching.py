"""``batch_size`` / ``slice_batch``: every batch structure is cut along the sample dimension, in order."""

from __future__ import annotations

import math
from collections import OrderedDict, UserDict
from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch
from torch import Tensor

from lightning_nanguard.diagnose.batching import UnsliceableBatchError, batch_size, nonfinite_fields, slice_batch

N = 5
POSITIONS = [4, 1, 3]  # not sorted: order must be kept


def ids(n: int = N) -> Tensor:
    return torch.arange(n * 2).view(n, 2)


class Pair(NamedTuple):
    x: Tensor
    names: list[str]


@dataclass
class Sample:
    x: Tensor
    names: list[str]
    weight: float = 0.5


@dataclass(frozen=True)
class FrozenSample:
    x: Tensor
    y: Tensor


class Encoding(UserDict):  # like transformers.BatchEncoding: a UserDict with extra attributes
    def __init__(self, data: dict, n_sequences: int) -> None:
        super().__init__(data)
        self.n_sequences = n_sequences


def test_tensor() -> None:
    x = ids()
    assert batch_size(x) == N
    assert torch.equal(slice_batch(x, POSITIONS), x[POSITIONS])


def test_tuple_list_and_scalar_leaves() -> None:
    x, y = ids(), torch.arange(N)
    out = slice_batch((x, y, 0.5, torch.tensor(3.0)), POSITIONS)
    assert isinstance(out, tuple)
    assert torch.equal(out[0], x[POSITIONS]) and out[1].tolist() == POSITIONS
    assert out[2] == 0.5 and out[3].item() == 3.0  # 0-dim tensors and scalars pass through
    assert isinstance(slice_batch([x, y], POSITIONS), list)


def test_dict_with_string_and_int_leaves() -> None:
    batch = {
        "x": ids(),
        "names": [f"s{i}" for i in range(N)],
        "ids": tuple(range(100, 100 + N)),
        "vocab": ["a", "b"],  # not per-sample (length != batch size): unchanged
        "split": "train",
    }
    assert batch_size(batch) == N
    out = slice_batch(batch, POSITIONS)
    assert type(out) is dict
    assert torch.equal(out["x"], batch["x"][POSITIONS])
    assert out["names"] == ["s4", "s1", "s3"]
    assert out["ids"] == (104, 101, 103)
    assert out["vocab"] == ["a", "b"]
    assert out["split"] == "train"
    assert batch["names"] == [f"s{i}" for i in range(N)]  # the original is untouched


def test_ordered_dict_keeps_its_type() -> None:
    out = slice_batch(OrderedDict(x=ids(), y=torch.arange(N)), POSITIONS)
    assert type(out) is OrderedDict and out["y"].tolist() == POSITIONS


def test_namedtuple() -> None:
    batch = Pair(ids(), [f"s{i}" for i in range(N)])
    out = slice_batch(batch, POSITIONS)
    assert type(out) is Pair
    assert torch.equal(out.x, batch.x[POSITIONS]) and out.names == ["s4", "s1", "s3"]


def test_dataclass() -> None:
    batch = Sample(ids(), [f"s{i}" for i in range(N)])
    out = slice_batch(batch, POSITIONS)
    assert type(out) is Sample
    assert torch.equal(out.x, batch.x[POSITIONS]) and out.names == ["s4", "s1", "s3"] and out.weight == 0.5
    assert batch.x.shape[0] == N  # the original is untouched


def test_frozen_dataclass() -> None:
    batch = FrozenSample(ids(), torch.arange(N))
    out = slice_batch(batch, POSITIONS)
    assert type(out) is FrozenSample and out.y.tolist() == POSITIONS
    assert batch.y.tolist() == list(range(N))


def test_userdict_keeps_class_and_attributes() -> None:
    batch = Encoding({"input_ids": ids(), "attention_mask": torch.ones(N, 2)}, n_sequences=N)
    out = slice_batch(batch, POSITIONS)
    assert type(out) is Encoding and out.n_sequences == N
    assert torch.equal(out["input_ids"], batch["input_ids"][POSITIONS])
    assert batch["input_ids"].shape[0] == N


def test_nested_structures() -> None:
    batch = {"inputs": (ids(), {"mask": torch.ones(N, 3)}), "meta": Sample(torch.arange(N), list("abcde"))}
    out = slice_batch(batch, [0, 2])
    assert out["inputs"][0].shape == (2, 2) and out["inputs"][1]["mask"].shape == (2, 3)
    assert out["meta"].x.tolist() == [0, 2] and out["meta"].names == ["a", "c"]


def test_given_size_skips_inference() -> None:
    assert slice_batch(torch.arange(N), [1], size=N).tolist() == [1]


def test_single_and_all_positions() -> None:
    x = ids()
    assert slice_batch(x, [2]).shape == (1, 2)
    assert torch.equal(slice_batch(x, list(range(N))), x)


@pytest.mark.parametrize(
    "batch",
    [
        pytest.param({"names": ["a", "b"]}, id="no-tensor"),
        pytest.param(torch.tensor(1.0), id="0-dim"),
        pytest.param((torch.zeros(4), torch.zeros(3)), id="sizes-disagree"),
        pytest.param((torch.zeros(6, 4), torch.zeros(4)), id="sequence-first"),  # (T, B) tokens, (B,) labels
    ],
)
def test_unsliceable_batches_raise_a_clear_error(batch: object) -> None:
    with pytest.raises(UnsliceableBatchError, match="batch_slicer"):
        batch_size(batch)
    assert issubclass(UnsliceableBatchError, TypeError)


# ------------------------------------------------------------------------------------ NaN/Inf in the batch itself


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nonfinite_fields_names_fields_and_samples(value: float) -> None:
    x = torch.ones(N, 3, 2)
    x[1, 2, 0] = value
    x[4, 0, 1] = value
    batch = {"x": x, "y": torch.ones(N), "ids": ids(), "names": list("abcde")}
    assert nonfinite_fields(batch) == {"x": [1, 4]}


def test_nonfinite_fields_of_every_structure() -> None:
    bad = torch.ones(N, 2)
    bad[3] = math.nan
    assert nonfinite_fields(bad) == {"<batch>": [3]}
    assert nonfinite_fields((torch.ones(N), bad)) == {1: [3]}
    assert nonfinite_fields(Pair(bad, list("abcde"))) == {"x": [3]}
    assert nonfinite_fields(Sample(bad, list("abcde"))) == {"x": [3]}
    assert nonfinite_fields(Encoding({"pixel_values": bad}, 1)) == {"pixel_values": [3]}
    assert nonfinite_fields({"inputs": {"x": bad}, "y": [torch.ones(N), bad]}) == {"inputs.x": [3], "y.1": [3]}
    assert nonfinite_fields({"x": torch.ones(N, 2), "ids": ids()}) == {}


def test_nonfinite_values_outside_the_sample_dimension_blame_no_sample() -> None:
    batch = {"x": torch.ones(N, 2), "scale": torch.tensor(math.inf), "table": torch.full((3, 2), math.nan)}
    assert nonfinite_fields(batch, size=N) == {"scale": None, "table": None}


def test_an_additive_mask_is_deliberate() -> None:
    mask = torch.zeros(N, 4)
    mask[:, 3] = -math.inf
    assert nonfinite_fields({"x": torch.ones(N, 4), "mask": mask}) == {}
    mask[0, 0] = math.inf  # +inf is no mask value
    assert nonfinite_fields({"x": torch.ones(N, 4), "mask": mask}) == {"mask": list(range(N))}


def test_nonfinite_fields_with_a_custom_slicer() -> None:
    """Sequence-first tensors: the user's slicer cuts each sample; the NaN is found in sample 2."""
    x = torch.ones(7, N)  # (time, batch)
    x[3, 2] = math.nan

    def slicer(batch: dict[str, Tensor], positions: list[int]) -> dict[str, Tensor]:
        return {"x": batch["x"][:, positions]}

    assert nonfinite_fields({"x": x}, size=N, slicer=slicer) == {"x": [2]}
