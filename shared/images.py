"""Image containers for the image codecs: batches of uint8 pictures as PNG or JPEG.

Pure byte logic below the codecs of :mod:`splitinfer.shared.codecs` (which map
tensor values to pixels and back). A payload is one image per sample, each
length-prefixed (u32, little-endian)::

    len0 u32, image0 (a whole PNG or JPEG file), len1 u32, image1, ...

A decoder checks every length, reads each image's size, depth and channels
from its own header (PNG IHDR, JPEG SOF) and compares them with the shape the
frame declared *before* Pillow decodes a single pixel, so a decompression bomb
(a small file that claims a huge picture) fails fast. It also checks that each
image ends where its format says (PNG IEND, JPEG EOI: a truncated image is not
padded with grey) and that every byte of the payload is consumed. Pixel counts
above ``PIL.Image.MAX_IMAGE_PIXELS`` are refused whatever the frame allows.

Pillow is imported at the point of use.
"""

from __future__ import annotations

import io
import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from splitinfer.shared.errors import CodecError

U8 = npt.NDArray[np.uint8]
Buffer = bytes | bytearray | memoryview

FORMATS = ("PNG", "JPEG")
#: zlib level of the PNGs we write: zlib's and Pillow's default, what a client sends.
#: Level 1 encodes about 1.7x faster and 10-15% larger on noisy pictures.
PNG_LEVEL = 6
JPEG_MAX_SIDE = 65535
#: From this JPEG quality up colour keeps full resolution (4:4:4): 4:2:0 costs small
#: or colourful pictures tens of levels, more than the quality promises.
JPEG_FULL_CHROMA = 90

_LENGTH = struct.Struct("<I")
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_IEND = b"\x00\x00\x00\x00IEND\xaeB`\x82"
_PNG_COLOR = {1: 0, 3: 2}  # channels -> IHDR colour type (grey, RGB)
_JPEG_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD})
_JPEG_SOF |= {0xCE, 0xCF}
_JPEG_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})
_MODES = {1: "L", 3: "RGB"}


def layout(shape: Sequence[int | str]) -> tuple[int | str, int, int | str, int | str] | None:
    """``(n, channels, height, width)`` of an image batch shape, or None if it is not one.

    ``[N, C, H, W]`` with C 1 or 3 (grey or RGB, channels first), or ``[N, H, W]``
    (grey). Symbolic dimensions (strings) are allowed anywhere but C.
    """
    dims = tuple(shape)
    if len(dims) == 4 and dims[1] in (1, 3) and not isinstance(dims[1], str):
        return dims[0], int(dims[1]), dims[2], dims[3]
    if len(dims) == 3:
        return dims[0], 1, dims[1], dims[2]
    return None


def describe(shape: Sequence[int | str]) -> str:
    """Why a shape is not an image batch, for an error message."""
    return (
        f"shape {list(shape)} is not an image batch [N, C, H, W] with C 1 or 3, or [N, H, W] (grey)"
    )


def to_nhwc(pixels: U8) -> U8:
    """[N, C, H, W] or [N, H, W] pixels as [N, H, W, C] (C 1 or 3)."""
    out: U8 = pixels[..., None] if pixels.ndim == 3 else pixels.transpose(0, 2, 3, 1)
    return out


def from_nhwc(pixels: U8, ndim: int) -> U8:
    """The inverse of :func:`to_nhwc` for a tensor of rank ``ndim``."""
    out: U8 = pixels[..., 0] if ndim == 3 else pixels.transpose(0, 3, 1, 2)
    return np.ascontiguousarray(out)


