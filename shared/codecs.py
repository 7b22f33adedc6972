"""Activation codecs: how one tensor's values become payload bytes and back.

Each codec is an object registered under a small integer wire id. ``encode``
turns an array into bytes; ``decode`` checks every length against the shape and
dtype the frame declared, bounds every size by ``max_bytes`` and insists that
every byte is consumed. A decoder raises only :class:`CodecError`.

Quantization (:class:`QuantParams`, the fast and reference paths) lives in
:mod:`splitinfer.shared.quant` and is re-exported here.

The image codecs (PNG, JPEG) carry image-shaped tensors as one picture per
sample. Float values become pixels through the same :class:`QuantParams` as the
int8 codecs: ``u = q + 128``, so ``x ~ (u - 128 - zero_point) * scale``, an
affine ``offset + scale * u`` whose offset ``-(128 + zero_point) * scale`` is a
whole number of steps (the pixel grid holds 0). :func:`calibrate_image` finds
that grid; uint8 tensors travel as they are. The containers themselves live in
:mod:`splitinfer.shared.images`.
"""

from __future__ import annotations

import abc
import functools
import math
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from splitinfer.shared import images, nibbles
from splitinfer.shared.errors import CodecError
from splitinfer.shared.quant import (
    F32,
    I8,
    U8,
    Array,
    Buffer,
    QuantParams,
    _finite_f32,
    calibrate_image,
    calibrate_params,
    dequantize,
    dequantize_reference,
    from_pixels,
    quantize,
    quantize_reference,
    to_pixels,
    to_pixels_reference,
)

#: The codecs' public names; the quantization ones come from :mod:`.quant`.
__all__ = [
    "F32",
    "FLOAT_DTYPES",
    "FP16",
    "HASH_LOG",
    "I8",
    "IMAGE_DTYPES",
    "INT4_ZSTD",
    "INT8",
    "INT8_ZSTD",
    "JPEG",
    "JPEG_QUALITY",
    "PNG",
    "RAW",
    "RAW_DTYPES",
    "U8",
    "ZSTD",
    "ZSTD_COMPANIONS",
    "Array",
    "Buffer",
    "Codec",
    "Fp16Codec",
    "Int4ZstdCodec",
    "Int8Codec",
    "Int8ZstdCodec",
    "JpegCodec",
    "PngCodec",
    "QuantParams",
    "RawCodec",
    "ZstdCodec",
    "calibrate_image",
    "calibrate_params",
    "default_codecs",
    "dequantize",
    "dequantize_reference",
    "dtype_name",
    "from_pixels",
    "get_codec",
    "quantize",
    "quantize_reference",
    "to_pixels",
    "to_pixels_reference",
]

RAW = 1
FP16 = 2
INT8 = 3
INT8_ZSTD = 4
PNG = 5
JPEG = 6
INT4_ZSTD = 7
ZSTD = 8

#: Logical dtypes the raw codec carries (little-endian on the wire).
RAW_DTYPES = frozenset(
    {"float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool"}
)
#: Logical dtypes the lossy codecs accept; they decode back to the same dtype.
FLOAT_DTYPES = frozenset({"float16", "float32", "float64"})
#: Logical dtypes the image codecs accept: floats through QuantParams, uint8 as it is.
IMAGE_DTYPES = FLOAT_DTYPES | {"uint8"}
#: JPEG quality when none is given (Pillow's scale, 1-100).
JPEG_QUALITY = 90
#: zstd's match-finding hash table for the int8/int4 codecs: 2**11 entries (8 KiB).
#: On cut activations here it compressed twice as fast as level 1's default (2**14)
#: with payloads as small or smaller (bench/bench_codecs.py).
HASH_LOG = 11

_FP16_MAX = 65504.0


class Codec(Protocol):
    """A payload codec, registered under :attr:`id`."""

    id: int
    name: str
    #: True if the codec needs :class:`QuantParams` (and the frame must carry them).
    needs_params: bool
    #: Logical dtypes this codec can carry.
    dtypes: frozenset[str]

    def encode(self, array: Array, params: QuantParams | None = None) -> bytes: ...

    def decode(
        self,
        data: Buffer,
        dtype: str,
        shape: tuple[int, ...],
        params: QuantParams | None,
        max_bytes: int,
    ) -> Array:
        """The values; possibly a read-only view of ``data`` (copy it to write)."""
        ...


