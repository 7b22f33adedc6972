"""Fuse ``x * HardSigmoid(x, alpha=1/6, beta=0.5)`` back into ``HardSwish(x)``.

ONNX Runtime's basic level expands HardSwish (an ONNX function op) into
HardSigmoid and Mul when it saves the optimized model; TensorRT and ORT both
have one kernel for HardSwish, so the pair is put back. The result is standard
ONNX (HardSwish is in the default domain since opset 14). Neither ORT nor
onnxslim has this rewrite, hence a pass of our own.
"""

from __future__ import annotations

import math
from pathlib import Path

import onnx
from onnx import helper


def _float_attr(node: onnx.NodeProto, name: str, default: float) -> float:
    for a in node.attribute:
        if a.name == name:
            return float(a.f)
    return default


def run(model: onnx.ModelProto, beside: Path | None = None) -> onnx.ModelProto:
    """``beside`` is not read: the pass never reads initializer data."""
    opset = next((o.version for o in model.opset_import if o.domain in {"", "ai.onnx"}), 0)
    if opset < 14:
        return model
    graph = model.graph
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    replace: dict[int, onnx.NodeProto] = {}
    drop: set[int] = set()
    for hs in graph.node:
        if hs.op_type != "HardSigmoid" or hs.domain not in {"", "ai.onnx"}:
            continue
        if not (
            math.isclose(_float_attr(hs, "alpha", 0.2), 1 / 6, rel_tol=1e-5)
            and math.isclose(_float_attr(hs, "beta", 0.5), 0.5, rel_tol=1e-6)
        ):
            continue
        x, gate = hs.input[0], hs.output[0]
        users = consumers.get(gate, [])
        if len(users) != 1 or gate in outputs:
            continue
        mul = users[0]
        if mul.op_type != "Mul" or sorted(mul.input) != sorted([x, gate]):
            continue
        fused = helper.make_node("HardSwish", [x], [mul.output[0]], name=mul.name or hs.name)
        replace[id(mul)] = fused
        drop.add(id(hs))
    if not replace:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    new_nodes = [replace.get(id(n), n) for n in graph.node if id(n) not in drop]
    del out.graph.node[:]
    out.graph.node.extend(new_nodes)
    return out