def encode_images(pixels: U8, fmt: str, *, quality: int = 90, level: int = PNG_LEVEL) -> bytes:
    """[N, H, W, C] uint8 pixels as N length-prefixed PNG or JPEG files."""
    from PIL import Image

    n, h, w, c = pixels.shape
    if h < 1 or w < 1:
        raise CodecError(f"{fmt.lower()}: an image of {h}x{w} pixels cannot be encoded")
    if fmt == "JPEG" and max(h, w) > JPEG_MAX_SIDE:
        raise CodecError(f"jpeg: {w}x{h} exceeds the format's {JPEG_MAX_SIDE} pixels a side")
    options: dict[str, Any] = {"compress_level": level, "optimize": False}
    if fmt == "JPEG":  # full-resolution colour from quality 90 up (4:4:4), else 4:2:0
        options = {"quality": quality, "subsampling": 0 if quality >= JPEG_FULL_CHROMA else 2}
    parts: list[bytes] = []
    for i in range(n):
        image = Image.fromarray(np.ascontiguousarray(pixels[i, :, :, 0] if c == 1 else pixels[i]))
        buf = io.BytesIO()
        image.save(buf, format=fmt, **options)
        data = buf.getvalue()
        parts += [_LENGTH.pack(len(data)), data]
    return b"".join(parts)


def decode_images(data: Buffer, fmt: str, n: int, h: int, w: int, c: int, max_bytes: int) -> U8:
    """N images of ``h`` x ``w`` x ``c`` from a payload, as [N, H, W, C] uint8.

    Raises :class:`CodecError` naming the image and what is wrong: truncated,
    not a PNG/JPEG, a size, depth or channel count other than expected, a
    picture above ``PIL.Image.MAX_IMAGE_PIXELS``, or trailing bytes.
    """
    name = fmt.lower()
    view = memoryview(data).cast("B")
    if len(view) > max_bytes:
        raise CodecError(f"{name}: payload of {len(view)} bytes exceeds {max_bytes}")
    if n * h * w * c > max_bytes:
        raise CodecError(f"{name}: {n} images of {w}x{h}x{c} exceed {max_bytes} bytes")
    out = np.empty((n, h, w, c), dtype=np.uint8)
    offset = 0
    for i in range(n):
        where = f"{name}: image {i}"
        if offset + _LENGTH.size > len(view):
            raise CodecError(f"{where}: length missing (payload truncated)")
        (size,) = _LENGTH.unpack_from(view, offset)
        offset += _LENGTH.size
        if size > len(view) - offset:
            raise CodecError(
                f"{where}: {size} bytes claimed, {len(view) - offset} left (payload truncated)"
            )
        chunk = bytes(view[offset : offset + size])
        offset += size
        pixels = _decode_one(chunk, fmt, h, w, c, where)
        out[i] = pixels.reshape(h, w, c)
    if offset != len(view):
        raise CodecError(f"{name}: {len(view) - offset} trailing bytes after the last image")
    return out


def _decode_one(chunk: bytes, fmt: str, h: int, w: int, c: int, where: str) -> U8:
    from PIL import Image

    got = _png_header(chunk, where) if fmt == "PNG" else _jpeg_header(chunk, where)
    if got != (w, h, c):
        gw, gh, gc = got
        raise CodecError(
            f"{where}: the header says {gw}x{gh} with {gc} channel(s), the frame's shape "
            f"needs {w}x{h} with {c} (wrong shape, or a decompression bomb)"
        )
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and w * h > limit:
        raise CodecError(f"{where}: {w}x{h} exceeds PIL.Image.MAX_IMAGE_PIXELS ({limit})")
    try:
        with Image.open(io.BytesIO(chunk), formats=[fmt]) as image:
            if image.size != (w, h) or image.mode != _MODES[c]:
                raise CodecError(
                    f"{where}: Pillow reads {image.size[0]}x{image.size[1]} {image.mode}, "
                    f"expected {w}x{h} {_MODES[c]}"
                )
            image.load()
            pixels = np.asarray(image, dtype=np.uint8)
    except CodecError:
        raise
    except Exception as exc:  # Pillow's decoders raise OSError, SyntaxError, ValueError, ...
        raise CodecError(f"{where}: not a valid {fmt} ({type(exc).__name__}: {exc})") from exc
    return pixels


