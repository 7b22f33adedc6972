"""Which nodes of our graph each node that ONNX Runtime executes came from.

Per-node costs are keyed by the nodes of the optimized graph (the graph the
cuts are made in), but at ``ORT_ENABLE_ALL`` ONNX Runtime runs a rewritten
graph: Conv+Relu becomes one ``FusedConv`` named after the Conv, MatMul+Div a
``FusedMatMul`` called ``<matmul>/MatMulScaleFusion/``, Add+LayerNormalization
a ``SkipLayerNormalization`` with a fresh name, and on x86 the NCHWc layout
transformer turns every Conv into ``<output tensor>_nchwc`` that reads and
writes ``reorder_token_N`` tensors, with ``ReorderInput``/``ReorderOutput``
converting layouts at the borders. :class:`Attributor` maps each runtime node
back to the graph nodes it computes, in three steps:

1. *Anchors.* A runtime node is anchored at the graph node of the same name
   (after stripping ORT's suffixes), at the producer of the tensor an
   ``_nchwc`` name is derived from, and at the producers of its outputs that
   still carry a graph name (layout conversions are looked through). From each
   such producer the walk goes upstream through tensors that no longer exist at
   run time until it meets a node whose op type the runtime op contains
   (``FusedConv`` contains ``Conv``), so ``relu_nchwc`` anchors both the Relu
   and the Conv before it.
2. *Growth.* A graph node no runtime node anchored was fused into a neighbour:
   it joins the runtime node of its producer when the tensor between them
   vanished and had no other consumer (post-ops: activation, residual Add),
   else that of its single consumer (pre-ops: the bias Add of ``BiasGelu``, the
   residual Add of ``SkipLayerNormalization``), repeated to a fixed point.
   ONNX Runtime only fuses through tensors with one consumer, so a tensor with
   several consumers is a real boundary.
3. *Shares.* A runtime node's time is split over its graph nodes in proportion
   to their FLOPs (evenly when they have none).

Layout and device copies (``ReorderInput``, ``ReorderOutput``, ``Memcpy*``)
are charged to the runtime node they serve: the consumer for conversions into
the runtime's layout or device, the producer for conversions out of it.
Runtime nodes that match nothing are left unattributed.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import onnx

from splitinfer.partitioner.analysis import GraphAnalysis

#: Runtime ops that only convert a tensor's layout or device.
INTO_RUNTIME = frozenset({"ReorderInput", "MemcpyFromHost"})
OUT_OF_RUNTIME = frozenset({"ReorderOutput", "MemcpyToHost"})
COPY_OPS = INTO_RUNTIME | OUT_OF_RUNTIME

_FUSION_SUFFIX = re.compile(r"/[A-Za-z0-9_]*Fusion[A-Za-z0-9_]*/?$")
_TOKEN_SUFFIX = re.compile(r"_token_\d+$")
_NCHWC = "_nchwc"
_MAX_WALK = 8  # graph nodes a fused runtime node is assumed to span upstream


def node_keys(analysis: GraphAnalysis) -> list[str]:
    """The key of each analysed node: its name, or ``f"{op_type}_{index}"``.

    ``passes.optimize`` names every node uniquely; a graph that skipped it may
    have empty or repeated names, which get the fallback key (``index`` is the
    position in ``analysis.nodes``).
    """
    counts = Counter(n.name for n in analysis.nodes)
    taken = {n.name for n in analysis.nodes if n.name and counts[n.name] == 1}
    keys: list[str] = []
    for i, node in enumerate(analysis.nodes):
        if node.name and counts[node.name] == 1:
            keys.append(node.name)
            continue
        key = f"{node.op_type}_{i}"
        while key in taken:
            key += "_"
        taken.add(key)
        keys.append(key)
    return keys


@dataclass(frozen=True)
class RuntimeNode:
    """One node of the graph ONNX Runtime executes (its optimized model)."""

    name: str
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    @classmethod
    def from_proto(cls, node: onnx.NodeProto) -> RuntimeNode:
        return cls(
            node.name,
            node.op_type,
            tuple(n for n in node.input if n),
            tuple(n for n in node.output if n),
        )


def name_variants(name: str) -> list[str]:
    """``name`` and what it is once ORT's prefixes and suffixes are removed."""
    out = [name]
    base = name.removeprefix("fused ")
    base = _FUSION_SUFFIX.sub("", base)
    base = _TOKEN_SUFFIX.sub("", base)
    if base and base not in out:
        out.append(base)
    return out


def _op_matches(runtime_op: str, graph_op: str) -> bool:
    return runtime_op == graph_op or (len(graph_op) >= 3 and graph_op in runtime_op)


