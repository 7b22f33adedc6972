"""OnnxSlim: dead nodes, common subexpressions, standard-op pattern fusions.

On a real-size model most of onnxslim's time goes into serializing the weights
(``ByteSize`` to decide whether the model passes 2 GB, then ONNX shape
inference on a full copy): 22 s of 26 s on BERT-base. The weights play no part
in what it rewrites (ONNX Runtime's basic pass before it has folded the
constants), so large initializers travel beside onnxslim: they go in as
data-less tensors of the same name, type and shape, and their data is put back
by name afterwards (where ONNX Runtime's pass left them in a file beside the
graph, only the reference is put back). If onnxslim reads such a tensor's values
(it would fail on the missing data), drops one and reuses its name, or changes
its type or shape, the pass runs again on the whole model, as before. Each
data-less tensor carries a label of its data (the same for tensors of equal
type, dims and bytes, and only for those), so onnxslim ties equal weights (and
only those) as it does with the data in place.
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx

from splitinfer.partitioner.loader import copy_except
from splitinfer.partitioner.passes.beside import (
    BesideData,
    any_beside,
    graphs,
    is_beside,
    node_tensors,
    read_beside,
    tensors,
)
from splitinfer.shared.errors import ModelError

#: Initializers at least this big (bytes of data) do not go through onnxslim.
STRIP_BYTES = 1 << 16
_SHELL = "splitinfer:held:"


def run(model: onnx.ModelProto, beside: Path | None = None) -> onnx.ModelProto:
    """The slimmed model; ``beside``: the folder of its external-data initializers (they
    stay references)."""
    logging.getLogger("onnxslim").setLevel(logging.ERROR)
    light, held = _strip(model, None if beside is None else BesideData(beside))
    if held:
        try:
            out = _restore(_slim(light), held)
        except Exception:  # onnxslim read a data-less tensor, or failed: do it in full
            out = None
        if out is not None:
            return out
    if beside is not None and any_beside(model):
        whole = onnx.ModelProto()
        whole.CopyFrom(model)
        read_beside(whole, beside)
        model = whole
    return _slim(model)


def _slim(model: onnx.ModelProto) -> onnx.ModelProto:
    import onnxslim

    try:
        out = onnxslim.slim(model)
    except Exception as exc:  # onnxslim raises bare Exceptions from its graph code
        raise ModelError(f"onnxslim failed on the model: {exc}") from exc
    if not isinstance(out, onnx.ModelProto):
        raise ModelError("onnxslim returned no model")
    return out


def _data_bytes(t: onnx.TensorProto) -> int:
    """Bytes of ``raw_data`` (from the shape: reading the field copies it), else 0."""
    if t.data_location == onnx.TensorProto.EXTERNAL or not t.HasField("raw_data"):
        return 0  # typed fields (float_data, ...): small in practice, left in place
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        return 0
    return _elements(t) * itemsize


def _strip(
    model: onnx.ModelProto, data: BesideData | None = None
) -> tuple[onnx.ModelProto, dict[str, onnx.TensorProto]]:
    """A copy of ``model`` whose large initializers have no data, and those initializers
    (with ``data``, every external-data initializer among them).

    Only the top-level graph's initializers are held: where a subgraph (an If branch,
    a Loop body) holds a tensor beside the graph, nothing is, and the whole model goes
    through onnxslim with its data read in."""
    graph = model.graph
    if data is not None and any(is_beside(t) for t in node_tensors(graph)):
        return model, {}
    held = {
        t.name: t
        for t in graph.initializer
        if (data is not None and is_beside(t)) or _data_bytes(t) >= STRIP_BYTES
    }
    if not held:
        return model, {}
    light = onnx.ModelProto()
    copy_except(light, model, "graph")
    copy_except(light.graph, graph, "initializer")
    kept = graph.initializer
    # onnxslim ties constants whose fields other than the name are equal: the label
    # keeps equal weights equal and different weights different. Labels by exact
    # comparison: a fingerprint (size, first and last 4 KB) picks the candidates, the
    # bytes decide.
    labels: dict[
        tuple[int, tuple[int, ...], tuple[int, int, int]], list[tuple[onnx.TensorProto, int]]
    ]
    labels = {}
    count = 0
    for t in kept:
        if t.name in held:
            buf = _bytes(t, data)
            same = labels.setdefault((t.data_type, tuple(t.dims), _fingerprint(buf)), [])
            label = next((k for rep, k in same if _bytes(rep, data) == buf), None)
            if label is None:
                label, count = count, count + 1
                same.append((t, label))
            del buf
            shell = light.graph.initializer.add()
            shell.name, shell.data_type = t.name, t.data_type
            shell.dims.extend(t.dims)
            shell.doc_string = f"{_SHELL}{label}"
        else:
            light.graph.initializer.add().CopyFrom(t)
    return light, held


def _bytes(t: onnx.TensorProto, data: BesideData | None) -> bytes | memoryview:
    """A held tensor's data: a view of the file beside the graph, or its ``raw_data``."""
    if is_beside(t):
        assert data is not None
        return data.bytes_of(t)
    return t.raw_data


def _fingerprint(buf: bytes | memoryview) -> tuple[int, int, int]:
    return len(buf), hash(bytes(buf[:4096])), hash(bytes(buf[-4096:]))


def _restore(out: onnx.ModelProto, held: dict[str, onnx.TensorProto]) -> onnx.ModelProto | None:
    """Put the held data back by name; ``None`` if the result does not line up.

    A node left with only constant inputs, one of them held, is one onnxslim would
    have folded with the data in place (its folding skips nodes it cannot evaluate).
    Subgraphs are looked at too: onnxslim moves an initializer that only one If
    branch reads into that branch.
    """
    every = list(graphs(out.graph))
    consts = {t.name for g in every for t in g.initializer}
    for node in (n for g in every for n in g.node):
        ins = [i for i in node.input if i]
        if ins and all(i in consts for i in ins) and any(i in held for i in ins):
            return None
    for t in (t for g in every for t in g.initializer):
        src = held.get(t.name)
        empty = not t.HasField("raw_data") and t.data_location != onnx.TensorProto.EXTERNAL
        if src is None:
            if t.doc_string.startswith(_SHELL) or (
                empty and _elements(t) > 0 and not _has_typed_data(t)
            ):
                return None  # a data-less tensor under a new name
            continue
        if list(t.dims) != list(src.dims) or t.data_type != src.data_type or not empty:
            return None
        t.CopyFrom(src)
    if any(t.doc_string.startswith(_SHELL) for t in tensors(out.graph)):
        return None  # a data-less tensor made a node's attribute
    return out


def _elements(t: onnx.TensorProto) -> int:
    n = 1
    for d in t.dims:
        n *= d
    return n


def _has_typed_data(t: onnx.TensorProto) -> bool:
    return any(
        len(getattr(t, f))
        for f in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data")
    ) or bool(t.string_data)