class RawCodec:
    """Id 1: the values as they are, little-endian. Lossless.

    Decoding is zero-copy where it can be: on a little-endian machine, with the
    payload aligned for its dtype (the frame encoder pads its header so that
    the first payload is), the result is a read-only view of the frame.
    """

    id: int = RAW
    name: str = "raw"
    needs_params: bool = False
    dtypes: frozenset[str] = RAW_DTYPES

    def encode(self, array: Array, params: QuantParams | None = None) -> bytes:
        dtype = _wire_dtype(dtype_name(np.asarray(array).dtype), self)
        return np.ascontiguousarray(array, dtype=dtype).tobytes()

    def decode(
        self,
        data: Buffer,
        dtype: str,
        shape: tuple[int, ...],
        params: QuantParams | None,
        max_bytes: int,
    ) -> Array:
        wire = _wire_dtype(dtype, self)
        _expect(data, _count(shape) * wire.itemsize, max_bytes, self)
        array = np.frombuffer(data, dtype=wire).reshape(shape)
        if not array.flags.aligned:  # numpy's unaligned paths are ~10x slower than a memcpy
            array = np.frombuffer(bytes(data), dtype=wire).reshape(shape)
        # a read-only view of the frame where the wire layout is the native one
        return array if wire.isnative else array.astype(dtype)


class Fp16Codec:
    """Id 2: IEEE half precision, little-endian.

    Error bound: for ``|x| <= 65504`` the decoded value is the nearest float16,
    so ``|err| <= 2**-11 * |x|`` for normal values and ``|err| <= 2**-25``
    in the subnormal range (``|x| < 2**-14``). Finite values beyond 65504
    saturate to +-65504; NaN and infinity are refused.
    """

    id: int = FP16
    name: str = "fp16"
    needs_params: bool = False
    dtypes: frozenset[str] = FLOAT_DTYPES

    def encode(self, array: Array, params: QuantParams | None = None) -> bytes:
        x = _finite_f32(array)
        clipped = np.clip(x, -_FP16_MAX, _FP16_MAX)
        return clipped.astype("<f2").tobytes()

    def decode(
        self,
        data: Buffer,
        dtype: str,
        shape: tuple[int, ...],
        params: QuantParams | None,
        max_bytes: int,
    ) -> Array:
        _check_dtype(dtype, self)
        _expect(data, _count(shape) * 2, max_bytes, self)
        return np.frombuffer(data, dtype="<f2").reshape(shape).astype(dtype)


class Int8Codec:
    """Id 3: affine int8 with per-channel or per-tensor :class:`QuantParams`.

    Error bound: ``|err| <= scale / 2`` per element (plus float32 rounding, a
    few ulp) for values within the calibrated range
    ``[(-128 - zero_point) * scale, (127 - zero_point) * scale]``; values outside
    are clipped to it. NaN and infinity are refused.
    """

    id: int = INT8
    name: str = "int8"
    needs_params: bool = True
    dtypes: frozenset[str] = FLOAT_DTYPES

    def encode(self, array: Array, params: QuantParams | None = None) -> bytes:
        return quantize(array, _need(params, self)).tobytes()

    def decode(
        self,
        data: Buffer,
        dtype: str,
        shape: tuple[int, ...],
        params: QuantParams | None,
        max_bytes: int,
    ) -> Array:
        return _dequantize_bytes(data, dtype, shape, _need(params, self), max_bytes, self)


