"""Graph optimization passes, one per module, registered by name.

Each pass maps a checked :class:`onnx.ModelProto` to an equivalent one that is
still standard ONNX (default domain only), so the edge segment runs on plain
ONNX Runtime and TensorRT alike. The default pipeline:

``ort_basic``
    ONNX Runtime's offline basic-level optimizer: constant folding, Identity and
    Dropout elimination, Conv+BatchNorm / Conv+Add / Conv+Mul folding, and the
    other provider-independent rewrites. Its output is standard ONNX.
``fuse_hardswish``
    ``x * HardSigmoid(x)`` back into ``HardSwish`` (ORT's basic level expands it).
``onnxslim``
    OnnxSlim: dead-node and common-subexpression elimination, MatMul+Add -> Gemm,
    Pad+Conv, Concat/Reshape clean-ups, a second constant-folding round.

Conv/Gemm/MatMul + activation are *not* rewritten into a fused op: standard ONNX
has none, and both ONNX Runtime (FusedConv) and TensorRT fuse them when they
build their kernels. The partitioner instead treats each such pair as one unit
that no cut separates (see :mod:`splitinfer.partitioner.cuts`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx

from splitinfer.partitioner.passes import fuse_hardswish, ort_basic, slim
from splitinfer.shared.errors import ConfigError, ModelError

Pass = Callable[[onnx.ModelProto], onnx.ModelProto]

PASSES: dict[str, Pass] = {
    "ort_basic": ort_basic.run,
    "fuse_hardswish": fuse_hardswish.run,
    "onnxslim": slim.run,
}

DEFAULT_PIPELINE: tuple[str, ...] = ("ort_basic", "fuse_hardswish", "onnxslim")

STANDARD_DOMAINS = frozenset({"", "ai.onnx"})


@dataclass(frozen=True)
class PassReport:
    name: str
    nodes_before: int
    nodes_after: int


def optimize(
    model: onnx.ModelProto, names: tuple[str, ...] = DEFAULT_PIPELINE
) -> tuple[onnx.ModelProto, list[PassReport]]:
    """Run the named passes in order; return the model and per-pass node counts."""
    reports: list[PassReport] = []
    for name in names:
        if name not in PASSES:
            raise ConfigError(f"unknown optimization pass {name!r}; known: {', '.join(PASSES)}")
        before = len(model.graph.node)
        model = PASSES[name](model)
        check_standard(model, name)
        reports.append(PassReport(name, before, len(model.graph.node)))
    name_nodes(model)
    return model, reports


def name_nodes(model: onnx.ModelProto) -> None:
    """Give every top-level node a unique, non-empty name, in place.

    Per-node costs (measured profiles, roofline estimates) are keyed by node
    name, so a name must identify one node. Existing unique names are kept.
    """
    seen: set[str] = set()
    for i, node in enumerate(model.graph.node):
        name = node.name
        if not name or name in seen:
            base = f"{node.op_type}_{i}"
            name, k = base, 1
            while name in seen:
                name, k = f"{base}_{k}", k + 1
            node.name = name
        seen.add(name)


def check_standard(model: onnx.ModelProto, after: str) -> None:
    """Refuse a result that left standard ONNX (the edge must run anywhere)."""
    for node in model.graph.node:
        if node.domain not in STANDARD_DOMAINS:
            raise ModelError(
                f"optimization pass {after!r} produced non-standard op "
                f"{node.domain}::{node.op_type} (node {node.name!r})"
            )
