"""OnnxSlim: dead nodes, common subexpressions, standard-op pattern fusions.

On a real-size model most of onnxslim's time goes into serializing the weights
(``ByteSize`` to decide whether the model passes 2 GB, then ONNX shape
inference on a full copy): 22 s of 26 s on BERT-base. The weights play no part
in what it rewrites (ONNX Runtime's basic pass before it has folded the
constants), so large initializers travel beside onnxslim: they go in as
data-less tensors of the same name, type and shape, and their data is put back
by name afterwards. If onnxslim reads such a tensor's values (it would fail on
the missing data), drops one and reuses its name, or changes its type or shape,
the pass runs again on the whole model, as before. Each data-less tensor carries
a label of its data (the same for tensors of equal type, dims and bytes, and only
for those), so onnxslim ties equal weights (and only those) as it does with the
data in place.
"""

from __future__ import annotations

import logging

import onnx

from splitinfer.partitioner.loader import copy_except
from splitinfer.shared.errors import ModelError

#: Initializers at least this big (bytes of data) do not go through onnxslim.
STRIP_BYTES = 1 << 16
_SHELL = "splitinfer:held:"


def run(model: onnx.ModelProto) -> onnx.ModelProto:
    logging.getLogger("onnxslim").setLevel(logging.ERROR)
    light, held = _strip(model)
    if held:
        try:
            out = _restore(_slim(light), held)
        except Exception:  # onnxslim read a data-less tensor, or failed: do it in full
            out = None
        if out is not None:
            return out
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


def _strip(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, onnx.TensorProto]]:
    """A copy of ``model`` whose large initializers have no data, and those initializers."""
    graph = model.graph
    held = {t.name: t for t in graph.initializer if _data_bytes(t) >= STRIP_BYTES}
    if not held:
        return model, {}
    light = onnx.ModelProto()
    copy_except(light, model, "graph")
    copy_except(light.graph, graph, "initializer")
    kept = graph.initializer
    # onnxslim ties constants whose fields other than the name are equal: the label
    # keeps equal weights equal and different weights different. Labels by exact
    # comparison: Python's bytes hash picks the candidates (a fifth of blake2b's time),
    # the bytes decide.
    labels: dict[tuple[int, tuple[int, ...], int], list[tuple[onnx.TensorProto, int]]] = {}
    count = 0
    for t in kept:
        if t.name in held:
            raw = t.raw_data
            same = labels.setdefault((t.data_type, tuple(t.dims), hash(raw)), [])
            label = next((k for rep, k in same if rep.raw_data == raw), None)
            if label is None:
                label, count = count, count + 1
                same.append((t, label))
            del raw
            shell = light.graph.initializer.add()
            shell.name, shell.data_type = t.name, t.data_type
            shell.dims.extend(t.dims)
            shell.doc_string = f"{_SHELL}{label}"
        else:
            light.graph.initializer.add().CopyFrom(t)
    return light, held


def _restore(out: onnx.ModelProto, held: dict[str, onnx.TensorProto]) -> onnx.ModelProto | None:
    """Put the held data back by name; ``None`` if the result does not line up.

    A node left with only constant inputs, one of them held, is one onnxslim would
    have folded with the data in place (its folding skips nodes it cannot evaluate).
    """
    consts = {t.name for t in out.graph.initializer}
    for node in out.graph.node:
        ins = [i for i in node.input if i]
        if ins and all(i in consts for i in ins) and any(i in held for i in ins):
            return None
    for t in out.graph.initializer:
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
