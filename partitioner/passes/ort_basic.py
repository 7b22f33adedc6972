"""ONNX Runtime's offline basic-level graph optimization.

Basic level holds only provider-independent, semantics-preserving rewrites
(constant folding, redundant node elimination such as Identity and Dropout,
Conv+BatchNorm/Add/Mul folding), so the saved graph stays standard ONNX and
portable; extended and higher levels insert contrib ops and are not used.

The weights go to ONNX Runtime beside the graph (a :class:`WeightShell`: the
model serialized without them, they replace the references before any
optimization runs): serializing a real-size model with its weights in it costs
seconds in Python. They come back the same way: ONNX Runtime writes the
optimized graph with its weights in a file beside it (its external-initializer
writer, half the time of writing them inline on BERT-base). Given a folder
(``beside``, as :func:`splitinfer.partitioner.passes.optimize` does), the pass
leaves them there as external-data references, for the passes after it to
leave untouched and ``optimize`` to read once at the end; alone, it reads them
back itself. That writer orders the nodes its own way and drops the nodes'
``metadata_props``; the nodes are put back in the source model's order (the order
numbers the units and the cuts, so the same model keeps the same cut ids whatever
order a version of ONNX Runtime writes).
"""

from __future__ import annotations

import heapq
import tempfile
from pathlib import Path

import onnx

from splitinfer.partitioner.analysis import subgraph_outer_inputs
from splitinfer.partitioner.loader import WeightShell
from splitinfer.partitioner.passes.beside import BESIDE_BYTES, read_beside
from splitinfer.shared.ortsession import open_session

#: The file, in ``beside``, that holds the optimized graph's large initializers.
WEIGHTS_FILE = "ort_basic.weights"

# Initializers of at least BESIDE_BYTES go to the file beside the graph; the session
# is made only to write it, so its kernels do not prepack the weights (a third of the
# session's time on BERT-base).
_WRITE_WEIGHTS_BESIDE = {
    "session.optimized_model_external_initializers_file_name": WEIGHTS_FILE,
    "session.optimized_model_external_initializers_min_size_in_bytes": str(BESIDE_BYTES),
    "session.disable_prepacking": "1",
}


def run(model: onnx.ModelProto, beside: Path | None = None) -> onnx.ModelProto:
    """The optimized model; with ``beside``, its large initializers stay in a file
    there (external-data references relative to ``beside``)."""
    if beside is None:
        with tempfile.TemporaryDirectory(prefix="splitinfer-ort-") as tmp:
            out = run(model, Path(tmp))
            read_beside(out, Path(tmp))
            return out
    shell = WeightShell(model)
    data = shell.model.SerializeToString()
    dst = beside / "ort_basic.onnx"
    opts = shell.options(
        optimize="basic", optimized_path=dst, arena=False, config=_WRITE_WEIGHTS_BESIDE
    )
    open_session(data, options=opts, name="the model")
    del data, opts, shell  # ONNX Runtime has copied the weights
    out = onnx.load(str(dst), load_external_data=False)
    in_source_order(out, model)
    # ORT does not carry model-level metadata through; keep the source's.
    del out.metadata_props[:]
    out.metadata_props.extend(model.metadata_props)
    out.producer_name = model.producer_name
    out.producer_version = model.producer_version
    return out


def in_source_order(out: onnx.ModelProto, source: onnx.ModelProto) -> None:
    """Reorder ``out``'s nodes, in place, as their counterparts in ``source``.

    A node's counterpart makes one of the same outputs (a node ONNX Runtime changed
    in place, such as a Conv with its BatchNorm folded in, keeps an output name);
    a node with none goes right after the last node it reads from. Ties, and nodes
    that must move to stay topological, keep the written order.
    """
    place: dict[str, int] = {}
    for i, node in enumerate(source.graph.node):
        for name in node.output:
            if name:
                place.setdefault(name, i)
    nodes = list(out.graph.node)
    made_by = {name: j for j, node in enumerate(nodes) for name in node.output if name}
    preds: list[set[int]] = []
    for node in nodes:
        reads = [*node.input, *subgraph_outer_inputs(node)]
        preds.append({made_by[n] for n in reads if n in made_by})
    succs: list[list[int]] = [[] for _ in nodes]
    for j, ps in enumerate(preds):
        for p in ps:
            succs[p].append(j)
    own = [min((place[n] for n in node.output if n in place), default=None) for node in nodes]
    key: list[float] = [0.0] * len(nodes)
    waiting = [len(ps) for ps in preds]
    ready: list[tuple[float, int]] = []

    def push(j: int) -> None:
        mine = own[j]
        key[j] = (
            float(mine) if mine is not None else max((key[p] for p in preds[j]), default=-1) + 0.5
        )
        heapq.heappush(ready, (key[j], j))

    for j, count in enumerate(waiting):
        if count == 0:
            push(j)
    order: list[int] = []
    while ready:
        _, j = heapq.heappop(ready)
        order.append(j)
        for s in succs[j]:
            waiting[s] -= 1
            if waiting[s] == 0:
                push(s)
    if len(order) != len(nodes):  # a cycle: not ours to judge here, leave the order
        return
    del out.graph.node[:]
    out.graph.node.extend(nodes[j] for j in order)
