"""Shapes, dtypes and roles of every tensor of an optimized graph.

The graph is run with ONNX Runtime several times with the *shape* of every
intermediate tensor exposed as an output (a ``Shape`` node per tensor, so ONNX
Runtime frees each intermediate as it goes and analysis holds a few integers
per tensor, not the activations): at batch 2 and 3 at the analysis shapes
(``--input-shape``), and once per free input dimension (a sequence length, an
image's H or W) at a second size of it. That gives, for each tensor:

* the size of each of its axes in every run (:attr:`TensorInfo.dims`): which
  axis follows the batch, which follows a free input dimension, which is fixed;
* whether it is *batched* (its leading axis follows the batch and nothing else
  does): only batched tensors may cross a cut, because the cloud batches
  requests from many devices along that axis;
* its per-sample shape and dtype at the analysis shapes (for bytes on the wire
  and FLOPs).

Shape values (``Shape -> Gather -> Concat -> Reshape``) whose producer sits on
the other side of a cut are recomputed on the cloud from the shapes of the cut
tensors themselves (see :meth:`splitinfer.partitioner.cuts.CutSpace.plan`), so
a segment runs at every size the source model runs at. The shapes come from
running the graph, never from the shapes it declares.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from splitinfer.partitioner.loader import (
    WeightShell,
    analysis_input_shapes,
    dims_of,
    graph_inputs,
)
from splitinfer.shared.errors import ModelError
from splitinfer.shared.ortsession import open_session

#: The batch sizes of the two analysis runs at the analysis shapes; probes run at the first.
BATCHES = (2, 3)

Dim = int | str | None  # a size, a symbol, or unknown


@dataclass(frozen=True)
class FreeDim:
    """A free non-batch dimension of the model's inputs, varied by one analysis run.

    ``axes`` are ``(input, axis)`` pairs (axis counted with the batch) that share the
    symbol; ``size`` is the analysis size, ``alt`` the second size the model ran at,
    or None when it ran at no other size (then the dimension is fixed to ``size``).
    """

    symbol: str
    axes: tuple[tuple[str, int], ...]
    size: int
    alt: int | None


@dataclass
class TensorInfo:
    name: str
    dtype: str
    producer: int | None  # node index; None for model inputs and initializers
    consumers: list[int] = field(default_factory=list)
    batched: bool = False
    # batched: shape of one sample; otherwise the full shape (at the analysis shapes)
    sample_shape: tuple[int, ...] = ()
    #: Full dimensions as the runs show them: the batch symbol, a free dimension's
    #: symbol, a fixed size, or None (varies, but with no input dimension).
    symbolic: list[Dim] | None = None
    #: Per axis, its size in each analysis run (the axis's signature).
    dims: tuple[tuple[int, ...], ...] = ()
    is_input: bool = False
    is_initializer: bool = False
    #: The axis that follows the batch (and nothing else does): 0 for a batched tensor,
    #: another for e.g. an RNN's ``(T, N, C)`` output; None when no axis does.
    batch_axis: int | None = None
    #: A non-batched integer vector (a shape value) that was the same in every run,
    #: flattened; the cloud gets it as a constant instead of recomputing it.
    value: tuple[int, ...] | None = None

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
    #: The free non-batch dimensions of the inputs, as analysis varied them.
    free_dims: list[FreeDim] = field(default_factory=list)
    #: The batch size of each analysis run (None: the model's batch is static).
    run_batches: tuple[int | None, ...] = ()

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
    """Infer types, run the graph at two batch sizes and at a second size of each
    free dimension, classify every tensor."""
    _check_batch_leads(graph_inputs(model), _batch_symbol(graph_inputs(model)))
    sample_shapes = analysis_input_shapes(model, overrides)
    shell = WeightShell(model)
    _infer_types(model, shell)
    graph = model.graph
    node_inputs = [
        [n for n in node.input if n] + subgraph_outer_inputs(node) for node in graph.node
    ]
    order = topo_sort(graph, node_inputs)
    nodes = [graph.node[i] for i in order]
    node_inputs = [node_inputs[i] for i in order]

    inputs_vi = graph_inputs(model)
    batch_symbol = _batch_symbol(inputs_vi)
    value_types: dict[str, int] = {}
    for vi in [*graph.value_info, *graph.output, *graph.input]:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            value_types[vi.name] = vi.type.tensor_type.elem_type
    for node in nodes:
        for name in node.output:
            if name and name not in value_types:
                raise ModelError(
                    f"cannot determine the type of tensor {name!r} (node {node.name!r}, "
                    f"{node.op_type}); shape inference gave no type"
                )

    # shape values (int vectors) also come back by value, to tell fixed ones from the rest
    vis = {vi.name: vi for vi in graph.value_info}
    small_ints = [
        name
        for node in nodes
        for name in node.output
        if name in vis
        and value_types[name] in (onnx.TensorProto.INT64, onnx.TensorProto.INT32)
        and len(vis[name].type.tensor_type.shape.dim) <= 1
        and vis[name].type.tensor_type.HasField("shape")
    ]
    prober = _ShapeProber(shell, nodes, inputs_vi, small_ints)
    del shell
    batches: tuple[int | None, ...] = BATCHES if batch_symbol is not None else (None,)
    runs = [prober.run(b, sample_shapes) for b in batches]
    free = _free_groups(inputs_vi, sample_shapes)
    free_dims: list[FreeDim] = []
    for symbol, axes in free.items():
        size = sample_shapes[axes[0][0]][axes[0][1] - 1]
        alt = None
        for cand in _alternatives(size):
            shapes = {k: list(v) for k, v in sample_shapes.items()}
            for inp, axis in axes:
                shapes[inp][axis - 1] = cand
            try:
                runs.append(prober.run(batches[0], shapes))
            except ModelError:
                continue
            alt = cand
            batches = (*batches, batches[0])
            break
        free_dims.append(FreeDim(symbol, tuple(axes), size, alt))
    values = prober.values
    del prober

    batch_sig = tuple(b for b in batches) if batch_symbol is not None else None
    symbol_of: dict[tuple[int, ...], str] = {}
    for fd in free_dims:
        if fd.alt is not None:
            inp, axis = fd.axes[0]
            symbol_of.setdefault(tuple(r[inp][axis] for r in runs), fd.symbol)

    def info_of(name: str, dtype: str, producer: int | None) -> TensorInfo:
        shapes = [r[name] for r in runs]
        info = TensorInfo(name=name, dtype=dtype, producer=producer)
        _classify(info, shapes, batch_sig, batch_symbol, symbol_of, _static_batch(inputs_vi))
        seen = [v.get(name) for v in values]
        if not info.batched and seen[0] is not None and all(v == seen[0] for v in seen):
            info.value = seen[0]
        return info

    tensors: dict[str, TensorInfo] = {}
    for init in graph.initializer:
        tensors[init.name] = TensorInfo(
            name=init.name,
            dtype=_np_dtype(init.data_type),
            producer=None,
            sample_shape=tuple(init.dims),
            symbolic=list(init.dims),
            dims=tuple((int(d),) * len(runs) for d in init.dims),
            is_initializer=True,
        )
    for vi in inputs_vi:
        info = info_of(vi.name, _np_dtype(vi.type.tensor_type.elem_type), None)
        info.is_input = True
        info.batched = batch_symbol is not None and bool(info.dims) and _is_batch_dim(vi)
        shp = tuple(d[0] for d in info.dims)
        info.sample_shape = shp[1:] if info.batched else shp
        tensors[vi.name] = info
    for idx, node in enumerate(nodes):
        for name in node.output:
            if name:
                tensors[name] = info_of(name, _np_dtype(value_types[name]), idx)
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
        free_dims=free_dims,
        run_batches=batches,
    )
    analysis.data_node = [
        any(o and tensors[o].batched for o in node.output) or node.output[0] in outputs
        for node in nodes
    ]
    return analysis


def _infer_types(model: onnx.ModelProto, shell: WeightShell) -> None:
    """Add the inferred value infos to ``model`` and its shell (their types are all
    analysis uses). Inference reads the shell: the weights' dims, not their data."""
    try:
        inferred = onnx.shape_inference.infer_shapes(shell.model, strict_mode=False, data_prop=True)
    except (onnx.shape_inference.InferenceError, ValueError) as exc:
        raise ModelError(f"shape inference failed: {str(exc).splitlines()[0]}") from exc
    known = _runtime_types(inferred, shell)
    for m in (model, shell.model):
        del m.graph.value_info[:]
        m.graph.value_info.extend(inferred.graph.value_info)
        m.graph.value_info.extend(known)


