"""Shapes, dtypes and roles of every tensor of an optimized graph.

The graph is run with ONNX Runtime at two batch sizes with every intermediate
tensor exposed as an output. That gives, for each tensor:

* whether it is *batched* (its leading dimension follows the batch size): only
  batched tensors may cross a cut, because the cloud batches requests from
  many devices along that axis;
* its per-sample shape and dtype (for bytes on the wire and FLOPs);
* for small non-batched tensors (shape arithmetic such as ``Shape -> Gather ->
  Concat -> Reshape``), their value as ``a * batch + b`` per element, so a
  segment that needs one whose producer sits on the other side can rebuild it
  locally instead of shipping it or breaking the batch.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from splitinfer.partitioner.loader import analysis_input_shapes, dims_of, graph_inputs
from splitinfer.shared.errors import ModelError

#: Largest non-batched tensor (elements) whose value is recorded for rebuilding.
MAX_REMAT_ELEMENTS = 4096


@dataclass(frozen=True)
class Remat:
    """How to rebuild a small non-batched tensor from the batch size alone.

    Element ``i`` equals ``coeffs[i][0] * batch + coeffs[i][1]``; a tensor with
    every ``a == 0`` is a constant.
    """

    dtype: str
    shape: tuple[int, ...]
    coeffs: tuple[tuple[int, int], ...] | None  # None: float constant in ``value``
    value: tuple[float, ...] | None = None

    @property
    def is_constant(self) -> bool:
        return self.coeffs is None or all(a == 0 for a, _ in self.coeffs)


@dataclass
class TensorInfo:
    name: str
    dtype: str
    producer: int | None  # node index; None for model inputs and initializers
    consumers: list[int] = field(default_factory=list)
    batched: bool = False
    # batched: shape of one sample; otherwise the full shape
    sample_shape: tuple[int, ...] = ()
    symbolic: list[int | str | None] | None = None
    remat: Remat | None = None
    is_input: bool = False
    is_initializer: bool = False

    @property
    def bytes_per_sample(self) -> int:
        return int(np.prod(self.sample_shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass
class GraphAnalysis:
    model: onnx.ModelProto
    nodes: list[onnx.NodeProto]
    node_inputs: list[list[str]]  # explicit and outer-scope (subgraph) inputs
    tensors: dict[str, TensorInfo]
    inputs: list[str]
    outputs: list[str]
    batch_symbol: str | None
    sample_input_shapes: dict[str, list[int]]
    data_node: list[bool] = field(default_factory=list)

    def dtype_of(self, name: str) -> str:
        return self.tensors[name].dtype


def subgraph_outer_inputs(node: onnx.NodeProto) -> list[str]:
    """Names that the node's subgraphs (If/Loop/Scan bodies) read from outer scope."""
    used: list[str] = []
    for attr in node.attribute:
        graphs = list(attr.g for _ in [0] if attr.HasField("g")) + list(attr.graphs)
        for g in graphs:
            defined = {vi.name for vi in g.input} | {t.name for t in g.initializer}
            for inner in g.node:
                defined.update(o for o in inner.output if o)
            for inner in g.node:
                for name in [*inner.input, *subgraph_outer_inputs(inner)]:
                    if name and name not in defined and name not in used:
                        used.append(name)
    return used


def topo_sort(graph: onnx.GraphProto, node_inputs: list[list[str]]) -> list[int]:
    """Kahn's algorithm over node indices; raises on a cycle."""
    produced_by: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        for o in node.output:
            if o:
                produced_by[o] = i
    indeg = [0] * len(graph.node)
    succ: dict[int, list[int]] = defaultdict(list)
    for i, names in enumerate(node_inputs):
        preds = {produced_by[n] for n in names if n in produced_by}
        indeg[i] = len(preds)
        for p in preds:
            succ[p].append(i)
    ready = [i for i, d in enumerate(indeg) if d == 0]
    order: list[int] = []
    while ready:
        i = ready.pop(0)
        order.append(i)
        for s in succ[i]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    if len(order) != len(graph.node):
        raise ModelError("the graph has a cycle")
    return order


