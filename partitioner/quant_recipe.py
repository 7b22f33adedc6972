"""The INT8 recipes: which nodes a CPU edge keeps fp32, where TensorRT wants Q/DQ, rewrites.

ONNX Runtime's CPU provider runs only some ops as integer kernels; around the
others the quantizer inserts a DequantizeLinear → fp32 op → QuantizeLinear round
trip that costs more than the op. :data:`CPU_INT8_OPS` is what
``config_for("cpu")`` quantizes; :func:`fp32_nodes` keeps stems and depthwise
convolutions fp32 (where ORT's fp32 kernels beat its int8 ones here);
:func:`global_pool` turns a spatial ReduceMean into GlobalAveragePool (a uint8
kernel); :func:`output_guards` protects graph outputs from a quantizer quirk and
:func:`log_guards` the inputs of a Log from rounding to 0; :func:`own_biases` and
:func:`vector_gemm_bias` give the quantizer biases as it handles them (one reader
each, a vector).
The measurements behind each rule are in docs/profiles.md and
``bench/bench_int8.py``. :func:`tensorrt_nodes` is TensorRT's Q/DQ placement
(the inputs of weighted operations and both inputs of residual adds; see
:mod:`.trt_rules` and docs/profiles.md "INT8 for TensorRT").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import onnx

if TYPE_CHECKING:
    from splitinfer.partitioner.quant_config import QuantConfig

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
#: The weighted operations: TensorRT runs them in INT8 when their inputs come through Q/DQ.
TENSORRT_WEIGHTED_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm")
#: Op types the TensorRT recipe quantizes: the weighted operations and residual Adds.
TENSORRT_INT8_OPS = (*TENSORRT_WEIGHTED_OPS, "Add")
_FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16})
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


def log_guards(model: onnx.ModelProto) -> list[str]:
    """The nodes whose output a Log reads, kept fp32 under every recipe.

    A quantized tensor gives back 0 for a positive value under half its scale step,
    and the Log -inf: basic-pitch's ``log(x² + 1e-10)`` turned every later value of its
    int8 segment into inf or NaN. Kept fp32, the small values stay positive.
    """
    logs = {n.input[0] for n in model.graph.node if n.op_type == "Log" and n.input}
    return [n.name for n in model.graph.node if n.name and logs.intersection(n.output)]


#: The default ONNX domain; an op outside it (``com.microsoft::Gelu``, ...) stays fp32.
_DEFAULT_DOMAINS = frozenset({"", "ai.onnx"})


def foreign_nodes(model: onnx.ModelProto) -> list[str]:
    """Names of the nodes outside the default ONNX domain, kept fp32 under every recipe.

    A source model's contrib op (``com.microsoft::DynamicQuantizeLSTM``) passes through
    untouched: the quantizer keys its op registry by op type alone, and has no int8 form
    of such an op to give it.
    """
    return [n.name for n in model.graph.node if n.name and n.domain not in _DEFAULT_DOMAINS]


#: What ONNX Runtime's quantizer names the tensors and nodes it adds for a tensor T
#: (T_quantized, T_scale, T_zero_point, T_QuantizeLinear, T_DequantizeLinear_Output, ...).
QUANTIZER_SUFFIXES = (
    "_quantized",
    "_scale",
    "_zero_point",
    "_QuantizeLinear",
    "_DequantizeLinear",
)


def quantizer_clashes(model: onnx.ModelProto) -> dict[str, str]:
    """New names for the inner tensors and nodes whose names the quantizer may also give.

    A model quantized before (ddddocr's, dynamically: ``140_quantized``, ``140_scale``
    from a ``140_QuantizeLinear`` node) holds such names, and the quantizer would add a
    second tensor or node of one name ("Graph is not a DAG"). Graph inputs and outputs
    keep theirs. Empty for most models; :func:`rename` applies it (and its inverse).
    """
    g = model.graph
    keep = {vi.name for vi in (*g.input, *g.output)}
    taken = keep | {t.name for t in g.initializer} | {n.name for n in g.node}
    taken.update(o for n in g.node for o in n.output)
    mapping: dict[str, str] = {}
    for name in sorted(taken - keep):
        if name and any(s in name for s in QUANTIZER_SUFFIXES):
            new = name.replace("_", ".")  # every suffix starts with "_"
            while new in taken:
                new += "."
            taken.add(new)
            mapping[name] = new
    return mapping


def rename(model: onnx.ModelProto, mapping: dict[str, str]) -> None:
    """Rename tensors and nodes of ``model``'s top-level graph by ``mapping``, in place."""
    if not mapping:
        return
    g = model.graph
    for node in g.node:
        node.name = mapping.get(node.name, node.name)
        for field in (node.input, node.output):
            for i, name in enumerate(field):
                if name in mapping:
                    field[i] = mapping[name]
    for t in g.initializer:
        t.name = mapping.get(t.name, t.name)
    for vi in g.value_info:
        vi.name = mapping.get(vi.name, vi.name)