def _runtime_types(inferred: onnx.ModelProto, shell: WeightShell) -> list[onnx.ValueInfoProto]:
    """Types (no shapes) from ONNX Runtime of the node outputs ONNX's shape inference left
    untyped: those of ops outside its schemas (``com.microsoft::DynamicQuantizeLSTM``),
    declared as the graph's outputs of a session on the shell. [] when none is missing
    or ONNX Runtime cannot tell (the caller names the tensor)."""
    g = inferred.graph
    typed = {
        vi.name
        for vi in (*g.value_info, *g.output, *g.input)
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type
    }
    typed.update(t.name for t in g.initializer)
    missing = [o for node in g.node for o in node.output if o and o not in typed]
    if not missing:
        return []
    probe = onnx.ModelProto()
    probe.CopyFrom(shell.model)  # the shell: the large weights carry no data
    del probe.graph.output[:]
    probe.graph.output.extend(onnx.ValueInfoProto(name=n) for n in missing)
    try:
        opts = shell.options(optimize="none", log_severity=4, arena=False)
        sess = open_session(probe.SerializeToString(), options=opts)
    except Exception:  # ORT's own exception types; the caller names the untyped tensor
        return []
    out = []
    for o in sess.get_outputs():
        kind = str(o.type)
        if kind.startswith("tensor(") and kind.endswith(")"):
            elem = onnx.TensorProto.DataType.Value(kind[7:-1].upper())
            out.append(helper.make_tensor_value_info(o.name, elem, None))
    return out


