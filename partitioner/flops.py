"""Per-sample FLOPs of a node, counted from the analysed shapes.

A multiply-add counts as two FLOPs. Data-movement ops (Reshape, Transpose,
Concat, Gather, Slice, ...) count zero; ops not listed count one FLOP per output
element, which is right for elementwise ops and a floor for the rest.
"""

from __future__ import annotations

import math

import onnx

from splitinfer.partitioner.analysis import GraphAnalysis

ZERO_COST = frozenset(
    {
        "Reshape", "Transpose", "Concat", "Split", "Slice", "Gather", "GatherElements",
        "GatherND", "Squeeze", "Unsqueeze", "Flatten", "Shape", "Size", "Identity", "Cast",
        "Constant", "ConstantOfShape", "Expand", "Tile", "Pad", "DepthToSpace", "SpaceToDepth",
        "Range", "NonZero", "Dropout",
    }
)  # fmt: skip
REDUCE_INPUT = frozenset(
    {
        "GlobalAveragePool", "GlobalMaxPool", "ReduceMean", "ReduceSum", "ReduceMax",
        "ReduceMin", "ReduceProd", "ReduceL2", "ReduceL1", "ReduceSumSquare", "ArgMax", "ArgMin",
    }
)  # fmt: skip
PER_ELEMENT = {
    "Softmax": 5,
    "LogSoftmax": 5,
    "LayerNormalization": 8,
    "BatchNormalization": 2,
    "InstanceNormalization": 8,
    "GroupNormalization": 8,
    "Gelu": 8,
    "Erf": 8,
    "HardSwish": 4,
    "HardSigmoid": 3,
}


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def node_flops(analysis: GraphAnalysis, index: int) -> int:
    """FLOPs one sample costs at node ``index`` (0 for shape arithmetic)."""
    if not analysis.data_node[index]:
        return 0
    node = analysis.nodes[index]
    op = node.op_type
    if op in ZERO_COST:
        return 0
    tensors = analysis.tensors
    out = _numel(tensors[node.output[0]].sample_shape)
    ins = [tensors[n] for n in node.input if n]
    if op == "Conv" and len(ins) >= 2:
        return 2 * out * _numel(ins[1].sample_shape[1:])
    if op == "ConvTranspose" and len(ins) >= 2:
        return 2 * _numel(ins[0].sample_shape) * _numel(ins[1].sample_shape[1:])
    if op == "Gemm" and len(ins) >= 2:
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        weight = ins[1].sample_shape
        k = weight[1] if trans_b else weight[0]
        return 2 * out * k
    if op == "MatMul" and len(ins) >= 2:
        a = ins[0].sample_shape
        k = a[-1] if a else 1
        return 2 * out * k
    if op in REDUCE_INPUT and ins:
        return _numel(ins[0].sample_shape)
    if op in {"MaxPool", "AveragePool", "LpPool"}:
        kernel = next((list(a.ints) for a in node.attribute if a.name == "kernel_shape"), [1])
        return out * math.prod(kernel)
    return out * PER_ELEMENT.get(op, 1)


def all_flops(analysis: GraphAnalysis) -> list[int]:
    return [node_flops(analysis, i) for i in range(len(analysis.nodes))]


def count_ops(model: onnx.ModelProto) -> int:
    return len(model.graph.node)
