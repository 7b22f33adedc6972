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

import contextlib
import importlib
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx

from splitinfer.partitioner.passes import fuse_hardswish, ort_basic, slim
from splitinfer.partitioner.passes.beside import read_beside
from splitinfer.shared.errors import ConfigError, ModelError

#: A pass: the model, and the folder its external-data initializers are in (None: the
#: model has none) -> the optimized model.
Pass = Callable[[onnx.ModelProto, Path | None], onnx.ModelProto]

PASSES: dict[str, Pass] = {
    "ort_basic": ort_basic.run,
    "fuse_hardswish": fuse_hardswish.run,
    "onnxslim": slim.run,
}

#: Passes that take a model whose large initializers are still beside the graph.
KEEP_BESIDE = frozenset({"fuse_hardswish", "onnxslim"})

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
    if "onnxslim" in names[1:]:
        _import_soon("onnxslim")
    with tempfile.TemporaryDirectory(prefix="splitinfer-passes-") as tmp:
        beside = Path(tmp)  # where ort_basic leaves the weights (see .beside)
        for name in names:
            if name not in PASSES:
                raise ConfigError(f"unknown optimization pass {name!r}; known: {', '.join(PASSES)}")
            if name not in KEEP_BESIDE:
                read_beside(model, beside)
            before = len(model.graph.node)
            model = PASSES[name](model, beside)
            check_standard(model, name)
            reports.append(PassReport(name, before, len(model.graph.node)))
        read_beside(model, beside)
    name_nodes(model)
    return model, reports


def _import_soon(module: str) -> None:
    """Import ``module`` on a thread while the passes before it run.

    onnxslim's import (sympy among it) takes half a second; ONNX Runtime's pass
    before it works without the GIL, so the import overlaps it. The pass itself
    imports the module as usual (waiting for this import if it is not done).
    """

    def load() -> None:
        with contextlib.suppress(Exception):  # the pass's own import reports failures
            importlib.import_module(module)

    threading.Thread(target=load, name=f"import-{module}", daemon=True).start()


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
