"""The wire frame: round trips, field-by-field validation and a fuzzer."""

from __future__ import annotations

import contextlib
import json
import struct
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitinfer.shared.codecs import FP16, INT8, INT8_ZSTD, RAW, QuantParams, calibrate_params
from splitinfer.shared.errors import CodecError, ProtocolError
from splitinfer.shared.frame import (
    Limits,
    Privacy,
    Request,
    Response,
    WireTensor,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)
from splitinfer.shared.manifest import Cut, Manifest, QuantSpec, Segment, TensorSpec

pytestmark = pytest.mark.unit

CUT = (
    TensorSpec("feat", "float32", ("N", 4, 3, 3)),
    TensorSpec("skip", "float32", ("N", 5)),
)
OUTPUTS = (TensorSpec("logits", "float32", ("N", 10)),)
MANIFEST = Manifest(
    model_name="tiny",
    source_sha256="0" * 64,
    opset=17,
    batch_dim="N",
    inputs=(TensorSpec("x", "float32", ("N", 3, 8, 8)),),
    outputs=OUTPUTS,
    default_cut="c1",
    cuts=(
        Cut(
            "c1",
            "split",
            CUT,
            (),
            100,
            10,
            20,
            edge=Segment("edge.onnx", "1" * 64, ("x",), ("feat", "skip"), 3),
            cloud=Segment("cloud.onnx", "2" * 64, ("feat", "skip"), ("logits",), 4),
            quant={"feat": QuantSpec((0.02, 0.03, 0.04, 0.05), (0, 0, 0, 0), 1)},
        ),
        Cut(
            "c2",
            "split",
            (TensorSpec("h", "float32", ("N", 7)),),
            (),
            28,
            15,
            15,
            edge=Segment("candidates/c2/edge.onnx", "3" * 64, ("x",), ("h",), 4),
            cloud=Segment("candidates/c2/cloud.onnx", "4" * 64, ("h",), ("logits",), 3),
        ),
        Cut(
            "c9",
            "all",
            OUTPUTS,
            (),
            40,
            30,
            0,
            edge=Segment("candidates/c9/edge.onnx", "5" * 64, ("x",), ("logits",), 7),
        ),
    ),
)
LIMITS = Limits(max_frame_bytes=1 << 20, max_tensor_bytes=1 << 16, max_batch=8)


def tensors(batch: int = 2, codec: int = RAW) -> tuple[WireTensor, ...]:
    rng = np.random.default_rng(batch)
    feat = np.maximum(rng.standard_normal((batch, 4, 3, 3)), 0).astype(np.float32)
    skip = rng.standard_normal((batch, 5)).astype(np.float32)
    quant = codec in (INT8, INT8_ZSTD)
    return (
        WireTensor("feat", feat, codec, calibrate_params(feat) if quant else None),
        WireTensor("skip", skip, codec, calibrate_params(skip, axis=None) if quant else None),
    )


def request(**changes: Any) -> Request:
    base = Request(
        request_id="r-1",
        model_name="tiny",
        model_version="3",
        cut_id="c1",
        tensors=tensors(),
        privacy=Privacy(noise_multiplier=1.1, clip=0.5, epsilon=0.01),
        deadline_ms=1_700_000_000_000,
        trace_id="t-9",
    )
    return replace(base, **changes)


def frame_with(edit: Any) -> bytes:
    """A valid request frame whose JSON header ``edit`` has changed in place."""
    data = encode_request(request())
    (hlen,) = struct.unpack_from("<I", data, 6)
    header = json.loads(data[10 : 10 + hlen])
    edit(header)
    blob = json.dumps(header).encode()
    return data[:6] + struct.pack("<I", len(blob)) + blob + data[10 + hlen :]