def _png_header(chunk: bytes, where: str) -> tuple[int, int, int]:
    """(width, height, channels) from the IHDR chunk; 8-bit grey or RGB only."""
    if not chunk.startswith(_PNG_SIGNATURE):
        raise CodecError(f"{where}: not a PNG (bad signature)")
    if len(chunk) < 33 or chunk[8:16] != b"\x00\x00\x00\x0dIHDR":
        raise CodecError(f"{where}: PNG header (IHDR) missing or truncated")
    width, height, depth, color = struct.unpack_from(">IIBB", chunk, 16)
    channels = {v: k for k, v in _PNG_COLOR.items()}.get(color)
    if depth != 8 or channels is None:
        raise CodecError(
            f"{where}: PNG of bit depth {depth}, colour type {color}; only 8-bit grey (0) or "
            "RGB (2) are accepted"
        )
    if not chunk.endswith(_PNG_IEND):
        raise CodecError(f"{where}: PNG truncated (it does not end with an IEND chunk)")
    return width, height, channels


def _jpeg_header(chunk: bytes, where: str) -> tuple[int, int, int]:
    """(width, height, channels) from the first SOF marker; 8-bit samples only."""
    if not chunk.startswith(b"\xff\xd8"):
        raise CodecError(f"{where}: not a JPEG (no start-of-image marker)")
    if not chunk.endswith(b"\xff\xd9"):
        raise CodecError(f"{where}: JPEG truncated (no end-of-image marker)")
    i = 2
    while i + 4 <= len(chunk):
        if chunk[i] != 0xFF:
            raise CodecError(f"{where}: JPEG marker expected at byte {i}")
        marker = chunk[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in _JPEG_STANDALONE:
            i += 2
            continue
        (size,) = struct.unpack_from(">H", chunk, i + 2)
        if size < 2:
            raise CodecError(f"{where}: JPEG segment at byte {i} has length {size}")
        if marker in _JPEG_SOF:
            if size < 8 or i + 10 > len(chunk):
                raise CodecError(f"{where}: JPEG frame header truncated")
            depth, height, width, channels = struct.unpack_from(">BHHB", chunk, i + 4)
            if depth != 8 or channels not in _MODES:
                raise CodecError(
                    f"{where}: JPEG of {depth}-bit samples with {channels} components; only "
                    "8-bit grey or colour are accepted"
                )
            return width, height, channels
        if marker == 0xDA:
            break  # scan data before any frame header
        i += 2 + size
    raise CodecError(f"{where}: JPEG without a frame header (SOF)")


def grid(values: npt.NDArray[Any], levels: int = 256) -> tuple[float, int] | None:
    """``(step, j)`` such that every value is ``(u - j) * step`` for an integer pixel u
    in [0, levels) (j in the same range: the grid holds 0), or None when the values
    lie on no such grid.

    The step is the greatest common divisor of the distinct values (Euclid's
    algorithm on floats, remainders below a thousandth of the finest useful step
    counting as zero), then refitted over the whole span. A cheap look at the first
    64 Ki values first rules out continuous data.
    """
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size == 0 or np.unique(x[: 1 << 16]).size > levels:
        return None
    distinct = np.unique(np.append(x, 0.0))
    if distinct.size > levels:
        return None
    if distinct.size == 1:
        return 1.0, 0  # all zeros
    span = float(distinct[-1] - distinct[0])
    tol = 1e-3 * span / (levels - 1)
    step = 0.0
    for v in np.abs(distinct[distinct != 0]):
        a, b = max(step, float(v)), min(step, float(v))
        while b > tol:
            a, b = b, math.fmod(a, b)
        step = a
    k = np.rint(distinct / step)
    if not np.all(np.abs(distinct / step - k) <= 1e-3) or k[-1] - k[0] >= levels:
        return None
    step = span / float(k[-1] - k[0])
    return (step, -int(k[0])) if math.isfinite(step) and step > 0 else None
