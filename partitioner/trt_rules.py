"""TensorRT's explicit-quantization rules, checked on a QDQ ONNX graph without TensorRT.

:func:`check_tensorrt_qdq` returns one line per violation, each naming the node
and the rule (``"node 'conv1': weight-axis: ..."``); an empty list means the
graph follows every rule below. The rules come from TensorRT's documentation and
its ONNX parser; docs/profiles.md ("INT8 for TensorRT") cites the source of each:

``int8``
    Q/DQ are signed INT8: every QuantizeLinear and DequantizeLinear has an int8
    zero point (ONNX's default without one is uint8, which TensorRT reads as
    int8: the two runtimes would disagree), no ``output_dtype`` but int8, and a
    DequantizeLinear reads int8 (no int32 bias DequantizeLinear).
``zero-point``
    Zero points are constants, all 0 (symmetric quantization only), of the
    scale's size.
``scale``
    Scales are float constants (build-time constants in TensorRT), finite and
    strictly positive.
``per-tensor-activation``
    A Q/DQ of an activation has one scale; per-axis scales are for weights only.
``weight-axis``
    A weight's scales lie on its output-channel axis and number that axis's
    size: axis 0 for Conv (K, C/g, ...), 1 for ConvTranspose (C, K/g, ...), the
    last axis (N) of a constant MatMul ``B``, for Gemm ``B`` axis 0 with
    ``transB=1`` (N, K) and 1 without (K, N).
``per-channel-weight``
    A quantized weight of Conv / ConvTranspose / MatMul / Gemm has one scale per
    output channel.
``weighted-inputs``
    Conv / ConvTranspose / MatMul / Gemm read their data and weight inputs
    through DequantizeLinear (TensorRT's placement: quantize all inputs of
    weighted operations; the bias stays float).
``residual-add``
    An Add of two activations of one shape (a skip connection) is quantized on
    both inputs: TensorRT fuses the Add into the convolution before it only when
    the residual input is int8 as well.
``q-feeds-dq``
    A QuantizeLinear output goes only to DequantizeLinear nodes and is no graph
    output (INT8 exists in TensorRT only between a Q and a DQ).
``ops``
    Default-domain ops only, and none TensorRT's parser lacks
    (DynamicQuantizeLinear, QLinearConv, QLinearMatMul, ConvInteger,
    MatMulInteger).
``opset``
    Per-axis Q/DQ need opset 13 or later.
``shape-tensor``
    Only float tensors are quantized, and no dequantized tensor is read as a
    shape (Reshape's shape, Slice's starts, Resize's sizes, ...).

Pure: reads the model, changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, numpy_helper

from splitinfer.partitioner.quant_recipe import same_shape, tensor_infos

__all__ = ["RULES", "WEIGHTED_OPS", "check_tensorrt_qdq", "weight_axis"]

Array = npt.NDArray[Any]

#: Rule id → one line; every violation names one of these.
RULES: dict[str, str] = {
    "int8": "Q/DQ are signed int8 (int8 zero point, int8 DequantizeLinear input)",
    "zero-point": "zero points are constant, all 0, one per scale",
    "scale": "scales are float constants, finite and > 0",
    "per-tensor-activation": "activations have one scale",
    "weight-axis": "weight scales lie on the output-channel axis, one per channel",
    "per-channel-weight": "weights of Conv/ConvTranspose/MatMul/Gemm are per output channel",
    "weighted-inputs": "Conv/ConvTranspose/MatMul/Gemm read both inputs through DequantizeLinear",
    "residual-add": "an Add of two same-shape activations (a skip) is quantized on both inputs",
    "q-feeds-dq": "QuantizeLinear outputs go only to DequantizeLinear",
    "ops": "default-domain ops TensorRT's ONNX parser supports",
    "opset": "per-axis Q/DQ need opset >= 13",
    "shape-tensor": "only float tensors are quantized; no dequantized tensor is read as a shape",
}

#: The operations TensorRT runs in INT8 from Q/DQ on their inputs (and their weight input).
WEIGHTED_OPS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
#: Ops TensorRT's ONNX parser does not import (onnx-tensorrt docs/operators.md).
UNSUPPORTED_OPS = frozenset(
    {"DynamicQuantizeLinear", "QLinearConv", "QLinearMatMul", "ConvInteger", "MatMulInteger"}
)
QDQ = frozenset({"QuantizeLinear", "DequantizeLinear"})
FLOATS = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16})
#: Inputs read as shapes, axes or sizes (by index), which must never be dequantized tensors.
SHAPE_INPUTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,),
    "Expand": (1,),
    "Tile": (1,),
    "Slice": (1, 2, 3, 4),
    "Resize": (1, 2, 3),
    "Upsample": (1,),
    "Pad": (1, 3),
    "ConstantOfShape": (0,),
    "Range": (0, 1, 2),
    "TopK": (1,),
    "Squeeze": (1,),
    "Unsqueeze": (1,),
    "Split": (1,),
    "ReduceMean": (1,),
    "ReduceSum": (1,),
    "ReduceMax": (1,),
    "ReduceMin": (1,),
    "ReduceProd": (1,),
    "ReduceL2": (1,),
    "OneHot": (1,),
}
#: Per-axis QuantizeLinear/DequantizeLinear (the ``axis`` attribute) came with opset 13.
PER_AXIS_OPSET = 13


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


def weight_axis(op_type: str, input_index: int, rank: int, trans_b: int = 0) -> int | None:
    """The output-channel axis of a weighted op's constant input, or ``None`` if it has none.

    Conv weights are (K, C/g, ...): axis 0. ConvTranspose weights are
    (C, K/g, ...): axis 1. MatMul ``B`` (..., K, N): the last axis; a constant
    MatMul ``A`` (..., M, K): its rows, ``rank - 2``. Gemm ``B``: (N, K) with
    ``transB=1``, axis 0; (K, N) without, axis 1.
    """
    if op_type == "Conv":
        return 0 if input_index == 1 else None
    if op_type == "ConvTranspose":
        return 1 if input_index == 1 else None
    if op_type == "Gemm":
        return (0 if trans_b else 1) if input_index == 1 else None
    if op_type == "MatMul":
        if rank < 2:
            return None
        return rank - 1 if input_index == 1 else rank - 2
    return None


class _Constants(Mapping[str, Array]):
    """Initializers and Constant values by name, turned into arrays only when read.

    Weights are only measured (:meth:`dims`); scales and zero points are read.
    """

    def __init__(self, protos: dict[str, onnx.TensorProto]) -> None:
        self.protos = protos
        self._arrays: dict[str, Array] = {}

    def __getitem__(self, name: str) -> Array:
        if name not in self._arrays:
            self._arrays[name] = numpy_helper.to_array(self.protos[name])
        return self._arrays[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.protos)

    def __len__(self) -> int:
        return len(self.protos)

    def __contains__(self, name: object) -> bool:
        return name in self.protos

    def dims(self, name: str) -> tuple[int, ...] | None:
        proto = self.protos.get(name)
        return None if proto is None else tuple(proto.dims)


class _Graph:
    """Lookups over one graph: constants, producers, consumers, element types."""

    def __init__(self, model: onnx.ModelProto) -> None:
        g = model.graph
        self.model = model
        self.consts = _Constants({t.name: t for t in g.initializer})
        self.const_types: dict[str, int] = {t.name: t.data_type for t in g.initializer}
        for node in g.node:
            if node.op_type == "Constant" and node.output:
                value = next((a.t for a in node.attribute if a.name == "value"), None)
                if value is not None:
                    self.consts.protos[node.output[0]] = value
                    self.const_types[node.output[0]] = value.data_type
        self.producer = {o: n for n in g.node for o in n.output if o}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in g.node:
            for name in node.input:
                if name:
                    self.consumers.setdefault(name, []).append(node)
        self.outputs = {vi.name for vi in g.output}
        self.types: dict[str, int] = dict(self.const_types)
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
        except Exception:  # a graph shape inference cannot read still gets the other checks
            inferred = model
        for vi in (*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output):
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                self.types.setdefault(vi.name, vi.type.tensor_type.elem_type)
        self.infos = tensor_infos(inferred)

    def is_constant(self, name: str) -> bool:
        """A constant, or the Q/DQ (or Identity) of one: weights in explicit-quantization form."""
        seen = 0
        while name not in self.consts:
            node = self.producer.get(name)
            if node is None or node.op_type not in (*QDQ, "Identity") or seen > 4:
                return False
            name, seen = node.input[0], seen + 1
        return True

    def source(self, name: str) -> str:
        """The tensor behind a DQ ← Q chain (the weight initializer of a weight's Q/DQ)."""
        for _ in range(4):
            node = self.producer.get(name)
            if node is None or node.op_type not in (*QDQ, "Identity"):
                break
            name = node.input[0]
        return name


def _label(node: onnx.NodeProto) -> str:
    return node.name or f"{node.op_type}({', '.join(node.output)})"


def _check_qdq_node(node: onnx.NodeProto, g: _Graph, out: list[str]) -> None:
    """Types, zero points, scales and per-axis use of one QuantizeLinear/DequantizeLinear."""
    name = _label(node)
    quantize = node.op_type == "QuantizeLinear"
    if len(node.input) < 3 or not node.input[2]:
        if quantize:
            out.append(
                f"node {name!r}: int8: no zero point, so ONNX quantizes to uint8 "
                "while TensorRT reads int8; give it an int8 zero point of 0"
            )
        zero_type, zero = None, None
    else:
        zero_type = g.const_types.get(node.input[2], g.types.get(node.input[2]))
        zero = g.consts.get(node.input[2])
        if zero_type is not None and zero_type != TensorProto.INT8:
            out.append(
                f"node {name!r}: int8: zero point {node.input[2]!r} is "
                f"{TensorProto.DataType.Name(zero_type).lower()}, TensorRT takes signed int8 only"
            )
        if zero is None:
            out.append(f"node {name!r}: zero-point: zero point {node.input[2]!r} is not a constant")
        elif np.any(zero != 0):
            out.append(
                f"node {name!r}: zero-point: zero point {node.input[2]!r} holds "
                f"{np.unique(zero)[:4].tolist()}, TensorRT takes symmetric quantization only (0)"
            )
    dtype = _attr(node, "output_dtype", 0)
    if quantize and dtype not in (0, TensorProto.INT8):
        out.append(
            f"node {name!r}: int8: output_dtype is "
            f"{TensorProto.DataType.Name(dtype).lower()}, not int8"
        )
    data_type = g.types.get(node.input[0])
    if quantize and data_type is not None and data_type not in FLOATS:
        out.append(
            f"node {name!r}: shape-tensor: quantizes {node.input[0]!r} of type "
            f"{TensorProto.DataType.Name(data_type).lower()}; only float tensors are quantized"
        )
    if not quantize and data_type is not None and data_type != TensorProto.INT8:
        out.append(
            f"node {name!r}: int8: dequantizes {node.input[0]!r} of type "
            f"{TensorProto.DataType.Name(data_type).lower()}; TensorRT dequantizes int8 only"
        )

    scale = g.consts.get(node.input[1]) if len(node.input) > 1 else None
    if scale is None:
        out.append(f"node {name!r}: scale: scale {node.input[1]!r} is not a constant")
        return
    if g.const_types.get(node.input[1]) not in FLOATS:
        out.append(f"node {name!r}: scale: scale {node.input[1]!r} is not a float tensor")
    elif not np.all(np.isfinite(scale)) or not np.all(scale > 0):
        bad = scale[~(np.isfinite(scale) & (scale > 0))]
        out.append(
            f"node {name!r}: scale: scale {node.input[1]!r} holds {bad[:4].tolist()}; "
            "TensorRT takes finite scales > 0"
        )
    if zero is not None and zero.size != scale.size:
        out.append(f"node {name!r}: zero-point: {zero.size} zero points for {scale.size} scales")
    if scale.size > 1 and not g.is_constant(node.input[0]):
        out.append(
            f"node {name!r}: per-tensor-activation: activation {node.input[0]!r} has "
            f"{scale.size} scales; TensorRT quantizes activations per tensor"
        )


def _check_weight(
    node: onnx.NodeProto, index: int, dq: onnx.NodeProto, g: _Graph, out: list[str]
) -> None:
    """The scales of a weighted op's constant input: one per output channel, on that axis."""
    weight = g.source(dq.input[0])
    shape = g.consts.dims(weight)
    scale = g.consts.get(dq.input[1]) if len(dq.input) > 1 else None
    if shape is None or scale is None:
        return
    axis = weight_axis(node.op_type, index, len(shape), _attr(node, "transB", 0))
    if axis is None:
        return
    name = _label(node)
    channels = shape[axis]
    if scale.size == 1 and channels > 1:
        out.append(
            f"node {name!r}: per-channel-weight: weight {weight!r} {list(shape)} has one "
            f"scale; give it {channels}, one per output channel (axis {axis})"
        )
        return
    got = _attr(dq, "axis", 1) % max(len(shape), 1)
    if scale.size != channels or (scale.size > 1 and got != axis):
        out.append(
            f"node {name!r}: weight-axis: weight {weight!r} {list(shape)} has "
            f"{scale.size} scales on axis {got}; its output channels are axis {axis} "
            f"({channels} of them)"
        )


def _check_weighted(node: onnx.NodeProto, g: _Graph, out: list[str]) -> None:
    name = _label(node)
    wanted = (0, 1)
    for index in wanted:
        if index >= len(node.input) or not node.input[index]:
            continue
        tensor = node.input[index]
        dtype = g.types.get(tensor)
        if dtype is not None and dtype not in FLOATS:
            return  # integer MatMul arithmetic: nothing TensorRT quantizes
        producer = g.producer.get(tensor)
        if producer is None or producer.op_type != "DequantizeLinear":
            kind = "weight" if g.is_constant(tensor) else "input"
            out.append(
                f"node {name!r}: weighted-inputs: {kind} {index} ({tensor!r}) is not read "
                "through a DequantizeLinear; TensorRT runs the op in int8 only when all "
                "its inputs are quantized"
            )
            continue
        if g.is_constant(producer.input[0]):
            _check_weight(node, index, producer, g, out)


def _check_residual(node: onnx.NodeProto, g: _Graph, out: list[str]) -> None:
    inputs = [t for t in node.input[:2] if t]
    if len(inputs) != 2 or any(g.is_constant(t) for t in inputs):
        return
    if not same_shape(g.infos, *inputs):
        return  # broadcast: an attention mask or a bias, not a skip connection
    if any(g.types.get(t, TensorProto.FLOAT) not in FLOATS for t in inputs):
        return
    plain = [
        t for t in inputs if (p := g.producer.get(t)) is None or p.op_type != "DequantizeLinear"
    ]
    if plain:
        out.append(
            f"node {_label(node)!r}: residual-add: input {plain[0]!r} is not quantized; "
            "quantize both inputs of a skip connection so TensorRT fuses it in int8"
        )


def check_tensorrt_qdq(model: onnx.ModelProto) -> list[str]:
    """Every way ``model`` breaks TensorRT's explicit-quantization rules (see :data:`RULES`).

    A model without any Q/DQ is a float model, which TensorRT builds as it is: the
    weighted-op and residual rules apply only once the model is quantized.
    """
    g = _Graph(model)
    out: list[str] = []
    nodes = list(model.graph.node)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    quantized = any(n.op_type in QDQ for n in nodes)
    for node in nodes:
        if node.domain not in ("", "ai.onnx"):
            out.append(
                f"node {_label(node)!r}: ops: {node.domain}.{node.op_type} is not a "
                "default-domain op; TensorRT's ONNX parser cannot read it"
            )
        elif node.op_type in UNSUPPORTED_OPS:
            out.append(
                f"node {_label(node)!r}: ops: TensorRT's ONNX parser does not support "
                f"{node.op_type}"
            )
    for node in nodes:
        if node.op_type in QDQ:
            _check_qdq_node(node, g, out)
            per_axis = any(a.name == "axis" for a in node.attribute) or (
                len(node.input) > 1 and g.consts.get(node.input[1], np.zeros(1)).size > 1
            )
            if per_axis and opset < PER_AXIS_OPSET:
                out.append(
                    f"node {_label(node)!r}: opset: per-axis {node.op_type} at opset {opset}; "
                    f"it needs opset {PER_AXIS_OPSET} or later"
                )
        if node.op_type == "QuantizeLinear":
            others = [
                c for c in g.consumers.get(node.output[0], []) if c.op_type != "DequantizeLinear"
            ]
            if others or node.output[0] in g.outputs:
                where = f"node {_label(others[0])!r}" if others else "the graph output"
                out.append(
                    f"node {_label(node)!r}: q-feeds-dq: its int8 output reaches {where}, "
                    "not a DequantizeLinear"
                )
        for index in SHAPE_INPUTS.get(node.op_type, ()):
            if index < len(node.input) and node.input[index]:
                producer = g.producer.get(node.input[index])
                if producer is not None and producer.op_type == "DequantizeLinear":
                    out.append(
                        f"node {_label(node)!r}: shape-tensor: input {index} "
                        f"({node.input[index]!r}) is a dequantized tensor read as a shape"
                    )
        if not quantized:
            continue
        if node.op_type in WEIGHTED_OPS:
            _check_weighted(node, g, out)
        elif node.op_type == "Add":
            _check_residual(node, g, out)
    return out
