"""Extract the edge and cloud segments of a planned cut as standalone models.

``edge.onnx`` takes the model's inputs and outputs the crossing tensors under
their own names; ``cloud.onnx`` takes the crossing tensors under the same names
and outputs the model's outputs. Composing the two by name reproduces the
model. A model input the cloud reads crosses as an edge output of the same name.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from splitinfer.partitioner.analysis import GraphAnalysis, Remat
from splitinfer.partitioner.cuts import CutPlan


def _value_info(analysis: GraphAnalysis, name: str) -> onnx.ValueInfoProto:
    """A value info with the batch dimension kept symbolic."""
    info = analysis.tensors[name]
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(info.dtype))
    if not info.batched:
        return helper.make_tensor_value_info(name, elem, list(info.sample_shape))
    batch = analysis.batch_symbol or "batch"
    sym = info.symbolic
    if sym is not None and len(sym) == len(info.sample_shape) + 1:
        dims: list[int | str | None] = [batch, *sym[1:]]
    else:
        dims = [batch, *info.sample_shape]
    return helper.make_tensor_value_info(name, elem, dims)


def _initializers(analysis: GraphAnalysis, node_ids: tuple[int, ...]) -> list[TensorProto]:
    used: set[str] = set()
    for i in node_ids:
        used.update(analysis.node_inputs[i])
    return [t for t in analysis.model.graph.initializer if t.name in used]


def _model(
    analysis: GraphAnalysis,
    name: str,
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    initializers: list[TensorProto],
) -> onnx.ModelProto:
    src = analysis.model
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=initializers)
    model = helper.make_model(
        graph, opset_imports=list(src.opset_import), producer_name="splitinfer"
    )
    model.ir_version = src.ir_version
    model.functions.extend(src.functions)
    return model


def edge_model(analysis: GraphAnalysis, plan: CutPlan) -> onnx.ModelProto:
    nodes = [analysis.nodes[i] for i in plan.edge_nodes]
    model_inputs = {vi.name: vi for vi in analysis.model.graph.input}
    inputs = [model_inputs[n] for n in analysis.inputs]
    outputs = [_value_info(analysis, n) for n in plan.crossing]
    return _model(
        analysis, "edge", nodes, inputs, outputs, _initializers(analysis, plan.edge_nodes)
    )


def cloud_model(analysis: GraphAnalysis, plan: CutPlan) -> onnx.ModelProto:
    inputs = [_value_info(analysis, n) for n in plan.crossing]
    anchor = next((n for n in plan.crossing if analysis.tensors[n].batched), None)
    nodes: list[onnx.NodeProto] = []
    initializers: list[TensorProto] = []
    for name in plan.remat:
        remat = analysis.tensors[name].remat
        assert remat is not None
        r_nodes, r_inits = _remat_nodes(name, remat, anchor)
        nodes.extend(r_nodes)
        initializers.extend(r_inits)
    nodes.extend(analysis.nodes[i] for i in plan.cloud_nodes)
    model_outputs = {vi.name: vi for vi in analysis.model.graph.output}
    outputs = [model_outputs[n] for n in analysis.outputs]
    initializers.extend(_initializers(analysis, plan.cloud_nodes))
    return _model(analysis, "cloud", nodes, inputs, outputs, initializers)


def _remat_nodes(
    name: str, remat: Remat, anchor: str | None
) -> tuple[list[onnx.NodeProto], list[TensorProto]]:
    """Nodes computing ``name`` on the cloud from the batch size of ``anchor``."""
    dtype = np.dtype(remat.dtype)
    if remat.is_constant:
        if remat.coeffs is not None:
            flat = np.array([b for _, b in remat.coeffs], dtype=dtype)
        else:
            assert remat.value is not None
            flat = np.array(remat.value, dtype=dtype)
        value = numpy_helper.from_array(flat.reshape(remat.shape), name=f"{name}__remat_value")
        return [helper.make_node("Constant", [], [name], value=value)], []
    assert anchor is not None
    assert remat.coeffs is not None
    p = f"{name}__remat"
    slope = numpy_helper.from_array(np.array([a for a, _ in remat.coeffs], np.int64), f"{p}_a")
    icpt = numpy_helper.from_array(np.array([b for _, b in remat.coeffs], np.int64), f"{p}_b")
    shape = numpy_helper.from_array(np.array(remat.shape, np.int64), f"{p}_shape")
    nodes = [
        helper.make_node("Shape", [anchor], [f"{p}_batch"], start=0, end=1),
        helper.make_node("Mul", [f"{p}_batch", f"{p}_a"], [f"{p}_scaled"]),
        helper.make_node("Add", [f"{p}_scaled", f"{p}_b"], [f"{p}_flat"]),
    ]
    last = f"{p}_flat"
    if dtype != np.int64:
        nodes.append(helper.make_node("Reshape", [last, f"{p}_shape"], [f"{p}_shaped"]))
        nodes.append(
            helper.make_node(
                "Cast", [f"{p}_shaped"], [name], to=helper.np_dtype_to_tensor_dtype(dtype)
            )
        )
    else:
        nodes.append(helper.make_node("Reshape", [last, f"{p}_shape"], [name]))
    return nodes, [slope, icpt, shape]
