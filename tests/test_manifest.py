"""The manifest: its JSON schema, versioning and field-by-field validation."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import onnx
import pytest
from graphs import residual

from splitinfer.partitioner.cli import main
from splitinfer.shared.errors import PackageError
from splitinfer.shared.manifest import (
    FORMAT_VERSION,
    SCHEMA_PATH,
    Manifest,
    is_package,
    load_manifest,
)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("pkg")
    onnx.save(residual(), str(tmp / "res.onnx"))
    assert main([str(tmp / "res.onnx"), "--split", "c2", "-o", str(tmp / "pkg"), "-q"]) == 0
    return tmp / "pkg"


def raw(package: Path) -> dict:
    return json.loads((package / "manifest.json").read_text())


def test_written_manifest_matches_the_schema(package: Path) -> None:
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(raw(package), schema)


def test_round_trip(package: Path) -> None:
    manifest = load_manifest(package)
    assert Manifest.from_dict(json.loads(manifest.to_json())) == manifest
    assert manifest.format_version == FORMAT_VERSION
    cut = manifest.cut
    assert cut.edge is not None
    assert cut.cloud is not None
    assert cut.edge.outputs == tuple(t.name for t in cut.tensors)
    assert cut.cloud.inputs == tuple(t.name for t in cut.tensors)
    assert (cut.edge.file, cut.cloud.file) == ("edge.onnx", "cloud.onnx")
    assert manifest.cut_ids == ("c2",)
    assert manifest.optimization["nodes_before"] == 4
    assert len(manifest.source_sha256) == 64
    assert is_package(package)


def test_newer_format_version_is_refused(package: Path) -> None:
    data = raw(package)
    data["format_version"] = FORMAT_VERSION + 1
    with pytest.raises(PackageError, match="newer than this splitinfer understands"):
        Manifest.from_dict(data)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(format="something-else"), "manifest.format is 'something-else'"),
        (lambda d: d.pop("cuts"), r"manifest.cuts: missing"),
        (lambda d: d.update(cuts=[]), r"manifest.cuts: a package holds at least one cut"),
        (lambda d: d.update(default_cut="c9"), r"manifest.default_cut: 'c9' is not among"),
        (lambda d: d["cuts"].append(d["cuts"][0]), r"manifest.cuts: duplicate cut ids"),
        (lambda d: d["cuts"][0].update(kind="half"), r"manifest.cuts\[0\].kind: 'half'"),
        (lambda d: d["cuts"][0].update(edge=None), r"manifest.cuts\[0\].edge: missing"),
        (lambda d: d["cuts"][0]["tensors"][0].update(shape=[1.5]), r"tensors\[0\].shape"),
        (lambda d: d["cuts"][0]["edge"].update(file="../x.onnx"), r"edge.file: '../x.onnx' must"),
        (lambda d: d["cuts"][0]["cloud"].update(file="/etc/x"), r"cloud.file: '/etc/x' must"),
        (lambda d: d["cuts"][0]["codec"].update(name="gzip"), r"codec.name: 'gzip'"),
        (
            lambda d: d["cuts"][0].update(sample_shapes={"t": [4, -1]}),
            r"cuts\[0\].sample_shapes.t: \[4, -1\] is not a list of sizes",
        ),
        (lambda d: d.update(privacy={"epsilon": 1}), r"manifest.privacy.delta"),
        (lambda d: d.update(opset="20"), r"manifest.opset: expected int"),
        (lambda d: d.update(format_version=True), "not a positive integer"),
    ],
)
def test_malformed_fields_name_the_field(package: Path, mutate, message: str) -> None:
    data = raw(package)
    mutate(data)
    with pytest.raises(PackageError, match=message):
        Manifest.from_dict(data)


def test_not_a_package(tmp_path: Path) -> None:
    with pytest.raises(PackageError, match="not a split package"):
        load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(PackageError, match="not valid JSON"):
        load_manifest(tmp_path)
    assert not is_package(tmp_path)


def test_format_1_manifests_are_still_read(package: Path) -> None:
    v2 = raw(package)
    cut = v2["cuts"][0]
    v1 = {k: v for k, v in v2.items() if k not in {"cuts", "default_cut", "fallback", "privacy"}}
    v1["format_version"] = 1
    v1["precision"] = {"edge": "fp32", "cloud": "fp32"}
    v1["segments"] = {"edge": cut.pop("edge"), "cloud": cut.pop("cloud")}
    for seg in v1["segments"].values():
        seg.pop("precision")
    for key in ("codec", "quant", "predicted", "quality"):
        cut.pop(key)
    v1["cut"] = cut
    manifest = Manifest.from_dict(v1)
    assert manifest.format_version == FORMAT_VERSION
    assert manifest.cut.id == "c2"
    assert manifest.cut.edge == load_manifest(package).cut.edge
    assert manifest.cut.codec.name == "raw"


def test_several_candidate_cuts_each_get_their_own_segments(tmp_path: Path) -> None:
    from splitinfer.partitioner.pipeline import prepare, write_package

    onnx.save(residual(), str(tmp_path / "res.onnx"))
    prepared = prepare(tmp_path / "res.onnx")
    plans = [prepared.space.find(c) for c in ("c2", "none", "all")]
    manifest = write_package(prepared, plans, tmp_path / "pkg")
    assert manifest.default_cut == "c2"
    assert load_manifest(tmp_path / "pkg") == manifest
    none, every = manifest.find_cut(plans[1].id), manifest.find_cut(plans[2].id)
    assert none is not None
    assert every is not None
    assert none.kind == "none"
    assert none.edge is None
    assert every.cloud is None
    for cut in manifest.cuts:
        for seg in cut.segments():
            assert (tmp_path / "pkg" / seg.file).is_file()
    assert none.cloud is not None
    assert none.cloud.file == f"candidates/{none.id}/cloud.onnx"
    jsonschema.validate(raw(tmp_path / "pkg"), json.loads(SCHEMA_PATH.read_text()))