#: The ops whose third input ONNX Runtime's quantizer takes for a bias
#: (``quantize_bias_tensor``).
BIAS_OPS = frozenset(
    {
        "Conv",
        "ConvTranspose",
        "Gemm",
        "BatchNormalization",
        "InstanceNormalization",
        "LayerNormalization",
    }
)


def own_biases(model: onnx.ModelProto) -> int:
    """Give every reader of a shared bias but the first its own copy of it, in place.

    The quantizer copies a bias that several nodes read (each one's bias scale follows
    its own input and weight scales) and names each copy the bias's name and a number,
    counting the initializers alone: basic-pitch's [36] Conv bias, read by 18 Convs,
    got a copy named as an activation, and that activation's reader read the bias.
    These copies are named after their node, apart from every name in the model.
    Returns how many it made.
    """
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    taken = _all_names(g)
    seen: set[str] = set()
    made = 0
    for node in g.node:
        if node.op_type not in BIAS_OPS or node.domain not in _DEFAULT_DOMAINS:
            continue
        bias = node.input[2] if len(node.input) > 2 else ""
        if bias not in inits:
            continue
        if bias in seen:
            node.input[2] = _add_copy(g, inits[bias], f"{bias}.{node.name}", taken)
            made += 1
        seen.add(bias)
    return made


def vector_gemm_bias(model: onnx.ModelProto) -> int:
    """Give every Gemm whose constant C is [1, N] the same C as [N], in place.

    onnxslim's MatMul+Add fusion keeps the Add's [1, N] constant as the Gemm's C, and
    ONNX Runtime's quantizer reads a per-channel weight's bias as a vector (magika:
    "The truth value of an array with more than one element is ambiguous"). Gemm
    broadcasts either shape alike. The [N] one is a copy (the [1, N] one stays for any
    other reader; the quantizer drops it if none). Returns how many it made.
    """
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    taken = _all_names(g)
    made = 0
    for node in g.node:
        if node.op_type != "Gemm" or node.domain not in _DEFAULT_DOMAINS:
            continue
        c = inits.get(node.input[2]) if len(node.input) > 2 else None
        if c is None or len(c.dims) != 2 or c.dims[0] != 1:
            continue
        node.input[2] = _add_copy(g, c, f"{c.name}.vector", taken, dims=[c.dims[1]])
        made += 1
    return made


def _add_copy(
    g: onnx.GraphProto,
    t: onnx.TensorProto,
    name: str,
    taken: set[str],
    dims: list[int] | None = None,
) -> str:
    """Add a copy of initializer ``t`` to ``g`` under ``name`` (made apart from
    ``taken``, which it joins), with ``dims`` if given; its name."""
    while name in taken:
        name += "."
    taken.add(name)
    copy = g.initializer.add()
    copy.CopyFrom(t)
    copy.name = name
    if dims is not None:
        del copy.dims[:]
        copy.dims.extend(dims)
    return name


def _all_names(g: onnx.GraphProto) -> set[str]:
    """Every tensor and node name of ``g`` and its subgraphs."""
    names = {vi.name for vi in (*g.input, *g.output, *g.value_info)}
    names.update(t.name for t in g.initializer)
    for node in g.node:
        names.add(node.name)
        names.update(node.input)
        names.update(node.output)
        for attr in node.attribute:
            for sub in (*([attr.g] if attr.HasField("g") else ()), *attr.graphs):
                names |= _all_names(sub)
    return names


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


