"""The INT8 recipe for CPU edges: which nodes stay fp32, and one rewrite.

ONNX Runtime's CPU provider runs only some ops as integer kernels; around the
others the quantizer inserts a DequantizeLinear → fp32 op → QuantizeLinear round
trip that costs more than the op. :data:`CPU_INT8_OPS` is what
``config_for("cpu")`` quantizes; :func:`fp32_nodes` keeps stems and depthwise
convolutions fp32 (where ORT's fp32 kernels beat its int8 ones here);
:func:`global_pool` turns a spatial ReduceMean into GlobalAveragePool (a uint8
kernel); :func:`output_guards` protects graph outputs from a quantizer quirk.
The measurements behind each rule are in docs/profiles.md and
``bench/bench_int8.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import onnx

if TYPE_CHECKING:
    from splitinfer.partitioner.quantize import QuantConfig

Array = npt.NDArray[Any]

#: Op types ONNX Runtime's CPU provider runs as integer kernels once their Q/DQ are fused
#: (QLinearConv, MatMulInteger/QGemm, QLinearAdd, QLinearConcat, NhwcMaxPool,
#: QLinearGlobalAveragePool, ...) or drops into a neighbour's zero point (Relu, Clip) or
#: runs on uint8 directly (data movement). Left out on purpose: HardSwish, HardSigmoid,
#: ReduceMean and Mul, which ORT runs in fp32 between a DequantizeLinear and a
#: QuantizeLinear: that round trip cost more than the op (see bench/bench_int8.py).
CPU_INT8_OPS = (
    "Conv",
    "MatMul",
    "Gemm",
    "Add",
    "Concat",
    "MaxPool",
    "AveragePool",
    "GlobalAveragePool",
    "Relu",
    "Clip",
    "LeakyRelu",
    "Sigmoid",
    "Reshape",
    "Flatten",
    "Transpose",
    "Squeeze",
    "Unsqueeze",
    "Resize",
    "Split",
    "Gather",
    "Pad",
)
#: A Conv reading a graph input with at most this many channels (an RGB stem) stays
#: fp32: ORT's int8 convolution is im2col + GEMM with K = C*kh*kw = 27, where its fp32
#: NCHWc direct convolution wins (3.5 ms vs 1.6 ms for 3→16 channels at 224x224).
STEM_CHANNELS = 4
#: Activations after a fp32 stem that stay fp32 with it (fused into its NCHWc kernel).
_STEM_FOLLOWERS = frozenset({"Relu", "Clip", "LeakyRelu", "HardSwish"})
#: Consumers that make a fp32 stem slower: ORT then runs these pools in fp32 NCHW
#: (23 ms for a 3x3 MaxPool over 16x224x224, against 0.4 ms for its uint8 NHWC kernel).
_POOLS = frozenset({"MaxPool", "AveragePool"})


def _int_attr(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


#: Activations the quantizer folds into the op before them: it gives that op's output
#: the activation's clipped range instead of its own.
_FOLDED_ACTIVATIONS = frozenset({"Relu", "Clip"})


def output_guards(model: onnx.ModelProto) -> list[str]:
    """Relu/Clip nodes that read a graph output, kept fp32 under every recipe.

    ONNX Runtime's quantizer folds such an activation into the op that produces its
    input, which gives that tensor the activation's clipped range; when the tensor is
    also a graph output (a cut tensor that the edge segment uses too) its negative
    values would be lost on the wire. Kept fp32, the activation leaves the tensor its
    own calibrated range.
    """
    outputs = {vi.name for vi in model.graph.output}
    return [
        n.name
        for n in model.graph.node
        if n.op_type in _FOLDED_ACTIVATIONS and n.name and n.input and n.input[0] in outputs
    ]


def fp32_nodes(model: onnx.ModelProto, config: QuantConfig) -> list[str]:
    """Names of the nodes ``config`` keeps fp32: stems and depthwise convolutions.

    A stem (a Conv reading a graph input of at most :data:`STEM_CHANNELS` channels)
    takes the activations that follow it along a single-consumer path, so they stay
    fused with it in ORT's fp32 NCHWc kernel; a stem whose result feeds a pool stays
    int8 (see :data:`_POOLS`).
    """
    if not (config.fp32_stem or config.fp32_depthwise):
        return []
    weights = {t.name: list(t.dims) for t in model.graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    outputs = {vi.name for vi in model.graph.output}
    inputs = set(_graph_input_names(model))
    keep: list[str] = []
    for node in model.graph.node:
        dims = weights.get(node.input[1]) if node.op_type == "Conv" else None
        if not node.name or not dims or len(dims) < 3:
            continue
        group = _int_attr(node, "group", 1)
        depthwise = group > 1 and dims[1] == 1
        if config.fp32_depthwise and depthwise:
            keep.append(node.name)
        elif (
            config.fp32_stem and node.input[0] in inputs and group == 1 and dims[1] <= STEM_CHANNELS
        ):
            stem = [node.name]
            tensor = node.output[0]
            while tensor not in outputs and len(consumers.get(tensor, [])) == 1:
                nxt = consumers[tensor][0]
                if nxt.op_type not in _STEM_FOLLOWERS or not nxt.name:
                    break
                stem.append(nxt.name)
                tensor = nxt.output[0]
            if not any(c.op_type in _POOLS for c in consumers.get(tensor, [])):
                keep.extend(stem)
    return keep


def _spatial_axes(node: onnx.NodeProto, consts: dict[str, Array]) -> list[int] | None:
    if len(node.input) > 1:
        axes = consts.get(node.input[1])
        return None if axes is None else [int(a) for a in np.ravel(axes)]
    attr = next((a for a in node.attribute if a.name == "axes"), None)
    return None if attr is None else list(attr.ints)


def global_pool(model: onnx.ModelProto) -> int:
    """Rewrite ``ReduceMean`` over H, W of a 4-D tensor (``keepdims=1``) as ``GlobalAveragePool``.

    Same values and output name; needs the input's rank (shape inference done).
    Returns how many nodes were rewritten; ``model`` is changed in place.
    """
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    ranks = {
        vi.name: len(vi.type.tensor_type.shape.dim)
        for vi in (*model.graph.value_info, *model.graph.input, *model.graph.output)
        if vi.type.tensor_type.HasField("shape")
    }
    done = 0
    for i, node in enumerate(model.graph.node):
        if node.op_type != "ReduceMean" or _int_attr(node, "keepdims", 1) != 1:
            continue
        if ranks.get(node.input[0]) != 4:
            continue
        axes = _spatial_axes(node, consts)
        if axes is None or sorted(a % 4 for a in axes) != [2, 3]:
            continue
        pool = onnx.helper.make_node(
            "GlobalAveragePool", [node.input[0]], list(node.output), name=node.name
        )
        model.graph.node[i].CopyFrom(pool)
        done += 1
    used = {name for node in model.graph.node for name in node.input}
    unused = [t for t in model.graph.initializer if t.name not in used]
    for t in unused:  # the axes of rewritten nodes
        model.graph.initializer.remove(t)
    return done


def _graph_input_names(model: onnx.ModelProto) -> list[str]:
    inits = {t.name for t in model.graph.initializer}
    return [vi.name for vi in model.graph.input if vi.name not in inits]