def _free_groups(
    inputs: list[onnx.ValueInfoProto], sample_shapes: dict[str, list[int]]
) -> dict[str, list[tuple[str, int]]]:
    """Free non-batch input axes grouped by symbol (an unnamed axis is its own group)."""
    groups: dict[str, list[tuple[str, int]]] = {}
    for vi in inputs:
        for axis, d in enumerate(dims_of(vi)):
            if axis == 0 or isinstance(d, int) or axis > len(sample_shapes[vi.name]):
                continue
            groups.setdefault(d or f"{vi.name}_dim{axis}", []).append((vi.name, axis))
    return groups


def _alternatives(size: int) -> list[int]:
    """Second sizes to try for a free dimension: strided nets want multiples, models with
    a largest length want smaller ones. Half comes first where it stays a multiple of
    32 (the deepest common stride): a run at half the size costs a quarter of one at
    double (an encoder at 128 tokens analyses at 64, not 256)."""
    half = [size // 2] if size % 2 == 0 and size >= 4 else []
    out = [*half, 2 * size] if size % 64 == 0 else [2 * size, *half]
    out.extend([size + 1, size - 1])
    return [c for c in dict.fromkeys(out) if c >= 1 and c != size]


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


def _check_batch_leads(inputs: list[onnx.ValueInfoProto], batch_symbol: str | None) -> None:
    """Refuse, in one line, an input that holds the batch symbol on another axis than its
    first (a recurrent state ``[2, batch, 128]``): requests are batched along axis 0."""
    if batch_symbol is None:
        return
    for vi in inputs:
        dims = dims_of(vi)
        if batch_symbol in dims[1:]:
            shape = "x".join("?" if d is None else str(d) for d in dims)
            raise ModelError(
                f"input {vi.name!r} ({shape}) holds the batch dimension {batch_symbol!r} on "
                f"axis {dims.index(batch_symbol, 1)}, not its first (a recurrent state?): "
                "splitinfer batches requests along the first axis of every input"
            )


def _static_batch(inputs: list[onnx.ValueInfoProto]) -> int | None:
    for vi in inputs:
        dims = dims_of(vi)
        if dims and isinstance(dims[0], int):
            return dims[0]
    return None


def _classify(
    info: TensorInfo,
    shapes: list[tuple[int, ...]],
    batch_sig: tuple[int | None, ...] | None,
    batch_symbol: str | None,
    symbol_of: dict[tuple[int, ...], str],
    static_batch: int | None,
) -> None:
    first = shapes[0]
    if any(len(s) != len(first) for s in shapes):
        # the rank follows a size: nothing about it is fixed, it never crosses
        info.sample_shape = tuple(first)
        info.symbolic = [None] * len(first)
        return
    info.dims = tuple(tuple(s[axis] for s in shapes) for axis in range(len(first)))
    if batch_sig is not None:
        info.batched = (
            bool(first)
            and info.dims[0] == batch_sig
            and shapes[1][1:] == first[1:]
            and batch_sig not in info.dims[1:]
        )
    else:
        info.batched = bool(first) and first[0] == static_batch
    info.sample_shape = tuple(first[1:]) if info.batched else tuple(first)
    if info.batched:
        info.batch_axis = 0
    elif batch_sig is not None and info.dims.count(batch_sig) == 1:
        # batched along another axis (nothing else moves with the batch): one sample is
        # the shape without that axis
        axis = info.dims.index(batch_sig)
        if all(x == y for k, (x, y) in enumerate(zip(first, shapes[1], strict=True)) if k != axis):
            info.batch_axis = axis
            info.sample_shape = tuple(d for k, d in enumerate(first) if k != axis)
    symbolic: list[Dim] = []
    for axis, sig in enumerate(info.dims):
        if batch_sig is not None and sig == batch_sig and (axis == 0 or not info.batched):
            symbolic.append(batch_symbol)
        elif len(set(sig)) == 1:
            symbolic.append(sig[0])
        else:
            symbolic.append(symbol_of.get(sig))
    info.symbolic = symbolic


class _ShapeProber:
    """One ONNX Runtime session of the graph with ``Shape`` of every tensor as its outputs."""

    def __init__(
        self,
        shell: WeightShell,
        nodes: list[onnx.NodeProto],
        inputs: list[onnx.ValueInfoProto],
        by_value: list[str],
    ) -> None:
        import onnxruntime as ort

        self.inputs = inputs
        self.by_value = by_value
        self.values: list[dict[str, tuple[int, ...]]] = []
        graph = shell.model.graph  # a copy of the model's graph: changed in place
        self.names: list[str] = []
        self.shape_names: list[str] = []
        for node in nodes:
            for name in node.output:
                if name:
                    self.names.append(name)
        for i, name in enumerate(self.names):
            out = f"{name}__splitinfer_shape{i}"
            self.shape_names.append(out)
            graph.node.append(helper.make_node("Shape", [name], [out]))
        # the probe's outputs are the shapes only, so the runtime frees every activation
        del graph.output[:]
        for out in self.shape_names:
            graph.output.append(helper.make_tensor_value_info(out, onnx.TensorProto.INT64, None))
        types = {vi.name: vi.type.tensor_type.elem_type for vi in graph.value_info}
        for name in by_value:
            graph.output.append(helper.make_tensor_value_info(name, types[name], None))
        data = shell.model.SerializeToString()
        # no arena, no prepacked weights, and each Shape run as soon as its input is
        # made (the default order leaves them to the end, every activation alive)
        opts = shell.options(
            optimize="none",
            log_severity=4,
            arena=False,
            priority_order=True,
            config={"session.disable_prepacking": "1"},
        )
        self.sess = open_session(data, options=opts)
        del data, opts
        self.run_opts = ort.RunOptions()
        self.run_opts.log_severity_level = 4

    def run(
        self, batch: int | None, sample_shapes: dict[str, list[int]]
    ) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape (inputs included) at ``batch`` and ``sample_shapes``."""
        rng = np.random.default_rng(0)
        feeds: dict[str, np.ndarray] = {}
        for vi in self.inputs:
            dims = dims_of(vi)
            if not dims:
                shape: list[int] = []
            elif batch is not None and _is_batch_dim(vi):
                shape = [batch, *sample_shapes[vi.name]]
            else:
                lead = [int(d) if isinstance(d, int) else 1 for d in dims[:1]]
                shape = lead + sample_shapes[vi.name]
            feeds[vi.name] = _feed(vi, shape, rng)
        try:
            values = self.sess.run([*self.shape_names, *self.by_value], feeds, self.run_opts)
        except Exception as exc:  # ORT's own exception types
            where = f"batch {batch}, " if batch is not None else ""
            sizes = ", ".join(f"{k}={'x'.join(map(str, v.shape))}" for k, v in feeds.items())
            hint = ""
            if batch is not None and batch > 1:
                # an input whose batch sits on an unnamed later axis (a state [2, ?, 128]
                # fixed to 1 by --input-shape) stays at 1 when the batch grows
                held = [
                    f"{vi.name!r} axis {k}"
                    for vi in self.inputs
                    for k, d in enumerate(dims_of(vi))
                    if k > 0 and not isinstance(d, int) and feeds[vi.name].shape[k] == 1
                ]
                if held:
                    hint = (
                        f" (does {' or '.join(held)} hold the batch? splitinfer batches "
                        "requests along the first axis of every input)"
                    )
            raise ModelError(
                f"ONNX Runtime cannot run the model at {where}{sizes}: {_first(exc)}{hint}"
            ) from exc
        result = {n: tuple(int(d) for d in v) for n, v in zip(self.names, values, strict=False)}
        small = values[len(self.names) :]
        self.values.append(
            {
                n: tuple(int(x) for x in np.asarray(v).reshape(-1))
                for n, v in zip(self.by_value, small, strict=True)
            }
        )
        result.update({k: tuple(v.shape) for k, v in feeds.items()})
        return result


def _first(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
