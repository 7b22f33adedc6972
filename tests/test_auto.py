"""`partition --split auto`: the choice, the INT8 edge, candidates, privacy and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import onnx
import pytest
from graphs import f32, make, rand
from onnx import helper
from ortutil import run

from splitinfer.partitioner.cli import main
from splitinfer.shared.manifest import SCHEMA_PATH, load_manifest
from splitinfer.shared.package import open_package

pytestmark = pytest.mark.integration

FIXED = ["--edge-profile", "raspberry-pi-5", "--cloud-profile", "l4"]


@pytest.fixture(scope="module")
def calib(zoo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """48 samples of the chain model's input as one .npy batch."""
    out = tmp_path_factory.mktemp("calib")
    rng = np.random.default_rng(0)
    np.save(out / "batch.npy", rng.standard_normal((48, 3, 16, 16)).astype(np.float32))
    return out


def partition(*argv: str) -> int:
    return main([*argv, "-q"])


def test_auto_writes_a_valid_int8_package_that_reproduces_the_model(
    zoo_dir: Path, calib: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "pkg"
    model = zoo_dir / "chain.onnx"
    args = [str(model), "--split", "auto", "-o", str(out), "--calibration", str(calib)]
    assert partition(*args, *FIXED, "--uplink", "1gbit", "--rtt", "1ms") == 0
    captured = capsys.readouterr()
    assert "warning" not in captured.err
    assert "chose c" in captured.out
    raw = json.loads((out / "manifest.json").read_text())
    jsonschema.validate(raw, json.loads(SCHEMA_PATH.read_text()))
    pkg = open_package(out)
    m = pkg.manifest
    cut = m.cut
    assert m.planning["table"]
    assert m.planning["cut_search"] == {"method": "exhaustive", "cuts": m.planning["cuts_costed"]}
    assert f"cut search: exhaustive over {m.planning['cuts_costed']} cuts" in captured.out
    assert m.planning["calibration"] == str(calib)
    assert cut.predicted["cut_id"] == cut.id
    # the chosen cut is the best of the table by predicted total
    best = min(m.planning["table"], key=lambda r: r["total_ms"])
    assert best["cut"] == cut.id
    assert cut.quality["samples"] > 0
    x = np.random.default_rng(9).standard_normal((8, 3, 16, 16)).astype(np.float32)
    want = run(model, {"x": x})["logits"]
    if cut.edge is not None:
        assert cut.edge.precision == "int8"
        edge = onnx.load(str(pkg.file(cut.edge)))
        assert any(n.op_type == "QuantizeLinear" for n in edge.graph.node)
        moved = run(edge, {"x": x})
    else:
        moved = {"x": x}
    got = (run(onnx.load(str(pkg.file(cut.cloud))), moved) if cut.cloud else moved)["logits"]
    agree = np.mean(np.argmax(got, 1) == np.argmax(want, 1))
    assert agree >= 0.75  # random-weight logits are close together; int8 keeps most top-1


def slow_device_profile(model: Path, out: Path, factor: float) -> Path:
    """A measured profile of this machine, made ``factor`` times slower: a weak device."""
    from dataclasses import replace

    from splitinfer.partitioner.pipeline import prepare
    from splitinfer.partitioner.profiler import measure_nodes

    prepared = prepare(model)
    x = np.random.default_rng(0).standard_normal((1, 3, 16, 16)).astype(np.float32)
    prof = measure_nodes(
        prepared.analysis.model,
        lambda b: {"x": np.repeat(x, b, 0)},
        runs=3,
        warmup=1,
        analysis=prepared.analysis,
        source_sha256=prepared.source.sha256,
    )
    slow = replace(
        prof,
        device="a weak device",
        times={b: {k: v * factor for k, v in t.items()} for b, t in prof.times.items()},
        wall={b: w * factor for b, w in prof.wall.items()},
    )
    slow.save(out)
    return out


def test_the_link_moves_the_cut(zoo_dir: Path, calib: Path, tmp_path: Path) -> None:
    model = zoo_dir / "resnet.onnx"
    weak = slow_device_profile(model, tmp_path / "weak.json", factor=1000.0)
    base = [str(model), "--split", "auto", "--calibration", str(calib), "--precision", "fp32"]
    base += ["--edge-profile", str(weak), "--cloud-profile", "l4"]
    # a device 1000x slower than this CPU: on a fast link the work goes to the cloud ...
    assert partition(*base, "-o", str(tmp_path / "fast"), "--uplink", "10gbit", "--rtt", "1ms") == 0
    fast = load_manifest(tmp_path / "fast")
    # ... on a crawling uplink nothing is worth sending
    assert partition(*base, "-o", str(tmp_path / "slow"), "--uplink", "1kbit") == 0
    slow = load_manifest(tmp_path / "slow")
    assert slow.cut.kind == "all"
    assert fast.cut.kind != "all"
    assert fast.cut.edge_flops < slow.cut.edge_flops
    assert fast.planning["edge_profile"] == str(weak)


def test_cuts_that_cannot_win_even_sending_nothing_are_not_built(
    zoo_dir: Path, calib: Path, tmp_path: Path
) -> None:
    """On a crawling uplink the all-edge cut is measured first; every other shortlisted
    cut needs the round trip at least, so none is built, and the table still lists them
    at their predicted cost (none below the chosen cut)."""
    out = tmp_path / "pkg"
    args = [str(zoo_dir / "chain.onnx"), "--split", "auto", "-o", str(out), *FIXED]
    assert partition(*args, "--calibration", str(calib), "--uplink", "1kbit", "--rtt", "2s") == 0
    m = load_manifest(out)
    assert m.cut.kind == "all"
    skipped = m.planning["cuts_not_built"]
    assert skipped
    assert m.cut.id not in skipped
    assert m.planning["cuts_built"] == 1
    table = {r["cut"]: r["total_ms"] for r in m.planning["table"]}
    assert set(skipped) <= set(table)
    assert min(table, key=lambda c: table[c]) == m.cut.id
    assert any("not built: even sending nothing" in n for n in m.planning["notes"])


def test_candidates_are_complete_pairs(zoo_dir: Path, calib: Path, tmp_path: Path) -> None:
    out = tmp_path / "pkg"
    args = [str(zoo_dir / "chain.onnx"), "--split", "auto", "-o", str(out)]
    assert partition(*args, "--calibration", str(calib), *FIXED, "--candidates", "3") == 0
    pkg = open_package(out)
    assert len(pkg.manifest.cuts) == 3
    assert len(set(pkg.manifest.cut_ids)) == 3
    for cut in pkg.manifest.cuts:
        assert cut.predicted["cut_id"] == cut.id
        for seg in cut.segments():
            assert pkg.file(seg).is_file()
    # the shortlist was screened on the whole INT8 model; every packaged cut was then
    # built as its own INT8 segment and measured (quality on the held-out samples)
    planning = pkg.manifest.planning
    assert planning["cuts_screened"] >= planning["cuts_built"] >= 3
    assert any("screened on the whole int8 model" in n for n in planning["notes"])
    for cut in pkg.manifest.cuts:
        assert cut.quality["samples"] > 0
        if cut.edge is not None:
            assert cut.edge.precision == "int8"
            edge = onnx.load(str(pkg.file(cut.edge)))
            assert any(n.op_type == "QuantizeLinear" for n in edge.graph.node), cut.id


def test_privacy_and_bottleneck_are_recorded(zoo_dir: Path, calib: Path, tmp_path: Path) -> None:
    out = tmp_path / "pkg"
    args = [str(zoo_dir / "chain.onnx"), "--split", "auto", "-o", str(out), *FIXED]
    args += ["--calibration", str(calib), "--uplink", "1gbit", "--rtt", "1ms"]
    assert partition(*args, "--epsilon", "8", "--clip", "4", "--bottleneck", "8") == 0
    m = load_manifest(out)
    assert m.privacy is not None
    assert m.privacy.epsilon == 8.0
    assert m.privacy.noise_multiplier > 0
    for cut in m.cuts:
        if cut.kind != "all":
            assert "private" in cut.quality


def test_min_agreement_failure_names_the_worst_layers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a conv stack whose output is a feature map: int8 cosine agreement is never exactly 1
    nodes, inits, prev = [], {}, "x"
    for i in range(3):
        inits[f"w{i}"] = rand(8, 8 if i else 3, 3, 3, seed=i)
        nodes += [
            helper.make_node(
                "Conv", [prev, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1], name=f"conv{i}"
            ),
            helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}"),
        ]
        prev = f"r{i}"
    nodes.append(helper.make_node("Identity", [prev], ["y"]))
    model = make(nodes, [f32("x", ["N", 3, 8, 8])], [f32("y", ["N", 8, 8, 8])], inits)
    path = tmp_path / "convs.onnx"
    onnx.save(model, str(path))
    argv = [str(path), "--split", "auto", "-o", str(tmp_path / "p"), "--uplink", "1kbit", "-q"]
    assert main([*argv, "--min-agreement", "1.0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("partition: error: cut c")
    assert "below --min-agreement 1.0" in err
    assert "worst layers:" in err
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--epsilon", "0", "--clip", "1"], "--epsilon 0.0: must be a finite number > 0"),
        (["--epsilon", "1", "--clip", "1", "--delta", "1"], r"--delta 1.0: must be in \(0, 1\)"),
        (["--epsilon", "1"], "privacy needs both --epsilon and --clip"),
        (["--calibration", "/nonexistent/calib"], "/nonexistent/calib"),
        (["--edge-profile", "jetson-orin-mega"], "unknown edge profile 'jetson-orin-mega'"),
        (["--uplink", "5kbps"], "kbps"),
        (["--edge-memory", "lots"], "--edge-memory 'lots'"),
        (["--candidates", "0"], "--candidates 0: must be at least 1"),
        (["--min-agreement", "1.5"], r"--min-agreement 1.5: must be in \(0, 1\]"),
    ],
)
def test_bad_auto_input_is_one_line_exit_2(
    zoo_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list, message: str
) -> None:
    argv = [str(zoo_dir / "chain.onnx"), "--split", "auto", "-o", str(tmp_path / "p"), *extra]
    assert main([*argv, "-q"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("partition: error: ")
    import re

    assert re.search(message, last), last
    assert not (tmp_path / "p").exists()


def test_bad_profile_and_trace_files(
    zoo_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "profile.json"
    bad.write_text("{not json")
    trace = tmp_path / "up.trace"
    trace.write_text("5\n3\n")
    model = str(zoo_dir / "chain.onnx")
    for extra in (["--edge-profile", str(bad)], ["--trace", str(trace)]):
        assert main([model, "--split", "auto", "-o", str(tmp_path / "p"), *extra, "-q"]) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("partition: error: ")
        assert str(bad if "--edge-profile" in extra else trace) in last


def test_auto_only_flags_are_refused_with_a_fixed_cut(
    zoo_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(zoo_dir / "chain.onnx"), "--split", "c1", "-o", str(tmp_path / "p")]
    assert main([*argv, "--candidates", "2", "-q"]) == 2
    assert "--candidates go(es) with --split auto" in capsys.readouterr().err


def _zero_point_types(path: Path) -> set[int]:
    model = onnx.load(str(path))
    inits = {t.name: t.data_type for t in model.graph.initializer}
    return {inits[n.input[2]] for n in model.graph.node if n.op_type == "QuantizeLinear"}


def test_fixed_cut_int8_takes_the_recipe_of_the_edge_profile(
    zoo_dir: Path, calib: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--split CUT --precision int8 --edge-profile P``: the INT8 recipe ``--split auto``
    would use for P (TensorRT's symmetric int8 for a Jetson, the CPU's uint8 otherwise)."""
    base = [str(zoo_dir / "chain.onnx"), "--split", "c2", "--precision", "int8"]
    base += ["--calibration", str(calib)]
    recipes = {}
    for name, profile in (("trt", ["--edge-profile", "jetson-orin-nano"]), ("cpu", [])):
        out = tmp_path / name
        assert partition(*base, "-o", str(out), *profile) == 0
        pkg = open_package(out)
        assert pkg.manifest.cut.edge is not None
        recipes[name] = _zero_point_types(pkg.file(pkg.manifest.cut.edge))
    assert recipes == {"trt": {onnx.TensorProto.INT8}, "cpu": {onnx.TensorProto.UINT8}}
    fp32 = [str(zoo_dir / "chain.onnx"), "--split", "c2", "-o", str(tmp_path / "x")]
    assert main([*fp32, "--edge-profile", "jetson-orin-nano", "-q"]) == 2
    assert "--edge-profile with a fixed --split goes with --precision int8" in (
        capsys.readouterr().err
    )


def test_fixed_cut_int8_and_fallback(zoo_dir: Path, calib: Path, tmp_path: Path) -> None:
    out = tmp_path / "pkg"
    argv = [str(zoo_dir / "chain.onnx"), "--split", "c2", "-o", str(out), "--precision", "int8"]
    assert partition(*argv, "--calibration", str(calib), "--edge-fallback") == 0
    pkg = open_package(out)
    assert pkg.manifest.cut.edge is not None
    assert pkg.manifest.cut.edge.precision == "int8"
    assert pkg.manifest.fallback is not None
    x = np.random.default_rng(3).standard_normal((2, 3, 16, 16)).astype(np.float32)
    full = run(onnx.load(str(pkg.file(pkg.manifest.fallback))), {"x": x})["logits"]
    np.testing.assert_allclose(full, run(zoo_dir / "chain.onnx", {"x": x})["logits"], atol=1e-4)
