"""Activation codecs: round trips within the documented bounds, and hostile payloads."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from splitinfer.shared.codecs import (
    DEFAULT_CODECS,
    FP16,
    INT4_ZSTD,
    INT8,
    INT8_ZSTD,
    JPEG,
    PNG,
    RAW,
    ZSTD,
    Int8ZstdCodec,
    QuantParams,
    calibrate_params,
    dequantize,
    dequantize_reference,
    get_codec,
    quantize,
    quantize_reference,
)
from splitinfer.shared.errors import CodecError

pytestmark = pytest.mark.unit

LIMIT = 1 << 24

shapes = st.tuples(st.integers(1, 8), st.lists(st.integers(1, 6), min_size=0, max_size=3)).map(
    lambda t: (t[0], *t[1])
)


def arrays(bound: float = 1e4) -> st.SearchStrategy[np.ndarray]:
    bound = float(np.float32(bound))
    elements = st.floats(-bound, bound, width=32, allow_nan=False, allow_infinity=False)
    return shapes.flatmap(lambda s: hnp.arrays(np.float32, s, elements=elements))


def params_for(x: np.ndarray) -> QuantParams:
    return calibrate_params(x, axis=1 if x.ndim >= 2 else None)


def int8_bound(x: np.ndarray, p: QuantParams) -> np.ndarray:
    scale = np.asarray(p.scale, dtype=np.float64)
    if not p.per_tensor:
        view = [1] * x.ndim
        view[p.axis] = len(p.scale)
        scale = scale.reshape(view)
    # scale / 2, plus a few float32 ulps of the value for the arithmetic itself
    return scale / 2 * (1 + 1e-5) + np.abs(x.astype(np.float64)) * 2e-7


@settings(max_examples=100, deadline=None)
@given(arrays(bound=3e38))
def test_raw_round_trips_exactly(x: np.ndarray) -> None:
    codec = get_codec(RAW)
    y = codec.decode(codec.encode(x), "float32", x.shape, None, LIMIT)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, x)


@settings(max_examples=100, deadline=None)
@given(arrays(bound=65504.0))
def test_fp16_error_is_within_its_bound(x: np.ndarray) -> None:
    codec = get_codec(FP16)
    y = codec.decode(codec.encode(x), "float32", x.shape, None, LIMIT)
    err = np.abs(y.astype(np.float64) - x)
    assert (err <= np.maximum(np.abs(x.astype(np.float64)) * 2.0**-11, 2.0**-25)).all()


def test_fp16_saturates_beyond_its_range() -> None:
    codec = get_codec(FP16)
    x = np.array([1e6, -1e6, 1.0], dtype=np.float32)
    y = codec.decode(codec.encode(x), "float32", (3,), None, LIMIT)
    np.testing.assert_array_equal(y, [65504.0, -65504.0, 1.0])


@pytest.mark.parametrize("codec_id", [INT8, INT8_ZSTD])
@settings(max_examples=60, deadline=None)
@given(x=arrays())
def test_int8_error_is_within_half_a_scale(codec_id: int, x: np.ndarray) -> None:
    codec = get_codec(codec_id)
    p = params_for(x)
    y = codec.decode(codec.encode(x, p), "float32", x.shape, p, LIMIT)
    assert y.shape == x.shape
    assert (np.abs(y.astype(np.float64) - x) <= int8_bound(x, p)).all()


@settings(max_examples=100, deadline=None)
@given(x=arrays(), zero=st.integers(-20, 20), shrink=st.floats(0.25, 2.0))
def test_reference_and_fast_quantization_agree(x: np.ndarray, zero: int, shrink: float) -> None:
    p = params_for(x)
    # asymmetric and partly clipping parameters exercise the zero point and the clip
    p = QuantParams(tuple(s * shrink for s in p.scale), (zero,) * len(p.scale), p.axis)
    q = quantize(x, p)
    np.testing.assert_array_equal(q, quantize_reference(x, p))
    np.testing.assert_array_equal(dequantize(q, p), dequantize_reference(q, p))


def test_values_outside_the_calibrated_range_are_clipped() -> None:
    p = QuantParams(scale=(0.5,), zero_point=(0,), axis=1)
    x = np.array([[1000.0, -1000.0, 1.0]], dtype=np.float32)
    y = dequantize(quantize(x, p), p)
    np.testing.assert_array_equal(y, [[63.5, -64.0, 1.0]])


@pytest.mark.parametrize("codec_id", [FP16, INT8, INT8_ZSTD])
def test_lossy_codecs_refuse_nan(codec_id: int) -> None:
    x = np.array([[1.0, np.nan]], dtype=np.float32)
    with pytest.raises(CodecError, match="NaN"):
        get_codec(codec_id).encode(x, QuantParams((1.0,), (0,)))


@pytest.mark.parametrize("codec_id", [RAW, FP16, INT8, INT8_ZSTD])
def test_truncated_or_extended_payload_fails(codec_id: int) -> None:
    codec = get_codec(codec_id)
    x = np.maximum(np.random.default_rng(0).standard_normal((2, 3, 4, 4)), 0).astype(np.float32)
    p = calibrate_params(x)
    data = codec.encode(x, p)
    for bad in (data[:-1], data + b"\0", b"", data[: len(data) // 2]):
        with pytest.raises(CodecError):
            codec.decode(bad, "float32", x.shape, p, LIMIT)


def test_decode_checks_size_limit_and_params() -> None:
    x = np.ones((2, 3), dtype=np.float32)
    raw = get_codec(RAW)
    with pytest.raises(CodecError, match="exceeds"):
        raw.decode(raw.encode(x), "float32", (2, 3), None, 23)
    int8 = get_codec(INT8)
    with pytest.raises(CodecError, match="needs quantization parameters"):
        int8.decode(bytes(6), "float32", (2, 3), None, LIMIT)
    with pytest.raises(CodecError, match="channels"):
        int8.decode(bytes(6), "float32", (2, 3), QuantParams((1.0, 1.0), (0, 0)), LIMIT)
    with pytest.raises(CodecError, match="dtype"):
        int8.decode(bytes(6), "int64", (2, 3), QuantParams((1.0,), (0,)), LIMIT)


@pytest.mark.parametrize(
    ("scale", "zero", "axis", "match"),
    [
        ((), (), 1, "empty"),
        ((0.0,), (0,), 1, "scale"),
        ((float("nan"),), (0,), 1, "scale"),
        ((1.0,), (200,), 1, "zero_point"),
        ((1.0, 2.0), (0,), 1, "zero_point"),
        ((1.0,), (0,), -1, "axis"),
    ],
)
def test_quant_params_are_validated(scale: tuple, zero: tuple, axis: int, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        QuantParams(scale, zero, axis)


def test_unknown_codec_id() -> None:
    with pytest.raises(CodecError, match="unknown codec id 9"):
        get_codec(9)
    assert set(DEFAULT_CODECS) == {RAW, FP16, INT8, INT8_ZSTD, PNG, JPEG, INT4_ZSTD, ZSTD}


def _bomb(size: int, content_size: bool) -> bytes:
    compressor = zstandard.ZstdCompressor(level=3, write_content_size=content_size)
    if content_size:
        return compressor.compress(bytes(size))
    obj = compressor.compressobj()
    chunk = bytes(1 << 20)
    parts = [obj.compress(chunk) for _ in range(size // len(chunk))]
    return b"".join([*parts, obj.flush()])


@pytest.mark.parametrize("codec_id", [INT8_ZSTD, INT4_ZSTD])
@pytest.mark.parametrize("content_size", [True, False])
def test_zstd_bomb_fails_fast(content_size: bool, codec_id: int) -> None:
    bomb = _bomb(256 << 20, content_size)
    assert len(bomb) < 64 << 10
    codec = get_codec(codec_id)
    p = QuantParams((1.0,), (0,))
    start = time.perf_counter()
    with pytest.raises(CodecError, match=r"zstd|claims"):
        codec.decode(bomb, "float32", (4, 1024), p, LIMIT)
    assert time.perf_counter() - start < 0.5


def test_zstd_header_claiming_a_huge_size_is_refused_before_allocating() -> None:
    good = zstandard.ZstdCompressor().compress(bytes(4096))
    assert zstandard.get_frame_parameters(good).content_size == 4096
    # a header that claims 2**40 bytes: refused from the header alone
    lying = zstandard.ZstdCompressor().compress(b"")[:4] + b"\xc0" + (2**40).to_bytes(8, "little")
    codec = get_codec(INT8_ZSTD)
    with pytest.raises(CodecError, match=r"claims|zstd"):
        codec.decode(lying, "float32", (4096,), QuantParams((1.0,), (0,)), LIMIT)


def test_zstd_garbage_and_trailing_frames_fail() -> None:
    codec = get_codec(INT8_ZSTD)
    p = QuantParams((1.0,), (0,))
    x = np.ones((8,), dtype=np.float32)
    data = codec.encode(x, p)
    for bad in (b"\x28\xb5\x2f\xfd" + b"\xff" * 20, data + data, b"notzstd!"):
        with pytest.raises(CodecError):
            codec.decode(bad, "float32", (8,), p, LIMIT)


def test_zstd_level_and_dictionary() -> None:
    rng = np.random.default_rng(1)
    samples = [
        quantize(
            np.maximum(rng.standard_normal((1, 4, 8, 8)), 0), QuantParams((0.05,), (0,))
        ).tobytes()
        for _ in range(64)
    ]
    dictionary = zstandard.train_dictionary(1024, samples).as_bytes()
    x = np.maximum(rng.standard_normal((1, 4, 8, 8)), 0).astype(np.float32)
    p = QuantParams((0.05,), (0,))
    with_dict = Int8ZstdCodec(level=9, dictionary=dictionary)
    data = with_dict.encode(x, p)
    y = with_dict.decode(data, "float32", x.shape, p, LIMIT)
    np.testing.assert_array_equal(y, dequantize(quantize(x, p), p))
    with pytest.raises(CodecError):
        Int8ZstdCodec().decode(data, "float32", x.shape, p, LIMIT)
    with pytest.raises(CodecError, match="level"):
        Int8ZstdCodec(level=99)


# -- the ONNX Runtime fast path against numpy ---------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 6),
    st.floats(1e-4, 10.0),
    st.booleans(),
    st.integers(0, 2**32 - 1),
)
def test_onnxruntime_quantize_gives_the_numpy_bytes(
    batch: int, channels: int, magnitude: float, per_tensor: bool, seed: int
) -> None:
    from splitinfer.shared import quant as codecs
    from splitinfer.shared import quantops

    rng = np.random.default_rng(seed)
    scales = rng.uniform(1e-3, 1.0, 1 if per_tensor else channels).astype(np.float32)
    params = QuantParams(
        tuple(float(s) for s in scales),
        tuple(int(z) for z in rng.integers(-5, 5, len(scales))),
        axis=1,
    )
    x = (rng.standard_normal((batch, channels, 8, 9)) * magnitude * 200).astype(np.float32)
    # exact ties (k + 0.5) * scale, where round-half-to-even decides
    k = rng.integers(-300, 300, x.shape)
    ties = ((k + 0.5) * scales.reshape((1, -1, 1, 1))).astype(np.float32)
    for value in (x, ties):
        fast = quantops.quantize(value, *params._linear_args())
        assert fast is not None
        np.testing.assert_array_equal(fast, codecs._quantize_numpy(value, params))
        back = quantops.dequantize(fast, *params._linear_args())
        assert back is not None
        np.testing.assert_array_equal(back, codecs._dequantize_numpy(fast, params))


def test_channels_in_short_runs_go_to_numpy() -> None:
    from splitinfer.shared import quantops

    x = np.random.default_rng(0).standard_normal((4, 16, 32)).astype(np.float32)
    last = calibrate_params(x, axis=2)  # [batch, seq, hidden]: runs of one value
    assert quantops.quantize(x, *last._linear_args()) is None
    np.testing.assert_array_equal(quantize(x, last), quantize_reference(x, last))
    whole = calibrate_params(x, axis=None)
    assert quantops.quantize(x, *whole._linear_args()) is not None


def test_without_onnxruntime_numpy_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    from splitinfer.shared import quantops

    params = calibrate_params(np.arange(-8, 8, dtype=np.float32).reshape(2, 8), axis=1)
    x = np.linspace(-8, 8, 16, dtype=np.float32).reshape(2, 8)
    with_ort = quantize(x, params)
    monkeypatch.setattr(quantops, "_unavailable", [True])
    assert quantops.quantize(x, *params._linear_args()) is None
    np.testing.assert_array_equal(quantize(x, params), with_ort)
    slow = dequantize(with_ort, params)
    monkeypatch.setattr(quantops, "_unavailable", [])
    np.testing.assert_array_equal(dequantize(with_ort, params), slow)


# -- int4 + zstd ---------------------------------------------------------------------------


def int4_params(x: np.ndarray) -> QuantParams:
    """The partitioner's 4-bit step: the calibrated range over 7 levels a side."""
    from splitinfer.partitioner.wirecodec import coarsen

    return coarsen(params_for(x), 4)


