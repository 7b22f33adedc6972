"""Tiny hand-built ONNX graphs (onnx.helper) for pass and cut tests."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def make(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    inits: dict[str, np.ndarray] | None = None,
    opset: int = OPSET,
) -> onnx.ModelProto:
    initializers = [numpy_helper.from_array(v, k) for k, v in (inits or {}).items()]
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def f32(name: str, shape: list[int | str | None]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def chain(n: int, width: int = 4) -> onnx.ModelProto:
    """``n`` alternating MatMul / Relu nodes (MatMul+Relu pairs fuse into units)."""
    nodes, inits = [], {}
    prev = "x"
    for i in range(n):
        out = f"t{i}"
        if i % 2 == 0:
            inits[f"w{i}"] = rand(width, width, seed=i)
            nodes.append(helper.make_node("MatMul", [prev, f"w{i}"], [out]))
        else:
            nodes.append(helper.make_node("Sigmoid", [prev], [out]))
        prev = out
    nodes.append(helper.make_node("Identity", [prev], ["y"]))
    return make(nodes, [f32("x", ["N", width])], [f32("y", ["N", width])], inits)


def residual() -> onnx.ModelProto:
    """x -> a=Sigmoid -> b=Tanh -> c=Add(b, a) -> y=Sigmoid.

    A cut inside the block carries two tensors."""
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["a"]),
        helper.make_node("Tanh", ["a"], ["b"]),
        helper.make_node("Add", ["b", "a"], ["c"]),
        helper.make_node("Sigmoid", ["c"], ["y"]),
    ]
    return make(nodes, [f32("x", ["N", 4])], [f32("y", ["N", 4])])


def shape_subgraph() -> onnx.ModelProto:
    """Shape -> Gather -> Unsqueeze -> Concat feeding a Reshape, as exporters emit."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "axes0"], ["n1"]),
        helper.make_node("Concat", ["n1", "flat"], ["target"], axis=0),
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Reshape", ["r", "target"], ["flat_r"]),
        helper.make_node("MatMul", ["flat_r", "w"], ["y"]),
    ]
    inits = {
        "zero": np.array(0, np.int64),
        "axes0": np.array([0], np.int64),
        "flat": np.array([24], np.int64),
        "w": rand(24, 5),
    }
    return make(nodes, [f32("x", ["N", 4, 6])], [f32("y", ["N", 5])], inits)


def control_flow() -> onnx.ModelProto:
    """An If whose branches read ``a`` from the outer scope."""
    then_g = helper.make_graph(
        [helper.make_node("Add", ["a", "one"], ["tb"])],
        "then",
        [],
        [f32("tb", ["N", 4])],
        initializer=[numpy_helper.from_array(np.array(1.0, np.float32), "one")],
    )
    else_g = helper.make_graph(
        [helper.make_node("Mul", ["a", "two"], ["eb"])],
        "else",
        [],
        [f32("eb", ["N", 4])],
        initializer=[numpy_helper.from_array(np.array(2.0, np.float32), "two")],
    )
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("If", ["flag"], ["b"], then_branch=then_g, else_branch=else_g),
        helper.make_node("Sigmoid", ["b"], ["y"]),
    ]
    flag = helper.make_tensor_value_info("flag", TensorProto.BOOL, [1])
    return make(nodes, [f32("x", ["N", 4]), flag], [f32("y", ["N", 4])])


def late_mask() -> onnx.ModelProto:
    """A second input read only at the end: it must cross every cut but the last."""
    nodes = [
        helper.make_node("Tanh", ["x"], ["h"]),
        helper.make_node("Sigmoid", ["h"], ["g"]),
        helper.make_node("Mul", ["g", "mask"], ["y"]),
    ]
    return make(nodes, [f32("x", ["N", 4]), f32("mask", ["N", 4])], [f32("y", ["N", 4])])


def free_dims() -> onnx.ModelProto:
    """A detector-like input with free height and width."""
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["p"]),
        helper.make_node("Flatten", ["p"], ["y"]),
    ]
    inits = {"w": rand(4, 3, 3, 3), "b": rand(4)}
    return make(nodes, [f32("x", ["N", 3, "H", "W"])], [f32("y", ["N", 4])], inits)


def weight_in_branch(inside: bool, n: int = 128) -> onnx.ModelProto:
    """An If whose then branch multiplies by an ``n`` x ``n`` weight (64 KiB at 128: a
    large one), held in the branch (``inside``) or read from the outer graph."""
    w = numpy_helper.from_array(rand(n, n, seed=3), "w")
    then_g = helper.make_graph(
        [helper.make_node("MatMul", ["a", "w"], ["tb"])],
        "then",
        [],
        [f32("tb", ["N", n])],
        initializer=[w] if inside else [],
    )
    else_g = helper.make_graph(
        [helper.make_node("Mul", ["a", "two"], ["eb"])],
        "else",
        [],
        [f32("eb", ["N", n])],
        initializer=[numpy_helper.from_array(np.array(2.0, np.float32), "two")],
    )
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("If", ["flag"], ["b"], then_branch=then_g, else_branch=else_g),
        helper.make_node("Sigmoid", ["b"], ["y"]),
    ]
    flag = helper.make_tensor_value_info("flag", TensorProto.BOOL, [1])
    inits = {} if inside else {"w": numpy_helper.to_array(w)}
    return make(nodes, [f32("x", ["N", n]), flag], [f32("y", ["N", n])], inits)
