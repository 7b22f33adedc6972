"""Declared input preprocessing: the manifest field, pictures to arrays, calibration from
image folders (``partition --preprocess``) and image bodies at the edge agent.

The digits (sklearn's 8x8 set) hold whole numbers 0..16, so a grey PNG holds them
exactly and ``scale=1/16`` gives back the model's k/16 inputs: calibrating from the
PNGs must give the very same parameters as calibrating from the equivalent .npy.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from graphs import f32, make, rand
from onnx import helper
from PIL import Image

from splitinfer.partitioner.calibration import load_calibration
from splitinfer.partitioner.cli import main as partition
from splitinfer.shared.errors import CodecError, ConfigError, PackageError
from splitinfer.shared.manifest import SCHEMA_PATH, Manifest, TensorSpec, load_manifest
from splitinfer.shared.preprocess import (
    PreprocessSpec,
    decode_pixels,
    image_to_input,
    normalize,
    parse_compact,
    parse_option,
)

pytestmark = pytest.mark.unit

GREY = TensorSpec("x", "float32", ("N", 1, 8, 8))
DIGITS = PreprocessSpec("L", (8, 8), scale=1 / 16)


def digit_pixels(n: int, offset: int = 0) -> np.ndarray:
    """[n, 8, 8] uint8 pixels 0..16."""
    from sklearn.datasets import load_digits

    return load_digits().images[offset : offset + n].astype(np.uint8)


def png(pixels: np.ndarray, **options: Any) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=options.pop("format", "PNG"), **options)
    return buf.getvalue()


def one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


# -- the spec ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"mode": "CMYK"}, "mode"),
        ({"size": (0, 8)}, "size"),
        ({"size": (8,)}, "size"),
        ({"size": (8, 20000)}, "size"),
        ({"layout": "CHW"}, "layout"),
        ({"scale": 0.0}, "scale"),
        ({"scale": float("nan")}, "scale"),
        ({"mean": (0.1, 0.2)}, "mean"),
        ({"std": (0.0,)}, "std"),
        ({"std": (1.0, 1.0, 1.0)}, "std"),  # three values for a grey picture
        ({"resize": "cubic"}, "resize"),
    ],
)
def test_each_bad_field_is_named(change: dict[str, Any], field: str) -> None:
    values: dict[str, Any] = {"mode": "L", "size": (8, 8), **change}
    with pytest.raises(PackageError) as exc:
        PreprocessSpec(**values)
    assert one_line(exc).startswith(f"preprocess.{field}: ")


def test_dict_round_trip_and_defaults() -> None:
    spec = PreprocessSpec(
        "RGB", (4, 6), "NHWC", 1 / 255, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), "bicubic"
    )
    data = json.loads(json.dumps(spec.to_dict()))
    assert data["size"] == [4, 6]
    assert PreprocessSpec.from_dict(data) == spec
    minimal = PreprocessSpec.from_dict({"mode": "L", "size": [8, 8]})
    assert (minimal.layout, minimal.scale, minimal.mean, minimal.std, minimal.resize) == (
        "NCHW",
        1 / 255,
        (0.0,),
        (1.0,),
        "bilinear",
    )


@pytest.mark.parametrize(
    ("data", "start"),
    [
        ({"size": [8, 8]}, "manifest.preprocessing.x.mode: missing"),
        ({"mode": "L", "size": 8}, "manifest.preprocessing.x.size: expected a list"),
        ({"mode": "L", "size": [8, 8], "gamma": 2}, "manifest.preprocessing.x.gamma: unknown"),
        ({"mode": "L", "size": [8, 8], "scale": -1}, "manifest.preprocessing.x.scale: -1"),
    ],
)
def test_from_dict_names_the_field(data: dict[str, Any], start: str) -> None:
    with pytest.raises(PackageError) as exc:
        PreprocessSpec.from_dict(data, "manifest.preprocessing.x")
    assert one_line(exc).startswith(start)


def _manifest_dict(shape: list[Any], preprocessing: Any = None) -> dict[str, Any]:
    segment = {"file": "cloud.onnx", "sha256": "0" * 64, "inputs": ["x"], "outputs": ["y"]}
    data: dict[str, Any] = {
        "format": "splitinfer.split-package",
        "format_version": 2,
        "model_name": "m",
        "source_sha256": "0" * 64,
        "opset": 17,
        "batch_dim": "N",
        "inputs": [{"name": "x", "dtype": "float32", "shape": shape}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": ["N", 10]}],
        "default_cut": "c0",
        "cuts": [
            {
                "id": "c0",
                "kind": "none",
                "tensors": [{"name": "x", "dtype": "float32", "shape": shape}],
                "rematerialized": [],
                "bytes_per_sample": 256,
                "edge_flops": 0,
                "cloud_flops": 1,
                "edge": None,
                "cloud": {**segment, "nodes": 1, "precision": "fp32"},
                "codec": {"name": "raw"},
            }
        ],
        "tool_version": "t",
    }
    if preprocessing is not None:
        data["preprocessing"] = preprocessing
    return data


def test_manifest_carries_the_field_and_the_schema_describes_it() -> None:
    import jsonschema

    schema = json.loads(SCHEMA_PATH.read_text())
    data = _manifest_dict(["N", 1, 8, 8], {"x": DIGITS.to_dict()})
    jsonschema.validate(data, schema)
    manifest = Manifest.from_dict(data)
    assert manifest.preprocessing == {"x": DIGITS}
    again = json.loads(manifest.to_json())
    jsonschema.validate(again, schema)
    assert Manifest.from_dict(again) == manifest
    assert again["format_version"] == 2
    # optional: absent when none is declared, and an older manifest reads as none
    plain = Manifest.from_dict(_manifest_dict(["N", 1, 8, 8]))
    assert plain.preprocessing == {}
    assert "preprocessing" not in json.loads(plain.to_json())
    bad = _manifest_dict(["N", 1, 8, 8], {"x": {"mode": "L", "size": [8, 8], "std": [0]}})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


@pytest.mark.parametrize(
    ("shape", "pre", "message"),
    [
        (["N", 1, 8, 8], {"z": DIGITS.to_dict()}, "'z' is not a model input (x)"),
        (["N", 3, 8, 8], {"x": DIGITS.to_dict()}, "mode L gives 1 channel(s)"),
        (["N", 1, 8, 9], {"x": DIGITS.to_dict()}, "its width is 9; use size=8x9"),
        (["N", 64], {"x": DIGITS.to_dict()}, "is not an image batch"),
        ([5, 1, 8, 8], {"x": DIGITS.to_dict()}, "has no batch axis first"),
    ],
)
def test_manifest_checks_the_spec_against_the_input(
    shape: list[Any], pre: dict[str, Any], message: str
) -> None:
    with pytest.raises(PackageError) as exc:
        Manifest.from_dict(_manifest_dict(shape, pre))
    text = one_line(exc)
    assert text.startswith("manifest.preprocessing.")
    assert message in text


def test_symbolic_sides_and_nhwc_and_grey_rank_three_fit() -> None:
    PreprocessSpec("L", (8, 8)).check_fits(TensorSpec("x", "float32", ("N", 1, "H", "W")), "w")
    rgb = PreprocessSpec("RGB", (5, 7), "NHWC")
    rgb.check_fits(TensorSpec("x", "float32", ("N", 5, 7, 3)), "w")
    with pytest.raises(PackageError, match=r"mode RGB gives 3 channel\(s\).*has 5"):
        rgb.check_fits(TensorSpec("x", "float32", ("N", 5, 7, 5)), "w")
    PreprocessSpec("L", (8, 8)).check_fits(TensorSpec("x", "float32", ("N", 8, 8)), "w")
    with pytest.raises(PackageError, match="need a float input"):
        DIGITS.check_fits(TensorSpec("x", "uint8", ("N", 1, 8, 8)), "w")
    PreprocessSpec("L", (8, 8), scale=1).check_fits(TensorSpec("x", "uint8", ("N", 1, 8, 8)), "w")


# -- the compact form -------------------------------------------------------------------


def test_parse_compact() -> None:
    name, spec = parse_compact("mode=L,size=8x8,scale=0.0625")
    assert (name, spec) == (None, DIGITS)
    name, spec = parse_compact(
        "input=img, mode=RGB, size=224, layout=NHWC, scale=1/255, "
        "mean=0.485,0.456,0.406, std=0.229,0.224,0.225, resize=bicubic"
    )
    assert name == "img"
    assert spec == PreprocessSpec(
        "RGB", (224, 224), "NHWC", 1 / 255, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), "bicubic"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("mode=L,size=8x8,gamma=2", "unknown key 'gamma'"),
        ("mode=L,size=8by8", "size '8by8': use HEIGHTxWIDTH"),
        ("mode=L,size=8x8,scale=1/0", "scale '1/0': not a number"),
        ("mode=L,size=8x8,mode=RGB", "mode given twice"),
        ("mode=L", "--preprocess.size: missing"),
        ("mode=L,size=8x8,std=0", "--preprocess.std: 0.0 is not allowed"),
        ("L,8x8", "is not key=value"),
    ],
)
def test_parse_compact_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_compact(text)
    assert message in one_line(exc)


def test_parse_option_picks_and_checks_the_input(tmp_path: Path) -> None:
    mask = TensorSpec("m", "float32", ("N", 4))
    assert parse_option("mode=L,size=8x8,scale=1/16", [GREY]) == {"x": DIGITS}
    assert parse_option("mode=L,size=8x8,scale=1/16,input=x", [mask, GREY]) == {"x": DIGITS}
    with pytest.raises(ConfigError) as exc:
        parse_option("mode=L,size=8x8", [mask, GREY])
    assert "the model has 2 inputs (m, x); name the image input with input=NAME" in one_line(exc)
    with pytest.raises(ConfigError, match=r"input 'm' of shape \[N, 4\] is not an image batch"):
        parse_option("mode=L,size=8x8,input=m", [mask, GREY])
    spec = tmp_path / "pre.json"
    spec.write_text(json.dumps({"input": "x", **DIGITS.to_dict()}))
    assert parse_option(str(spec), [mask, GREY]) == {"x": DIGITS}
    spec.write_text("{mode: L")
    with pytest.raises(ConfigError, match=r"pre\.json: not valid JSON"):
        parse_option(str(spec), [GREY])
    spec.write_text(json.dumps({"mode": "L", "size": [8, 8], "scale": "1/16"}))
    with pytest.raises(ConfigError) as exc:
        parse_option(str(spec), [GREY])
    assert one_line(exc).startswith("--preprocess.scale: '1/16' is not a positive number")


# -- pictures to arrays -----------------------------------------------------------------


def test_grey_png_gives_the_digits_exactly() -> None:
    pixels = digit_pixels(1)[0]
    x = image_to_input(png(pixels), DIGITS, GREY)
    assert x.dtype == np.float32
    assert x.shape == (1, 1, 8, 8)
    np.testing.assert_array_equal(x[0, 0], (pixels / 16.0).astype(np.float32))


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_rgb_mean_std_in_either_layout(layout: str) -> None:
    pixels = np.random.default_rng(0).integers(0, 256, (3, 5, 3), dtype=np.uint8)
    spec = PreprocessSpec("RGB", (3, 5), layout, 1 / 255, (0.5, 0.4, 0.3), (0.2, 0.25, 0.5))
    shape = ("N", 3, 3, 5) if layout == "NCHW" else ("N", 3, 5, 3)
    x = image_to_input(png(pixels), spec, TensorSpec("img", "float32", shape))
    want = (pixels / 255.0 - np.array([0.5, 0.4, 0.3])) / np.array([0.2, 0.25, 0.5])
    if layout == "NCHW":
        want = want.transpose(2, 0, 1)
    np.testing.assert_allclose(x[0], want.astype(np.float32), rtol=1e-6)


def test_conversion_and_resize() -> None:
    blocks = np.random.default_rng(1).integers(0, 256, (4, 4), dtype=np.uint8)
    big = np.kron(blocks, np.ones((4, 4), dtype=np.uint8))  # 16x16 of 4x4 blocks
    got = decode_pixels(png(big), PreprocessSpec("L", (4, 4), resize="box"))
    np.testing.assert_array_equal(got[..., 0], blocks)  # box-averaging constant blocks
    flat = np.full((10, 6, 4), 77, dtype=np.uint8)  # RGBA, constant: any filter keeps it
    got = decode_pixels(png(flat), PreprocessSpec("RGB", (3, 2)))
    assert got.shape == (3, 2, 3)
    assert set(got.ravel().tolist()) == {77}
    grey = decode_pixels(png(np.full((2, 2, 3), 200, np.uint8)), PreprocessSpec("L", (2, 2)))
    assert grey.shape == (2, 2, 1)
    assert set(grey.ravel().tolist()) == {200}
    rank3 = normalize(grey[None], PreprocessSpec("L", (2, 2), scale=1), "float32", rank=3)
    assert rank3.shape == (1, 2, 2)


def test_exif_orientation_is_applied() -> None:
    pixels = np.zeros((2, 4), dtype=np.uint8)
    pixels[0, 0] = 255
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    data = png(pixels, format="JPEG", quality=100, exif=exif)
    got = decode_pixels(data, PreprocessSpec("L", (4, 2)))
    assert got.shape == (4, 2, 1)  # displayed upright: 4 high, 2 wide
    assert got[0, 1, 0] > 128 > got[0, 0, 0]


def test_bad_pictures_are_one_line_codec_errors() -> None:
    with pytest.raises(CodecError) as exc:
        decode_pixels(b"\x89PNG\r\n\x1a\nnot really", DIGITS)
    assert one_line(exc).startswith("not a picture Pillow can read")
    deep = png(np.full((8, 8), 4000, dtype=np.uint16))
    with pytest.raises(CodecError, match="not 8 bits per channel"):
        decode_pixels(deep, DIGITS)
    with pytest.raises(CodecError, match="a picture of 8x8 exceeds the limit of 63 pixels"):
        decode_pixels(png(digit_pixels(1)[0]), DIGITS, max_pixels=63)


# -- calibration folders ----------------------------------------------------------------


def picture_folder(root: Path, pixels: np.ndarray, suffix: str = ".png") -> Path:
    root.mkdir()
    for i, p in enumerate(pixels):
        (root / f"d{i:03d}{suffix}").write_bytes(png(p))
    return root


def npy_folder(root: Path, pixels: np.ndarray) -> Path:
    root.mkdir()
    np.save(root / "digits.npy", (pixels / 16.0).astype(np.float32)[:, None])
    return root


def test_pictures_calibrate_like_the_equivalent_npy(tmp_path: Path) -> None:
    pixels = digit_pixels(12)
    images = picture_folder(tmp_path / "png", pixels, ".PNG")  # suffix case does not matter
    arrays = npy_folder(tmp_path / "npy", pixels)
    got = load_calibration(images, [GREY], "N", preprocessing={"x": DIGITS})
    want = load_calibration(arrays, [GREY], "N")
    assert len(got) == len(want) == 12
    for a, b in zip(got, want, strict=True):
        assert a["x"].dtype == b["x"].dtype
        np.testing.assert_array_equal(a["x"], b["x"])
    assert len(load_calibration(images, [GREY], "N", 5, {"x": DIGITS})) == 5


def test_calibration_folder_errors(tmp_path: Path) -> None:
    pixels = digit_pixels(3)
    images = picture_folder(tmp_path / "png", pixels)
    with pytest.raises(ConfigError) as exc:
        load_calibration(images, [GREY], "N")
    assert "no preprocessing is declared for input 'x'; give --preprocess" in one_line(exc)
    two = [GREY, TensorSpec("m", "float32", ("N", 4))]
    with pytest.raises(ConfigError, match="a picture feeds a single-input model"):
        load_calibration(images, two, "N", preprocessing={"x": DIGITS})
    rgb = {"x": PreprocessSpec("RGB", (8, 8))}
    with pytest.raises(ConfigError, match=r"mode RGB gives 3 channel\(s\)"):
        load_calibration(images, [GREY], "N", preprocessing=rgb)
    np.save(images / "extra.npy", np.zeros((1, 8, 8), np.float32))
    with pytest.raises(ConfigError) as exc:
        load_calibration(images, [GREY], "N", preprocessing={"x": DIGITS})
    assert "mixes 1 .npy/.npz file(s) and 3 image(s)" in one_line(exc)
    (images / "extra.npy").unlink()
    (images / "d001.png").write_bytes(b"\x89PNG\r\n\x1a\ntruncated")
    with pytest.raises(ConfigError) as exc:
        load_calibration(images, [GREY], "N", preprocessing={"x": DIGITS})
    assert one_line(exc).startswith(f"calibration file {images / 'd001.png'}: not a picture")


# -- partition: --preprocess and image calibration --------------------------------------


def conv_classifier(tmp_path: Path) -> Path:
    """x [N, 1, 8, 8] -> Conv 4x3x3 -> Relu -> Flatten -> MatMul -> y [N, 10]."""
    model = make(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c"], ["r"]),
            helper.make_node("Flatten", ["r"], ["f"], axis=1),
            helper.make_node("MatMul", ["f", "m"], ["y"]),
        ],
        [f32("x", ["N", 1, 8, 8])],
        [f32("y", ["N", 10])],
        {"w": rand(4, 1, 3, 3, seed=1), "m": rand(256, 10, seed=2)},
    )
    path = tmp_path / "clf.onnx"
    onnx.save(model, str(path))
    return path


def cli_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert partition([*argv, "-q"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("partition: error: ")
    return lines[0]


def test_partition_preprocess_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = str(conv_classifier(tmp_path))
    out = str(tmp_path / "pkg")
    images = picture_folder(tmp_path / "png", digit_pixels(4))
    split = [model, "--split", "none", "-o", out]
    line = cli_error(capsys, [*split, "--preprocess", "mode=RGB,size=8x8"])
    assert "--preprocess: mode RGB gives 3 channel(s), input 'x' [N, 1, 8, 8]" in line
    assert "use mode=L" in line
    line = cli_error(capsys, [*split, "--preprocess", "mode=L,size=16x16"])
    assert "its height is 8; use size=8x8" in line
    line = cli_error(capsys, [*split, "--preprocess", "mode=L,size=8x8,input=y"])
    assert "--preprocess input=y: not a model input; inputs: x" in line
    line = cli_error(capsys, [model, "--list-cuts", "--preprocess", "mode=L,size=8x8"])
    assert "--preprocess goes with --split" in line
    line = cli_error(capsys, [*split, "--preprocess", str(tmp_path / "missing.json")])
    assert "missing.json: cannot be read" in line
    argv = [model, "--split", "c1", "--precision", "int8", "--calibration", str(images)]
    line = cli_error(capsys, [*argv, "-o", out])
    assert "holds images, but no preprocessing is declared for input 'x'; give --preprocess" in line
    (images / "d002.png").write_bytes(b"garbage")
    line = cli_error(capsys, [*argv, "-o", out, "--preprocess", "mode=L,size=8x8,scale=1/16"])
    assert f"calibration file {images / 'd002.png'}: not a picture Pillow can read" in line
    assert not Path(out).exists()


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The classifier partitioned twice each way: from 48 digit PNGs with --preprocess,
    and from the same digits as .npy without it."""
    tmp = tmp_path_factory.mktemp("pre")
    model = conv_classifier(tmp)
    pixels = digit_pixels(48)
    images = picture_folder(tmp / "png", pixels)
    arrays = npy_folder(tmp / "npy", pixels)
    spec = tmp / "digits.json"
    spec.write_text(json.dumps({"mode": "L", "size": [8, 8], "scale": 0.0625}))
    out: dict[str, Path] = {"model": model}
    int8 = ["--split", "c1", "--precision", "int8"]
    none = ["--split", "none", "--input-codec", "auto"]
    runs = {
        "png-int8": [
            *int8,
            "--calibration",
            str(images),
            "--preprocess",
            "mode=L,size=8x8,scale=1/16",
        ],
        "png-none": [*none, "--calibration", str(images), "--preprocess", str(spec)],  # JSON form
        "npy-int8": [*int8, "--calibration", str(arrays)],
        "npy-none": [*none, "--calibration", str(arrays)],
    }
    for name, argv in runs.items():
        out[name] = tmp / name
        assert partition([str(model), *argv, "-o", str(out[name]), "-q"]) == 0
    return out


