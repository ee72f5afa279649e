"""The per-event context files (source lines, stack, thumbnails) and the PNG thumbnails themselves."""

from __future__ import annotations

import json
import math
from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from png_reader import decode_png

from lightning_nanguard.core.events import NanEvent
from lightning_nanguard.reporting.context import read_source_window, save_incident_context
from lightning_nanguard.reporting.thumbnails import INF_RGB, NAN_RGB, encode_png, find_image_tensor, thumbnail
from lightning_nanguard_tensorboard.layout import CONTEXT_FILENAME, INCIDENTS_DIRNAME

HERE = Path(__file__).resolve()


def event(**changes: Any) -> NanEvent:
    base = NanEvent(12, 1, 3, 0, ("loss", "grad"), "skipped", offending_samples=(1, 3), dataset_indices=(41, 43))
    return base.replace(**changes)


def load_context(directory: Path) -> dict[str, Any]:
    return json.loads((directory / CONTEXT_FILENAME).read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------------ PNG


def test_png_round_trip() -> None:
    rgb = bytes(range(2 * 3 * 3))
    width, height, pixels = decode_png(encode_png(3, 2, rgb))
    assert (width, height) == (3, 2)
    assert bytes(value for pixel in pixels for value in pixel) == rgb


def test_png_rejects_a_wrong_buffer_size() -> None:
    with pytest.raises(ValueError, match="expected 2x2x3 = 12 bytes, got 11"):
        encode_png(2, 2, bytes(11))


# ------------------------------------------------------------------------------------ what counts as an image


@pytest.mark.parametrize(
    ("shape", "dtype", "layout"),
    [
        ((4, 1, 8, 8), torch.float32, "NCHW"),
        ((4, 3, 32, 20), torch.float16, "NCHW"),
        ((4, 4, 9, 9), torch.bfloat16, "NCHW"),
        ((4, 3, 16, 16), torch.uint8, "NCHW"),
        ((4, 16, 16, 3), torch.float32, "NHWC"),
        ((4, 28, 28), torch.uint8, "NHW"),
        ((4, 2, 16, 16), torch.float32, None),  # 2 channels: not an image
        ((4, 3, 7, 16), torch.float32, None),  # smaller than 8 pixels
        ((4, 28, 28), torch.float32, None),  # float [N, T, D]: a sequence, not grey images
        ((4, 3, 16, 16), torch.int64, None),  # token ids or labels
        ((4, 64), torch.float32, None),
    ],
)
def test_image_like_tensors(shape: tuple[int, ...], dtype: torch.dtype, layout: str | None) -> None:
    found = find_image_tensor(torch.zeros(shape, dtype=dtype))
    assert (found.layout if found is not None else None) == layout


def test_image_found_inside_containers() -> None:
    images = torch.rand(2, 3, 8, 8)
    Pair = namedtuple("Pair", ["label", "pixels"])

    @dataclass
    class Batch:
        ids: torch.Tensor
        image: torch.Tensor

    for batch in (
        (torch.zeros(2), images),
        [["caption a", "caption b"], images],
        {"label": torch.zeros(2), "mask": torch.zeros(2, 3, 8, 8, dtype=torch.bool), "pixel_values": images},
        Pair(torch.zeros(2), images),
        Batch(torch.zeros(2, 5, dtype=torch.long), images),
        {"outer": {"inner": (images,)}},
    ):
        found = find_image_tensor(batch)
        assert found is not None and found.tensor is images, type(batch)
    assert find_image_tensor({"a": {"b": {"c": {"d": images}}}}) is None  # deeper than three levels
    assert find_image_tensor(["text", 3, None]) is None


def test_dict_keys_naming_images_are_preferred() -> None:
    other = torch.rand(2, 3, 8, 8)
    images = torch.rand(2, 3, 8, 8)
    assert find_image_tensor({"noise": other, "image": images}).tensor is images  # type: ignore[union-attr]


# ------------------------------------------------------------------------------------ thumbnails


def test_thumbnail_marks_nan_and_inf_pixels_and_keeps_values_in_unit_range() -> None:
    images = torch.full((2, 1, 8, 8), 0.5)
    images[1, 0, 0, 0] = math.nan
    images[1, 0, 0, 1] = math.inf
    images[1, 0, 7, 7] = 1.0
    thumb = thumbnail(find_image_tensor(images), 1)  # type: ignore[arg-type]
    width, height, pixels = decode_png(thumb.png)
    assert (width, height, thumb.source_size) == (8, 8, (8, 8))
    assert pixels[0] == NAN_RGB and pixels[1] == INF_RGB
    assert pixels[2] == (128, 128, 128)  # 0.5 in [0, 1] is shown as it is, grey
    assert pixels[-1] == (255, 255, 255)
    assert thumb.nonfinite_values == 2 and thumb.value_range == (0.5, 1.0)


def test_thumbnail_stretches_values_outside_unit_range_per_sample() -> None:
    images = torch.zeros(1, 3, 8, 8)
    images[0, 0] = -2.0  # red channel low, green and blue at 0, one bright pixel
    images[0, :, 0, 0] = 3.0
    _, _, pixels = decode_png(thumbnail(find_image_tensor(images), 0).png)  # type: ignore[arg-type]
    assert pixels[0] == (255, 255, 255)
    assert pixels[1] == (0, 102, 102)  # (0 - -2) / 5 = 0.4


def test_thumbnail_of_channels_last_bytes_and_blank_images() -> None:
    images = torch.zeros(2, 10, 12, 3, dtype=torch.uint8)
    images[0, :, :, 0] = 255
    red = thumbnail(find_image_tensor(images), 0)  # type: ignore[arg-type]
    width, height, pixels = decode_png(red.png)
    assert (width, height) == (12, 10) and set(pixels) == {(255, 0, 0)}
    _, _, blank = decode_png(thumbnail(find_image_tensor(images), 1).png)  # type: ignore[arg-type]
    assert set(blank) == {(0, 0, 0)}  # a blank image stays black


def test_large_images_are_averaged_down_and_a_nan_block_stays_visible() -> None:
    images = torch.rand(1, 3, 256, 128)
    images[0, 1, :4, :4] = math.nan
    thumb = thumbnail(find_image_tensor(images), 0, max_size=64)  # type: ignore[arg-type]
    width, height, pixels = decode_png(thumb.png)
    assert (width, height) == (32, 64) and thumb.source_size == (256, 128)
    assert pixels[0] == NAN_RGB and NAN_RGB not in pixels[1:]
    assert len(thumb.png) < 16_000


# ------------------------------------------------------------------------------------ save_incident_context


def test_context_holds_source_window_stack_and_thumbnails(tmp_path: Path) -> None:
    line = 30  # the 'def decode_png' region of this file
    stack = [
        {"file": str(HERE), "line": 20, "function": "outer"},
        {"file": str(HERE), "line": line, "function": "decode_png"},
    ]
    images = torch.rand(4, 3, 16, 16)
    images[3, 0, 2, 2] = math.nan
    ev = event(source_line=f"tests/{HERE.name}:{line}", details={"stack": stack})
    directory = save_incident_context(tmp_path, ev, str(HERE), (images, torch.zeros(4)), [1, 3])
    assert directory == tmp_path / INCIDENTS_DIRNAME / "step-12"
    context = load_context(directory)
    assert context["format"] == 1
    assert context["event"] == {"global_step": 12, "rank": 0, "epoch": 1, "batch_idx": 3, "kinds": ["loss", "grad"]}
    lines = HERE.read_text(encoding="utf-8").splitlines()
    source = context["source"]
    assert source["file"] == f"tests/{HERE.name}"  # as the event shows it, never the absolute path read
    assert (source["line"], source["first_line"]) == (line, line - 5)
    assert source["lines"] == lines[line - 6 : line + 5]
    assert [f["function"] for f in context["stack"]] == ["outer", "decode_png"]  # innermost last
    assert context["stack"][1]["text"] == lines[line - 1].strip()
    thumbs = context["thumbnails"]
    assert [(t["position"], t["dataset_index"], t["file"]) for t in thumbs] == [
        (1, 41, "sample-1.png"),
        (3, 43, "sample-3.png"),
    ]
    assert thumbs[1]["nonfinite_values"] == 1 and thumbs[0]["nonfinite_values"] == 0
    assert context["image_batch"] == {"layout": "NCHW", "shape": [4, 3, 16, 16], "dtype": "torch.float32"}
    for t in thumbs:
        assert decode_png((directory / t["file"]).read_bytes())[:2] == (16, 16)
    assert not list(directory.glob("*.tmp"))


def test_positions_default_to_the_offending_samples_and_are_capped(tmp_path: Path) -> None:
    ev = event(offending_samples=tuple(range(12)), dataset_indices=tuple(range(100, 112)))
    directory = save_incident_context(tmp_path, ev, batch=torch.rand(12, 1, 8, 8), max_thumbnails=3)
    context = load_context(directory)  # type: ignore[arg-type]
    assert [t["position"] for t in context["thumbnails"]] == [0, 1, 2]
    assert "first 3 of 12 samples shown" in context["notes"]


def test_without_image_batch_or_source_the_reasons_are_written(tmp_path: Path) -> None:
    ev = event(source_line="does/not/exist.py:3")
    context = load_context(save_incident_context(tmp_path, ev, None, torch.zeros(4, 16, 32), [1]))  # type: ignore[arg-type]
    assert context["source"] is None and context["thumbnails"] == [] and context["image_batch"] is None
    assert context["notes"] == ["source file not readable: does/not/exist.py", "the batch holds no image-like tensor"]
    context = load_context(save_incident_context(tmp_path, event(offending_samples=None), None, None, None))  # type: ignore[arg-type]
    assert context["notes"] == ["no source line in the event", "no batch given"]


def test_innermost_stack_frame_is_the_source_when_no_culprit_line(tmp_path: Path) -> None:
    ev = event(details={"stack": [{"file": str(HERE), "line": 3, "function": "f"}]})
    context = load_context(save_incident_context(tmp_path, ev))  # type: ignore[arg-type]
    assert context["source"]["line"] == 3 and context["source"]["first_line"] == 1


def test_events_at_the_same_step_get_their_own_directories(tmp_path: Path) -> None:
    names = [save_incident_context(tmp_path, event()).name for _ in range(3)]  # type: ignore[union-attr]
    assert names == ["step-12", "step-12-2", "step-12-3"]
    assert save_incident_context(tmp_path, event(rank=2)).name == "step-12-rank2"  # type: ignore[union-attr]


def test_never_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory", encoding="utf-8")
    assert save_incident_context(blocker, event()) is None
    assert "could not save the incident context of step 12" in caplog.text
    # a broken thumbnail (positions past the batch) and malformed stack entries: the rest is still written
    bad = event(details={"stack": [{"file": None}, "garbage", {"file": "x.py", "line": "12"}]})
    context = load_context(save_incident_context(tmp_path, bad, batch=torch.rand(2, 1, 8, 8), positions=[5]))  # type: ignore[arg-type]
    assert context["thumbnails"] == [] and context["stack"] == [
        {"file": "x.py", "line": 12, "function": None, "text": None}
    ]


def test_source_window_at_the_edges_of_a_file(tmp_path: Path) -> None:
    path = tmp_path / "short.py"
    path.write_text("a = 1\nb = 2\nc = 3\n", encoding="utf-8")
    assert read_source_window(str(path), 3, context_lines=5) == {
        "line": 3,
        "first_line": 1,
        "lines": ["a = 1", "b = 2", "c = 3"],
    }
    assert read_source_window(str(path), 4) is None
    assert read_source_window(str(tmp_path / "missing.py"), 1) is None