@pytest.mark.parametrize("codec", [RAW, FP16, INT8, INT8_ZSTD])
def test_request_round_trip(codec: int) -> None:
    sent = request(tensors=tensors(3, codec))
    got = decode_request(encode_request(sent), MANIFEST, LIMITS)
    assert replace(got, tensors=()) == replace(sent, tensors=())
    for a, b in zip(got.tensors, sent.tensors, strict=True):
        assert (a.name, a.codec, a.quant) == (b.name, b.codec, b.quant)
        assert a.array.shape == b.array.shape
        atol = 0.0 if codec == RAW else max(b.quant.scale) if b.quant else 1e-2
        np.testing.assert_allclose(a.array, b.array, atol=atol, rtol=1e-3)


def test_response_round_trip_and_error_status() -> None:
    logits = np.arange(20, dtype=np.float32).reshape(2, 10)
    sent = Response("r-1", 200, (WireTensor("logits", logits),), model_version="7", load=0.25)
    got = decode_response(encode_response(sent), MANIFEST, LIMITS)
    assert got.request_id == "r-1"
    assert got.status == 200
    assert (got.model_version, got.load) == ("7", 0.25)
    np.testing.assert_array_equal(got.tensors[0].array, logits)
    failed = Response("r-2", 503, (), "overloaded")
    assert decode_response(encode_response(failed), MANIFEST, LIMITS) == failed
    with pytest.raises(ProtocolError, match=r"frame\.tensors: names"):
        decode_response(encode_response(replace(sent, status=500)), MANIFEST, LIMITS)
    with pytest.raises(ProtocolError, match=r"frame\.load: -1\.0 is not a finite number"):
        decode_response(encode_response(replace(sent, load=-1.0)), MANIFEST, LIMITS)


def _set(path: tuple[Any, ...], value: Any) -> Any:
    def edit(header: dict[str, Any]) -> None:
        target: Any = header
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return edit


def _delete(key: str) -> Any:
    return lambda header: header.pop(key)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (_set(("model",), "other"), "frame.model"),
        (_set(("cut_id",), "c3"), "frame.cut_id: 'c3' is not a cut"),
        (_set(("cut_id",), "c9"), "frame.cut_id: 'c9' is not a cut"),
        (_set(("cut_id",), "c2"), r"frame.tensors: names \['feat', 'skip'\] are not"),
        (_set(("request_id",), 7), "frame.request_id"),
        (_set(("trace_id",), "x" * 1000), "frame.trace_id"),
        (_set(("deadline_ms",), -1), "frame.deadline_ms"),
        (_set(("deadline_ms",), 2**64), "frame.deadline_ms"),
        (_set(("privacy", "epsilon"), -0.5), "frame.privacy.epsilon"),
        (_set(("privacy", "clip"), "big"), "frame.privacy.clip"),
        (_set(("privacy", "extra"), 1), "frame.privacy.extra"),
        (_delete("trace_id"), "frame.trace_id"),
        (_set(("surprise",), 1), "frame.surprise"),
        (_set(("tensors", 0, "name"), "skip"), "frame.tensors"),
        (lambda h: h["tensors"].reverse(), "frame.tensors"),
        (lambda h: h["tensors"].pop(), "frame.tensors"),
        (_set(("tensors", 0, "dtype"), "float64"), r"frame.tensors\[0\].dtype"),
        (_set(("tensors", 0, "shape"), [2, 4, 3]), r"frame.tensors\[0\].shape"),
        (_set(("tensors", 0, "shape"), [2, 4, 3, 4]), r"frame.tensors\[0\].shape"),
        (_set(("tensors", 0, "shape"), [2, 4, 3, 3.0]), r"frame.tensors\[0\].shape"),
        (_set(("tensors", 1, "shape"), [3, 5]), r"frame.tensors\[1\].shape"),
        (_set(("tensors", 0, "shape"), [0, 4, 3, 3]), r"frame.tensors\[0\].shape"),
        (_set(("tensors", 0, "shape"), [99, 4, 3, 3]), r"frame.tensors\[0\].shape"),
        (_set(("tensors", 0, "codec"), 42), r"frame.tensors\[0\].codec"),
        (_set(("tensors", 0, "codec"), True), r"frame.tensors\[0\].codec"),
        (_set(("tensors", 0, "quant"), {"scale": [1.0]}), r"frame.tensors\[0\].quant"),
        (_set(("tensors", 1, "codec"), INT8), r"frame.tensors\[1\].quant"),
        (_set(("tensors", 1, "extra"), 0), r"frame.tensors\[1\].extra"),
        (_set(("tensors", 0, "shape"), [1, 4, 3, 3]), r"frame.tensors\[1\].shape"),
    ],
)
def test_every_validation_failure_names_its_field(edit: Any, field: str) -> None:
    with pytest.raises(ProtocolError, match=f"^{field}"):
        decode_request(frame_with(edit), MANIFEST, LIMITS)


