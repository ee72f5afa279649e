"""A minimal PNG decoder for the tests of the thumbnails the guard writes (8-bit RGB, filter 0)."""

from __future__ import annotations

import struct
import zlib


def decode_png(data: bytes) -> tuple[int, int, list[tuple[int, int, int]]]:
    """A minimal decoder for the encoder's output (8-bit RGB, filter 0): ``(width, height, pixels)``."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    offset, chunks = 8, {}
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind, body = data[offset + 4 : offset + 8], data[offset + 8 : offset + 8 + length]
        (crc,) = struct.unpack(">I", data[offset + 8 + length : offset + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        chunks[kind] = chunks.get(kind, b"") + body
        offset += 12 + length
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, colour, interlace) == (8, 2, 0)
    raw = zlib.decompress(chunks[b"IDAT"])
    stride = width * 3 + 1
    pixels = []
    for row in range(height):
        line = raw[row * stride : (row + 1) * stride]
        assert line[0] == 0  # filter type "none"
        pixels += [tuple(line[1 + 3 * i : 4 + 3 * i]) for i in range(width)]
    return width, height, pixels  # type: ignore[return-value]