@settings(max_examples=80, deadline=None)
@given(x=arrays())
def test_int4_error_is_within_half_its_step(x: np.ndarray) -> None:
    codec = get_codec(INT4_ZSTD)
    p = int4_params(x)
    data = codec.encode(x, p)
    y = codec.decode(data, "float32", x.shape, p, LIMIT)
    assert y.shape == x.shape
    assert (np.abs(y.astype(np.float64) - x) <= int8_bound(x, p)).all()
    # the same values int8 + zstd carries at that step, in half the bytes before zstd
    wide = get_codec(INT8_ZSTD)
    same = wide.decode(wide.encode(x, p), "float32", x.shape, p, LIMIT)
    np.testing.assert_array_equal(y, same)


@pytest.mark.parametrize("count", [0, 1, 2, 3, 4097])
def test_nibbles_round_trip_every_value_and_odd_counts(count: int) -> None:
    from splitinfer.shared import nibbles

    values = np.resize(np.arange(-8, 8, dtype=np.int8), count)
    packed = nibbles.pack(values)
    assert len(packed) == nibbles.packed_size(count) == (count + 1) // 2
    np.testing.assert_array_equal(nibbles.unpack(packed, count), values)
    if count >= 2:  # element 0 in the low nibble of byte 0, element 1 in its high nibble
        assert packed[0] == (int(values[0]) & 0x0F) | ((int(values[1]) & 0x0F) << 4)


