"""The one ONNX Runtime session factory (shared/ortsession.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from splitinfer.shared.errors import ModelError
from splitinfer.shared.ortsession import open_session, session_options

pytestmark = pytest.mark.unit


def relu_model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def test_each_choice_sets_its_option(tmp_path: Path) -> None:
    opts = session_options(
        threads=2,
        inter_threads=3,
        optimize="basic",
        log_severity=4,
        parallel=True,
        arena=False,
        priority_order=True,
        optimized_path=tmp_path / "opt.onnx",
        profile=True,
        spinning=False,
        config={"session.disable_prepacking": "1"},
    )
    assert opts.intra_op_num_threads == 2
    assert opts.inter_op_num_threads == 3
    assert opts.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    assert opts.log_severity_level == 4
    assert opts.execution_mode == ort.ExecutionMode.ORT_PARALLEL
    assert opts.enable_cpu_mem_arena is False
    assert opts.execution_order == ort.ExecutionOrder.PRIORITY_BASED
    assert opts.optimized_model_filepath == str(tmp_path / "opt.onnx")
    assert opts.enable_profiling is True
    assert opts.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert opts.get_session_config_entry("session.inter_op.allow_spinning") == "0"
    assert opts.get_session_config_entry("session.disable_prepacking") == "1"


def test_defaults_leave_onnx_runtime_its_own() -> None:
    opts, plain = session_options(), ort.SessionOptions()
    assert opts.intra_op_num_threads == plain.intra_op_num_threads
    assert opts.execution_mode == plain.execution_mode
    assert opts.enable_cpu_mem_arena is True
    assert opts.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert opts.log_severity_level == 3


def test_sequential_and_parallel_exclude_each_other() -> None:
    with pytest.raises(TypeError, match="sequential or parallel"):
        session_options(sequential=True, parallel=True)


def test_a_model_opens_from_a_proto_bytes_or_a_path(tmp_path: Path) -> None:
    model = relu_model()
    onnx.save(model, str(tmp_path / "m.onnx"))
    x = np.array([[-1.0, 0.0, 2.0]], np.float32)
    for source in (model, model.SerializeToString(), tmp_path / "m.onnx"):
        (y,) = open_session(source).run(None, {"x": x})
        np.testing.assert_array_equal(y, np.maximum(x, 0))


def test_optimized_path_writes_the_graph_onnx_runtime_ran(tmp_path: Path) -> None:
    open_session(relu_model(), optimize="basic", optimized_path=tmp_path / "out.onnx")
    assert [n.op_type for n in onnx.load(str(tmp_path / "out.onnx")).graph.node] == ["Relu"]


def test_a_load_failure_is_one_model_error_line_naming_the_model(tmp_path: Path) -> None:
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model")
    with pytest.raises(ModelError, match=r"^edge\.onnx: ONNX Runtime cannot load it: \S") as e:
        open_session(junk, name="edge.onnx")
    assert "\n" not in str(e.value)
    with pytest.raises(ModelError, match=r"junk\.onnx: ONNX Runtime cannot load it"):
        open_session(junk)
    with pytest.raises(ModelError, match=r"^ONNX Runtime cannot load the model: \S"):
        open_session(b"not a model")
    with pytest.raises(ModelError, match=r"^ONNX Runtime cannot load the model: \S"):
        open_session(junk, name="the model")


def test_options_and_choices_do_not_mix() -> None:
    with pytest.raises(TypeError, match="either options or"):
        open_session(relu_model(), options=session_options(), threads=1)
