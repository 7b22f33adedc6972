"""Image codecs (PNG, JPEG) for the cloud-only cut's inputs: the pixel mapping against
its reference, round trips within the documented bounds, hostile payloads, the frame,
the manifest, the partition-time choice and ``partition --input-codec``."""

from __future__ import annotations

import contextlib
import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from graphs import f32, make
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from onnx import helper
from PIL import Image

from splitinfer.partitioner.cli import main
from splitinfer.partitioner.wirecodec import InputCodec, plan_wire
from splitinfer.shared.codecs import (
    DEFAULT_CODECS,
    JPEG,
    PNG,
    JpegCodec,
    PngCodec,
    QuantParams,
    calibrate_image,
    from_pixels,
    get_codec,
    to_pixels,
    to_pixels_reference,
)
from splitinfer.shared.errors import CodecError, ConfigError, PackageError
from splitinfer.shared.frame import Limits, WireTensor, decode_request, encode_request
from splitinfer.shared.manifest import (
    SCHEMA_PATH,
    CodecSpec,
    Cut,
    Manifest,
    Segment,
    TensorSpec,
    load_manifest,
)
from splitinfer.shared.package import quant_params

pytestmark = pytest.mark.unit

LIMIT = 1 << 24

image_shapes = st.one_of(
    st.tuples(st.integers(1, 3), st.sampled_from([1, 3]), st.integers(1, 12), st.integers(1, 12)),
    st.tuples(st.integers(1, 3), st.integers(1, 12), st.integers(1, 12)),
)


def grid_images(levels: int = 17, step: float = 1 / 16, j: int = 0) -> st.SearchStrategy:
    """Image batches whose values are (k - j) * step, k in [0, levels)."""
    return image_shapes.flatmap(
        lambda s: hnp.arrays(np.int64, s, elements=st.integers(0, levels - 1))
    ).map(lambda k: ((k - j) * step).astype(np.float32))


def digits(n: int = 32) -> np.ndarray:
    from sklearn.datasets import load_digits

    return (load_digits().images[:n, None] / 16).astype(np.float32)


def smooth(rng: np.random.Generator, n: int, c: int, h: int, w: int) -> np.ndarray:
    """A few low-frequency sinusoids per channel, values around 0.5."""
    yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
    out = np.empty((n, c, h, w), np.float32)
    for i in range(n):
        for ch in range(c):
            a, b, phase = rng.uniform(-3, 3), rng.uniform(-3, 3), rng.uniform(0, 6)
            out[i, ch] = rng.uniform(0.3, 0.7) + rng.uniform(0, 0.5) * np.sin(
                a * xx + b * yy + phase
            )
    return out


# -- the pixel mapping -------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    image_shapes.flatmap(lambda s: hnp.arrays(np.float32, s, elements=st.floats(-50, 50, width=32)))
)
def test_pixels_match_the_reference_bit_for_bit(x: np.ndarray) -> None:
    p = calibrate_image(x)
    np.testing.assert_array_equal(to_pixels(x, p), to_pixels_reference(x, p))
    if x.ndim == 4:  # per-channel parameters too
        q = QuantParams((0.1, 0.2, 0.3)[: x.shape[1]], (-128, -20, 5)[: x.shape[1]], 1)
        np.testing.assert_array_equal(to_pixels(x, q), to_pixels_reference(x, q))


@settings(max_examples=60, deadline=None)
@given(
    image_shapes.flatmap(
        lambda s: hnp.arrays(np.float32, s, elements=st.floats(-1e3, 1e3, width=32))
    )
)
def test_off_grid_values_round_within_half_a_step(x: np.ndarray) -> None:
    p = calibrate_image(x)
    y = from_pixels(to_pixels(x, p), p)
    err = np.abs(y.astype(np.float64) - x)
    assert (err <= p.scale[0] / 2 * (1 + 1e-4) + np.abs(x) * 2e-7).all()


