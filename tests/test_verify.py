"""A package proves itself before it is written: a cut that answers differently is refused."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from graphs import f32, make, residual
from onnx import TensorProto, helper

from splitinfer.partitioner import pipeline
from splitinfer.partitioner.cli import main
from splitinfer.partitioner.pipeline import artifacts_for, prepare, write_package
from splitinfer.partitioner.verify import candidates_for, sample_feeds, verify
from splitinfer.shared.errors import PackageError

pytestmark = pytest.mark.unit


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "res.onnx"
    onnx.save(residual(), str(path))
    return path


def _swap_last_op(model: onnx.ModelProto, op: str) -> onnx.ModelProto:
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    broken.graph.node[-1].op_type = op
    return broken


def _append(model: onnx.ModelProto, make_node, elem: int, dims: list) -> onnx.ModelProto:
    """``y`` passed through one more node (``make_node(src, dst)``) and declared anew."""
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    g = broken.graph
    for node in g.node:
        node.output[:] = ["y_inner" if o == "y" else o for o in node.output]
    g.node.extend(make_node("y_inner", "y"))
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("y", elem, dims))
    return broken


def test_a_broken_cloud_segment_is_refused_naming_output_and_cut(
    model: Path, tmp_path: Path
) -> None:
    prepared = prepare(model)
    art = artifacts_for(prepared, prepared.space.find("c2"))
    assert art.cloud is not None
    art = replace(art, cloud=_swap_last_op(art.cloud, "Tanh"))  # was Sigmoid
    out = tmp_path / "pkg"
    with pytest.raises(PackageError, match=r"cut c2: output 'y' differs from the source"):
        write_package(prepared, [art], out)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["res.onnx"]  # no temporary folder left


def test_a_segment_of_the_wrong_shape_or_dtype_is_refused(model: Path, tmp_path: Path) -> None:
    prepared = prepare(model)
    art = artifacts_for(prepared, prepared.space.find("c3"))
    assert art.cloud is not None

    def unsqueeze(src: str, dst: str) -> list[onnx.NodeProto]:
        axes = helper.make_node(
            "Constant", [], ["ax"], value=helper.make_tensor("v", TensorProto.INT64, [1], [1])
        )
        return [axes, helper.make_node("Unsqueeze", [src, "ax"], [dst])]

    wide = _append(art.cloud, unsqueeze, TensorProto.FLOAT, ["N", 1, 4])
    with pytest.raises(PackageError, match=r"cut c3: output 'y' has shape \(1, 1, 4\) where"):
        write_package(prepared, [replace(art, cloud=wide)], tmp_path / "a")

    def cast(src: str, dst: str) -> list[onnx.NodeProto]:
        return [helper.make_node("Cast", [src], [dst], to=TensorProto.DOUBLE)]

    double = _append(art.cloud, cast, TensorProto.DOUBLE, ["N", 4])
    with pytest.raises(PackageError, match=r"cut c3: output 'y' is float64 where .* float32"):
        write_package(prepared, [replace(art, cloud=double)], tmp_path / "b")


def test_a_quantized_edge_is_held_to_shapes_and_its_plan_to_values(
    model: Path, tmp_path: Path
) -> None:
    prepared = prepare(model)
    art = artifacts_for(prepared, prepared.space.find("c2"))
    assert art.edge is not None
    # an "int8" edge may differ in value: allowed; the plan's fp32 segments are right
    lossy = replace(art, edge=_swap_last_op(art.edge, "Relu"), edge_precision="int8")
    write_package(prepared, [lossy], tmp_path / "ok")
    assert (tmp_path / "ok" / "manifest.json").exists()


def test_verification_runs_two_batches_and_a_second_size(tmp_path: Path) -> None:
    nodes = [helper.make_node("Relu", ["x"], ["y"])]
    m = make(nodes, [f32("x", ["N", "L"])], [f32("y", ["N", "L"])])
    onnx.save(m, str(tmp_path / "m.onnx"))
    prepared = prepare(tmp_path / "m.onnx", {"x": [1, 6]})
    shapes = [f["x"].shape for _, f in sample_feeds(prepared.source.model, prepared.analysis)]
    assert shapes == [(1, 6), (3, 6), (2, 12)]
    art = artifacts_for(prepared, prepared.space.find("none"))
    cands = candidates_for(prepared.analysis, art.plan, art.edge, art.cloud, True)
    assert verify(prepared.source.model, prepared.analysis, cands) == 3


def test_cli_refuses_with_one_line(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    real = pipeline.cloud_model

    def broken(analysis, plan):  # every cloud segment computes something else
        return _swap_last_op(real(analysis, plan), "Tanh")

    monkeypatch.setattr(pipeline, "cloud_model", broken)
    out = tmp_path / "pkg"
    assert main([str(model), "--split", "c2", "-o", str(out), "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("partition: error: cut c2: output 'y' differs from the source")
    assert not out.exists()
    np.testing.assert_equal(len(list(tmp_path.iterdir())), 1)
