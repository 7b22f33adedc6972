"""Graph optimization passes, one per module, registered by name.

Each pass maps a checked :class:`onnx.ModelProto` to an equivalent one and adds
no op outside the default ONNX domain, so a segment of a standard model runs on
plain ONNX Runtime and TensorRT alike. Ops outside it that the source model
already holds (ddddocr's ``com.microsoft::DynamicQuantizeLSTM``) pass through
untouched: :func:`check_standard` refuses only one a pass *introduced*, naming the
source node it took the place of, and a segment that holds one is marked in the
package as needing ONNX Runtime (:attr:`Segment.nonstandard_ops
<splitinfer.shared.manifest.Segment.nonstandard_ops>`). The default pipeline:

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
from collections import Counter
from collections.abc import Callable, Iterator
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
        sources = _made_by(model)
        for name in names:
            if name not in PASSES:
                raise ConfigError(f"unknown optimization pass {name!r}; known: {', '.join(PASSES)}")
            if name not in KEEP_BESIDE:
                read_beside(model, beside)
            before = len(model.graph.node)
            held = HeldOps.of(model)  # before the pass: some change the model in place
            model = PASSES[name](model, beside)
            check_standard(model, name, held, sources)
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


def op_key(node: onnx.NodeProto) -> str:
    """``domain::op_type`` (``ai.onnx`` for the default domain)."""
    return f"{node.domain or 'ai.onnx'}::{node.op_type}"


def _nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node of ``graph``, those of its subgraphs (If, Loop, Scan bodies) included."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in (*([attr.g] if attr.HasField("g") else ()), *attr.graphs):
                yield from _nodes(sub)


def nonstandard_ops(model: onnx.ModelProto) -> tuple[str, ...]:
    """The ops outside the default ONNX domain ``model`` holds, ``domain::op_type``, sorted."""
    return tuple(sorted({op_key(n) for n in _nodes(model.graph) if not _standard(n)}))


def _standard(node: onnx.NodeProto) -> bool:
    return node.domain in STANDARD_DOMAINS


def _made_by(model: onnx.ModelProto) -> dict[str, tuple[str, str]]:
    """Each tensor name -> (name, ``domain::op_type``) of the node that makes it."""
    return {
        out: (node.name, op_key(node)) for node in _nodes(model.graph) for out in node.output if out
    }


@dataclass(frozen=True)
class HeldOps:
    """The non-standard ops a model holds: by the tensors they make, and counted."""

    by_output: dict[str, str]
    counts: Counter[str]

    @classmethod
    def of(cls, model: onnx.ModelProto) -> HeldOps:
        odd = [n for n in _nodes(model.graph) if not _standard(n)]
        return cls(
            {out: op_key(n) for n in odd for out in n.output if out},
            Counter(op_key(n) for n in odd),
        )


def check_standard(
    model: onnx.ModelProto,
    after: str,
    held: HeldOps | None = None,
    sources: dict[str, tuple[str, str]] | None = None,
) -> None:
    """Refuse a non-standard op that pass ``after`` introduced (the edge must run anywhere).

    ``held`` is what the model the pass was given held: a non-standard node of the
    result is held over when a node of the same ``domain::op_type`` made one of the
    same outputs there, or, where the pass renamed them, when the model held more such
    ops than the result's other held-over nodes account for. Without ``held`` every
    non-standard op is refused. An introduced one is named with the source node
    (``sources``: tensor name -> (node name, op) in the source model) whose output it
    now makes.
    """
    held = held or HeldOps({}, Counter())
    spare = Counter(held.counts)
    renamed: list[onnx.NodeProto] = []
    for node in _nodes(model.graph):
        if _standard(node):
            continue
        key = op_key(node)
        if any(held.by_output.get(o) == key for o in node.output if o):
            spare[key] -= 1
        else:
            renamed.append(node)
    for node in renamed:
        key = op_key(node)
        if spare[key] > 0:
            spare[key] -= 1
            continue
        origin = next((sources[o] for o in node.output if sources and o in sources), None)
        source = ""
        if origin is not None:
            source = f", in place of source node {origin[0] or '(unnamed)'!r} ({origin[1]})"
        raise ModelError(
            f"optimization pass {after!r} produced non-standard op {key} "
            f"(node {node.name!r}{source}), which the source model does not hold; "
            f"leave the pass out with --skip-pass {after}"
        )