@pytest.mark.integration
def test_png_calibration_equals_npy_calibration(packages: dict[str, Path]) -> None:
    import jsonschema

    schema = json.loads(SCHEMA_PATH.read_text())
    for name in ("int8", "none"):
        got, want = load_manifest(packages[f"png-{name}"]), load_manifest(packages[f"npy-{name}"])
        assert got.preprocessing == {"x": DIGITS}
        assert want.preprocessing == {}
        jsonschema.validate(
            json.loads((packages[f"png-{name}"] / "manifest.json").read_text()), schema
        )
        for a, b in zip(got.cuts, want.cuts, strict=True):
            assert (a.codec, a.quant, a.quality) == (b.codec, b.quant, b.quality)
    # the INT8 edge segments hold the calibrated scales: byte for byte the same
    got, want = load_manifest(packages["png-int8"]).cut, load_manifest(packages["npy-int8"]).cut
    assert got.edge is not None
    assert want.edge is not None
    assert got.edge.precision == "int8"
    assert got.edge.sha256 == want.edge.sha256
    none = load_manifest(packages["png-none"]).cut
    assert none.quant  # calibrated wire parameters were recorded and compared above


# -- the edge agent: picture bodies -----------------------------------------------------

ClientFactory = Callable[..., Any]


async def _agent(aiohttp_client: ClientFactory, package: Path) -> Any:
    from incloud import start_cloud

    from splitinfer.edge.agent import create_app
    from splitinfer.edge.config import EdgeConfig

    cfg = EdgeConfig(package=package, cloud=("http://cloud.invalid:1",))
    cloud = await start_cloud(package)
    app = create_app(cfg, transports=[cloud.transport()], warm_up=False)
    app.on_cleanup.append(lambda _: cloud.stop())  # the real cloud stops with the agent
    return await aiohttp_client(app)