def test_a_header_checked_once_lets_nothing_else_through() -> None:
    """Tensor headers are checked once and remembered (devices repeat them): a header that
    differs only in a value's type, or the same header under other limits or another
    manifest, is checked on its own."""
    good = frame_with(lambda h: None)
    for _ in range(2):
        decode_request(good, MANIFEST, LIMITS)
    for dim in (2.0, True):
        with pytest.raises(ProtocolError, match=r"frame\.tensors\[0\]\.shape"):
            decode_request(
                frame_with(_set(("tensors", 0, "shape"), [dim, 4, 3, 3])), MANIFEST, LIMITS
            )
    with pytest.raises(ProtocolError, match=r"frame\.tensors\[0\]\.shape: dim 0 \(N\) is 2"):
        decode_request(good, MANIFEST, replace(LIMITS, max_batch=1))
    wider = (TensorSpec("feat", "float32", ("N", 4, 3, 4)), CUT[1])
    other = replace(MANIFEST, cuts=(replace(MANIFEST.cuts[0], tensors=wider), *MANIFEST.cuts[1:]))
    with pytest.raises(ProtocolError, match=r"frame\.tensors\[0\]\.shape: dim 3 is 3"):
        decode_request(good, other, LIMITS)


def test_quant_params_are_checked_against_the_shape() -> None:
    def edit(header: dict[str, Any]) -> None:
        header["tensors"][0]["codec"] = INT8
        header["tensors"][0]["quant"] = {"scale": [1.0, 1.0], "zero_point": [0, 0], "axis": 1}

    with pytest.raises(ProtocolError, match=r"^frame\.tensors\[0\]\.quant: .*channels"):
        decode_request(frame_with(edit), MANIFEST, LIMITS)


def test_payload_errors_name_the_tensor() -> None:
    data = encode_request(request())
    assert decode_request(data, MANIFEST, LIMITS)
    (hlen,) = struct.unpack_from("<I", data, 6)
    start = 10 + hlen
    # shorten the first payload by 4 bytes, keeping the frame self-consistent
    (plen,) = struct.unpack_from("<I", data, start)
    short = (
        data[:start]
        + struct.pack("<I", plen - 4)
        + data[start + 4 : start + plen]
        + data[start + 4 + plen :]
    )
    with pytest.raises(CodecError, match=r"^frame\.tensors\[0\]\.payload"):
        decode_request(short, MANIFEST, LIMITS)
    with pytest.raises(ProtocolError, match="trailing"):
        decode_request(data + b"\0", MANIFEST, LIMITS)
    with pytest.raises(ProtocolError, match=r"frame\.tensors\[1\]\.payload"):
        decode_request(data[:-1], MANIFEST, LIMITS)