@pytest.mark.parametrize(
    ("values", "scale", "zero_point"),
    [
        (np.arange(17) / 16, 1 / 16, -128),  # digits: k/16
        (np.arange(256.0), 1.0, -128),  # 0..255 pictures
        (np.arange(-8, 9) / 4, 0.25, -120),  # a grid around 0
        (np.array([3.0]), 3.0, -128),
        (np.array([-2.0, -1.0]), 1.0, -126),  # pixels 0, 1 and 2 (= 0.0)
    ],
)
def test_grid_values_get_the_grid_step(values: np.ndarray, scale: float, zero_point: int) -> None:
    p = calibrate_image(values.astype(np.float32))
    assert p.scale == (scale,)
    assert p.zero_point == (zero_point,)


def test_continuous_values_fall_back_to_min_max() -> None:
    x = np.linspace(-1.0, 3.0, 1000, dtype=np.float32).reshape(1, 1, 10, 100)
    p = calibrate_image(x)
    assert p.scale[0] == pytest.approx(4.0 / 255)
    assert -(128 + p.zero_point[0]) * p.scale[0] == pytest.approx(-1.0, abs=p.scale[0] / 2)
    with pytest.raises(CodecError, match="finite"):
        calibrate_image(np.array([np.nan], np.float32))


# -- round trips -------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.one_of(grid_images(), grid_images(256, 1.0), grid_images(200, 0.5, 100)))
def test_png_is_exact_on_grid_values(x: np.ndarray) -> None:
    p = calibrate_image(x)
    codec = get_codec(PNG)
    y = codec.decode(codec.encode(x, p), "float32", x.shape, p, LIMIT)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, x)


def test_png_is_exact_on_the_digits_set() -> None:
    x = digits(64)
    p = calibrate_image(x)
    codec = PngCodec()
    y = codec.decode(codec.encode(x, p), "float32", x.shape, p, LIMIT)
    np.testing.assert_array_equal(y, x)
    g = x[:, 0]  # the same as [N, H, W] grey
    np.testing.assert_array_equal(codec.decode(codec.encode(g, p), "float32", g.shape, p, LIMIT), g)


@settings(max_examples=40, deadline=None)
@given(image_shapes.flatmap(lambda s: hnp.arrays(np.uint8, s)))
def test_uint8_pictures_pass_as_they_are(x: np.ndarray) -> None:
    for codec in (PngCodec(), PngCodec(level=0)):
        y = codec.decode(codec.encode(x), "uint8", x.shape, None, LIMIT)
        assert y.dtype == np.uint8
        np.testing.assert_array_equal(y, x)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.integers(1, 2),
    st.sampled_from([1, 3]),
    st.integers(8, 40),
    st.integers(8, 40),
)
def test_jpeg_error_is_within_its_documented_bound(
    seed: int, n: int, c: int, h: int, w: int
) -> None:
    x = smooth(np.random.default_rng(seed), n, c, h, w)
    p = calibrate_image(x)
    codec = get_codec(JPEG)
    y = codec.decode(codec.encode(x, p), "float32", x.shape, p, LIMIT)
    levels = np.abs(y.astype(np.float64) - x) / p.scale[0]
    assert levels.mean() <= 3 + 0.5  # + calibrate_image's own rounding
    assert levels.max() <= 16 + 0.5


def test_jpeg_quality_trades_bytes_for_error() -> None:
    x = smooth(np.random.default_rng(3), 1, 3, 64, 64)
    p = calibrate_image(x)
    sizes, errors = [], []
    for q in (30, 60, 95):
        codec = JpegCodec(q)
        data = codec.encode(x, p)
        sizes.append(len(data))
        errors.append(np.abs(codec.decode(data, "float32", x.shape, p, LIMIT) - x).mean())
    assert sizes == sorted(sizes)
    assert errors == sorted(errors, reverse=True)
    with pytest.raises(CodecError, match="quality"):
        JpegCodec(0)
    with pytest.raises(CodecError, match="level"):
        PngCodec(level=10)


def test_registered_under_the_next_free_ids() -> None:
    assert (PNG, JPEG) == (5, 6)
    assert isinstance(DEFAULT_CODECS[PNG], PngCodec)
    assert isinstance(DEFAULT_CODECS[JPEG], JpegCodec)


