"""The `partition` command: tables, packages, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from graphs import f32, make, rand, residual
from onnx import helper
from ortutil import assert_close, compose, run

from splitinfer.partitioner.cli import main
from splitinfer.shared.errors import ConfigError
from splitinfer.shared.manifest import load_manifest

pytestmark = pytest.mark.unit


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "res.onnx"
    onnx.save(residual(), str(path))
    return path


def error_of(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main([*argv, "-q"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("partition: error: ")
    assert "Traceback" not in err
    return lines[0]


def test_list_cuts_table_reports_node_counts(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(model), "--list-cuts", "-q"]) == 0
    out = capsys.readouterr().out
    assert "nodes: 4 -> 4 after optimization" in out
    assert "valid cuts: 5" in out
    assert "a, b" in out


def test_list_cuts_json(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(model), "--list-cuts", "--json", "-q"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["format"], doc["valid_cuts"], doc["exact"], doc["note"]) == (1, 5, True, None)
    rows = doc["cuts"]
    assert [r["id"] for r in rows] == ["c0", "c1", "c2", "c3", "c4"]
    for row in rows:
        assert {"id", "tensors", "bytes_per_sample", "edge_flops", "cloud_flops"} <= set(row)
    assert next(r for r in rows if r["tensors"] == ["a", "b"])["bytes_per_sample"] == 32


def test_split_writes_a_package_that_composes(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "pkg"
    assert main([str(model), "--split", "a,b", "-o", str(out), "-q"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["cloud.onnx", "edge.onnx", "manifest.json"]
    manifest = load_manifest(out)
    assert [t.name for t in manifest.cut.tensors] == ["a", "b"]
    assert manifest.cut.tensors[0].shape == ("N", 4)
    assert manifest.batch_dim == "N"
    feeds = {"x": rand(4, 4)}
    assert_close(compose(out / "edge.onnx", out / "cloud.onnx", feeds), run(model, feeds))
    # splitting again into the same package replaces it
    assert main([str(model), "--split", "none", "-o", str(out), "-q"]) == 0
    assert load_manifest(out).cut.kind == "none"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".pkg")]


def test_not_onnx(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "notes.onnx"
    bad.write_text("this is not a model\n" * 10)
    assert "not an ONNX model" in error_of(capsys, [str(bad), "--list-cuts"])


def test_truncated_file(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(model.read_bytes()[: len(model.read_bytes()) // 2])
    assert "not an ONNX model" in error_of(capsys, [str(cut), "--list-cuts"])


def test_empty_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    assert "not an ONNX model" in error_of(capsys, [str(empty), "--list-cuts"])


def test_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "no such file" in error_of(capsys, [str(tmp_path / "gone.onnx"), "--list-cuts"])


def test_model_failing_the_checker(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    node = helper.make_node("Relu", ["undefined_tensor"], ["y"])
    graph = helper.make_graph([node], "g", [f32("x", ["N", 2])], [f32("y", ["N", 2])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "bad.onnx"
    path.write_bytes(m.SerializeToString())
    assert "fails the ONNX checker" in error_of(capsys, [str(path), "--list-cuts"])


def test_missing_external_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = make(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [f32("x", ["N", 64])],
        [f32("y", ["N", 64])],
        {"w": rand(64, 64)},
    )
    path = tmp_path / "ext.onnx"
    onnx.save(m, str(path), save_as_external_data=True, location="ext.bin", size_threshold=0)
    (tmp_path / "ext.bin").unlink()
    line = error_of(capsys, [str(path), "--list-cuts"])
    assert "external data file 'ext.bin'" in line
    assert "missing" in line


def test_unknown_cut_writes_nothing(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "pkg"
    assert "unknown cut 'c42'" in error_of(capsys, [str(model), "--split", "c42", "-o", str(out)])
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [model]


def test_cut_that_does_not_separate(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = error_of(capsys, [str(model), "--split", "b", "-o", str(tmp_path / "pkg")])
    assert "do not separate the graph" in line


def test_existing_folder_that_is_not_a_package(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "photos"
    out.mkdir()
    (out / "cat.jpg").write_bytes(b"\xff\xd8")
    line = error_of(capsys, [str(model), "--split", "c2", "-o", str(out)])
    assert "is not a split package; refusing to overwrite it" in line
    assert [p.name for p in out.iterdir()] == ["cat.jpg"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--list-cuts", "--input-shape", "x=1x4x4"], "rank 3 given"),
        (["--list-cuts", "--input-shape", "y=1x4"], "unknown input 'y'"),
        (["--list-cuts", "--input-shape", "x=1by4"], "expected NAME=DxDxD"),
        (["--split", "c1"], "--split needs -o/--output DIR"),
        (["--list-cuts", "--precision", "int8"], "--precision and --edge-fallback go with --split"),
        (["--split", "c1", "--precision", "int4"], "invalid choice: 'int4'"),
        ([], "one of the arguments --list-cuts --split is required"),
        (["--list-cuts", "--max-cuts", "0"], "--max-cuts must be at least 1"),
    ],
)
def test_bad_flags(
    model: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert message in error_of(capsys, [str(model), *extra])


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--rtt", "-5ms"),
        ("--max-latency", "-80ms"),
        ("--uplink", "-5mbit"),
        ("--downlink", "-1.5Mbit/s"),
        ("--edge-memory", "-512MB"),
    ],
)
def test_negative_values_say_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    """Refused by name before the model is read (it does not exist here)."""
    argv = [str(tmp_path / "never-read.onnx"), "--split", "auto", "-o", "o", f"{flag}={value}"]
    assert error_of(capsys, argv) == (
        f"partition: error: {flag}: must not be negative (got {value})"
    )


def test_the_request_is_built_and_checked_before_the_model_is_read(tmp_path: Path) -> None:
    """Flag rules live in PartitionRequest: a bad combination fails without a model."""
    import dataclasses

    from splitinfer.partitioner.request import PartitionRequest

    gone = str(tmp_path / "never-read.onnx")
    req = PartitionRequest.from_argv([gone, "--split", "auto", "-o", "out", "--uplink", "1mbit"])
    assert (req.auto, req.edge_precision, req.uplink, req.candidates) == (True, "int8", "1mbit", 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.split = "c1"  # type: ignore[misc]
    fixed = PartitionRequest.from_argv([gone, "--split", "c1", "-o", "o", "--precision", "int8",
                                        "--edge-profile", "jetson-orin-nano"])  # fmt: skip
    assert (fixed.edge_precision, fixed.edge_profile) == ("int8", "jetson-orin-nano")
    for argv, message in (
        (["--split", "c1", "-o", "o", "--epsilon", "1"], "--epsilon go(es) with --split auto"),
        (["--split", "auto", "-o", "o", "--clip", "1"], "privacy needs both --epsilon and --clip"),
        (["--split", "auto", "-o", "o", "--edge-memory", "lots"], "--edge-memory 'lots'"),
        (["--list-cuts", "--split", "c1"], "--list-cuts and --split go one at a time"),
        (["--list-cuts", "--preprocess", "mode=L"], "--preprocess goes with --split"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            PartitionRequest.from_argv([gone, *argv])


@pytest.mark.integration
def test_console_script_exit_code_and_single_line(model: Path, tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("partition")
    proc = subprocess.run(
        [str(exe), str(model), "--split", "c9", "-o", str(tmp_path / "p")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "partition: error: unknown cut 'c9': ids run from c0 to c4"
    )
    assert "Traceback" not in proc.stderr
    ok = subprocess.run(
        [str(exe), str(model), "--list-cuts", "--json", "-q"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert len(json.loads(ok.stdout)["cuts"]) == 5