class Int8ZstdCodec:
    """Id 4: the int8 codec's bytes compressed as one zstd frame.

    Same error bound as :class:`Int8Codec` (zstd is lossless). ``level`` is the
    zstd level; ``dictionary`` optional zstd dictionary bytes that encoder and
    decoder must share. Decompression is bounded: a frame whose header claims a
    size other than the expected one is refused before any output is allocated,
    and one without a size may not grow past it.
    """

    id: int = INT8_ZSTD
    name: str = "int8+zstd"
    needs_params: bool = True
    dtypes: frozenset[str] = FLOAT_DTYPES

    def __init__(self, level: int = 1, dictionary: bytes | None = None) -> None:
        import zstandard

        if not isinstance(level, int) or not -7 <= level <= zstandard.MAX_COMPRESSION_LEVEL:
            raise CodecError(
                f"zstd level {level!r} is out of range [-7, {zstandard.MAX_COMPRESSION_LEVEL}]"
            )
        self.level = level
        self._dict = zstandard.ZstdCompressionDict(dictionary) if dictionary else None
        default = zstandard.ZstdCompressionParameters.from_level(level)
        self._params = zstandard.ZstdCompressionParameters.from_level(
            level,
            # a small match table: activations have no long-range repeats to find,
            # and one that fits the L1 cache halves the time (smaller output too)
            hash_log=min(default.hash_log, HASH_LOG),
            write_content_size=True,
            write_dict_id=False,  # both sides know the dictionary: save 4 bytes
        )

    def _payload(self, q: I8) -> bytes:
        """The quantized values as the bytes zstd compresses."""
        return q.tobytes()

    def _payload_size(self, count: int) -> int:
        return count

    def _values(self, raw: bytes, count: int) -> I8:
        return np.frombuffer(raw, dtype=np.int8)

    def encode(self, array: Array, params: QuantParams | None = None) -> bytes:
        import zstandard

        raw = self._payload(quantize(array, _need(params, self)))
        compressor = zstandard.ZstdCompressor(dict_data=self._dict, compression_params=self._params)
        return compressor.compress(raw)

    def decode(
        self,
        data: Buffer,
        dtype: str,
        shape: tuple[int, ...],
        params: QuantParams | None,
        max_bytes: int,
    ) -> Array:
        quant = _need(params, self)
        _check_dtype(dtype, self)
        count = _count(shape)
        tensor_bytes = count * np.dtype(dtype).itemsize
        raw = _unzstd(
            data, self._payload_size(count), self._dict, self, shape, tensor_bytes, max_bytes
        )
        quant.check_shape(shape)
        q = self._values(raw, count).reshape(shape)
        return dequantize(q, quant).astype(dtype, copy=False)


