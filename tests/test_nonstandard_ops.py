"""Ops outside the default ONNX domain that the source model holds pass through untouched.

A tiny graph with ``com.microsoft::Gelu`` (ONNX Runtime's CPU provider runs it) between
standard ops goes through the passes, ``--list-cuts``, a fixed cut at fp32 and int8 and
the manifest; a pass that *adds* such an op is still refused, naming the source node;
the edge never gives such a segment to TensorRT; ``--skip-pass`` / ``--no-optimize``
choose the passes; ddddocr's ``common_old.onnx`` (``com.microsoft::DynamicQuantizeLSTM``)
lists its cuts and writes a package.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jsonschema
import numpy as np
import onnx
import pytest
from graphs import OPSET, f32, rand
from onnx import helper, numpy_helper
from ortutil import assert_close, compose, run

from splitinfer.edge.config import RuntimeConfig
from splitinfer.edge.runtime import CPU, CUDA, TENSORRT, DeviceInfo, select_providers
from splitinfer.partitioner import passes
from splitinfer.partitioner.cli import main
from splitinfer.partitioner.loader import load_model
from splitinfer.partitioner.passes import PASSES, optimize
from splitinfer.partitioner.pipeline import prepare
from splitinfer.partitioner.quantize import config_for, quantize_model
from splitinfer.partitioner.request import PartitionRequest
from splitinfer.shared.errors import ConfigError, ModelError, PackageError
from splitinfer.shared.manifest import SCHEMA_PATH, Segment, load_manifest

pytestmark = pytest.mark.unit

GELU = "com.microsoft::Gelu"


def gelu_model() -> onnx.ModelProto:
    """x -> Sigmoid a -> com.microsoft::Gelu g -> Tanh t -> MatMul m -> Relu r -> Sigmoid y."""
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["a"], name="sig_a"),
        helper.make_node("Gelu", ["a"], ["g"], name="gelu", domain="com.microsoft"),
        helper.make_node("Tanh", ["g"], ["t"], name="tanh_t"),
        helper.make_node("MatMul", ["t", "w"], ["m"], name="matmul"),
        helper.make_node("Relu", ["m"], ["r"], name="relu"),
        helper.make_node("Sigmoid", ["r"], ["y"], name="sig_y"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [f32("x", ["N", 8])],
        [f32("y", ["N", 8])],
        initializer=[numpy_helper.from_array(rand(8, 8, seed=1), "w")],
    )
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


@pytest.fixture
def model_path(tmp_path: Path) -> Path:
    path = tmp_path / "gelu.onnx"
    onnx.save(gelu_model(), str(path))
    return path


def feeds(batch: int = 3) -> dict[str, np.ndarray]:
    return {"x": rand(batch, 8, seed=7)}


def domains(model: onnx.ModelProto) -> dict[str, str]:
    return {n.op_type: n.domain for n in model.graph.node}


# -- the passes ---------------------------------------------------------------------------


def test_the_passes_keep_a_source_contrib_op_and_prepare_records_it(model_path: Path) -> None:
    source = load_model(model_path).model
    out, reports = optimize(source)
    assert [r.name for r in reports] == list(passes.DEFAULT_PIPELINE)
    assert domains(out)["Gelu"] == "com.microsoft"
    assert_close(run(out, feeds()), run(source, feeds()))
    prepared = prepare(model_path)
    assert prepared.nonstandard_ops == (GELU,)


def _contrib_tanh(model: onnx.ModelProto, beside: Path | None = None) -> onnx.ModelProto:
    """A bad pass: Tanh becomes a com.microsoft op, in place (as fuse_hardswish edits)."""
    for node in model.graph.node:
        if node.op_type == "Tanh":
            node.op_type, node.domain, node.name = "FastGelu", "com.microsoft", "fused"
    return model


def test_a_pass_that_adds_a_contrib_op_is_refused_naming_the_source_node(
    monkeypatch: pytest.MonkeyPatch, model_path: Path
) -> None:
    monkeypatch.setitem(PASSES, "fake", _contrib_tanh)
    with pytest.raises(ModelError) as err:
        optimize(load_model(model_path).model, ("ort_basic", "fake"))
    text = str(err.value)
    assert "pass 'fake' produced non-standard op com.microsoft::FastGelu" in text, text
    assert "source node 'tanh_t' (ai.onnx::Tanh)" in text, text
    assert "--skip-pass fake" in text
    assert "\n" not in text
    # the source's own Gelu alone is no reason to refuse
    assert "Gelu " not in text.replace("FastGelu", "")


def test_a_pass_that_renames_a_held_contrib_op_keeps_it(
    monkeypatch: pytest.MonkeyPatch, model_path: Path
) -> None:
    def rename_g(model: onnx.ModelProto, beside: Path | None = None) -> onnx.ModelProto:
        out = onnx.ModelProto()
        out.CopyFrom(model)
        for node in out.graph.node:
            node.input[:] = ["g2" if n == "g" else n for n in node.input]
            node.output[:] = ["g2" if n == "g" else n for n in node.output]
        return out

    monkeypatch.setitem(PASSES, "rename", rename_g)
    out, _ = optimize(load_model(model_path).model, ("rename",))
    assert [n.output[0] for n in out.graph.node if n.domain] == ["g2"]


# -- the partition command ----------------------------------------------------------------


def test_list_cuts_answers(model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(model_path), "--list-cuts", "--json", "-q"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["cuts"] if isinstance(doc, dict) else doc
    assert ["g"] in [r["tensors"] for r in rows]


@pytest.mark.parametrize(("cut", "edge_ops", "cloud_ops"), [("g", (GELU,), ()), ("a", (), (GELU,))])
def test_a_fixed_cut_composes_and_the_manifest_marks_the_segment(
    model_path: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    cut: str,
    edge_ops: tuple[str, ...],
    cloud_ops: tuple[str, ...],
) -> None:
    pkg = tmp_path / "pkg"
    assert main([str(model_path), "--split", cut, "-o", str(pkg), "-q"]) == 0, capsys.readouterr()
    manifest = load_manifest(pkg)
    c = manifest.cut
    assert c.edge is not None
    assert c.cloud is not None
    assert (c.edge.nonstandard_ops, c.cloud.nonstandard_ops) == (edge_ops, cloud_ops)
    assert c.edge.needs_onnxruntime == bool(edge_ops)
    assert_close(compose(pkg / "edge.onnx", pkg / "cloud.onnx", feeds()), run(model_path, feeds()))
    # absent rather than empty, so a package without such ops reads as before
    raw = json.loads((pkg / "manifest.json").read_text())["cuts"][0]
    held = "edge" if edge_ops else "cloud"
    assert raw[held]["nonstandard_ops"] == [GELU]
    assert "nonstandard_ops" not in raw["cloud" if edge_ops else "edge"]
    doc = json.loads((pkg / "manifest.json").read_text())
    jsonschema.validate(doc, json.loads(SCHEMA_PATH.read_text()))


def test_an_int8_edge_keeps_the_contrib_op_fp32(
    model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pkg = tmp_path / "pkg"
    argv = [str(model_path), "--split", "r", "--precision", "int8", "-o", str(pkg), "-q"]
    assert main(argv) == 0, capsys.readouterr()
    c = load_manifest(pkg).cut
    assert c.edge is not None
    assert c.edge.precision == "int8"
    assert c.edge.nonstandard_ops == (GELU,)
    edge = onnx.load(str(pkg / "edge.onnx"))
    ops = {n.op_type for n in edge.graph.node}
    assert "QuantizeLinear" in ops
    assert domains(edge)["Gelu"] == "com.microsoft"
    got = compose(pkg / "edge.onnx", pkg / "cloud.onnx", feeds())["y"]
    np.testing.assert_allclose(got, run(model_path, feeds())["y"], atol=0.05)


def test_quantizing_a_model_quantized_before_keeps_its_names_apart() -> None:
    """Names the quantizer also gives (``a_quantized``, a ``a_QuantizeLinear`` node), as a
    model dynamically quantized before holds them, no longer make two tensors of one name."""
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["a"], name="sig"),
        helper.make_node("Relu", ["a"], ["a_quantized"], name="a_QuantizeLinear"),
        helper.make_node("MatMul", ["a_quantized", "w"], ["m"], name="mm"),
        helper.make_node("Add", ["m", "a"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [f32("x", ["N", 8])],
        [f32("y", ["N", 8])],
        initializer=[numpy_helper.from_array(rand(8, 8, seed=2), "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    samples = [{"x": rand(4, 8, seed=s)} for s in range(4)]
    out = quantize_model(model, samples, config_for("cpu"))
    assert any(n.op_type == "QuantizeLinear" for n in out.graph.node)
    np.testing.assert_allclose(
        run(out, feeds())["y"], run(model, feeds())["y"], rtol=0.05, atol=0.05
    )


# -- --skip-pass and --no-optimize --------------------------------------------------------


def test_skip_pass_and_no_optimize_choose_the_passes(
    model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    req = PartitionRequest.from_argv([str(model_path), "--list-cuts", "--skip-pass", "onnxslim"])
    assert req.passes == ("ort_basic", "fuse_hardswish")
    argv = [str(model_path), "--list-cuts", "--skip-pass", "ort_basic", "--skip-pass", "onnxslim"]
    assert PartitionRequest.from_argv(argv).passes == ("fuse_hardswish",)
    req = PartitionRequest.from_argv([str(model_path), "--list-cuts", "--no-optimize"])
    assert req.passes == ()
    assert [r.name for r in prepare(model_path, passes=req.passes).passes] == []
    pkg = tmp_path / "pkg"
    argv = [str(model_path), "--split", "g", "-o", str(pkg), "--skip-pass", "onnxslim", "-q"]
    assert main(argv) == 0, capsys.readouterr()
    assert load_manifest(pkg).optimization["passes"] == ["ort_basic", "fuse_hardswish"]
    assert main([str(model_path), "--list-cuts", "--no-optimize"]) == 0
    assert "optimizing (no passes)" in capsys.readouterr().err


def test_an_unknown_pass_is_one_line_and_exit_2(
    model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(model_path), "--list-cuts", "--skip-pass", "bogus", "-q"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "--skip-pass 'bogus'" in lines[0]
    assert "ort_basic, fuse_hardswish, onnxslim" in lines[0]
    with pytest.raises(ConfigError, match="--no-optimize"):
        PartitionRequest.from_argv(
            [str(model_path), "--list-cuts", "--no-optimize", "--skip-pass", "onnxslim"]
        )


# -- the manifest and the edge ------------------------------------------------------------

CONTRIB = Segment("edge.onnx", "ab" * 32, ("x",), ("t",), 3, "fp32", (GELU,))
JETSON = DeviceInfo(jetson=True, gpu_name="NVIDIA Jetson Orin Nano", tensorrt_version="10.3.0")


def test_the_segment_field_round_trips_and_is_checked() -> None:
    data = {"file": "e.onnx", "sha256": "ab" * 32, "inputs": ["x"], "outputs": ["t"], "nodes": 3}
    assert Segment.from_dict(data, "s").nonstandard_ops == ()
    got = Segment.from_dict({**data, "nonstandard_ops": [GELU]}, "s")
    assert got.nonstandard_ops == (GELU,)
    assert got.needs_onnxruntime
    with pytest.raises(PackageError, match="nonstandard_ops"):
        Segment.from_dict({**data, "nonstandard_ops": ["Gelu"]}, "s")


@pytest.mark.parametrize(
    ("available", "config", "want"),
    [
        ([TENSORRT, CUDA, CPU], RuntimeConfig(), [CUDA, CPU]),  # auto on a Jetson
        ([TENSORRT, CPU], RuntimeConfig(), [CPU]),
        ([TENSORRT, CUDA, CPU], RuntimeConfig(providers=("tensorrt",)), [CUDA, CPU]),
    ],
)
def test_the_edge_never_gives_such_a_segment_to_tensorrt(
    available: list[str],
    config: RuntimeConfig,
    want: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="splitinfer.edge.runtime"):
        got = select_providers(available, JETSON, config, CONTRIB, Path("/cache"))
    assert [n for n, _ in got] == want
    (line,) = [r.getMessage() for r in caplog.records]
    assert "TensorRT cannot run com.microsoft::Gelu" in line
    assert "\n" not in line
    with pytest.raises(ConfigError, match=r"TensorRT cannot run com\.microsoft::Gelu"):
        select_providers(available, JETSON, config, CONTRIB, Path("/cache"), strict=True)


# -- as shipped: ddddocr's common_old.onnx ------------------------------------------------


def _common_old() -> Path:
    ddddocr = pytest.importorskip("ddddocr", reason="the demo extra brings ddddocr's models")
    path = Path(ddddocr.__file__).parent / "common_old.onnx"
    if not path.is_file():
        pytest.skip("this ddddocr has no common_old.onnx")
    return path


@pytest.mark.slow
def test_common_old_lists_its_cuts_and_writes_a_package(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = str(_common_old())
    shape = ["--input-shape", "input1=1x1x64x256", "-q"]
    assert main([src, "--list-cuts", *shape]) == 0, capsys.readouterr().err
    assert "c5" in capsys.readouterr().out
    pkg = tmp_path / "pkg"
    assert main([src, "--split", "c5", "-o", str(pkg), *shape]) == 0, capsys.readouterr().err
    c = load_manifest(pkg).cut
    assert c.cloud is not None
    assert c.cloud.nonstandard_ops == ("com.microsoft::DynamicQuantizeLSTM",)


@pytest.mark.slow
def test_common_old_int8_edges(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """At int8 both an edge with the LSTM (all edge) and one without; ``common_old`` was
    quantized dynamically before, so its names are ones ORT's quantizer also gives.
    ORT's symbolic shape inference fails on the LSTM and dumps the model into the
    working folder (``sym_shape_infer_temp.onnx``, ``<uuid>.data``): never the user's."""
    src = str(_common_old())
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    for cut in ("c20", "all"):
        pkg = tmp_path / cut
        argv = [src, "--split", cut, "--precision", "int8", "-o", str(pkg)]
        assert main([*argv, "--input-shape", "input1=1x1x64x256", "-q"]) == 0, (
            capsys.readouterr().err
        )
        c = load_manifest(pkg).cut
        assert c.edge is not None
        assert c.edge.precision == "int8"
    assert c.edge.nonstandard_ops == ("com.microsoft::DynamicQuantizeLSTM",)
    assert list(cwd.iterdir()) == []