# -- what encode refuses ------------------------------------------------------------


@pytest.mark.parametrize(
    ("array", "params", "match"),
    [
        (np.zeros((2, 16), np.float32), QuantParams((1.0,), (0,)), "not an image batch"),
        (np.zeros((1, 2, 4, 4), np.float32), QuantParams((1.0,), (0,)), "not an image batch"),
        (np.zeros((1, 4, 4), np.float32), None, "needs quantization parameters"),
        (np.zeros((1, 4, 4), np.int64), None, "dtype 'int64'"),
        (np.full((1, 4, 4), np.nan, np.float32), QuantParams((1.0,), (0,)), "NaN"),
        (np.zeros((1, 0, 4), np.uint8), None, "0x4 pixels"),
    ],
)
def test_encode_refuses(array: np.ndarray, params: QuantParams | None, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        PngCodec().encode(array, params)


# -- hostile payloads ---------------------------------------------------------------


def _one(image: bytes) -> bytes:
    return struct.pack("<I", len(image)) + image


def _png(width: int, height: int, rows: bytes | None = None, color: int = 0) -> bytes:
    """A hand-made grey PNG; ``rows`` the raw scanlines (zeros if None)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    if rows is None:
        comp = zlib.compressobj(9)
        line = bytes(width + 1)
        idat = b"".join(comp.compress(line) for _ in range(height)) + comp.flush()
    else:
        idat = zlib.compress(rows)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, color, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_png_bomb_fails_from_the_header() -> None:
    bomb = _png(10_000, 10_000)  # 100 Mpixel of zeros in about 100 KB
    assert len(bomb) < 200_000
    with pytest.raises(CodecError, match=r"10000x10000.*decompression bomb"):
        PngCodec().decode(_one(bomb), "uint8", (1, 28, 28), None, LIMIT)
    # a frame that itself claims the picture is refused by its size, before any header
    with pytest.raises(CodecError, match="exceed"):
        PngCodec().decode(_one(bomb), "uint8", (1, 10_000, 10_000), None, LIMIT)


def test_max_image_pixels_is_respected(monkeypatch: pytest.MonkeyPatch) -> None:
    x = np.zeros((1, 28, 28), np.uint8)
    data = PngCodec().encode(x)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 500)
    with pytest.raises(CodecError, match="MAX_IMAGE_PIXELS"):
        PngCodec().decode(data, "uint8", x.shape, None, LIMIT)


def test_hand_made_png_decodes() -> None:
    rows = b"".join(b"\x00" + bytes(range(i, i + 5)) for i in range(3))
    got = PngCodec().decode(_one(_png(5, 3, rows)), "uint8", (1, 3, 5), None, LIMIT)
    np.testing.assert_array_equal(got[0], [list(range(i, i + 5)) for i in range(3)])


def _good(codec: PngCodec | JpegCodec, shape: tuple[int, ...] = (2, 3, 8, 8)) -> bytes:
    x = np.random.default_rng(0).integers(0, 255, shape, dtype=np.uint8)
    return codec.encode(x)


@pytest.mark.parametrize("codec", [PngCodec(), JpegCodec()], ids=["png", "jpeg"])
@pytest.mark.parametrize(
    ("mutate", "shape", "match"),
    [
        (lambda d: d[:-7], (2, 3, 8, 8), "truncated"),
        (lambda d: d[:2], (2, 3, 8, 8), "length missing"),
        (lambda d: d + b"\x00", (2, 3, 8, 8), "trailing"),
        (lambda d: d, (2, 3, 8, 9), r"8x8.*needs 9x8"),
        (lambda d: d, (2, 1, 8, 8), "with 3 channel"),
        (lambda d: d, (3, 3, 8, 8), "length missing"),
        (lambda d: d[:4] + b"GIF89a" + d[10:], (2, 3, 8, 8), "not a (PNG|JPEG)"),
        (lambda d: d, (2, 8, 8, 3), "not an image batch"),
    ],
)
def test_decode_errors_name_what_is_wrong(
    codec: PngCodec | JpegCodec, mutate, shape: tuple[int, ...], match: str
) -> None:
    with pytest.raises(CodecError, match=match):
        codec.decode(mutate(_good(codec)), "uint8", shape, None, LIMIT)


def test_a_jpeg_is_not_a_png_and_corrupt_data_is_a_codec_error() -> None:
    jpeg = _good(JpegCodec(), (1, 3, 8, 8))
    with pytest.raises(CodecError, match="not a PNG"):
        PngCodec().decode(jpeg, "uint8", (1, 3, 8, 8), None, LIMIT)
    png = bytearray(_good(PngCodec(), (1, 3, 8, 8)))
    png[45] ^= 0xFF  # inside the IDAT: a CRC or zlib failure inside Pillow
    with pytest.raises(CodecError, match="image 0"):
        PngCodec().decode(bytes(png), "uint8", (1, 3, 8, 8), None, LIMIT)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=300), st.sampled_from([PNG, JPEG]))
def test_fuzz_only_codec_errors_escape(data: bytes, codec_id: int) -> None:
    codec = get_codec(codec_id)
    p = QuantParams((1.0,), (0,))
    with contextlib.suppress(CodecError):
        codec.decode(data, "float32", (1, 3, 4, 4), p, 4096)


def test_float_decode_needs_params_and_a_fitting_size() -> None:
    data = _good(PngCodec(), (1, 1, 8, 8))
    with pytest.raises(CodecError, match="needs quantization parameters"):
        PngCodec().decode(data, "float32", (1, 1, 8, 8), None, LIMIT)
    with pytest.raises(CodecError, match="exceeds 100 bytes"):
        PngCodec().decode(data, "float32", (1, 1, 8, 8), QuantParams((1.0,), (0,)), 100)


# -- the frame and the manifest -----------------------------------------------------


def _manifest(codec: CodecSpec, x: np.ndarray, p: QuantParams) -> Manifest:
    from splitinfer.shared.package import quant_spec

    inputs = (TensorSpec("x", "float32", ("N", *x.shape[1:])),)
    cut = Cut(
        "c0",
        "none",
        inputs,
        (),
        x[:1].nbytes,
        0,
        10,
        cloud=Segment("cloud.onnx", "2" * 64, ("x",), ("y",), 1),
        codec=codec,
        quant={"x": quant_spec(p)},
    )
    outputs = (TensorSpec("y", "float32", ("N", 10)),)
    return Manifest("m", "0" * 64, 17, "N", inputs, outputs, "c0", (cut,))


@pytest.mark.parametrize("codec", [CodecSpec("png"), CodecSpec("jpeg", quality=80)])
def test_frame_carries_images_with_the_manifest_affine(codec: CodecSpec) -> None:
    from splitinfer.shared.frame import Request

    x = digits(4)
    manifest = _manifest(codec, x, calibrate_image(digits()))
    assert Manifest.from_dict(json.loads(manifest.to_json())) == manifest
    p = quant_params(manifest.cut, "x")
    assert p is not None
    wire_id = PNG if codec.name == "png" else JPEG
    request = Request("r1", "m", "1", "c0", (WireTensor("x", x, wire_id, p, quant_ref=True),))
    frame = encode_request(request)
    assert b'"quant":"manifest"' in frame
    got = decode_request(frame, manifest, Limits()).tensors[0]
    assert got.codec == wire_id
    if codec.name == "png":
        np.testing.assert_array_equal(got.array, x)
    else:
        assert np.abs(got.array - x).max() <= 16 * p.scale[0]  # the documented worst pixel


def test_codec_spec_quality_is_validated_by_name() -> None:
    where = "manifest.cuts[0].codec"
    for bad, match in [
        ({"name": "jpeg", "quality": 0}, "codec.quality: 0 is not an integer in"),
        ({"name": "jpeg", "quality": True}, "codec.quality: True"),
        ({"name": "png", "quality": 90}, "only the jpeg codec"),
        ({"name": "webp"}, r"codec.name: 'webp' is not one of .*png, jpeg"),
    ]:
        with pytest.raises(PackageError, match=match):
            CodecSpec.from_dict(bad, where)
    assert CodecSpec.from_dict({"name": "jpeg", "quality": 75}, where).quality == 75
    assert CodecSpec.from_dict({"name": "jpeg"}, where).quality is None
    with pytest.raises(PackageError, match="quality"):
        CodecSpec("jpeg", quality=101)


def test_schema_accepts_image_codecs_and_refuses_a_bad_quality() -> None:
    import jsonschema

    schema = json.loads(SCHEMA_PATH.read_text())
    data = json.loads(
        _manifest(CodecSpec("jpeg", quality=90), digits(2), calibrate_image(digits())).to_json()
    )
    jsonschema.validate(data, schema)
    data["cuts"][0]["codec"]["quality"] = 0
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, schema)


# -- the choice at partition time ------------------------------------------------------


def test_input_codec_parse() -> None:
    assert InputCodec.parse("jpeg:75") == InputCodec("jpeg", 75)
    assert InputCodec.parse("PNG") == InputCodec("png")
    assert InputCodec.parse("jpeg").spec() == CodecSpec("jpeg", quality=90)
    for bad, match in [("webp", "use auto"), ("png:3", "only jpeg"), ("jpeg:0", "1..100")]:
        with pytest.raises(ConfigError, match=match):
            InputCodec.parse(bad)


def test_auto_keeps_the_smallest_codec_that_holds_agreement() -> None:
    rng = np.random.default_rng(0)
    pictures = {"x": (smooth(rng, 16, 3, 32, 32) * 255).round().astype(np.uint8)}
    plan = plan_wire(pictures, dictionary_file="d", input_codec=InputCodec())
    assert plan.codec.name == "png"  # uint8: int8+zstd cannot carry it, raw is 4x bigger
    assert plan.quant["x"].scale == (1.0,)
    assert [r["codec"] for r in plan.tried] == ["raw", "png"]  # no score: no jpeg
    good = plan_wire(pictures, dictionary_file="d", score=lambda _: 1.0, input_codec=InputCodec())
    assert good.codec.name == "jpeg"  # when nothing is lost, jpeg is smallest
    assert good.codec.quality == 75
    assert good.wire_bytes == pytest.approx(min(r["wire_bytes"] for r in good.tried), abs=0.05)
    assert good.summary()["tried"] == list(good.tried)

    def strict(rounded: dict[str, np.ndarray]) -> float:  # only a lossless trip agrees
        return 1.0 if np.array_equal(rounded["x"], pictures["x"]) else 0.5

    kept = plan_wire(pictures, dictionary_file="d", score=strict, input_codec=InputCodec())
    assert kept.codec.name == "png"
    assert kept.agreement == 1.0


def test_digits_png_is_measured_against_int8_zstd() -> None:
    acts = {"x": digits(64)}
    plan = plan_wire(acts, dictionary_file="d", score=lambda _: 1.0, input_codec=InputCodec())
    rows = {r["codec"]: r["wire_bytes"] for r in plan.tried}
    # a score that never drops lets the int8 step go to 4 bits: int4+zstd
    assert set(rows) == {"int4+zstd", "png", "jpeg:90", "jpeg:75"}
    assert plan.wire_bytes == pytest.approx(min(rows.values()), abs=0.05)
    forced = plan_wire(acts, dictionary_file="d", input_codec=InputCodec("png"))
    assert forced.codec == CodecSpec("png")
    assert forced.wire_bytes == pytest.approx(rows["png"], abs=0.05)
    # the recorded affine decodes the digits exactly
    p = quant_params(Cut("c0", "none", (), (), 0, 0, 0, quant=forced.quant), "x")
    assert p is not None
    x = acts["x"]
    np.testing.assert_array_equal(
        PngCodec().decode(PngCodec().encode(x, p), "float32", x.shape, p, LIMIT), x
    )


def test_non_image_inputs_keep_the_usual_codecs_and_refuse_a_forced_image_codec() -> None:
    acts = {"v": np.random.default_rng(0).standard_normal((16, 10)).astype(np.float32)}
    plan = plan_wire(acts, dictionary_file="d", input_codec=InputCodec())
    assert plan.codec.name == "int8+zstd"
    assert plan.tried == ()
    with pytest.raises(ConfigError, match=r"input 'v' has shape \[16, 10\] is not an image"):
        plan_wire(acts, dictionary_file="d", input_codec=InputCodec("jpeg"))
    assert plan_wire(acts, dictionary_file="d", input_codec=InputCodec("raw")).codec.name == "raw"


# -- partition --input-codec ------------------------------------------------------------


def _classifier(tmp_path: Path, shape: list[int | str]) -> Path:
    width = int(np.prod([d for d in shape[1:] if isinstance(d, int)]))
    w = np.random.default_rng(0).standard_normal((width, 10)).astype(np.float32)
    model = make(
        [
            helper.make_node("Flatten", ["x"], ["f"], axis=1),
            helper.make_node("MatMul", ["f", "w"], ["y"]),
        ],
        [f32("x", shape)],
        [f32("y", ["N", 10])],
        {"w": w},
    )
    path = tmp_path / "clf.onnx"
    onnx.save(model, str(path))
    return path


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main([*argv, "-q"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("partition: error: ")
    return lines[0]


@pytest.mark.parametrize("choice", ["png", "jpeg:85", "auto"])
def test_partition_none_records_the_input_codec(tmp_path: Path, choice: str) -> None:
    model = _classifier(tmp_path, ["N", 1, 8, 8])
    calib = tmp_path / "calib"
    calib.mkdir()
    np.save(calib / "digits.npy", digits(40))
    out = tmp_path / "pkg"
    argv = [str(model), "--split", "none", "--input-codec", choice, "--calibration", str(calib)]
    assert main([*argv, "-o", str(out), "-q"]) == 0
    cut = load_manifest(out).cut
    wire = cut.quality["wire"]
    if choice == "png":
        assert cut.codec == CodecSpec("png")
        assert wire["agreement"] == 1.0  # digits are on the k/16 grid: lossless
        assert cut.quant["x"].scale == (1 / 16,)
    elif choice == "jpeg:85":
        assert cut.codec == CodecSpec("jpeg", quality=85)
    else:
        assert cut.codec.name in {"int8+zstd", "png", "jpeg"}
        assert len(wire["tried"]) == 4
    schema = json.loads(SCHEMA_PATH.read_text())
    import jsonschema

    jsonschema.validate(json.loads((out / "manifest.json").read_text()), schema)


def test_partition_input_codec_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    vector = _classifier(tmp_path, ["N", 16])
    out = str(tmp_path / "pkg")
    line = _error(capsys, [str(vector), "--split", "none", "--input-codec", "png", "-o", out])
    assert "--input-codec png: input 'x' has shape ['N', 16] is not an image batch" in line
    image = _classifier(tmp_path, ["N", 1, 8, 8])
    line = _error(capsys, [str(image), "--split", "none", "--input-codec", "jpeg:0", "-o", out])
    assert "QUALITY must be an integer in 1..100" in line
    line = _error(capsys, [str(image), "--split", "all", "--input-codec", "png", "-o", out])
    assert "applies to the cloud-only cut" in line
    line = _error(capsys, [str(image), "--list-cuts", "--input-codec", "png"])
    assert "--input-codec goes with --split none or --split auto" in line
    assert not Path(out).exists()


def test_help_names_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--input-codec auto|raw|png|jpeg[:QUALITY]" in capsys.readouterr().out


def test_pillow_reads_what_we_write() -> None:
    x = np.random.default_rng(1).integers(0, 255, (1, 3, 5, 7), dtype=np.uint8)
    data = PngCodec().encode(x)
    with Image.open(io.BytesIO(data[4:])) as image:
        assert (image.format, image.size, image.mode) == ("PNG", (7, 5), "RGB")
        np.testing.assert_array_equal(np.asarray(image).transpose(2, 0, 1), x[0])
