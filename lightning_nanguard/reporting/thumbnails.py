r"""Small PNG thumbnails of the offending samples of an image batch, with no imaging library.

What counts as an image batch (the first match found in the batch, see :func:`find_image_tensor`):

- a 4-D float or ``uint8`` tensor ``[N, C, H, W]`` with ``C`` in ``{1, 3, 4}`` and ``H, W >= 8``;
- a 4-D tensor ``[N, H, W, C]`` (channels last) with ``C`` in ``{1, 3, 4}`` and ``H, W >= 8``;
- a 3-D ``uint8`` tensor ``[N, H, W]`` with ``H, W >= 8`` (grey-scale bytes). A 3-D float tensor is
  not taken for images: ``[batch, time, features]`` sequences have the same shape.

The batch may be that tensor, or a tuple, list, namedtuple, dict or dataclass holding it (dict keys
such as ``"image"`` or ``"pixel_values"`` are looked at first), up to three levels deep.

Display: one channel is grey, three are RGB, four are RGBA shown without alpha. ``uint8`` values
are shown as they are; float values already in ``[0, 1]`` too; anything else is stretched from the
sample's finite minimum to its finite maximum. NaN pixels are magenta, +/-Inf pixels orange, so
the thumbnail also shows *where* the sample is broken. Images larger than ``max_size`` pixels on a
side are averaged down to it (a block holding a NaN stays NaN).

Example:
    >>> import torch
    >>> images = torch.rand(4, 1, 12, 12)
    >>> images[2, 0, :3] = float("nan")
    >>> found = find_image_tensor((images, torch.zeros(4)))
    >>> found.layout, tuple(found.tensor.shape)
    ('NCHW', (4, 1, 12, 12))
    >>> thumb = thumbnail(found, 2)
    >>> (thumb.width, thumb.height, thumb.nonfinite_values), thumb.png[:4]
    ((12, 12, 36), b'\x89PNG')
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor
from torch.nn import functional

__all__ = ["ImageTensor", "Thumbnail", "encode_png", "find_image_tensor", "thumbnail"]

ImageLayout = Literal["NCHW", "NHWC", "NHW"]

MIN_SIDE = 8
IMAGE_CHANNELS = (1, 3, 4)
IMAGE_KEYS = ("image", "images", "img", "imgs", "pixel_values", "pixels", "x", "input", "inputs")
NAN_RGB = (255, 0, 255)
INF_RGB = (255, 140, 0)
_MAX_DEPTH = 3


@dataclass(frozen=True)
class ImageTensor:
    """The image tensor found in a batch and how to read it."""

    tensor: Tensor
    layout: ImageLayout

    @property
    def batch_size(self) -> int:
        return int(self.tensor.shape[0])


@dataclass(frozen=True)
class Thumbnail:
    """One encoded thumbnail.

    Args:
        png: the PNG file's bytes (8-bit RGB).
        width: width in pixels.
        height: height in pixels.
        source_size: ``(height, width)`` of the sample before any downscaling.
        nonfinite_values: NaN/Inf values in the sample (all channels, before downscaling).
        value_range: finite minimum and maximum of the sample (``None`` when nothing is finite).
    """

    png: bytes
    width: int
    height: int
    source_size: tuple[int, int]
    nonfinite_values: int
    value_range: tuple[float, float] | None


def _image_layout(tensor: Tensor) -> ImageLayout | None:
    if not (tensor.is_floating_point() or tensor.dtype == torch.uint8) or tensor.is_complex():
        return None
    shape = tuple(tensor.shape)
    if tensor.dim() == 4 and shape[0] > 0:
        if shape[1] in IMAGE_CHANNELS and min(shape[2], shape[3]) >= MIN_SIDE:
            return "NCHW"
        if shape[3] in IMAGE_CHANNELS and min(shape[1], shape[2]) >= MIN_SIDE:
            return "NHWC"
    if tensor.dim() == 3 and tensor.dtype == torch.uint8 and shape[0] > 0 and min(shape[1], shape[2]) >= MIN_SIDE:
        return "NHW"
    return None


def _children(value: Any) -> list[Any]:
    if isinstance(value, Mapping):
        ordered = sorted(enumerate(value), key=lambda item: (str(item[1]).lower() not in IMAGE_KEYS, item[0]))
        return [value[key] for _, key in ordered]
    if isinstance(value, (list, tuple)):
        return list(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [getattr(value, f.name) for f in dataclasses.fields(value)]
    return []


def find_image_tensor(batch: Any, _depth: int = 0) -> ImageTensor | None:
    """The first image-like tensor in ``batch`` (see the module docstring), or ``None``.

    Example:
        >>> find_image_tensor({"label": torch.zeros(2), "image": torch.zeros(2, 3, 8, 8)}).layout
        'NCHW'
        >>> find_image_tensor(torch.zeros(2, 16, 32)) is None  # [batch, time, features]
        True
    """
    if isinstance(batch, Tensor):
        layout = _image_layout(batch)
        return ImageTensor(batch, layout) if layout is not None else None
    if _depth >= _MAX_DEPTH:
        return None
    for child in _children(batch):
        found = find_image_tensor(child, _depth + 1)
        if found is not None:
            return found
    return None


def _chw(image: ImageTensor, position: int) -> Tensor:
    sample = image.tensor[position].detach().to("cpu")
    if image.layout == "NHWC":
        sample = sample.permute(2, 0, 1)
    elif image.layout == "NHW":
        sample = sample.unsqueeze(0)
    return sample


def _normalised(sample: Tensor, is_bytes: bool) -> tuple[Tensor, tuple[float, float] | None]:
    """Values mapped to ``[0, 1]`` (non-finite values kept as they are) and the finite value range."""
    finite = sample[torch.isfinite(sample)]
    if finite.numel() == 0:
        return sample, None
    low, high = float(finite.min()), float(finite.max())
    if is_bytes:
        return sample / 255.0, (low, high)
    if low >= 0.0 and high <= 1.0:
        return sample, (low, high)
    if high > low:
        return (sample - low) / (high - low), (low, high)
    return torch.where(torch.isfinite(sample), torch.full_like(sample, 0.5), sample), (low, high)


def _downscaled(sample: Tensor, max_size: int) -> Tensor:
    height, width = sample.shape[-2:]
    if max(height, width) <= max_size:
        return sample
    scale = max_size / max(height, width)
    size = (max(1, round(height * scale)), max(1, round(width * scale)))
    return functional.adaptive_avg_pool2d(sample.unsqueeze(0), size).squeeze(0)


def thumbnail(image: ImageTensor, position: int, max_size: int = 64) -> Thumbnail:
    """Encode the sample at ``position`` of ``image`` as a PNG of at most ``max_size`` pixels a side."""
    sample = _chw(image, position)
    is_bytes = sample.dtype == torch.uint8
    sample = sample.float()
    source_size = (int(sample.shape[-2]), int(sample.shape[-1]))
    nonfinite = int((~torch.isfinite(sample)).sum())
    sample = sample[:3] if sample.shape[0] >= 3 else sample[:1].expand(3, -1, -1)
    values, value_range = _normalised(sample, is_bytes)
    values = _downscaled(values, max_size)
    nan = torch.isnan(values).any(0)
    inf = torch.isinf(values).any(0) & ~nan
    rgb = (values.nan_to_num(0.0, 0.0, 0.0).clamp(0.0, 1.0) * 255.0).round().to(torch.uint8)
    for mask, colour in ((nan, NAN_RGB), (inf, INF_RGB)):
        if bool(mask.any()):
            rgb[:, mask] = torch.tensor(colour, dtype=torch.uint8).unsqueeze(1)
    height, width = int(rgb.shape[1]), int(rgb.shape[2])
    pixels = bytes(rgb.permute(1, 2, 0).contiguous().flatten().tolist())
    return Thumbnail(encode_png(width, height, pixels), width, height, source_size, nonfinite, value_range)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(width: int, height: int, rgb: bytes) -> bytes:
    r"""An 8-bit RGB PNG of ``width`` x ``height`` from row-major ``rgb`` bytes (3 per pixel).

    Example:
        >>> png = encode_png(2, 1, bytes([255, 0, 0, 0, 0, 255]))
        >>> png[:8] == b"\x89PNG\r\n\x1a\n", png[12:16]
        (True, b'IHDR')
    """
    if width <= 0 or height <= 0 or len(rgb) != width * height * 3:
        raise ValueError(f"expected {width}x{height}x3 = {width * height * 3} bytes, got {len(rgb)}")
    stride = width * 3
    raw = b"".join(b"\x00" + rgb[row * stride : (row + 1) * stride] for row in range(height))  # filter 0 per row
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, truecolour, no interlace
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b"")
    )
