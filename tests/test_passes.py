"""Each optimization pass on a tiny graph, checked by running ONNX Runtime before and after."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from cloudkit import variable_length
from graphs import f32, make, rand, weight_in_branch
from onnx import helper
from ortutil import run

from splitinfer.partitioner.passes import DEFAULT_PIPELINE, PASSES, name_nodes, optimize
from splitinfer.partitioner.passes.ort_basic import in_source_order
from splitinfer.shared.errors import ConfigError, ModelError

pytestmark = pytest.mark.unit


def ops(model: onnx.ModelProto) -> Counter[str]:
    return Counter(n.op_type for n in model.graph.node)


def same_outputs(before: onnx.ModelProto, after: onnx.ModelProto, feeds: dict) -> None:
    want, got = run(before, feeds), run(after, feeds)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5)


def conv_bn_dropout(cin: int = 3, cout: int = 4) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Identity", ["x"], ["xi"]),
        helper.make_node("Conv", ["xi", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "g", "beta", "mean", "var"], ["bn"]),
        helper.make_node("Relu", ["bn"], ["r"]),
        helper.make_node("Dropout", ["r"], ["d"]),
        helper.make_node("Add", ["w2", "w2"], ["w2x2"]),  # constant subexpression
        helper.make_node("Mul", ["d", "w2x2"], ["y"]),
    ]
    inits = {
        "w": rand(cout, cin, 3, 3),
        "b": rand(cout, seed=1),
        "g": np.abs(rand(cout, seed=2)) + 0.5,
        "beta": rand(cout, seed=3),
        "mean": rand(cout, seed=4),
        "var": np.abs(rand(cout, seed=5)) + 0.5,
        "w2": rand(1, cout, 1, 1, seed=6),
    }
    return make(nodes, [f32("x", ["N", cin, 8, 8])], [f32("y", ["N", cout, 8, 8])], inits)


def test_ort_basic_folds_bn_constants_identity_and_dropout() -> None:
    model = conv_bn_dropout()
    out = PASSES["ort_basic"](model)
    assert ops(model)["BatchNormalization"] == 1
    assert ops(out) == Counter({"Conv": 1, "Relu": 1, "Mul": 1}), ops(out)
    same_outputs(model, out, {"x": rand(2, 3, 8, 8, seed=9)})


def test_fuse_hardswish_restores_the_single_op() -> None:
    nodes = [
        helper.make_node("HardSigmoid", ["x"], ["g"], alpha=1 / 6, beta=0.5),
        helper.make_node("Mul", ["x", "g"], ["y"]),
    ]
    model = make(nodes, [f32("x", ["N", 8])], [f32("y", ["N", 8])])
    out = PASSES["fuse_hardswish"](model)
    assert ops(out) == Counter({"HardSwish": 1})
    same_outputs(model, out, {"x": rand(3, 8) * 5})


def test_fuse_hardswish_leaves_other_hardsigmoids_alone() -> None:
    nodes = [
        helper.make_node("HardSigmoid", ["x"], ["g"], alpha=0.2, beta=0.5),
        helper.make_node("Mul", ["x", "g"], ["y"]),
    ]
    model = make(nodes, [f32("x", ["N", 8])], [f32("y", ["N", 8])])
    assert ops(PASSES["fuse_hardswish"](model)) == ops(model)


def test_onnxslim_fuses_matmul_add_and_drops_dead_nodes() -> None:
    # onnxslim fuses MatMul+Add into Gemm only where the input's shape is static
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["a"]),
        helper.make_node("Relu", ["a"], ["y"]),
        helper.make_node("Tanh", ["x"], ["dead"]),  # feeds nothing
    ]
    model = make(nodes, [f32("x", [5, 6])], [f32("y", [5, 3])], {"w": rand(6, 3), "b": rand(3)})
    out = PASSES["onnxslim"](model)
    assert ops(out) == Counter({"Gemm": 1, "Relu": 1}), ops(out)
    same_outputs(model, out, {"x": rand(5, 6)})


def test_default_pipeline_reports_node_counts_and_stays_standard() -> None:
    model = conv_bn_dropout()
    out, reports = optimize(model)
    assert [r.name for r in reports] == list(DEFAULT_PIPELINE)
    assert reports[0].nodes_before == len(model.graph.node) == 7
    assert reports[-1].nodes_after == len(out.graph.node) == 3
    assert all(n.domain in ("", "ai.onnx") for n in out.graph.node)
    same_outputs(model, out, {"x": rand(1, 3, 8, 8, seed=3)})


def test_unknown_pass_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown optimization pass 'nope'"):
        optimize(conv_bn_dropout(), ("nope",))


def test_ort_rejecting_the_model_is_a_model_error() -> None:
    node = helper.make_node("NoSuchOp", ["x"], ["y"], domain="")
    graph = helper.make_graph([node], "g", [f32("x", [1])], [f32("y", [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ModelError, match="ONNX Runtime cannot load the model"):
        PASSES["ort_basic"](model)


def test_optimize_names_every_node_uniquely() -> None:
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Neg", ["a"], ["b"], name="dup"),
        helper.make_node("Abs", ["b"], ["c"], name="dup"),
        helper.make_node("Sigmoid", ["c"], ["y"], name="Sigmoid_3"),
    ]
    model = make(nodes, [f32("x", ["N", 4])], [f32("y", ["N", 4])], {})
    out, _ = optimize(model, ())
    names = [n.name for n in out.graph.node]
    assert all(names)
    assert len(set(names)) == 4
    assert "dup" in names
    assert "Sigmoid_3" in names


def test_the_pipeline_keeps_large_weights_beside_the_graph_and_returns_them_in_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a 81 KiB Conv weight (48 x 48 x 3 x 3, folded with its BatchNorm by ONNX Runtime)
    model = conv_bn_dropout(cin=48, cout=48)
    seen: list[bool] = []
    slim_run = PASSES["onnxslim"]

    def spy(m: onnx.ModelProto, beside: object = None) -> onnx.ModelProto:
        seen.append(any(t.data_location == onnx.TensorProto.EXTERNAL for t in m.graph.initializer))
        return slim_run(m, beside)  # type: ignore[arg-type]

    monkeypatch.setitem(PASSES, "onnxslim", spy)
    out, _ = optimize(model)
    assert seen == [True]  # onnxslim got the folded weight as a reference to the file
    assert all(
        t.data_location == onnx.TensorProto.DEFAULT and not t.HasField("data_location")
        for t in out.graph.initializer
    )
    assert ops(out)["BatchNormalization"] == 0
    same_outputs(model, out, {"x": rand(2, 48, 8, 8, seed=9)})
    # the same model, pass by pass on their own, each reading its weights in place
    alone = model
    for name in DEFAULT_PIPELINE:
        alone = slim_run(alone) if name == "onnxslim" else PASSES[name](alone)
    name_nodes(alone)
    assert out.SerializeToString(deterministic=True) == alone.SerializeToString(deterministic=True)


def test_weights_inside_an_if_branch_come_back_from_beside_the_graph() -> None:
    # ONNX Runtime writes the branch's 64 KiB weight to the file beside the graph too
    model = weight_in_branch(inside=True)
    out, _ = optimize(model)
    for flag in (True, False):
        feeds = {"x": rand(2, 128, seed=9), "flag": np.array([flag])}
        same_outputs(model, out, feeds)


def test_ort_basic_keeps_the_source_order_of_the_nodes() -> None:
    # x and mask feed three independent chains; ONNX Runtime's writer puts them in
    # another order, and the order numbers the cuts
    model = variable_length()
    assert [n.output[0] for n in model.graph.node] == ["h", "r", "m3", "rm", "s", "cnt", "y"]
    out = PASSES["ort_basic"](model)
    assert [n.output[0] for n in out.graph.node] == ["h", "r", "m3", "rm", "s", "cnt", "y"]


def test_source_order_puts_a_new_node_after_what_it_reads() -> None:
    src = make(
        [
            helper.make_node("Relu", ["x"], ["a"]),
            helper.make_node("Neg", ["x"], ["b"]),
            helper.make_node("Add", ["a", "b"], ["y"]),
        ],
        [f32("x", [2])],
        [f32("y", [2])],
        {},
    )
    # as a writer might give it back: reordered, and Neg replaced by a new node
    nodes = [
        helper.make_node("Add", ["a2", "b2"], ["y"]),
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Sigmoid", ["a"], ["a2"]),
        helper.make_node("Sigmoid", ["x"], ["b2"]),
    ]
    out = helper.make_model(helper.make_graph(nodes, "g", [f32("x", [2])], [f32("y", [2])]))
    in_source_order(out, src)
    # Relu keeps its place; the new Sigmoids go after what they read (a, and the input)
    assert [n.output[0] for n in out.graph.node] == ["b2", "a", "a2", "y"]
