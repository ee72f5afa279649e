"""PNG thumbnails of image samples, with no imaging library (``lightning_nanguard.reporting.thumbnails``)."""

from __future__ import annotations

import math
from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch
from png_reader import decode_png

from lightning_nanguard.reporting.thumbnails import INF_RGB, NAN_RGB, encode_png, find_image_tensor, thumbnail

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


def test_grey_bytes_and_rgba_are_shown_as_rgb() -> None:
    grey = torch.full((1, 8, 9), 51, dtype=torch.uint8)  # [N, H, W] bytes
    found = find_image_tensor(grey)
    assert found is not None and found.layout == "NHW" and found.batch_size == 1
    width, height, pixels = decode_png(thumbnail(found, 0).png)
    assert (width, height) == (9, 8) and set(pixels) == {(51, 51, 51)}
    rgba = torch.zeros(1, 4, 8, 8)
    rgba[0, 1] = 1.0  # green
    rgba[0, 3] = 0.25  # alpha: dropped
    _, _, pixels = decode_png(thumbnail(find_image_tensor(rgba), 0).png)  # type: ignore[arg-type]
    assert set(pixels) == {(0, 255, 0)}


def test_a_constant_sample_outside_unit_range_is_mid_grey() -> None:
    images = torch.full((1, 3, 8, 8), 7.0)
    thumb = thumbnail(find_image_tensor(images), 0)  # type: ignore[arg-type]
    assert set(decode_png(thumb.png)[2]) == {(128, 128, 128)}
    assert thumb.value_range == (7.0, 7.0) and thumb.nonfinite_values == 0


def test_an_all_nan_sample_has_no_value_range() -> None:
    images = torch.full((1, 1, 8, 8), math.nan)
    thumb = thumbnail(find_image_tensor(images), 0)  # type: ignore[arg-type]
    assert thumb.value_range is None and thumb.nonfinite_values == 64
    assert set(decode_png(thumb.png)[2]) == {NAN_RGB}


@pytest.mark.parametrize(("width", "height"), [(0, 1), (1, 0), (-1, 2)])
def test_png_rejects_an_empty_or_negative_size(width: int, height: int) -> None:
    with pytest.raises(ValueError, match="expected"):
        encode_png(width, height, b"")
