"""Cuts worth a look in a space too big to list: min-cuts, single-tensor cuts, depth bands.

The unit order of a :class:`~splitinfer.partitioner.cuts.CutSpace` becomes a
:class:`~splitinfer.partitioner.mincut.CutProblem` (:func:`problem`): each unit
priced on each side, each value that can cross priced once. What a cut sends
follows :meth:`CutSpace.plan`: a unit in the cloud reads the batched tensors of
edge units and the model inputs it needs directly or through shape arithmetic
(``Shape -> Gather -> Concat``). Shape arithmetic is recomputed in the cloud: a
shape value that is the same in every analysis run is a constant there, and a
``Shape``/``Size`` of an edge-side tensor is rebuilt from the sizes of the
tensors that cross (both free). A non-batched tensor of a unit may not cross
(infinite). Where the plan cannot rebuild a size from the crossing tensors and
sends the tensor it reads instead, the min-cut's price is off by that tensor,
and the exact cost model that ranks the candidates afterwards has the true
figure.

Every candidate is planned by :meth:`CutSpace.plan_for`; an edge set the plan
refuses (a value needed on both sides, say) is dropped and counted.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from splitinfer.partitioner.cuts import SHAPE_OPS, CutPlan, CutSpace, bits, fp32_bytes
from splitinfer.partitioner.mincut import INPUT, OUTPUT, CutProblem, Tensor, count_downsets, solve

#: Link speeds (bits/s) of the min-cut sweep in --list-cuts.
LIST_RATES = tuple(float(r) for r in np.geomspace(0.25e6, 100e6, 8))
#: Depth bands of the fewest-bytes cuts in --list-cuts.
DEPTH_BANDS = 10
#: Single-tensor cuts kept at most (evenly spread through the graph).
MAX_ARTICULATION = 64


@dataclass(frozen=True)
class Flow:
    """A value a cloud unit may need from the edge: a tensor of an edge unit or an input."""

    name: str
    producer: int  # unit, or INPUT
    consumers: tuple[int, ...]  # units, and OUTPUT
    crossable: bool  # batched tensor or model input; else it may not cross


_FLOWS: weakref.WeakKeyDictionary[CutSpace, tuple[Flow, ...]] = weakref.WeakKeyDictionary()


def flows_of(space: CutSpace) -> tuple[Flow, ...]:
    """Every value that crosses some cut, with the units that read it; O(V + E)."""
    cached = _FLOWS.get(space)
    if cached is not None:
        return cached
    a = space.analysis
    unit_of = space.unit_of
    memo: dict[int, tuple[str, ...]] = {}

    def sources(name: str) -> tuple[str, ...]:
        info = a.tensors.get(name)
        if info is None or info.is_initializer:
            return ()
        if info.is_input:
            return (name,)
        p = info.producer
        if p is None:
            return ()
        if p in unit_of:
            return (name,)
        if info.value is not None:
            return ()  # a shape value that is the same in every run: a constant on the cloud
        if a.nodes[p].op_type in SHAPE_OPS:
            return ()  # the cloud rebuilds a shape from the sizes of the tensors it receives
        if p not in memo:
            memo[p] = ()  # the graph is acyclic; this only guards the recursion
            found: dict[str, None] = {}
            for n in a.node_inputs[p]:
                found.update(dict.fromkeys(sources(n)))
            memo[p] = tuple(found)
        return memo[p]

    readers: dict[str, dict[int, None]] = {}
    for i in range(len(a.nodes)):
        u = unit_of.get(i)
        if u is None:
            continue
        for name in a.node_inputs[i]:
            for src in sources(name):
                p = a.tensors[src].producer
                if p is not None and unit_of.get(p) == u:
                    continue
                readers.setdefault(src, {})[u] = None
    for out in a.outputs:
        for src in sources(out):
            readers.setdefault(src, {})[OUTPUT] = None
    flows = []
    for name, who in readers.items():
        info = a.tensors[name]
        producer = INPUT if info.producer is None else unit_of[info.producer]
        crossable = info.is_input or info.batched
        flows.append(Flow(name, producer, tuple(who), crossable))
    result = tuple(flows)
    _FLOWS[space] = result
    return result


def problem(
    space: CutSpace,
    edge_unit: Sequence[float],
    cloud_unit: Sequence[float],
    tensor_cost: Callable[[Flow], float],
    *,
    forced_edge: int = 0,
    forced_cloud: int = 0,
) -> CutProblem:
    """The space as a min-cut problem; ``tensor_cost`` prices each crossable value."""
    tensors = tuple(
        Tensor(f.producer, f.consumers, tensor_cost(f) if f.crossable else math.inf)
        for f in flows_of(space)
    )
    preds = tuple(bits(m) for m in space.pred)
    return CutProblem(
        preds, tuple(edge_unit), tuple(cloud_unit), tensors, forced_edge, forced_cloud
    )


def unit_sums(space: CutSpace, per_node: np.ndarray) -> list[float]:
    """Per unit: the sum of its nodes' values (per-node vector in analysis order)."""
    return [float(sum(per_node[i] for i in members)) for members in space.units]