def test_int4_clips_beyond_its_range_and_refuses_a_wrong_size() -> None:
    codec = get_codec(INT4_ZSTD)
    p = QuantParams((1.0,), (0,))
    x = np.array([-100.0, -8.0, -3.4, 0.0, 6.6, 7.0, 100.0], dtype=np.float32)
    y = codec.decode(codec.encode(x, p), "float32", x.shape, p, LIMIT)
    np.testing.assert_array_equal(y, [-8.0, -8.0, -3.0, 0.0, 7.0, 7.0, 7.0])
    seven = codec.encode(x, p)
    with pytest.raises(CodecError, match=r"claims 4 bytes, expected 5"):
        codec.decode(seven, "float32", (9,), p, LIMIT)
    raw = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(4))
    with pytest.raises(CodecError, match=r"does not state its content size"):
        codec.decode(raw, "float32", (7,), p, LIMIT)


@pytest.mark.parametrize("codec_id", [INT8_ZSTD, INT4_ZSTD])
def test_a_zstd_payload_that_omits_its_content_size_is_refused(codec_id: int) -> None:
    """The wire format says a zstd payload states its size; one that does not is refused."""
    codec = get_codec(codec_id)
    p = QuantParams((1.0,), (0,))
    x = np.zeros(64, np.float32)
    good = codec.encode(x, p)
    assert codec.decode(good, "float32", x.shape, p, LIMIT).shape == x.shape
    payload = zstandard.ZstdDecompressor().decompress(good)
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(payload)
    assert zstandard.get_frame_parameters(unsized).content_size == zstandard.CONTENTSIZE_UNKNOWN
    with pytest.raises(CodecError, match="does not state its content size"):
        codec.decode(unsized, "float32", x.shape, p, LIMIT)


