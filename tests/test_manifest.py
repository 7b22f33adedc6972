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
    assert manifest.segments["edge"].outputs == tuple(t.name for t in manifest.cut.tensors)
    assert manifest.segments["cloud"].inputs == tuple(t.name for t in manifest.cut.tensors)
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
        (lambda d: d.pop("cut"), r"manifest.cut: missing"),
        (lambda d: d["cut"].update(kind="half"), r"manifest.cut.kind: 'half'"),
        (lambda d: d["cut"]["tensors"][0].update(shape=[1.5]), r"tensors\[0\].shape"),
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