def articulation_cuts(space: CutSpace, limit: int = MAX_ARTICULATION) -> list[int]:
    """Edge sets that end at one unit every other unit is ordered with, and that
    nothing beyond reads from except that unit: cuts sending one unit's output
    (plus any model input read later). Up to ``limit``, spread through the graph."""
    n = len(space.units)
    succ_mask = [0] * n
    for u, ws in enumerate(space.succ):
        for w in ws:
            succ_mask[u] |= 1 << w
    found = []
    for u in range(n):
        below = space.below[u]
        if below | space.above[u] != space.full or below == space.full:
            continue
        m, ok = below & ~(1 << u), True
        while m and ok:
            low = m & -m
            ok = succ_mask[low.bit_length() - 1] & ~below == 0
            m ^= low
        if ok:
            found.append(below)
    found.sort(key=int.bit_count)
    if len(found) > limit:
        idx = np.linspace(0, len(found) - 1, limit).round().astype(int)
        found = [found[i] for i in sorted(set(idx.tolist()))]
    return found


def depth_band_cuts(space: CutSpace, bands: int = DEPTH_BANDS) -> list[tuple[str, int]]:
    """Per band of unit depth: the edge set that sends the fewest fp32 bytes among the
    cuts whose boundary lies in the band (shallower units on the edge, deeper ones in
    the cloud)."""
    depth = space.depths()
    top = max(depth, default=0) + 1
    edges = sorted({round(i * top / bands) for i in range(bands + 1)})
    zeros = [0.0] * len(space.units)
    a = space.analysis

    def nbytes(f: Flow) -> float:
        return float(fp32_bytes(a.tensors[f.name]))

    out = []
    for lo, hi in itertools.pairwise(edges):
        forced_edge = sum(1 << u for u, d in enumerate(depth) if d < lo)
        forced_cloud = sum(1 << u for u, d in enumerate(depth) if d > hi)
        mask = solve(problem(space, zeros, zeros, nbytes, forced_edge=forced_edge,
                             forced_cloud=forced_cloud))  # fmt: skip
        if mask is not None:
            out.append((f"fewest bytes at depth {lo}-{hi}", mask))
    return out


@dataclass
class Found:
    """Candidate edge sets with why each is there, in the order found."""

    why: dict[int, list[str]] = field(default_factory=dict)
    #: max-flows run, link points and weightings they were run at
    runs: int = 0
    points: int = 0
    weightings: int = 0
    #: distinct edge sets that came out of the max-flows
    distinct: int = 0

    def add(self, mask: int | None, reason: str) -> None:
        if mask is not None:
            self.why.setdefault(mask, []).append(reason)

    def plans(self, space: CutSpace) -> tuple[list[CutPlan], dict[str, str], int]:
        """The valid ones planned, each id's reasons, and how many the plan refused."""
        plans, reasons, refused = [], {}, 0
        for mask, why in self.why.items():
            plan = space.plan_for(mask)
            if plan is None:
                refused += 1
                continue
            plans.append(plan)
            reasons[plan.id] = "; ".join(why)
        plans.sort(key=lambda p: (p.edge_units.bit_count(), p.id))
        return plans, reasons, refused


