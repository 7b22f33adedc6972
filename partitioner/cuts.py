"""Valid cuts of a graph that need not be a chain.

A cut splits the *data nodes* (nodes with a batched output) into an edge set E
and a cloud set C such that nothing in E depends on anything in C: E is a
down-set (an ideal) of the dependency order. The tensors crossing from E to C
(plus the model inputs the cloud half reads, e.g. an attention mask) are the
cut. Residual and multi-branch blocks thus give cuts that carry several tensors.

Shape arithmetic (non-batched nodes such as ``Shape -> Gather -> Concat``) is
not part of the order: each half computes what it needs from what it has. On the
cloud, a ``Shape`` of a tensor that stays on the edge is replaced by the sizes of
the tensors that cross (an axis whose size follows the same batch, sequence
length or image size in every analysis run), so the cloud segment runs at every
size the source model runs at; a shape that no crossing tensor gives carries its
tensor across instead.

Units: a Conv/ConvTranspose/Gemm/MatMul whose only consumer is an activation
forms one unit with it. Runtimes fuse such pairs; a cut between them would ship
the same bytes as the cut after the activation, uncompressed by it.
Control-flow nodes (If/Loop/Scan) are single nodes: no cut enters their bodies.

Complexity: building units and the order is O(V + E). Enumeration is
output-sensitive: each ideal is produced from its parent by adding one
available unit, O(width * degree) big-int operations per ideal, so
O(#cuts * width * degree) overall; a chain of V nodes has V + 1 cuts. Each cut
is then planned (crossing tensors, bytes, FLOPs) in O(V + E). Graphs with many
parallel branches have exponentially many cuts; ``max_cuts`` bounds the
exhaustive list (:meth:`CutSpace.exhaustive` is None past it) and the callers
then choose by minimum cut (``partitioner/cutsearch.py``) over a count of the
space (:meth:`CutSpace.count`) that needs no list.

Ids: in an enumerated space ``c0`` (all cloud) ... ``cN`` (all edge) in the
order of :meth:`CutSpace.ideals`. Any cut also has a *frontier id*, ``u`` and
the dot-separated indices of the last units on the edge (``u12.40``), which
needs no enumeration; ``c0`` stands for the empty edge set in both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from splitinfer.partitioner.analysis import GraphAnalysis, TensorInfo
from splitinfer.partitioner.flops import all_flops
from splitinfer.partitioner.mincut import closure, topological
from splitinfer.shared.errors import CutError

FUSABLE_PRODUCERS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
ACTIVATIONS = frozenset(
    {
        "Relu", "Clip", "LeakyRelu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Gelu",
        "Elu", "Selu", "Celu", "Softplus", "Mish", "ThresholdedRelu",
    }
)  # fmt: skip

DEFAULT_MAX_CUTS = 20_000

#: Nodes that read only the shape of their input.
SHAPE_OPS = frozenset({"Shape", "Size"})

#: One axis of a rebuilt shape: (tensor the cloud receives, axis), or ("", fixed size).
DimSource = tuple[str, int]


@dataclass(frozen=True)
class CutPlan:
    """One valid cut, planned: what runs where and what crosses."""

    id: str
    edge_units: int  # bitmask over units
    edge_nodes: tuple[int, ...]
    cloud_nodes: tuple[int, ...]
    crossing: tuple[str, ...]  # batched tensors sent edge -> cloud, in topological order
    remat: tuple[str, ...]  # non-batched tensors the cloud recomputes instead of receiving
    bytes_per_sample: int
    edge_flops: int
    cloud_flops: int
    #: Shape/Size nodes whose input stays on the edge, computed on the cloud from the
    #: sizes of tensors it receives: node index -> per axis (tensor, axis) or ("", size).
    rebuilt: tuple[tuple[int, tuple[DimSource, ...]], ...] = ()
    #: Shape values the same in every analysis run: constants in the cloud segment.
    constants: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        if not self.edge_nodes:
            return "none"
        if not self.cloud_nodes:
            return "all"
        return "split"


class CutSpace:
    """Units, their dependency order, and every valid cut of an analysed graph."""

    def __init__(self, analysis: GraphAnalysis, max_cuts: int = DEFAULT_MAX_CUTS) -> None:
        self.analysis = analysis
        self.max_cuts = max_cuts
        self.flops = all_flops(analysis)
        self._build_units()
        self._plans: list[CutPlan] | None = None
        self._too_many = False
        self._count: tuple[int, bool] | None = None
        self._by_mask: dict[int, CutPlan] | None = None

    # -- units and order ----------------------------------------------------
    def _build_units(self) -> None:
        a = self.analysis
        nodes = a.nodes
        unit_of: dict[int, int] = {}
        units: list[list[int]] = []
        for i, node in enumerate(nodes):
            if not a.data_node[i] or i in unit_of:
                continue
            unit_of[i] = len(units)
            units.append([i])
            if node.op_type in FUSABLE_PRODUCERS and len(node.output) == 1:
                info = a.tensors[node.output[0]]
                if len(info.consumers) == 1 and node.output[0] not in a.outputs:
                    j = info.consumers[0]
                    if nodes[j].op_type in ACTIVATIONS and a.data_node[j] and j not in unit_of:
                        unit_of[j] = unit_of[i]
                        units[-1].append(j)
        self.units = units
        self.unit_of = unit_of
        # near[i]: bitmask of the units whose outputs node i reads, directly or through
        # chains of non-data nodes (shape arithmetic).
        near: list[int] = [0] * len(nodes)
        for i in range(len(nodes)):
            mask = 0
            for name in a.node_inputs[i]:
                p = a.tensors[name].producer if name in a.tensors else None
                if p is None:
                    continue
                mask |= (1 << unit_of[p]) if p in unit_of else near[p]
            near[i] = mask
        self.near = near
        pred = [0] * len(units)
        for u, members in enumerate(units):
            for i in members:
                pred[u] |= near[i]
            pred[u] &= ~(1 << u)
        self.pred = pred
        succ: list[list[int]] = [[] for _ in units]
        for u, mask in enumerate(pred):
            m = mask
            while m:
                low = m & -m
                succ[low.bit_length() - 1].append(u)
                m ^= low
        self.succ = succ
        self.full = (1 << len(units)) - 1
        self.below = closure(pred, down=True)  # each unit and everything it depends on
        self.above = closure(pred, down=False)  # each unit and everything that reads it

    # -- enumeration ----------------------------------------------------------
    def ideals(self) -> list[int]:
        """Every down-set of the unit order, sorted by size then topological position."""
        pred, succ = self.pred, self.succ
        start_avail = 0
        for u, mask in enumerate(pred):
            if mask == 0:
                start_avail |= 1 << u
        seen = {0}
        stack = [(0, start_avail)]
        while stack:
            ideal, avail = stack.pop()
            a = avail
            while a:
                low = a & -a
                a ^= low
                new = ideal | low
                if new in seen:
                    continue
                seen.add(new)
                if len(seen) > self.max_cuts:
                    self._too_many = True
                    raise CutError(
                        f"the graph has more than {self.max_cuts} valid cuts (many parallel "
                        "branches) to list them all; raise --max-cuts, or let --list-cuts "
                        "and --split auto choose by minimum cut"
                    )
                navail = avail & ~low
                for w in succ[low.bit_length() - 1]:
                    if pred[w] & ~new == 0:
                        navail |= 1 << w
                stack.append((new, navail))
        return sorted(seen, key=lambda m: (m.bit_count(), bits(m)))

    def plans(self) -> list[CutPlan]:
        """Every valid cut, planned, with ids ``c0`` (all cloud) ... ``cN`` (all edge);
        :class:`CutError` past ``max_cuts``."""
        if self._plans is None:
            plans: list[CutPlan] = []
            for ideal in self.ideals():  # down-sets by construction: closed
                plan = self.plan(ideal, f"c{len(plans)}", closed=True)
                if plan is not None:
                    plans.append(plan)
            self._plans = plans
        return self._plans

    @property
    def too_many_to_list(self) -> bool:
        """True once listing has stopped at ``max_cuts``."""
        return self._too_many

    def exhaustive(self) -> list[CutPlan] | None:
        """:meth:`plans`, or None when the space has more than ``max_cuts`` cuts."""
        if self._too_many:
            return None
        try:
            return self.plans()
        except CutError:
            if self._too_many:
                return None
            raise

    def count(self, budget: int = 2_000_000) -> tuple[int, bool]:
        """``(n, exact)``: the number of valid cuts when the space was enumerated, else
        the number of down-sets of the unit order counted without listing them
        (units that a tensor which cannot cross ties together counted as one), or, if
        that visits more than ``budget`` elements, a lower bound (``exact`` False)."""
        if self._plans is not None:
            return len(self._plans), True
        if self._count is None:
            from splitinfer.partitioner.cutsearch import count_space

            self._count = count_space(self, budget)
        return self._count

    def depths(self) -> list[int]:
        """Per unit: the length of the longest dependency chain that ends at it."""
        depth = [0] * len(self.units)
        for u in topological(self.pred):
            m, d = self.pred[u], 0
            while m:
                low = m & -m
                d = max(d, depth[low.bit_length() - 1] + 1)
                m ^= low
            depth[u] = d
        return depth

    # -- one cut --------------------------------------------------------------
    def frontier_id(self, edge_units: int) -> str:
        """The id of an edge set that needs no enumeration: ``u`` + its last units."""
        if edge_units == 0:
            return "c0"
        last = []
        m = edge_units
        while m:
            low = m & -m
            u = low.bit_length() - 1
            if self.above[u] & edge_units == low:
                last.append(u)
            m ^= low
        return "u" + ".".join(map(str, last))

    def edge_set_of(self, units: Sequence[int]) -> int:
        """The smallest edge set holding ``units``."""
        mask = 0
        for u in units:
            mask |= self.below[u]
        return mask

    def plan_for(self, edge_units: int) -> CutPlan | None:
        """The plan of an edge set, with its ``cN`` id when the space is enumerated and
        its frontier id otherwise; None if it is not a valid cut."""
        if self._plans is not None:
            if self._by_mask is None:
                self._by_mask = {p.edge_units: p for p in self._plans}
            return self._by_mask.get(edge_units)
        return self.plan(edge_units, self.frontier_id(edge_units))

    def plan(self, edge_units: int, cut_id: str, *, closed: bool = False) -> CutPlan | None:
        """Place every node for the edge set ``edge_units``; None if no valid split.
        ``closed``: the caller knows the set is closed under dependencies."""
        try:
            return self._plan(edge_units, cut_id, closed=closed)
        except _Invalid:
            return None

    def explain(self, edge_units: int) -> str:
        """Why ``edge_units`` gives no valid cut (for error messages)."""
        try:
            self._plan(edge_units, "?")
        except _Invalid as exc:
            return str(exc)
        return ""

    def _plan(self, edge_units: int, cut_id: str, *, closed: bool = False) -> CutPlan:
        a = self.analysis
        tensors = a.tensors
        unit_of = self.unit_of
        if not closed:
            m = edge_units
            while m:
                low = m & -m
                if self.pred[low.bit_length() - 1] & ~edge_units:
                    raise _Invalid("the edge set is not closed under dependencies")
                m ^= low
        cloud: set[int] = set()
        crossing: list[str] = []
        remat: list[str] = []
        sources: dict[int, str] = {}  # Shape/Size node -> the edge-side tensor it reads
        constants: list[str] = []
        seen: set[str] = set()
        chain: set[str] = set()  # inputs of a recomputed shape chain
        need = list(a.outputs)
        while need:
            name = need.pop()
            if name in seen:
                continue
            seen.add(name)
            info = tensors[name]
            if info.is_initializer:
                continue
            if info.is_input:
                crossing.append(name)
                continue
            p = info.producer
            assert p is not None
            if p in unit_of:
                if not edge_units >> unit_of[p] & 1:
                    cloud.add(p)
                    need.extend(a.node_inputs[p])
                elif info.batched or (edge_units == self.full and name in a.outputs):
                    crossing.append(name)
                else:
                    raise _Invalid(
                        f"tensor {name!r} would cross the cut but is not batched "
                        f"(shape {list(info.sample_shape)}) and cannot be rebuilt on the cloud"
                    )
                continue
            # shape arithmetic and other non-batched work: computed on every side that
            # needs it, from what that side has
            in_chain = name in chain
            if not in_chain and self.near[p] & ~edge_units == 0:
                remat.append(name)
                in_chain = True
            if info.value is not None:  # the same in every run: a constant on the cloud
                constants.append(name)
                continue
            cloud.add(p)
            source = self._shape_source(p, edge_units)
            if source is not None:
                sources[p] = source
                continue
            if in_chain:
                chain.update(a.node_inputs[p])
            need.extend(a.node_inputs[p])
        rebuilt = self._rebuild_shapes(sources, crossing)
        constants = [c for c in constants if tensors[c].producer not in cloud]
        edge: set[int] = set()
        need_edge = [c for c in crossing if not tensors[c].is_input]
        seen = set()
        while need_edge:
            name = need_edge.pop()
            if name in seen:
                continue
            seen.add(name)
            info = tensors[name]
            if info.producer is None:
                continue
            p = info.producer
            if p in cloud and p in unit_of:
                raise _Invalid(f"node {a.nodes[p].name!r} would be needed on both sides")
            edge.add(p)
            need_edge.extend(a.node_inputs[p])
        crossing.sort(key=lambda n: (-1 if tensors[n].producer is None else tensors[n].producer, n))
        crossing = _inputs_first(crossing, a.inputs)
        edge_flops = sum(self.flops[i] for i in edge)
        cloud_flops = sum(self.flops[i] for i in cloud)
        return CutPlan(
            id=cut_id,
            edge_units=edge_units,
            edge_nodes=tuple(sorted(edge)),
            cloud_nodes=tuple(sorted(cloud)),
            crossing=tuple(crossing),
            remat=tuple(sorted(remat)),
            bytes_per_sample=sum(fp32_bytes(tensors[c]) for c in crossing),
            edge_flops=edge_flops,
            cloud_flops=cloud_flops,
            rebuilt=tuple(sorted(rebuilt.items())),
            constants=tuple(sorted(constants)),
        )

    def _shape_source(self, p: int, edge_units: int) -> str | None:
        """The batched edge-side tensor that Shape/Size node ``p`` reads, if it reads one."""
        a = self.analysis
        node = a.nodes[p]
        if node.op_type not in SHAPE_OPS or not node.input:
            return None
        name: str = node.input[0]
        info = a.tensors.get(name)
        if info is None or not info.batched or len(info.dims) != len(info.sample_shape) + 1:
            return None
        q = info.producer
        if q is None:
            return name if info.is_input else None
        if q in self.unit_of and edge_units >> self.unit_of[q] & 1:
            return name
        return None

    def _rebuild_shapes(
        self, sources: dict[int, str], crossing: list[str]
    ) -> dict[int, tuple[DimSource, ...]]:
        """How the cloud computes the shape each node of ``sources`` reads.

        Every axis of the source tensor is a fixed size or an axis of a tensor the
        cloud receives whose size follows it in every analysis run; a source with an
        axis that matches none crosses the cut itself (it is batched), and its own
        Shape then runs on the cloud unchanged.
        """
        tensors = self.analysis.tensors
        rebuilt: dict[int, tuple[DimSource, ...]] = {}
        for p in sorted(sources):
            x = sources[p]
            if x in crossing:
                continue
            axes: list[DimSource] = []
            for sig in tensors[x].dims:
                if len(set(sig)) == 1:
                    axes.append(("", sig[0]))
                    continue
                found = next(
                    (
                        (c, j)
                        for c in crossing
                        for j, other in enumerate(tensors[c].dims)
                        if other == sig
                    ),
                    None,
                )
                if found is None:
                    break
                axes.append(found)
            else:
                rebuilt[p] = tuple(axes)
                continue
            crossing.append(x)
        return rebuilt

    # -- lookup ---------------------------------------------------------------
    def find(self, spec: str) -> CutPlan:
        """A cut by id (``c7``, ``u12.40``), ``none``, ``all``, or comma-separated tensor
        names. Only a space of at most ``max_cuts`` cuts is enumerated for it."""
        plans = self.exhaustive()
        spec = spec.strip()
        if spec in ("none", "all", "c0"):
            plan = self.plan_for(self.full if spec == "all" else 0)
            if plan is None:
                raise CutError(f"the graph has no valid {spec!r} cut: {self.explain(0)}")
            return plan
        if plans is not None:
            for known in plans:
                if known.id == spec:
                    return known
        if spec.startswith("c") and spec[1:].isdigit():
            if plans is None:
                raise CutError(
                    f"unknown cut {spec!r}: ids c1, c2, ... number the full list of cuts, "
                    f"and this graph has more than {self.max_cuts} (--max-cuts); use an id "
                    "from --list-cuts (u...) or tensor names"
                )
            raise CutError(f"unknown cut {spec!r}: ids run from c0 to {plans[-1].id}")
        if spec.startswith("u") and all(p.isdigit() for p in spec[1:].split(".")):
            return self._find_frontier(spec)
        names = [n.strip() for n in spec.split(",") if n.strip()]
        missing = [n for n in names if n not in self.analysis.tensors]
        if missing:
            ids = f"c0..{plans[-1].id}" if plans is not None else "u... from --list-cuts"
            raise CutError(
                f"unknown cut {spec!r}: not a cut id ({ids}), 'none', 'all', "
                f"or tensor names of the graph (no tensor {missing[0]!r})"
            )
        edge_units = self._closure_of(names)
        found = self.plan(edge_units, "?")
        if found is None:
            raise CutError(
                f"tensors {', '.join(names)} do not separate the graph: {self.explain(edge_units)}"
            )
        wanted = set(names)
        got = set(found.crossing)
        if not wanted <= got or not (got - wanted) <= set(self.analysis.inputs):
            extra = sorted(got - wanted - set(self.analysis.inputs))
            unused = sorted(wanted - got)
            detail = f"the cut also carries {', '.join(extra)}" if extra else ""
            if unused:
                detail += ("; " if detail else "") + f"{', '.join(unused)} would not cross"
            raise CutError(f"tensors {', '.join(names)} do not separate the graph: {detail}")
        return self.plan_for(found.edge_units) or found

    def _find_frontier(self, spec: str) -> CutPlan:
        units = [int(p) for p in spec[1:].split(".")]
        bad = [u for u in units if u >= len(self.units)]
        if bad:
            raise CutError(
                f"unknown cut {spec!r}: the graph has units 0..{len(self.units) - 1} "
                f"(no unit {bad[0]})"
            )
        edge_units = self.edge_set_of(units)
        if self.frontier_id(edge_units) != spec:
            raise CutError(
                f"unknown cut {spec!r}: its units are not the last ones of an edge set "
                f"(that edge set is {self.frontier_id(edge_units)})"
            )
        plan = self.plan_for(edge_units)
        if plan is None:
            raise CutError(f"cut {spec!r} is not valid: {self.explain(edge_units)}")
        return plan

    def _closure_of(self, names: list[str]) -> int:
        """The smallest edge set that produces ``names``."""
        a = self.analysis
        mask = 0
        stack: list[int] = []
        for n in names:
            p = a.tensors[n].producer
            if p is not None:
                stack.append(p)
        seen: set[int] = set()
        while stack:
            p = stack.pop()
            if p in seen:
                continue
            seen.add(p)
            if p in self.unit_of:
                u = self.unit_of[p]
                mask |= 1 << u
                for member in self.units[u]:
                    if member not in seen:
                        stack.append(member)
            for name in a.node_inputs[p]:
                q = a.tensors[name].producer if name in a.tensors else None
                if q is not None:
                    stack.append(q)
        return mask


class _Invalid(Exception):
    pass


def bits(mask: int) -> tuple[int, ...]:
    """The positions of the set bits of ``mask``, lowest first."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return tuple(out)


def fp32_bytes(info: TensorInfo) -> int:
    """Bytes of one sample of ``info`` sent as fp32 (non-float tensors: as they are)."""
    numel = math.prod(info.sample_shape)
    return numel * 4 if np.dtype(info.dtype).kind == "f" else numel * np.dtype(info.dtype).itemsize


def _inputs_first(crossing: list[str], inputs: list[str]) -> list[str]:
    head = [n for n in inputs if n in crossing]
    return head + [n for n in crossing if n not in head]