def _np_dtype(elem_type: int) -> str:
    return str(np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)))


def _feed(vi: onnx.ValueInfoProto, shape: list[int], rng: np.random.Generator) -> np.ndarray:
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type))
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    # integers (token ids, indices) and booleans (masks): ones are valid for both
    return np.ones(shape, dtype=dtype)


def analyse(model: onnx.ModelProto, overrides: dict[str, list[int]]) -> GraphAnalysis:
    """Infer shapes, run the graph at two batch sizes, classify every tensor."""
    sample_shapes = analysis_input_shapes(model, overrides)
    try:
        model = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except (onnx.shape_inference.InferenceError, ValueError) as exc:
        raise ModelError(f"shape inference failed: {str(exc).splitlines()[0]}") from exc
    graph = model.graph
    node_inputs = [
        [n for n in node.input if n] + subgraph_outer_inputs(node) for node in graph.node
    ]
    order = topo_sort(graph, node_inputs)
    nodes = [graph.node[i] for i in order]
    node_inputs = [node_inputs[i] for i in order]

    inputs_vi = graph_inputs(model)
    batch_symbol = _batch_symbol(inputs_vi)
    batches = (2, 3) if batch_symbol is not None else (None,)

    value_types: dict[str, int] = {}
    for vi in [*graph.value_info, *graph.output, *graph.input]:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            value_types[vi.name] = vi.type.tensor_type.elem_type
    symbolic = {vi.name: dims_of(vi) for vi in [*graph.value_info, *graph.output, *inputs_vi]}

    runs = [_run_all(model, nodes, inputs_vi, sample_shapes, b, value_types) for b in batches]

    tensors: dict[str, TensorInfo] = {}
    for init in graph.initializer:
        tensors[init.name] = TensorInfo(
            name=init.name,
            dtype=_np_dtype(init.data_type),
            producer=None,
            sample_shape=tuple(init.dims),
            is_initializer=True,
        )
    for vi in inputs_vi:
        shp = tuple(runs[0][vi.name].shape)
        batched = batch_symbol is not None and len(shp) > 0 and _is_batch_dim(vi)
        tensors[vi.name] = TensorInfo(
            name=vi.name,
            dtype=str(runs[0][vi.name].dtype),
            producer=None,
            batched=batched,
            sample_shape=shp[1:] if batched else shp,
            symbolic=symbolic.get(vi.name),
            is_input=True,
        )
    static_batch = _static_batch(inputs_vi) if batch_symbol is None else None
    for idx, node in enumerate(nodes):
        for name in node.output:
            if not name:
                continue
            if name not in runs[0]:
                raise ModelError(
                    f"cannot determine the type of tensor {name!r} (node {node.name!r}, "
                    f"{node.op_type}); shape inference gave no type"
                )
            values = [r[name] for r in runs]
            info = TensorInfo(
                name=name,
                dtype=str(values[0].dtype),
                producer=idx,
                symbolic=symbolic.get(name),
            )
            _classify(info, values, batches, static_batch)
            tensors[name] = info
    for idx, names in enumerate(node_inputs):
        for name in names:
            if name in tensors:
                tensors[name].consumers.append(idx)

    outputs = [o.name for o in graph.output]
    analysis = GraphAnalysis(
        model=model,
        nodes=nodes,
        node_inputs=node_inputs,
        tensors=tensors,
        inputs=[vi.name for vi in inputs_vi],
        outputs=outputs,
        batch_symbol=batch_symbol,
        sample_input_shapes=sample_shapes,
    )
    analysis.data_node = [
        any(o and tensors[o].batched for o in node.output) or node.output[0] in outputs
        for node in nodes
    ]
    return analysis


def _is_batch_dim(vi: onnx.ValueInfoProto) -> bool:
    dims = dims_of(vi)
    return bool(dims) and not isinstance(dims[0], int)