def test_the_lossless_zstd_codec_carries_ids_and_masks_exactly_and_smaller() -> None:
    codec = get_codec(ZSTD)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 30522, size=(2, 128), dtype=np.int64)
    mask = np.ones((2, 128), np.int64)
    flags = rng.random((3, 5)) > 0.5
    for x in (ids, mask, flags, np.zeros((0, 4), np.int32), rng.standard_normal(7)):
        payload = codec.encode(x)
        y = codec.decode(payload, str(x.dtype), x.shape, None, LIMIT)
        assert y.dtype == x.dtype
        np.testing.assert_array_equal(y, x)
    assert len(codec.encode(ids)) < ids.nbytes / 2  # token ids are mostly zero bytes
    assert len(codec.encode(mask)) < 64


def test_the_lossless_zstd_codec_refuses_bombs_and_lies() -> None:
    codec = get_codec(ZSTD)
    x = np.arange(16, dtype=np.int64)
    good = codec.encode(x)
    with pytest.raises(CodecError, match=r"claims 128 bytes, expected 256"):
        codec.decode(good, "int64", (32,), None, LIMIT)
    bomb = zstandard.ZstdCompressor().compress(bytes(1 << 20))  # 1 MiB of zeros, tiny
    with pytest.raises(CodecError, match="exceeds"):
        codec.decode(bomb, "int64", (1 << 17,), None, 1 << 16)
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(x.tobytes())
    with pytest.raises(CodecError, match="does not state its content size"):
        codec.decode(unsized, "int64", (16,), None, LIMIT)
    with pytest.raises(CodecError):
        codec.decode(good + b"\x00", "int64", (16,), None, LIMIT)  # bytes after the frame
