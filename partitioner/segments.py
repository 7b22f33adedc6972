"""Extract the edge and cloud segments of a planned cut as standalone models.

``edge.onnx`` takes the model's inputs and outputs the crossing tensors under
their own names; ``cloud.onnx`` takes the crossing tensors under the same names
and outputs the model's outputs. Composing the two by name reproduces the
model. A model input the cloud reads crosses as an edge output of the same name.
Every declared shape is the one the analysis runs showed (the batch and the
free dimensions symbolic), never the shape the source model declares; a Shape
whose input stays on the edge is rebuilt on the cloud from the sizes of the
tensors it receives (:attr:`CutPlan.rebuilt`).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from splitinfer.partitioner.analysis import GraphAnalysis
from splitinfer.partitioner.cuts import CutPlan, DimSource


def _value_info(analysis: GraphAnalysis, name: str) -> onnx.ValueInfoProto:
    """A value info of the shape the runs showed: batch and free dimensions symbolic."""
    info = analysis.tensors[name]
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(info.dtype))
    dims = info.symbolic
    if dims is None:
        dims = [*((analysis.batch_symbol or "batch",) if info.batched else ()), *info.sample_shape]
    return helper.make_tensor_value_info(name, elem, list(dims))


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
    rebuilt = dict(plan.rebuilt)
    nodes: list[onnx.NodeProto] = []
    initializers: list[TensorProto] = []
    for name in plan.constants:
        info = analysis.tensors[name]
        assert info.value is not None
        value = np.array(info.value, dtype=info.dtype).reshape(info.sample_shape)
        tensor = numpy_helper.from_array(value, f"{name}__value")
        nodes.append(helper.make_node("Constant", [], [name], value=tensor))
    for i in plan.cloud_nodes:
        if i in rebuilt:
            r_nodes, r_inits = _rebuilt_shape(analysis, analysis.nodes[i], rebuilt[i])
            nodes.extend(r_nodes)
            initializers.extend(r_inits)
        else:
            nodes.append(analysis.nodes[i])
    outputs = [_value_info(analysis, n) for n in analysis.outputs]
    kept = tuple(i for i in plan.cloud_nodes if i not in rebuilt)
    initializers.extend(_initializers(analysis, kept))
    return _model(analysis, "cloud", nodes, inputs, outputs, initializers)


def _rebuilt_shape(
    analysis: GraphAnalysis, node: onnx.NodeProto, axes: tuple[DimSource, ...]
) -> tuple[list[onnx.NodeProto], list[TensorProto]]:
    """Nodes computing the output of Shape/Size ``node`` from the tensors the cloud has."""
    out = node.output[0]
    p = f"{out}__rebuilt"
    rank = len(axes)
    if node.op_type == "Shape":
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        start, end = int(attrs.get("start", 0)), int(attrs.get("end", rank))
        start = min(max(start + rank if start < 0 else start, 0), rank)
        end = min(max(end + rank if end < 0 else end, 0), rank)
        axes = axes[start:end]
    nodes: list[onnx.NodeProto] = []
    inits: list[TensorProto] = []
    shapes: dict[str, str] = {}
    pieces: list[str] = []
    for k, (tensor, value) in enumerate(axes):
        piece = f"{p}_{k}"
        if not tensor:
            inits.append(numpy_helper.from_array(np.array([value], np.int64), piece))
        else:
            if tensor not in shapes:
                shapes[tensor] = f"{p}_shape{len(shapes)}"
                nodes.append(helper.make_node("Shape", [tensor], [shapes[tensor]]))
            index = f"{piece}_index"
            inits.append(numpy_helper.from_array(np.array([value], np.int64), index))
            nodes.append(helper.make_node("Gather", [shapes[tensor], index], [piece], axis=0))
        pieces.append(piece)
    shape = out if node.op_type == "Shape" else f"{p}_full"
    if pieces:
        nodes.append(helper.make_node("Concat", pieces, [shape], axis=0))
    else:
        empty = numpy_helper.from_array(np.zeros((0,), np.int64), f"{p}_empty")
        nodes.append(helper.make_node("Constant", [], [shape], value=empty))
    if node.op_type == "Size":
        nodes.append(helper.make_node("ReduceProd", [shape], [out], keepdims=0))
    return nodes, inits