def latency_sweep(
    space: CutSpace,
    edge_t: np.ndarray,
    cloud_t: np.ndarray,
    wire: Callable[[str], tuple[float, float]],
    rates: Iterable[float],
    found: Found,
    label: Callable[[float], str] = lambda r: f"min-cut at {rate_label(r)}",
) -> None:
    """The latency-optimal min-cut at each uplink rate; ``wire(name)`` gives a value's
    (wire bytes, codec seconds)."""
    e, c = unit_sums(space, edge_t), unit_sums(space, cloud_t)
    for r in rates:

        def cost(f: Flow, r: float = r) -> float:
            nbytes, codec_s = wire(f.name)
            return nbytes * 8 / r + codec_s

        found.add(solve(problem(space, e, c, cost)), label(r))
        found.runs += 1


def rate_label(bps: float) -> str:
    return f"{bps / 1e6:.3g} Mbit/s"


def roofline_weights(space: CutSpace, edge: str, cloud: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-node seconds (analysis order) from two built-in profiles' rooflines."""
    from splitinfer.partitioner.profiles import node_times, resolve_profile
    from splitinfer.partitioner.runtime_map import node_keys

    a = space.analysis
    keys = node_keys(a)
    out = []
    for spec, kind in ((edge, "edge"), (cloud, "cloud")):
        times = node_times(a, resolve_profile(spec, kind), "fp32", 1).times
        out.append(np.array([times.get(k, 0.0) for k in keys]))
    return out[0], out[1]


def list_candidates(
    space: CutSpace, edge: str, cloud: str, ratio: float
) -> tuple[list[CutPlan], Mapping[str, str], Found]:
    """What ``--list-cuts`` shows for a space too big to list: all cloud, all edge, the
    single-tensor cuts, the latency min-cuts across :data:`LIST_RATES` (rooflines of
    ``edge`` and ``cloud``, float tensors compressed ``ratio`` x) and the fewest-bytes
    cut per depth band."""
    found = Found()
    found.add(0, "all cloud")
    found.add(space.full, "all edge")
    for mask in articulation_cuts(space):
        found.add(mask, "single tensor")
    edge_t, cloud_t = roofline_weights(space, edge, cloud)
    a = space.analysis

    def wire(name: str) -> tuple[float, float]:
        info = a.tensors[name]
        raw = fp32_bytes(info)
        return (raw / ratio if np.dtype(info.dtype).kind == "f" else raw), 0.0

    latency_sweep(space, edge_t, cloud_t, wire, LIST_RATES, found)
    found.points, found.weightings = len(LIST_RATES), 1
    for why, mask in depth_band_cuts(space):
        found.add(mask, why)
    plans, reasons, _ = found.plans(space)
    return plans, reasons, found


# -- counting ----------------------------------------------------------------------------


def count_space(space: CutSpace, budget: int) -> tuple[int, bool]:
    """See :meth:`CutSpace.count`."""
    preds = _tied_order(space)
    exact = count_downsets(preds, budget)
    if exact is not None:
        return exact, True
    # Units at the same depth are pairwise unordered: every subset of one level is
    # an antichain, and antichains <-> down-sets.
    depth = space.depths()
    sizes: dict[int, int] = {}
    for d in depth:
        sizes[d] = sizes.get(d, 0) + 1
    bound = 1 + sum(2**k - 1 for k in sizes.values())
    return max(bound, space.max_cuts + 1 if space.too_many_to_list else 0), False


def _tied_order(space: CutSpace) -> list[int]:
    """The unit order with the units tied by a tensor that cannot cross merged."""
    n = len(space.units)
    root = list(range(n))

    def find(u: int) -> int:
        while root[u] != u:
            root[u] = root[root[u]]
            u = root[u]
        return u

    for f in flows_of(space):
        if f.crossable or f.producer < 0:
            continue
        for c in f.consumers:
            if c >= 0:
                # c depends on the producer and may not be apart from it: so is every
                # unit between them
                between = space.above[f.producer] & space.below[c]
                m = between
                while m:
                    low = m & -m
                    root[find(low.bit_length() - 1)] = find(f.producer)
                    m ^= low
    groups = sorted({find(u) for u in range(n)})
    index = {g: i for i, g in enumerate(groups)}
    preds = [0] * len(groups)
    for u in range(n):
        gu = index[find(u)]
        m = space.pred[u]
        while m:
            low = m & -m
            gp = index[find(low.bit_length() - 1)]
            if gp != gu:
                preds[gu] |= 1 << gp
            m ^= low
    return preds