async def _post(client: Any, body: bytes, ctype: str) -> tuple[int, bytes]:
    resp = await client.post("/v1/infer", data=body, headers={"Content-Type": ctype})
    return resp.status, await resp.read()


def _outputs(body: bytes) -> np.ndarray:
    with np.load(io.BytesIO(body)) as z:
        return np.asarray(z["y"])


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


@pytest.mark.integration
async def test_edge_agent_answers_a_picture_like_its_array(
    aiohttp_client: ClientFactory, packages: dict[str, Path]
) -> None:
    client = await _agent(aiohttp_client, packages["png-int8"])
    pixels = digit_pixels(3, offset=500)  # not calibration images
    for p in pixels:
        status, body = await _post(client, png(p), "image/png")
        assert status == 200, body
        status, ref = await _post(client, _npy((p / 16.0).astype(np.float32)[None, None]), "")
        assert status == 200, ref
        np.testing.assert_array_equal(_outputs(body), _outputs(ref))
    # a JPEG, sniffed without a Content-Type, answers like the pixels it decodes to
    jpeg = png(pixels[0] * 15, format="JPEG", quality=95)
    decoded = np.asarray(Image.open(io.BytesIO(jpeg)).convert("L"), dtype=np.float64)
    status, body = await _post(client, jpeg, "")
    assert status == 200, body
    status, ref = await _post(client, _npy((decoded / 16).astype(np.float32)[None, None]), "")
    np.testing.assert_allclose(_outputs(body), _outputs(ref), rtol=1e-6)
    status, body = await _post(client, b"\x89PNG\r\n\x1a\ncut short", "image/png")
    assert status == 400
    assert json.loads(body)["error"].startswith("image body: not a picture Pillow can read")


@pytest.mark.integration
async def test_edge_agent_refuses_pictures_without_preprocessing(
    aiohttp_client: ClientFactory, packages: dict[str, Path]
) -> None:
    client = await _agent(aiohttp_client, packages["npy-int8"])
    status, body = await _post(client, png(digit_pixels(1)[0]), "image/jpeg")
    assert status == 415
    error = json.loads(body)["error"]
    assert "declares no preprocessing" in error
    assert "--preprocess" in error


@pytest.mark.integration
@pytest.mark.slow
def test_split_auto_calibrates_from_pictures(tmp_path: Path) -> None:
    model = conv_classifier(tmp_path)
    images = picture_folder(tmp_path / "png", digit_pixels(40))
    out = tmp_path / "pkg"
    argv = [str(model), "--split", "auto", "--calibration", str(images), "-o", str(out), "-q"]
    profiles = ["--edge-profile", "jetson-orin-nano", "--cloud-profile", "l4"]
    assert partition([*argv, *profiles, "--preprocess", "mode=L,size=8x8,scale=1/16"]) == 0
    manifest = load_manifest(out)
    assert manifest.preprocessing == {"x": DIGITS}
    assert manifest.planning["calibration"] == str(images)
