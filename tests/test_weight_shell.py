"""Large weights held beside the graph: the checker, shape inference and the ONNX Runtime
runs see what they saw with the weights in place."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from graphs import f32, make
from onnx import helper, numpy_helper

from splitinfer.partitioner.analysis import analyse
from splitinfer.partitioner.loader import BIG_INITIALIZER, WeightShell, load_model
from splitinfer.partitioner.passes import PASSES
from splitinfer.shared.errors import ModelError

pytestmark = pytest.mark.unit


def _model(rows: int = 64) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((rows, rows)).astype(np.float32)
    inits = {"w": w, "b": np.ones(rows, np.float32)}
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["a"]),
        helper.make_node("Relu", ["a"], ["y"]),
    ]
    model: onnx.ModelProto = make(nodes, [f32("x", ["N", rows])], [f32("y", ["N", rows])], inits)
    return model


def test_the_shell_holds_the_large_weights_only() -> None:
    model = _model()
    shell = WeightShell(model)
    assert shell.names == ["w"]  # 16 KiB held, the 256-byte bias stays in place
    held = {t.name: t for t in shell.model.graph.initializer}
    assert held["w"].data_location == onnx.TensorProto.EXTERNAL
    assert not held["w"].HasField("raw_data")
    assert held["b"].HasField("raw_data")
    source = numpy_helper.to_array(model.graph.initializer[0])
    np.testing.assert_array_equal(shell.arrays[0], source)
    assert model.graph.initializer[0].data_location == onnx.TensorProto.DEFAULT  # untouched
    assert 64 * 64 * 4 > BIG_INITIALIZER >= 64 * 4


def test_ort_basic_with_held_weights_gives_the_weights_back() -> None:
    model = _model()
    out = PASSES["ort_basic"](model)
    weights = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    np.testing.assert_array_equal(weights["w"], numpy_helper.to_array(model.graph.initializer[0]))
    assert all(t.data_location == onnx.TensorProto.DEFAULT for t in out.graph.initializer)


def test_analysis_runs_with_held_weights_and_leaves_the_model_whole() -> None:
    model = _model()
    a = analyse(model, {})
    assert a.tensors["y"].batched
    assert a.tensors["y"].sample_shape == (64,)
    assert model.graph.initializer[0].HasField("raw_data")
    assert {vi.name for vi in model.graph.value_info} >= {"m", "a"}


def test_the_checker_refuses_a_held_weight_whose_data_is_short(tmp_path: Path) -> None:
    model = _model()
    w = model.graph.initializer[0]
    w.raw_data = w.raw_data[:-4]
    path = tmp_path / "short.onnx"
    onnx.save(model, str(path))
    short = r"fails the ONNX checker: .*raw_data size \(16380 bytes\)"
    with pytest.raises(ModelError, match=short):
        load_model(path)
    # the same words as the checker's own on the model with its data in place
    with pytest.raises(onnx.checker.ValidationError, match=r"raw_data size \(16380 bytes\)"):
        onnx.checker.check_model(model)


def test_the_checker_still_sees_the_graph(tmp_path: Path) -> None:
    model = _model()
    model.graph.node[0].input[1] = "nowhere"
    path = tmp_path / "bad.onnx"
    onnx.save(model, str(path))
    with pytest.raises(ModelError, match="fails the ONNX checker"):
        load_model(path)
    load_model(_saved(_model(), tmp_path))


def _saved(model: onnx.ModelProto, tmp_path: Path) -> Path:
    path = tmp_path / "good.onnx"
    onnx.save(model, str(path))
    return path
