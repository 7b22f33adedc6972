"""``edge-agent profile`` and the CLI's error handling (the daemon: test_edge_integration)."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from graphs import chain

from splitinfer.edge.cli import main
from splitinfer.edge.profile import profile_package, whole_model
from splitinfer.partitioner.pipeline import PackageExtras, artifacts_for, prepare, write_package
from splitinfer.shared.nodeprofile import NodeProfile
from splitinfer.shared.package import open_package

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("cli")
    onnx.save(chain(6, width=16), str(tmp / "m.onnx"))
    prepared = prepare(tmp / "m.onnx")
    plans = prepared.space.plans()
    out = {}
    for name, cuts, fallback in (
        ("split", (2,), False),
        ("none", (2, 0), False),
        ("full", (2,), True),
    ):
        out[name] = tmp / name
        write_package(
            prepared,
            [artifacts_for(prepared, plans[i]) for i in cuts],
            out[name],
            extras=PackageExtras(fallback=prepared.optimized if fallback else None),
        )
    out["nodes"] = tmp  # the optimized graph's node names, for comparison
    (tmp / "nodes.txt").write_text("\n".join(sorted(n.name for n in prepared.optimized.graph.node)))
    return out


def test_the_whole_graph_is_found(packages: dict[str, Path]) -> None:
    assert whole_model(open_package(packages["full"]))[1] == "full.onnx"
    assert whole_model(open_package(packages["none"]))[1].startswith("cut c0 (")
    segs, what = whole_model(open_package(packages["split"]))
    assert len(segs) == 2
    assert what == "cut c2 (edge.onnx + cloud.onnx)"


@pytest.mark.parametrize("which", ["split", "full"])
def test_the_whole_graph_profile_has_every_node_of_the_optimized_graph(
    packages: dict[str, Path], which: str, tmp_path: Path
) -> None:
    # what sim/ scales into a slower device; edge-agent profile measures the edge
    # segments instead (test_edge_profile_segments.py)
    out = tmp_path / "edge-profile.json"
    result = profile_package(packages[which], batch_sizes=(1, 2), runs=2, warmup=1, whole=True)
    result.profile.save(out)
    profile = NodeProfile.load(out)
    want = (packages["nodes"] / "nodes.txt").read_text().splitlines()
    assert sorted(profile.nodes) == want
    assert profile.batch_sizes == (1, 2)
    assert all(t >= 0 for t in profile.times[1].values())
    assert profile.source_sha256 == open_package(packages[which]).manifest.source_sha256


def test_profile_errors_are_one_line(
    packages: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["profile", "--package", str(tmp_path), "-o", str(tmp_path / "p.json")]) == 2
    assert "not a split package" in capsys.readouterr().err
    argv = ["profile", "--package", str(packages["split"]), "-o", str(tmp_path / "p.json")]
    assert main([*argv, "--batch", "one"]) == 2
    assert "--batch 'one': give batch sizes like 1,4" in capsys.readouterr().err
    assert main(["profile"]) == 2
    assert "required" in capsys.readouterr().err


def test_the_daemon_refuses_a_missing_package(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["--package", str(tmp_path / "nope"), "--cloud", "http://127.0.0.1:9"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("edge-agent: error: ")
    assert "not a split package" in err