def test_preamble_and_limits() -> None:
    data = encode_request(request())
    cases = {
        b"XXXX" + data[4:]: "frame.magic",
        data[:4] + b"\x02" + data[5:]: "frame.version",
        data[:5] + b"\x02" + data[6:]: "frame.kind",
        data[:6] + struct.pack("<I", 1 << 20) + data[10:]: "frame.header",
        data[:6] + struct.pack("<I", 1000) + data[10:]: "frame.header",
        data[:7]: "frame",
    }
    for bad, field in cases.items():
        with pytest.raises(ProtocolError, match=f"^{field}"):
            decode_request(bad, MANIFEST, LIMITS)
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        decode_request(data, MANIFEST, replace(LIMITS, max_frame_bytes=100))
    with pytest.raises(ProtocolError, match=r"frame\.tensors\[0\]\.shape: .*over 100"):
        decode_request(data, MANIFEST, replace(LIMITS, max_tensor_bytes=100))
    (hlen,) = struct.unpack_from("<I", data, 6)
    huge = data[: 10 + hlen] + struct.pack("<I", 2**31) + data[14 + hlen :]
    with pytest.raises(ProtocolError, match=r"frame\.tensors\[0\]\.payload: .*exceeds"):
        decode_request(huge, MANIFEST, LIMITS)
    with pytest.raises(ProtocolError, match=r"frame\.header: .*exceeds"):
        decode_request(data, MANIFEST, replace(LIMITS, max_header_bytes=100))


def test_deeply_nested_or_non_json_header() -> None:
    for blob in (b"[" * 50_000, b"\xff\xfe", b'{"a": NaN}', b"[1]"):
        data = b"SPLT\x01\x01" + struct.pack("<I", len(blob)) + blob
        with pytest.raises(ProtocolError, match=r"^frame\.header"):
            decode_request(data, MANIFEST, Limits())


VALID = [
    encode_request(request(tensors=tensors(b, codec)))
    for b in (1, 2)
    for codec in (RAW, FP16, INT8, INT8_ZSTD)
]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "splice"]))
        at = draw(st.integers(0, len(data)))
        if kind == "flip" and at < len(data):
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 16))]
        else:
            data[at : at + 8] = draw(st.binary(min_size=8, max_size=8))
    return bytes(data)


frames = st.one_of(
    st.binary(max_size=256),
    st.binary(max_size=64).map(lambda b: b"SPLT\x01\x01" + b),
    mutated(),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames)
def test_fuzz_only_protocol_or_codec_errors_escape(data: bytes) -> None:
    for decode in (decode_request, decode_response):
        with contextlib.suppress(ProtocolError, CodecError):
            decode(data, MANIFEST, LIMITS)


def test_calibrated_parameters_travel_as_a_reference() -> None:
    cal = QuantParams((0.02, 0.03, 0.04, 0.05), (0, 0, 0, 0), 1)
    feat, skip = tensors(codec=INT8_ZSTD)
    by_ref = replace(feat, quant=cal, quant_ref=True)
    full = replace(feat, quant=cal)
    small = encode_request(request(tensors=(by_ref, skip)))
    big = encode_request(request(tensors=(full, skip)))
    assert len(small) < len(big)
    got = decode_request(small, MANIFEST, LIMITS)
    assert got.tensors[0].quant == cal
    assert got.tensors[0].quant_ref
    np.testing.assert_allclose(got.tensors[0].array, feat.array, atol=max(cal.scale))
    # a tensor the package holds no parameters for cannot be sent by reference
    bad = replace(skip, quant_ref=True)
    with pytest.raises(ProtocolError, match=r"frame.tensors\[1\].quant: 'manifest', but"):
        decode_request(encode_request(request(tensors=(by_ref, bad))), MANIFEST, LIMITS)


def test_peek_request_reads_the_ids_and_nothing_else() -> None:
    from splitinfer.shared.frame import Limits, Request, WireTensor, encode_request, peek_request

    x = np.zeros((1, 4), np.float32)
    frame = encode_request(Request("r1", "m", "3", "c2", (WireTensor("t", x, 1),)))
    assert peek_request(frame, Limits()) == ("m", "3", "c2")
    assert peek_request(frame[:8], Limits()) is None  # truncated preamble
    assert peek_request(b"XXXX" + frame[4:], Limits()) is None  # not a frame
    assert peek_request(frame, Limits(max_header_bytes=8)) is None  # header over the limit