def _batch_symbol(inputs: list[onnx.ValueInfoProto]) -> str | None:
    """The batch symbol: the first input's symbolic leading dimension, if any."""
    for vi in inputs:
        dims = dims_of(vi)
        if dims and not isinstance(dims[0], int):
            return dims[0] or "batch"
    return None


def _static_batch(inputs: list[onnx.ValueInfoProto]) -> int | None:
    for vi in inputs:
        dims = dims_of(vi)
        if dims and isinstance(dims[0], int):
            return dims[0]
    return None


def _classify(
    info: TensorInfo,
    values: list[np.ndarray],
    batches: tuple[int | None, ...],
    static_batch: int | None,
) -> None:
    first = values[0]
    if batches[0] is not None:
        info.batched = all(
            v.ndim > 0 and v.shape[0] == b for v, b in zip(values, batches, strict=True)
        ) and all(v.shape[1:] == first.shape[1:] for v in values)
    else:
        info.batched = first.ndim > 0 and first.shape[0] == static_batch
    if info.batched:
        info.sample_shape = tuple(first.shape[1:])
        return
    info.sample_shape = tuple(first.shape)
    if first.size > MAX_REMAT_ELEMENTS or any(v.shape != first.shape for v in values):
        return
    if all(np.array_equal(v, first) for v in values[1:]):
        if first.dtype.kind in "iub":
            coeffs = tuple((0, int(x)) for x in first.reshape(-1))
            info.remat = Remat(str(first.dtype), first.shape, coeffs)
        else:
            info.remat = Remat(
                str(first.dtype), first.shape, None, tuple(float(x) for x in first.reshape(-1))
            )
        return
    if first.dtype.kind in "iu" and len(values) == 2:
        b0, b1 = batches[0], batches[1]
        assert b0 is not None
        assert b1 is not None
        v0 = values[0].reshape(-1).astype(np.int64)
        v1 = values[1].reshape(-1).astype(np.int64)
        slope = (v1 - v0) // (b1 - b0)
        if np.array_equal(slope * (b1 - b0), v1 - v0):
            intercept = v0 - slope * b0
            info.remat = Remat(
                str(first.dtype),
                first.shape,
                tuple((int(a), int(b)) for a, b in zip(slope, intercept, strict=True)),
            )


def _run_all(
    model: onnx.ModelProto,
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    sample_shapes: dict[str, list[int]],
    batch: int | None,
    value_types: dict[str, int],
) -> dict[str, np.ndarray]:
    """Run the model once with every node output exposed; return name -> value."""
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    existing = {o.name for o in probe.graph.output}
    for node in nodes:
        for name in node.output:
            if name and name not in existing and name in value_types:
                probe.graph.output.append(
                    helper.make_tensor_value_info(name, value_types[name], None)
                )
                existing.add(name)
    rng = np.random.default_rng(0)
    feeds: dict[str, np.ndarray] = {}
    for vi in inputs:
        dims = dims_of(vi)
        if not dims:
            shape: list[int] = []
        elif batch is not None and _is_batch_dim(vi):
            shape = [batch, *sample_shapes[vi.name]]
        else:
            shape = [int(d) if isinstance(d, int) else 1 for d in dims[:1]] + sample_shapes[vi.name]
        feeds[vi.name] = _feed(vi, shape, rng)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    try:
        sess = ort.InferenceSession(
            probe.SerializeToString(), opts, providers=["CPUExecutionProvider"]
        )
        names = [o.name for o in sess.get_outputs()]
        values = sess.run(names, feeds)
    except Exception as exc:  # ORT's own exception types
        text = str(exc).strip().splitlines()
        raise ModelError(
            f"ONNX Runtime cannot run the model at batch {batch}: {text[0] if text else exc}"
        ) from exc
    result = dict(zip(names, (np.asarray(v) for v in values), strict=True))
    result.update(feeds)
    for init in model.graph.initializer:
        result.setdefault(init.name, numpy_helper.to_array(init))
    return result