def without_pass_through(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` without the graph outputs that are graph inputs too (a copy, nodes named).

    An edge segment forwards a model input unchanged when the cloud needs it (the
    residual stream of a transformer cut inside a block). ONNX Runtime's quantizer
    puts a Q/DQ pair on every graph output it quantizes by renaming the tensor's
    producer output; a graph input has no producer, and the pair it inserts reads
    its own output ("Graph is not a DAG"). The quantizer gets the graph without
    those outputs; the caller adds them back, still the untouched input.
    """
    inputs = {vi.name for vi in model.graph.input}
    passed = [vi for vi in model.graph.output if vi.name in inputs]
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    name_nodes(copy)
    if passed and len(passed) < len(model.graph.output):
        keep = [vi for vi in copy.graph.output if vi.name not in inputs]
        del copy.graph.output[:]
        copy.graph.output.extend(keep)
    return copy


def _constants(model: onnx.ModelProto) -> set[str]:
    names = {t.name for t in model.graph.initializer}
    names.update(n.output[0] for n in model.graph.node if n.op_type == "Constant" and n.output)
    return names


def tensorrt_nodes(model: onnx.ModelProto) -> list[str]:
    """Names of the nodes the TensorRT recipe quantizes (shape inference done, nodes named).

    Every Conv / ConvTranspose / MatMul / Gemm whose inputs are float, and every Add
    of two float activations of one shape (a residual or skip connection: both
    branches get Q/DQ). Bias Adds (one constant input), broadcast Adds (an attention
    mask, whose -1e4 would take all of a per-tensor scale) and every other op stay:
    TensorRT moves Q/DQ across data movement and pooling itself, and a Q/DQ in
    front of Softmax, LayerNormalization or a bias Add is a conversion it cannot
    fuse (TensorRT developer guide, "Q/DQ Layer-Placement Recommendations").
    """
    consts = _constants(model)
    infos = tensor_infos(model)

    def is_float(name: str) -> bool:
        return infos.get(name, (onnx.TensorProto.FLOAT, None))[0] in _FLOAT_TYPES

    keep: list[str] = []
    for node in model.graph.node:
        data = [t for t in node.input[:2] if t]
        if not node.name or not data or not all(is_float(t) for t in data):
            continue
        if node.domain not in _DEFAULT_DOMAINS:
            continue
        if node.op_type in TENSORRT_WEIGHTED_OPS or (
            node.op_type == "Add"
            and len(data) == 2
            and not any(t in consts for t in data)
            and same_shape(infos, *data)
        ):
            keep.append(node.name)
    return keep


Dims = tuple[int | str | None, ...]


def tensor_infos(model: onnx.ModelProto) -> dict[str, tuple[int, Dims | None]]:
    """Element type and dims (``int``, a symbolic name or ``None``) of every typed tensor."""
    out: dict[str, tuple[int, Dims | None]] = {}
    for vi in (*model.graph.value_info, *model.graph.input, *model.graph.output):
        if not vi.type.HasField("tensor_type"):
            continue
        t = vi.type.tensor_type
        dims: Dims | None = None
        if t.HasField("shape"):
            dims = tuple(
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                for d in t.shape.dim
            )
        out[vi.name] = (t.elem_type, dims)
    for init in model.graph.initializer:
        out[init.name] = (init.data_type, tuple(init.dims))
    return out


def same_shape(infos: dict[str, tuple[int, Dims | None]], a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` have the same shape, as far as shape inference knows.

    A skip connection adds two tensors of one shape; an attention mask or a bias is
    broadcast. Unknown shapes count as the same (a skip connection is the safe guess).
    """
    da, db = infos.get(a, (0, None))[1], infos.get(b, (0, None))[1]
    if da is None or db is None:
        return True
    if len(da) != len(db):
        return False
    return all(x is None or y is None or x == y for x, y in zip(da, db, strict=True))


def name_nodes(model: onnx.ModelProto) -> None:
    """Give every unnamed node a unique name (in place): the quantizer selects nodes by name."""
    taken = {n.name for n in model.graph.node if n.name}
    for i, node in enumerate(model.graph.node):
        if not node.name:
            name = f"{node.op_type}_q{i}"
            while name in taken:
                name += "_"
            node.name = name
            taken.add(name)
