"""Bounded per-channel details for events (``lightning_nanguard.diagnose.compact``)."""

from __future__ import annotations

import pytest
import torch

from lightning_nanguard.diagnose.compact import MAX_CHANNELS, MAX_LAYERS, channels_text, compact_channels


def test_nothing_cut_gives_no_summary() -> None:
    channels = {f"bn{i}": list(range(MAX_CHANNELS)) for i in range(MAX_LAYERS)}
    shown, summary = compact_channels(channels)
    assert shown == channels and summary is None
    assert compact_channels({}) == ({}, None)


def test_too_many_channels_in_one_layer() -> None:
    shown, summary = compact_channels({"a": [1, 2], "b": list(range(10, 10 + MAX_CHANNELS + 1))})
    assert shown == {"a": [1, 2], "b": list(range(10, 10 + MAX_CHANNELS))}
    assert summary == {"layers": 2, "channels": 2 + MAX_CHANNELS + 1, "counts": {"a": 2, "b": MAX_CHANNELS + 1}}


def test_too_many_layers_keeps_the_first_in_order() -> None:
    channels = {name: [0] for name in ("z", "y", "x", "w", "v", "u")}
    shown, summary = compact_channels(channels)
    assert list(shown) == ["z", "y", "x", "w"]
    assert summary == {"layers": 6, "channels": 6, "counts": {"z": 1, "y": 1, "x": 1, "w": 1}}


def test_custom_limits_and_plain_ints() -> None:
    shown, summary = compact_channels({"a": torch.tensor([3, 1, 2]), "b": (7,)}, max_layers=1, max_channels=2)
    assert shown == {"a": [3, 1]} and all(type(c) is int for c in shown["a"])
    assert summary == {"layers": 2, "channels": 4, "counts": {"a": 3}}


@pytest.mark.parametrize(
    ("channels", "text"),
    [
        ({"net.1": [0, 2]}, "net.1 [0, 2]"),
        ({"a": [1], "b": [2, 3]}, "a [1]; b [2, 3]"),
        (
            {"a": list(range(10))},
            "a [0, 1, 2, 3, 4, 5, 6, 7, ...] (10 channels)",
        ),
        (
            {f"l{i}": [i] for i in range(6)},
            "l0 [0]; l1 [1]; l2 [2]; l3 [3]; and 2 more layers (6 channels in 6 layers)",
        ),
    ],
    ids=["one", "two", "channels-cut", "layers-cut"],
)
def test_channels_text_of_a_compacted_dict(channels: dict[str, list[int]], text: str) -> None:
    assert channels_text(*compact_channels(channels)) == text


def test_channels_text_without_a_summary_shows_what_it_is_given() -> None:
    assert channels_text({"a": [5, 6]}, None) == "a [5, 6]"
    assert channels_text({}) == ""