class _Aliases:
    """Union-find over runtime tensor names joined by layout/device copies."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, name: str) -> str:
        root = name
        while self.parent.get(root, root) != root:
            root = self.parent[root]
        while name != root:  # path compression
            self.parent[name], name = root, self.parent.get(name, name)
        return root

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra


class Attributor:
    """Shares of each runtime node's time over the graph nodes it computes.

    ``runtime`` is the node list of the model ONNX Runtime saved through
    ``SessionOptions.optimized_model_filepath``; ``None`` when that is not
    available (then only names that equal a graph node's key are attributed).
    """

    def __init__(
        self,
        analysis: GraphAnalysis,
        flops: Sequence[int],
        runtime: Sequence[RuntimeNode] | None,
    ) -> None:
        self.keys = node_keys(analysis)
        self._index = {k: i for i, k in enumerate(self.keys)}
        self._analysis = analysis
        self._flops = list(flops)
        self._shares: dict[str, dict[int, float]] = {}
        if runtime is not None:
            self._build(list(runtime))

    def shares(self, runtime_name: str) -> dict[int, float] | None:
        """Graph node index -> fraction of ``runtime_name``'s time; None if unknown."""
        if runtime_name in self._shares:
            return self._shares[runtime_name]
        if runtime_name in self._index:
            return {self._index[runtime_name]: 1.0}
        return None

    # -- construction -----------------------------------------------------

    def _data_inputs(self, i: int) -> list[str]:
        tensors = self._analysis.tensors
        return [
            t
            for t in dict.fromkeys(self._analysis.node_inputs[i])
            if t in tensors and tensors[t].producer is not None
        ]

    def _build(self, runtime: list[RuntimeNode]) -> None:
        a = self._analysis
        aliases = _Aliases()
        for r in runtime:
            if r.op_type in COPY_OPS and r.inputs and r.outputs:
                aliases.union(r.inputs[0], r.outputs[0])
        identity: dict[str, str] = {}
        for r in runtime:
            for t in (*r.inputs, *r.outputs):
                if t in a.tensors:
                    identity.setdefault(aliases.find(t), t)
        self._known = set(identity.values())  # graph tensors that exist at run time

        compute = [r for r in runtime if r.op_type not in COPY_OPS]
        covered: dict[int, list[str]] = {}
        for r in compute:
            for i in sorted(self._anchors(r, aliases, identity)):
                covered.setdefault(i, []).append(r.name)
        self._grow(covered)

        members: dict[str, list[int]] = {}
        for i, owners in covered.items():
            for name in owners:
                members.setdefault(name, []).append(i)
        for name, nodes in members.items():
            weights = [max(self._flops[i], 0) for i in nodes]
            total = sum(weights)
            if total > 0:
                self._shares[name] = {i: w / total for i, w in zip(nodes, weights, strict=True)}
            else:
                self._shares[name] = {i: 1.0 / len(nodes) for i in nodes}

        hosts = self._hosts(runtime, compute, aliases)
        for r in runtime:
            host = hosts.get(r.name)
            if host is not None and host in self._shares:
                self._shares[r.name] = self._shares[host]

    def _anchors(self, r: RuntimeNode, aliases: _Aliases, identity: dict[str, str]) -> set[int]:
        tensors = self._analysis.tensors
        found: set[int] = set()
        for variant in name_variants(r.name):
            if variant in self._index:
                found.add(self._index[variant])
            if variant.endswith(_NCHWC):
                t = variant[: -len(_NCHWC)]
                producer = tensors[t].producer if t in tensors else None
                if producer is not None:
                    found |= self._walk(producer, r.op_type)
        for out in r.outputs:
            graph_name = identity.get(aliases.find(out))
            producer = tensors[graph_name].producer if graph_name is not None else None
            if producer is not None:
                found |= self._walk(producer, r.op_type)
        return found

    def _walk(self, start: int, runtime_op: str) -> set[int]:
        """From ``start`` upstream through vanished tensors to a node of ``runtime_op``."""
        nodes = self._analysis.nodes
        tensors = self._analysis.tensors
        path = [start]
        cur = start
        for _ in range(_MAX_WALK):
            if _op_matches(runtime_op, nodes[cur].op_type):
                return set(path)
            vanished = [t for t in self._data_inputs(cur) if t not in self._known]
            if len(vanished) != 1:
                break
            producer = tensors[vanished[0]].producer
            assert producer is not None
            cur = producer
            path.append(cur)
        return {start}

    def _grow(self, covered: dict[int, list[str]]) -> None:
        a = self._analysis
        outputs = set(a.outputs)

        def fusable(t: str) -> bool:
            return t not in self._known and t not in outputs

        changed = True
        while changed:
            changed = False
            for i, node in enumerate(a.nodes):
                if i in covered:
                    continue
                owners: list[str] | None = None
                for t in self._data_inputs(i):
                    producer = a.tensors[t].producer
                    if fusable(t) and set(a.tensors[t].consumers) == {i} and producer in covered:
                        owners = covered[producer]
                        break
                if owners is None:
                    for t in (o for o in node.output if o):
                        consumers = set(a.tensors[t].consumers)
                        if fusable(t) and len(consumers) == 1:
                            (c,) = consumers
                            if c in covered:
                                owners = covered[c]
                                break
                if owners is not None:
                    covered[i] = list(owners)
                    changed = True

    @staticmethod
    def _hosts(
        runtime: list[RuntimeNode], compute: list[RuntimeNode], aliases: _Aliases
    ) -> dict[str, str]:
        """The compute node each layout/device copy is charged to."""
        producer: dict[str, str] = {}
        consumers: dict[str, list[str]] = {}
        for r in compute:
            for t in r.outputs:
                producer.setdefault(aliases.find(t), r.name)
            for t in r.inputs:
                consumers.setdefault(aliases.find(t), []).append(r.name)
        hosts: dict[str, str] = {}
        for r in runtime:
            if not r.inputs or not r.outputs:
                continue
            root = aliases.find(r.inputs[0])
            before = producer.get(root)
            after = next(iter(consumers.get(root, [])), None)
            if r.op_type in INTO_RUNTIME:
                host = after or before
            elif r.op_type in OUT_OF_RUNTIME:
                host = before or after
            else:
                continue
            if host is not None:
                hosts[r.name] = host
        return hosts


def load_runtime_graph(path: str) -> list[RuntimeNode] | None:
    """The nodes of the optimized model ONNX Runtime wrote, or None if unreadable."""
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception:  # missing or undecodable: fall back to matching by name
        return None
    return [RuntimeNode.from_proto(n) for n in model.graph.node]
