"""``edge-agent profile`` measures what runs on the device: each cut's edge segment.

(It used to measure the whole graph, found in a cloud-only cut's cloud segment
when the package had one: the cloud's half, timed on the device.)
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from graphs import chain

from splitinfer.edge.cli import main
from splitinfer.edge.profile import edge_segments
from splitinfer.partitioner.pipeline import artifacts_for, prepare, write_package
from splitinfer.shared.nodeprofile import NodeProfile
from splitinfer.shared.package import open_package

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("edgeprofile")
    onnx.save(chain(6, width=16), str(tmp / "m.onnx"))
    prepared = prepare(tmp / "m.onnx")
    plans = prepared.space.plans()
    out = {}
    # split + cloud-only, two splits + cloud-only, cloud-only alone
    for name, cuts in (("split", (2, 0)), ("two", (1, 2, 0)), ("cloud", (0,))):
        out[name] = tmp / name
        write_package(prepared, [artifacts_for(prepared, plans[i]) for i in cuts], out[name])
    return out


def nodes_of(package: Path, *files: str) -> set[str]:
    return {n.name for f in files for n in onnx.load(str(package / f)).graph.node}


def profile(package: Path, out: Path) -> int:
    argv = ["profile", "--package", str(package), "-o", str(out), "--runs", "2", "--warmup", "1"]
    return main(argv)


def test_the_edge_segment_is_measured_and_the_cloud_only_cut_skipped(
    packages: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    package = packages["split"]
    out = tmp_path / "p.json"
    assert profile(package, out) == 0
    measured = NodeProfile.load(out)
    edge = nodes_of(package, "edge.onnx")
    cloud = nodes_of(package, "cloud.onnx")
    assert set(measured.nodes) == edge
    assert not set(measured.nodes) & cloud  # nothing of the cloud's half
    assert measured.source_sha256 == open_package(package).manifest.source_sha256
    captured = capsys.readouterr()
    assert f"{len(edge)} nodes of the edge segment(s) of cut(s) c2 (edge.onnx)" in captured.out
    assert captured.err.strip() == (
        "edge-agent profile: cut c0 (none) has no edge segment: skipped"
    )


def test_every_cuts_edge_segment_is_measured(
    packages: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    package = packages["two"]
    found, notes = edge_segments(open_package(package))
    files = [seg.file for _, seg in found]
    assert [cut_id for cut_id, _ in found] == ["c1", "c2"]
    assert notes == ["cut c0 (none) has no edge segment: skipped"]
    out = tmp_path / "p.json"
    assert profile(package, out) == 0
    measured = NodeProfile.load(out)
    assert set(measured.nodes) == nodes_of(package, *files)
    assert measured.meta["segments"] == ", ".join(files)
    assert "cut(s) c1 (edge.onnx), c2 (candidates/c2/edge.onnx)" in capsys.readouterr().out


def test_no_edge_segment_at_all_is_an_error(
    packages: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert profile(packages["cloud"], tmp_path / "p.json") == 2
    err = capsys.readouterr().err
    assert "cut c0 (none) has no edge segment: skipped" in err
    assert "edge-agent: error:" in err
    assert "no cut of this package has an edge segment" in err
    assert not (tmp_path / "p.json").exists()