def test_read_request_head_parses_once_for_routing_and_decoding() -> None:
    from splitinfer.shared.frame import read_request_head

    data = encode_request(request())
    head = read_request_head(data, LIMITS)
    assert (head.model, head.model_version, head.cut_id) == ("tiny", "3", "c1")
    from_head = decode_request(head, MANIFEST, LIMITS)
    assert encode_request(from_head) == encode_request(decode_request(data, MANIFEST, LIMITS))
    with pytest.raises(ProtocolError, match=r"frame.model_version: expected a string"):
        read_request_head(frame_with(lambda h: h.update(model_version=3)), LIMITS)
    with pytest.raises(ProtocolError, match=r"frame.magic"):
        read_request_head(b"XXXX" + data[4:], LIMITS)
    with pytest.raises(ProtocolError, match=r"frame.header: not UTF-8 JSON"):
        read_request_head(data[:10] + b"\xff" + data[11:], LIMITS)


def test_the_first_payload_is_aligned_and_raw_tensors_decode_without_a_copy() -> None:
    for trace_id in ("", "t", "tt", "ttt-with-more-characters"):
        data = encode_request(request(trace_id=trace_id))
        (hlen,) = struct.unpack_from("<I", data, 6)
        assert (10 + hlen + 4) % 16 == 0  # preamble, padded header, payload length
        json.loads(data[10 : 10 + hlen])  # the padding is JSON whitespace
        got = decode_request(data, MANIFEST, LIMITS)
        body = np.frombuffer(data, np.uint8)
        for t, sent in zip(got.tensors, request().tensors, strict=True):
            assert np.shares_memory(t.array, body)  # a view of the frame, not a copy
            assert not t.array.flags.writeable
            np.testing.assert_array_equal(t.array, sent.array)


def test_an_unaligned_frame_from_another_encoder_still_decodes() -> None:
    unpadded = frame_with(lambda h: None)  # header re-encoded without the padding
    (hlen,) = struct.unpack_from("<I", unpadded, 6)
    assert (10 + hlen + 4) % 4 != 0  # the float32 payload is misaligned
    got = decode_request(unpadded, MANIFEST, LIMITS)
    for t, sent in zip(got.tensors, request().tensors, strict=True):
        assert t.array.flags.aligned
        np.testing.assert_array_equal(t.array, sent.array)


def test_ids_under_a_zstd_cut_codec_travel_as_zstd_or_raw_and_nothing_else() -> None:
    from splitinfer.shared.codecs import ZSTD
    from splitinfer.shared.manifest import CodecSpec

    ids = TensorSpec("ids", "int64", ("N", 6))
    cut = replace(MANIFEST.cuts[1], id="c3", tensors=(ids,))

    def manifest(codec: str) -> Manifest:
        return replace(MANIFEST, cuts=(*MANIFEST.cuts, replace(cut, codec=CodecSpec(name=codec))))

    values = np.arange(12, dtype=np.int64).reshape(2, 6)
    for codec in (ZSTD, RAW):
        sent = request(cut_id="c3", tensors=(WireTensor("ids", values, codec),))
        got = decode_request(encode_request(sent), manifest("int8+zstd"), LIMITS, strict_codec=True)
        assert got.tensors[0].codec == codec
        np.testing.assert_array_equal(got.tensors[0].array, values)
    zstd = encode_request(request(cut_id="c3", tensors=(WireTensor("ids", values, ZSTD),)))
    with pytest.raises(ProtocolError, match=r"not the cut's codec \(raw, from the manifest\)"):
        decode_request(zstd, manifest("fp16"), LIMITS, strict_codec=True)