def _unzstd(
    data: Buffer,
    expected: int,
    dictionary: Any,
    codec: Codec,
    shape: tuple[int, ...],
    tensor_bytes: int,
    max_bytes: int,
) -> bytes:
    """One zstd frame that states exactly ``expected`` bytes of content, decompressed;
    :class:`CodecError` before any allocation if the tensor (``tensor_bytes`` decoded)
    or the frame is over ``max_bytes``, or the frame claims another size or none."""
    if tensor_bytes > max_bytes or len(data) > max_bytes:
        raise CodecError(f"{codec.name}: tensor of shape {list(shape)} exceeds {max_bytes} bytes")
    import zstandard

    try:
        claimed = zstandard.get_frame_parameters(data).content_size
        if claimed == zstandard.CONTENTSIZE_UNKNOWN:
            raise CodecError(
                f"{codec.name}: zstd frame does not state its content size (the wire "
                f"format requires it: {expected} bytes)"
            )
        if claimed != expected:
            raise CodecError(
                f"{codec.name}: zstd frame claims {claimed} bytes, expected {expected}"
            )
        if expected == 0:
            raw = b""
        else:
            decompressor = zstandard.ZstdDecompressor(dict_data=dictionary)
            raw = decompressor.decompress(data, max_output_size=expected, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CodecError(f"{codec.name}: {exc}") from exc
    if len(raw) != expected:
        raise CodecError(f"{codec.name}: {len(raw)} bytes decompressed, expected {expected}")
    return raw


class ZstdCodec:
    """Id 8: the raw codec's bytes as one zstd frame. Lossless.

    It carries the tensors a lossy cut codec cannot (token ids, masks, integer
    indices) when the cut's codec is a zstd one (:data:`ZSTD_COMPANIONS`): int64
    ids below 2**16 are three-quarters zero bytes. No dictionary; the same bounded
    decompression as the int8+zstd codec.
    """

    id: int = ZSTD
    name: str = "zstd"
    needs_params: bool = False
    dtypes: frozenset[str] = RAW_DTYPES

    def __init__(self, level: int = 3) -> None:
        import zstandard

        self.level = level
        self._params = zstandard.ZstdCompressionParameters.from_level(
            level, write_content_size=True, write_dict_id=False
        )
        self._raw = RawCodec()

    def encode(self, array: Array, params: QuantParams | None = None) -> bytes:
        import zstandard

        raw = self._raw.encode(array)
        return zstandard.ZstdCompressor(compression_params=self._params).compress(raw)

    def decode(
        self,
        data: Buffer,
        dtype: str,
        shape: tuple[int, ...],
        params: QuantParams | None,
        max_bytes: int,
    ) -> Array:
        nbytes = _count(shape) * _wire_dtype(dtype, self).itemsize
        raw = _unzstd(data, nbytes, None, self, shape, nbytes, max_bytes)
        return self._raw.decode(raw, dtype, shape, None, max_bytes)


class Int4ZstdCodec(Int8ZstdCodec):
    """Id 7: values of 4 effective bits packed two to a byte (:mod:`.nibbles`), then one
    zstd frame.

    For the coarse steps the partitioner picks where agreement allows (scale =
    amax / 7): the int8 value ``clip(rint(x / scale) + zero_point)`` is clipped
    again to -8..7. Error bound: ``|err| <= scale / 2`` for values within
    ``[(-8 - zero_point) * scale, (7 - zero_point) * scale]``; values outside
    are clipped to it. Half the bytes of int8 before zstd, which then has half
    the work: smaller and faster than int8 + zstd at the same step.
    """

    id: int = INT4_ZSTD
    name: str = "int4+zstd"

    def _payload(self, q: I8) -> bytes:
        return nibbles.pack(np.clip(q, nibbles.INT4_MIN, nibbles.INT4_MAX))

    def _payload_size(self, count: int) -> int:
        return nibbles.packed_size(count)

    def _values(self, raw: bytes, count: int) -> I8:
        return nibbles.unpack(raw, count)


class _ImageCodec(abc.ABC):
    """Image-shaped tensors as one picture per sample (see :mod:`.images`).

    ``[N, C, H, W]`` with C 1 or 3, or ``[N, H, W]``; float values become pixels
    through :class:`QuantParams` (:func:`to_pixels`), uint8 values are the pixels
    (any parameters are then not used).
    """

    id: int
    name: str
    needs_params: bool = True
    dtypes: frozenset[str] = IMAGE_DTYPES
    _format: str

    @abc.abstractmethod
    def _options(self) -> dict[str, int]:
        """The container's encoder settings (zlib level, JPEG quality)."""

    def encode(self, array: Array, params: QuantParams | None = None) -> bytes:
        a = np.asarray(array)
        dtype = str(a.dtype)
        _check_dtype(dtype, self)
        if images.layout(a.shape) is None:
            raise CodecError(f"{self.name}: {images.describe(a.shape)}")
        pixels = a if dtype == "uint8" else to_pixels(a, _need(params, self))
        return images.encode_images(images.to_nhwc(pixels), self._format, **self._options())

    def decode(
        self,
        data: Buffer,
        dtype: str,
        shape: tuple[int, ...],
        params: QuantParams | None,
        max_bytes: int,
    ) -> Array:
        _check_dtype(dtype, self)
        found = images.layout(shape)
        if found is None:
            raise CodecError(f"{self.name}: {images.describe(shape)}")
        if _count(shape) * np.dtype(dtype).itemsize > max_bytes:
            raise CodecError(
                f"{self.name}: tensor of shape {list(shape)} exceeds {max_bytes} bytes"
            )
        quant = None
        if dtype != "uint8":
            quant = _need(params, self)
            quant.check_shape(shape)
        n, c, h, w = (int(d) for d in found)
        nhwc = images.decode_images(data, self._format, n, h, w, c, max_bytes)
        pixels = images.from_nhwc(nhwc, len(shape))
        if quant is None:
            return pixels
        return from_pixels(pixels, quant).astype(dtype, copy=False)


class PngCodec(_ImageCodec):
    """Id 5: lossless PNG per sample (8-bit grey or RGB).

    Error bound: none on the pixels. For floats, that of :func:`calibrate_image`:
    exact on values of its grid (calibrated from them), else ``|err| <= scale / 2``
    within the calibrated range, clipped outside it. ``level`` is the zlib level.
    """

    id: int = PNG
    name: str = "png"
    _format = "PNG"

    def __init__(self, level: int = images.PNG_LEVEL) -> None:
        if not isinstance(level, int) or isinstance(level, bool) or not 0 <= level <= 9:
            raise CodecError(f"png level {level!r} is out of range [0, 9]")
        self.level = level

    def _options(self) -> dict[str, int]:
        return {"level": self.level}


class JpegCodec(_ImageCodec):
    """Id 6: lossy baseline JPEG per sample at ``quality`` (1-100, Pillow's scale).

    Error bound: none per pixel (the DCT quantization spreads error). Measured
    and tested on smooth pictures of at least 8x8 pixels (a few sinusoids) at
    quality 90, where colour is kept at full resolution (4:4:4; 4:2:0 below 90):
    mean absolute error within 3 levels, worst pixel within 16 levels, i.e.
    ``3 * scale`` and ``16 * scale`` for floats, beyond :func:`calibrate_image`'s
    rounding. Noisy or tiny pictures lose more: the partitioner measures the top-1
    agreement before it picks JPEG.
    """

    id: int = JPEG
    name: str = "jpeg"
    _format = "JPEG"

    def __init__(self, quality: int = JPEG_QUALITY) -> None:
        if not isinstance(quality, int) or isinstance(quality, bool) or not 1 <= quality <= 100:
            raise CodecError(f"jpeg quality {quality!r} is out of range [1, 100]")
        self.quality = quality

    def _options(self) -> dict[str, int]:
        return {"quality": self.quality}


def default_codecs() -> dict[int, Codec]:
    """A fresh registry of every codec with default settings, by wire id."""
    codecs: list[Codec] = [
        RawCodec(),
        Fp16Codec(),
        Int8Codec(),
        Int8ZstdCodec(),
        PngCodec(),
        Int4ZstdCodec(),
        JpegCodec(),
        ZstdCodec(),
    ]
    return {c.id: c for c in codecs}


def get_codec(codec_id: int, codecs: Mapping[int, Codec] | None = None) -> Codec:
    """The codec registered under ``codec_id``; :class:`CodecError` if none is."""
    registry = DEFAULT_CODECS if codecs is None else codecs
    try:
        return registry[codec_id]
    except (KeyError, TypeError):
        known = ", ".join(str(k) for k in sorted(registry))
        raise CodecError(f"unknown codec id {codec_id!r} (known: {known})") from None


#: Cut codecs under which the tensors they cannot carry travel as :class:`ZstdCodec`
#: (id 8) instead of raw.
ZSTD_COMPANIONS = frozenset({INT8_ZSTD, INT4_ZSTD})

#: The default registry. Build your own mapping for a zstd dictionary or level.
DEFAULT_CODECS: Mapping[int, Codec] = default_codecs()


def _dequantize_bytes(
    data: Buffer,
    dtype: str,
    shape: tuple[int, ...],
    params: QuantParams,
    max_bytes: int,
    codec: Codec,
) -> Array:
    _check_dtype(dtype, codec)
    count = _count(shape)
    if count * np.dtype(dtype).itemsize > max_bytes:
        raise CodecError(f"{codec.name}: tensor of shape {list(shape)} exceeds {max_bytes} bytes")
    _expect(data, count, max_bytes, codec)
    params.check_shape(shape)
    q = np.frombuffer(data, dtype=np.int8).reshape(shape)
    return dequantize(q, params).astype(dtype, copy=False)


def _need(params: QuantParams | None, codec: Codec) -> QuantParams:
    if not isinstance(params, QuantParams):
        raise CodecError(f"{codec.name}: needs quantization parameters")
    return params


def _count(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _check_dtype(dtype: str, codec: Codec) -> None:
    if dtype not in codec.dtypes:
        allowed = ", ".join(sorted(codec.dtypes))
        raise CodecError(f"{codec.name}: dtype {dtype!r} is not one of {allowed}")


def _wire_dtype(dtype: str, codec: Codec) -> np.dtype[Any]:
    _check_dtype(dtype, codec)
    return _little(dtype)


@functools.cache
def dtype_name(dtype: np.dtype[Any]) -> str:
    """``str(dtype)``, remembered: numpy builds the string anew on every call."""
    return str(dtype)


@functools.cache
def _little(dtype: str) -> np.dtype[Any]:
    return np.dtype(dtype).newbyteorder("<")


def _expect(data: Buffer, nbytes: int, max_bytes: int, codec: Codec) -> None:
    if nbytes > max_bytes:
        raise CodecError(f"{codec.name}: payload of {nbytes} bytes exceeds {max_bytes}")
    if len(data) != nbytes:
        raise CodecError(f"{codec.name}: payload is {len(data)} bytes, expected {nbytes}")
